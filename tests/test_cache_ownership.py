"""One owner for each piece of the generation cache's state, checked on the sources (no model runs):

- the cache's counters (`CacheLengths`: seq_len, packed_len, before and the device copy) change only
  through their own class's methods, and the dense engine's lengths only through `DenseCache`'s;
- gate keys reach a cache from one module, `attention/dispatch.py` (`run_gate`, and on a token step
  `gate_ahead_hook`, which lets the cache start the gate before the layer's projections), and only the layer
  cache writes its buffers;
- one protocol per object, both in `attention/cache_protocol.py` (`attention/` never imports `inference/`):
  `GenerationCache` for the whole cache, `LayerCache` for one layer's (its methods and the data decode and
  prefill read); they describe the classes that implement them, share no name with a class, and every
  `layer_cache` parameter is typed as `LayerCache`.

Each check is a pure function of source text, so the tests below also show it refusing a violation.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from gsm_train.attention.cache_protocol import GenerationCache, LayerCache
from gsm_train.attention.dispatch import run_gate
from gsm_train.attention.kv_store import CacheLengths
from gsm_train.inference.cache import GSMCache, GSMCacheLayer

REPO = Path(__file__).resolve().parent.parent
SOURCES = sorted([*(REPO / "gsm_train").rglob("*.py"), *(REPO / "benchmarks").rglob("*.py")])
COUNTERS = {"seq_len", "packed_len", "before", "_seq_len", "_packed_len", "_before", "length", "device_length"}
DEVICE_COUNTERS = {"device": "CacheLengths", "slots": "CacheLengths", "device_length": "DenseCache"}  # tensor -> owner
GATE_KEY_BUFFERS = {"gate_keys", "gate_key_scales"}
GATE_KEY_ENTRIES = ("keep_gate_keys", "token_gate", "select_ahead")  # the layer cache's methods that write them


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _enclosing_class(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> str | None:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.ClassDef):
            return node.name
    return None


def _enclosing_function(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> str | None:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return node.name
    return None


def _targets(node: ast.AST) -> list[ast.expr]:
    """The expressions an assignment statement writes, tuples unpacked."""
    if isinstance(node, ast.Assign):
        pending = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        pending = [node.target]
    else:
        return []
    flat = []
    while pending:
        target = pending.pop()
        if isinstance(target, ast.Tuple | ast.List):
            pending.extend(target.elts)
        elif isinstance(target, ast.Starred):
            pending.append(target.value)
        else:
            flat.append(target)
    return flat


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _attribute_under(node: ast.expr) -> ast.Attribute | None:
    """`x.attr` for `x.attr`, `x.attr[...]` and `x.attr[...][...]`, else None."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return node if isinstance(node, ast.Attribute) else None


def counter_writes(source: str) -> list[str]:
    """Where `source` changes a cache's counters other than through their owner's methods: an assignment
    to a counter attribute of anything but `self` (or a `setattr` of one), or an in-place op (`copy_`,
    `add_`, ...) on a device copy (`CacheLengths.device`, `DenseCache.device_length`) outside its class."""
    tree = ast.parse(source)
    parents = _parents(tree)
    found = []
    for node in ast.walk(tree):
        for target in _targets(node):
            if isinstance(target, ast.Attribute) and target.attr in COUNTERS and not _is_self(target.value):
                found.append(f"line {target.lineno}: {ast.unparse(target)} assigned")
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "setattr" and len(node.args) > 1:
            name = node.args[1]
            if isinstance(name, ast.Constant) and name.value in COUNTERS:
                found.append(f"line {node.lineno}: setattr of {name.value}")
        if isinstance(func, ast.Attribute) and func.attr.endswith("_") and not func.attr.startswith("_"):
            owner = _attribute_under(func.value)
            if owner is not None and owner.attr in DEVICE_COUNTERS:
                if _enclosing_class(node, parents) != DEVICE_COUNTERS[owner.attr]:
                    found.append(f"line {node.lineno}: {ast.unparse(func)} on a cache's device lengths")
    return found


def gate_key_writes(source: str) -> list[str]:
    """Where `source` writes gate keys into a cache: every call of a `GATE_KEY_ENTRIES` method (named with the
    function it is in), and every write into a `gate_keys` / `gate_key_scales` buffer outside `GSMCacheLayer`."""
    tree = ast.parse(source)
    parents = _parents(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in GATE_KEY_ENTRIES:
                found.append(f"{node.func.attr} called in {_enclosing_function(node, parents)}")
            owner = _attribute_under(node.func.value)
            in_place = node.func.attr.endswith("_") and not node.func.attr.startswith("_")
            if in_place and owner is not None and owner.attr in GATE_KEY_BUFFERS:
                if _enclosing_class(node, parents) != "GSMCacheLayer":
                    found.append(f"line {node.lineno}: {ast.unparse(node.func)} outside GSMCacheLayer")
        for target in _targets(node):
            owner = _attribute_under(target) if isinstance(target, ast.Subscript) else None
            if owner is not None and owner.attr in GATE_KEY_BUFFERS:
                if _enclosing_class(node, parents) != "GSMCacheLayer":
                    found.append(f"line {target.lineno}: {ast.unparse(target)} written outside GSMCacheLayer")
    return found


def _relative(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def test_the_counters_change_only_through_their_own_class() -> None:
    found = {_relative(p): writes for p in SOURCES if (writes := counter_writes(p.read_text()))}
    assert found == {}


def test_the_counter_check_refuses_writes_from_outside() -> None:
    outside = """
def restore(cache, saved):
    cache.lengths.seq_len, cache.lengths.packed_len = saved[0], saved[1]
    lengths = cache.lengths
    lengths.before += 1
    lengths.device[0:1].add_(1)
    lengths.device.copy_(saved[2])
    setattr(lengths, "seq_len", 3)
    cache.device_length.copy_(saved[2])
"""
    assert len(counter_writes(outside)) == 7
    owner = """
class CacheLengths:
    def add_token(self):
        self._before, self._seq_len = self._seq_len, self._seq_len + 1
        self.device[0:1].add_(1)
"""
    assert counter_writes(owner) == []


def test_the_counters_are_read_only_from_outside() -> None:
    lengths = CacheLengths(torch.device("cpu"))
    for name in ("seq_len", "packed_len", "before"):
        with pytest.raises(AttributeError):
            setattr(lengths, name, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="copies to a GPU")
def test_a_chunks_counters_reach_the_gpu_without_waiting_for_its_queue() -> None:
    """`add_chunk` returns while the GPU is still busy with earlier work (its copies come from pinned memory;
    from pageable memory CUDA first waits for the stream, leaving the GPU idle between a prompt's layers), and
    the device copies hold the new counters once that work is done."""
    lengths = CacheLengths(torch.device("cuda"))
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of one busy kernel ahead of the copies
    lengths.add_chunk(130, 64)
    assert not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert lengths.device.tolist() == [130, 128] and lengths.slots.tolist() == [129, 1]


def test_gate_keys_are_written_from_one_module() -> None:
    found = {_relative(p): sorted(writes) for p in SOURCES if (writes := gate_key_writes(p.read_text()))}
    expected = [
        "keep_gate_keys called in run_gate",
        "select_ahead called in gate_ahead_hook",
        "token_gate called in run_gate",
    ]
    assert found == {_relative(Path(inspect.getsourcefile(run_gate))): expected}


def test_the_gate_key_check_refuses_a_second_writer() -> None:
    second = """
def chunk_attention(step, layer_cache):
    layer_cache.keep_gate_keys(step.gate_k, 8)
    layer_cache.select_ahead(step.settings, step.hidden, step.cos, step.sin)
    layer_cache.gate_keys[:, :, 0:4] = step.codes
    layer_cache.gate_key_scales.index_copy_(2, step.slot, step.scales)
"""
    assert len(gate_key_writes(second)) == 4


def test_the_protocols_describe_the_cache_and_share_no_class_name() -> None:
    for protocol, implementation in ((GenerationCache, GSMCache), (LayerCache, GSMCacheLayer)):
        members = [name for name, _ in inspect.getmembers(protocol, inspect.isfunction) if not name.startswith("_")]
        assert members
        for name in members:
            expected = list(inspect.signature(getattr(protocol, name)).parameters)
            assert list(inspect.signature(getattr(implementation, name)).parameters) == expected, name
    layer_class = next(
        node
        for node in ast.walk(ast.parse(Path(inspect.getsourcefile(GSMCacheLayer)).read_text()))
        if isinstance(node, ast.ClassDef) and node.name == GSMCacheLayer.__name__
    )
    defined = {node.name for node in layer_class.body if isinstance(node, ast.FunctionDef)}
    defined |= {
        target.attr
        for node in ast.walk(layer_class)
        for target in _targets(node)
        if isinstance(target, ast.Attribute) and _is_self(target.value)
    }
    assert LayerCache.__annotations__
    assert set(LayerCache.__annotations__) - defined == set()
    classes: dict[str, list[str]] = {}
    protocols: dict[str, str] = {}
    for path in sorted((REPO / "gsm_train").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(_relative(path))
                if any(ast.unparse(base) in ("Protocol", "typing.Protocol") for base in node.bases):
                    protocols[node.name] = _relative(path)
    protocol_file = _relative(Path(inspect.getsourcefile(LayerCache)))
    assert {name for name, path in protocols.items() if path == protocol_file} == {"GenerationCache", "LayerCache"}
    assert [name for name, path in protocols.items() if path.startswith("gsm_train/inference/")] == []
    assert {name: classes[name] for name in protocols if len(classes[name]) > 1} == {}


def layer_cache_types(source: str) -> list[str]:
    """Every parameter named `layer_cache` in `source` whose type is not the `LayerCache` protocol (or
    `LayerCache | None`), as `function: annotation`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
                annotation = ast.unparse(arg.annotation) if arg.annotation is not None else "no annotation"
                if arg.arg == "layer_cache" and annotation not in ("LayerCache", "LayerCache | None"):
                    found.append(f"{node.name}: {annotation}")
    return found


def test_every_layer_cache_parameter_is_typed_by_the_one_protocol() -> None:
    found = {_relative(p): wrong for p in SOURCES if (wrong := layer_cache_types(p.read_text()))}
    assert found == {}
    typed = sum(p.read_text().count("layer_cache: LayerCache") for p in SOURCES)
    assert typed >= 10  # dispatch, decode and prefill attention


def test_the_layer_cache_type_check_refuses_another_type() -> None:
    other = """
def decode_attention(step, layer_cache: StoredLayer): ...
def chunk_attention(step, layer_cache: GSMCacheLayer): ...
def select_keys(step, layer_cache): ...
def gather_kv(adapter, layer_cache: LayerCache, index): ...
"""
    assert layer_cache_types(other) == [
        "decode_attention: StoredLayer",
        "chunk_attention: GSMCacheLayer",
        "select_keys: no annotation",
    ]


def test_attention_never_imports_inference() -> None:
    for path in sorted((REPO / "gsm_train" / "attention").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(name.startswith("gsm_train.inference") for name in names), _relative(path)
