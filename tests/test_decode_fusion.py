"""The decode step's fused elementwise kernels (`gsm_train.kernels.decode_fusion`) against transformers' own
modules, and their use in both engines' token steps (`gsm_train.inference.decode_fusion.fused_decode`).

Bounds: in fp32 the kernels agree with transformers to 1e-5 relative (sums in another order, rsqrt and exp
of another library); in bf16 and fp16 every value equals transformers' or lies at most two steps of the
dtype's grid from it, and at most 1% of the values differ at all: the kernels round where PyTorch's ops
round, so a value differs only where an intermediate within an fp32 rounding error of a boundary of the
narrow grid rounds the other way, by one step, which the next op's product and rounding can make two."""

from __future__ import annotations

import importlib
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from run_helpers import KERNEL_DEVICE, TRITON_KERNEL_MARKS
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from benchmarks import decode_step_profile
from gsm_train.attention import inject_gsm
from gsm_train.config.schema import GSMConfig
from gsm_train.inference import decode_fusion
from gsm_train.inference.decode_fusion import FUSED_CLASSES, fused_decode
from gsm_train.inference.dense_engine import DenseEngine
from gsm_train.inference.engine import enable_gsm_generation
from gsm_train.models.families import FAMILIES, decoder_layers
from gsm_train.models.model_zoo import tiny_model

pytestmark = TRITON_KERNEL_MARKS

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SPARSE = {"top_k": 6, "k_min": 2, "gate_head_dim": 16, "dense_layers": [0], "mode": "sparse"}  # GSM's tiny gates
GRID_STEPS = 2  # in bf16 and fp16, a value lies at most this many steps of the dtype's grid off
MOST_DIFFERING = 0.01  # and at most this share of the values differ at all


def _assert_agrees(got: torch.Tensor, expected: torch.Tensor) -> None:
    """The module docstring's bound for `got` against transformers' `expected` (same dtype and shape)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        return
    info = torch.finfo(got.dtype)
    assert torch.equal(got.isfinite(), expected.isfinite())
    got, expected = got.float().nan_to_num(), expected.float().nan_to_num()
    largest = torch.maximum(got.abs(), expected.abs())
    step = (torch.exp2(torch.floor(torch.log2(largest))) * info.eps).clamp(min=info.tiny * info.eps)
    assert bool(((got - expected).abs() <= GRID_STEPS * step).all()), (got - expected).abs().max()
    assert (got != expected).float().mean().item() <= MOST_DIFFERING


def test_fused_classes_name_every_family() -> None:
    """Every supported family's modules are fused (a family added to `FAMILIES` gets a row here too)."""
    assert set(FUSED_CLASSES) == set(FAMILIES)


def _norm_input(kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Hidden states [..., n] of `kind`: random, large (|x| up to about 4e4, fp16's range), an outlier
    (one value 1e4 times the rest in each row), zeros (an all-zero row, a row with one nonzero, a row of
    zeros but one tiny value) or overflow (x^2 beyond fp32's range: the variance is inf, the output 0)."""
    generator = torch.Generator().manual_seed(len(kind))
    x = torch.randn(shape, generator=generator)
    if kind == "large":
        x = (x * 1e4).clamp(-6e4, 6e4)
    elif kind == "outlier":
        x[..., 7] = 1e4
    elif kind == "zeros":
        x = torch.zeros(shape)
        x.view(-1, shape[-1])[1, 3] = 3.0
        x.view(-1, shape[-1])[2, 5] = 1e-3
    elif kind == "overflow":
        x = x.sign() * 1e20
    return x.to(dtype).to(KERNEL_DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["random", "large", "outlier", "zeros", "overflow"])
@pytest.mark.parametrize("shape", [(3, 1, 576), (3, 1, 4, 16)], ids=["hidden", "qwen3_head"])
def test_fused_rms_norm_equals_transformers_rmsnorm(dtype: torch.dtype, kind: str, shape: tuple[int, ...]) -> None:
    """A layer's RMSNorm over the hidden size (576: no power of two) and Qwen3's per-head q/k norm (16)."""
    from gsm_train.kernels.decode_fusion import rms_norm, rms_norm_fits

    if kind == "overflow" and dtype == torch.float16:
        pytest.skip("fp16 holds no value whose square overflows fp32")
    norm = LlamaRMSNorm(shape[-1], eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.5, generator=torch.Generator().manual_seed(3))
    norm = norm.to(dtype).to(KERNEL_DEVICE)
    x = _norm_input(kind, shape, dtype)
    assert rms_norm_fits(x, norm.weight)
    with torch.no_grad():
        expected = norm(x)
    got = rms_norm(x, norm.weight, norm.variance_epsilon)
    _assert_agrees(got, expected)
    if kind == "overflow":
        assert not got.any()
    if kind == "zeros":
        assert not got.view(-1, shape[-1])[0].any()


def test_fused_rms_norm_promotes_as_transformers_does() -> None:
    """An fp32 weight over bf16 hidden states (weights kept in fp32): fp32 out, as the module gives."""
    from gsm_train.kernels.decode_fusion import rms_norm

    norm = LlamaRMSNorm(96, eps=1e-6).to(KERNEL_DEVICE)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0)
        x = _norm_input("random", (2, 1, 96), torch.bfloat16)
        expected = norm(x)
    got = rms_norm(x, norm.weight, norm.variance_epsilon)
    assert expected.dtype == got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _rope_tables(positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [rows, 1, 16] of a Llama 3 rotary embedding (theta 500000) at `positions` [rows, 1]."""
    model = tiny_model("llama", num_layers=1)
    model.config.rope_parameters["rope_theta"] = 500000.0
    rotary = LlamaRotaryEmbedding(model.config)
    return rotary(torch.zeros(1, dtype=dtype), positions)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("table_rows", [1, 2])
def test_fused_rope_equals_apply_rotary_pos_emb(dtype: torch.dtype, table_rows: int) -> None:
    """One token's q [2, 4, 1, 16] and k [2, 2, 1, 16], transposed views of the projections as the attention
    makes them, at far positions (up to 131071), with one cos/sin row for the batch or one per row."""
    from gsm_train.kernels.decode_fusion import rope, rope_fits

    generator = torch.Generator().manual_seed(table_rows)
    q = (torch.randn(2, 1, 4, 16, generator=generator) * 3).to(dtype).to(KERNEL_DEVICE).transpose(1, 2)
    k = (torch.randn(2, 1, 2, 16, generator=generator) * 3).to(dtype).to(KERNEL_DEVICE).transpose(1, 2)
    cos, sin = _rope_tables(torch.tensor([[131071], [70000]])[:table_rows], dtype)
    cos, sin = cos.to(KERNEL_DEVICE), sin.to(KERNEL_DEVICE)
    assert rope_fits(q, k, cos, sin)
    expected = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    got = rope(q, k, cos, sin)
    for fused, eager in zip(got, expected, strict=True):
        _assert_agrees(fused, eager)
    assert not rope_fits(q.expand(2, 4, 3, 16), k, cos, sin)  # a prompt's: the original serves it


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_silu_mul_equals_transformers_swiglu(dtype: torch.dtype) -> None:
    """SiLU(gate) * up over 3000 values per row (not a multiple of the block), gates up to +-100 (exp
    overflows for the most negative: SiLU -0)."""
    from gsm_train.kernels.decode_fusion import silu_mul, silu_mul_fits

    generator = torch.Generator().manual_seed(5)
    gate = (torch.randn(2, 1, 3000, generator=generator) * 4).to(dtype).to(KERNEL_DEVICE)
    gate[0, 0, :2] = torch.tensor([100.0, -100.0], dtype=dtype)
    up = torch.randn(2, 1, 3000, generator=generator).to(dtype).to(KERNEL_DEVICE)
    assert silu_mul_fits(gate, up)
    _assert_agrees(silu_mul(gate, up), F.silu(gate) * up)


class _OwnNorm(LlamaRMSNorm):
    """A subclass of a known class: not known, stays eager."""


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_decode_swaps_the_known_modules_and_restores_them(family: str) -> None:
    """Every RMSNorm of the family's class (Qwen3's q/k norms too), every SiLU MLP and the modeling module's
    RoPE are swapped inside the block and restored after; a subclass's module and one whose forward is
    replaced on the instance are left alone."""
    model = tiny_model(family, num_layers=2).to(KERNEL_DEVICE)
    layers = decoder_layers(model)
    layers[0].input_layernorm = _OwnNorm(model.config.hidden_size).to(KERNEL_DEVICE)
    wrapped = layers[1].post_attention_layernorm
    wrapped.forward = wrapped.forward  # e.g. an autocast wrapper
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    original_rope = modeling.apply_rotary_pos_emb
    known_norms = 2 * (4 if family == "qwen3" else 2) + 1 - 2  # per layer (q/k norms too), the final one; 2 not
    with fused_decode(model) as fused:
        assert fused == decode_fusion.Fused(norms=known_norms, mlps=2, rope=True)
        assert "forward" in vars(layers[1].input_layernorm) and "forward" in vars(layers[0].mlp)
        assert modeling.apply_rotary_pos_emb is not original_rope
        with fused_decode(model) as inner:  # nested: nothing more to swap
            assert inner == decode_fusion.Fused()
        assert modeling.apply_rotary_pos_emb is not original_rope
    assert modeling.apply_rotary_pos_emb is original_rope
    swapped = [module for module in model.modules() if "forward" in vars(module)]
    assert swapped == [wrapped]
    with fused_decode(model, enabled=False) as fused:
        assert fused == decode_fusion.Fused()


def _counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Calls of each fused kernel from the swapped forwards, counted."""
    calls = {"rms_norm": 0, "rope": 0, "silu_mul": 0}
    for name in calls:
        kernel = getattr(decode_fusion, name)

        def counted(*args, _kernel=kernel, _name=name):
            calls[_name] += 1
            return _kernel(*args)

        monkeypatch.setattr(decode_fusion, name, counted)
    return calls


def _step_calls(layers: int, steps: int, family: str = "llama") -> dict[str, int]:
    """The fused calls of `steps` token steps of a model of `family` with `layers` layers (and none for
    the prompt): per layer 2 norms (4 with Qwen3's q/k norms), RoPE and SwiGLU; the final norm. On a GPU
    the token steps are replayed from a CUDA graph: the kernels are called at the two warm-up steps and the
    capture only (3 steps' worth), the replays run them from the graph."""
    steps = min(steps, 3) if KERNEL_DEVICE == "cuda" else steps
    norms = 4 if family == "qwen3" else 2
    return {"rms_norm": steps * (norms * layers + 1), "rope": steps * layers, "silu_mul": steps * layers}


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_dense_engine_fused_tokens_equal_the_unfused(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy fp32: the fused steps' tokens equal the unfused steps', and each token step (only those) ran
    every norm, RoPE and SwiGLU of the model fused (Qwen3: its q/k norms too)."""
    model = tiny_model(family).to(KERNEL_DEVICE)
    ids = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(0)).to(KERNEL_DEVICE)
    expected = DenseEngine(model, prefill_chunk=8).generate(ids, 6)
    calls = _counting(monkeypatch)
    assert torch.equal(DenseEngine(model, prefill_chunk=8, fused_decode=True).generate(ids, 6), expected)
    assert calls == _step_calls(4, 5, family)  # the first new token comes from the prompt's forward


def test_gsm_generation_fused_tokens_equal_the_unfused(monkeypatch: pytest.MonkeyPatch) -> None:
    """GSM's engine (a sparse GSM model, greedy fp32): as the dense engine's test."""
    model = tiny_model("llama").to(KERNEL_DEVICE)
    torch.manual_seed(1)
    inject_gsm(model, GSMConfig.model_validate({"sparse_attention": SPARSE}), mode="sparse")
    ids = torch.randint(0, 256, (2, 21), generator=torch.Generator().manual_seed(0)).to(KERNEL_DEVICE)

    def generate() -> torch.Tensor:
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=256)

    enable_gsm_generation(model)
    expected = generate()
    enable_gsm_generation(model, fused_decode=True)
    calls = _counting(monkeypatch)
    assert torch.equal(generate(), expected)
    assert calls == _step_calls(4, 5)


# the aten ops one decoder layer's RMSNorms (2), RoPE and SwiGLU run eagerly in fp32 (no casts): what a fused
# token step runs as 4 Triton launches instead, besides 5 allocations of their outputs
EAGER_ELEMENTWISE = {
    "aten.pow.Tensor_Scalar": 2,
    "aten.mean.dim": 2,
    "aten.rsqrt.default": 2,
    "aten.neg.default": 2,
    "aten.cat.default": 2,
    "aten.silu.default": 1,
    "aten.mul.Tensor": 9,  # norms 4, RoPE 4, SwiGLU 1
    "aten.add.Tensor": 4,  # norms 2, RoPE 2 (the residual adds stay)
}
ALLOCATIONS = {"aten.empty.memory_format", "aten.empty_like.default"}


def test_fused_decode_cuts_the_token_steps_ops(tmp_path: Path) -> None:
    """`decode_step_profile --count --fused` on the tiny Llama: each layer of both engines' token steps runs
    the 24 eager ops of `EAGER_ELEMENTWISE` fewer and nothing more but the kernels' output allocations
    (docs/design-decisions.md, 'The decode step's elementwise work, fused')."""
    counts = {}
    for fused in ([], ["--fused"]):
        path = tmp_path / f"count{len(fused)}.json"
        argv = ["--model", "tiny", "--context", "40", "--count", "--device", KERNEL_DEVICE, "--result", str(path)]
        decode_step_profile.main(argv + fused)
        counts[bool(fused)] = json.loads(path.read_text())
    for method in ("dense_engine", "gsm"):
        for before, after in zip(counts[False][method]["ops"], counts[True][method]["ops"], strict=True):
            removed, added = Counter(before) - Counter(after), Counter(after) - Counter(before)
            assert {op: removed[op] for op in EAGER_ELEMENTWISE} == EAGER_ELEMENTWISE
            assert set(added) <= ALLOCATIONS
            assert not (EAGER_ELEMENTWISE.keys() - {"aten.add.Tensor"}) & set(after)  # the residual adds remain
