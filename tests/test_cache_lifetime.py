"""A generation's cache is freed when its last reference goes, as transformers' own caches are, not when
Python's cycle collector next runs: its layers, and the captured steps it keeps (`cache.step_graphs`), hold
it weakly. Before, each layer held its cache, so a finished `model.generate` kept the whole cache (at 8B and
32k, tens of GB of device buffers) allocated until a collection, and the next call allocated beside it.

Each test runs with the collector off, so an object kept only by a cycle shows as alive."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch

from gsm_train.attention import inject_gsm
from gsm_train.config.schema import GSMConfig
from gsm_train.inference.cache import GSMCache, cache_kwargs
from gsm_train.inference.decode_graph import StepGraphs
from gsm_train.inference.dense_engine import DenseCache, DenseEngine
from gsm_train.inference.engine import enable_gsm_generation
from gsm_train.models.model_zoo import tiny_model

GSM = {
    "sparse_attention": {"top_k": 8, "k_min": 8, "gate_init": "random"},
    "kv_compression": {"enabled": True, "block_size": 16},
}
IDS = torch.arange(40).reshape(1, 40) * 7 % 256


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _alive(kind: type) -> int:
    """Objects of `kind` alive (a weak proxy of one, which isinstance also matches while it lives, not counted)."""
    return sum(isinstance(obj, kind) and not isinstance(obj, weakref.ProxyTypes) for obj in gc.get_objects())


def _gsm_model() -> torch.nn.Module:
    model = tiny_model("llama").eval()
    inject_gsm(model, GSMConfig.model_validate(GSM), mode="sparse")
    enable_gsm_generation(model)
    return model


def test_model_generate_keeps_one_cache_for_the_next_call_and_frees_each_it_replaces(collector_off: None) -> None:
    model = _gsm_model()
    with torch.no_grad():
        model.generate(IDS, max_new_tokens=12, do_sample=False)  # crosses a block edge: a pack in the steps
        model.generate(IDS[:, :30], max_new_tokens=12, do_sample=False)  # the same rows and band: the same cache
        assert _alive(GSMCache) == 1
        model.generate(IDS.expand(2, -1), max_new_tokens=12, do_sample=False)  # two rows: a new cache replaces it
    assert _alive(GSMCache) == 1
    enable_gsm_generation(model)  # its settings anew: the kept cache goes
    assert _alive(GSMCache) == 0


def test_without_reuse_model_generate_leaves_no_gsm_cache_behind(collector_off: None) -> None:
    model = _gsm_model()
    enable_gsm_generation(model, reuse_cache=False)
    with torch.no_grad():
        model.generate(IDS, max_new_tokens=12, do_sample=False)
    assert _alive(GSMCache) == 0


def test_a_gsm_cache_with_its_step_graphs_is_freed_with_its_last_reference(collector_off: None) -> None:
    model = _gsm_model()
    cache = GSMCache(model, capacity=64)
    with torch.no_grad():
        model(input_ids=IDS, use_cache=True, **cache_kwargs(model, cache))
    cache.step_graphs = StepGraphs(model, cache)  # as the engine keeps them (the graphs are captured on a GPU)
    freed = weakref.ref(cache)
    del cache
    assert freed() is None


def test_the_dense_engine_s_cache_is_freed_with_its_last_reference(collector_off: None) -> None:
    engine = DenseEngine(tiny_model("llama").eval())
    cache = engine.new_cache(1, IDS.shape[1] + 4)
    engine.prefill(cache, IDS)
    engine.token_step(cache)(IDS[:, -1:])
    freed = weakref.ref(cache)
    del cache
    assert freed() is None and _alive(DenseCache) == 0
