"""Injection of the GSM modules into the tiny models of every supported family (CPU, fp32)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedModel

from gsm_train.attention import (
    configure_gsm,
    gsm_collect,
    gsm_disabled,
    gsm_parameters,
    gsm_settings,
    inject_cache_bridge,
    inject_gsm,
    inject_kv_compressor,
    inject_sparse_gate,
)
from gsm_train.config.schema import GSMConfig
from gsm_train.models.model_zoo import TINY_FAMILIES, tiny_model
from gsm_train.modules import ASQCompressor, CacheBridge, GSMError, SparseGateHead

LENGTH = 32
BLOCK = 8
SPARSE = {"top_k": 4, "k_min": 2, "gate_head_dim": 16}
ASQ = {"enabled": True, "block_size": BLOCK, "cluster_num": 4, "hidden_dim": 8}
BRIDGE = {"enabled": True, "bridge_from": 1, "bridge_to_start": 2}
NO_SPARSE = {"enabled": False}
EVERYTHING = {"sparse_attention": SPARSE, "kv_compression": ASQ, "cross_layer_sharing": BRIDGE}

families = pytest.mark.parametrize("family", TINY_FAMILIES)


def _injected(family: str, sections: dict[str, Any], mode: str = "dense") -> PreTrainedModel:
    model = tiny_model(family)
    inject_gsm(model, GSMConfig.model_validate(sections), mode=mode)
    return model


def _ids(seed: int = 0) -> Tensor:
    return torch.randint(0, 256, (2, LENGTH), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _logits(model: PreTrainedModel, ids: Tensor | None = None) -> Tensor:
    return model(_ids() if ids is None else ids, use_cache=False).logits


@pytest.fixture(scope="module")
def base_logits() -> dict[str, Tensor]:
    """Logits of the unmodified tiny model of each family."""
    return {family: _logits(tiny_model(family)) for family in TINY_FAMILIES}


# --------------------------------------------------------------------------- exactness


@families
@pytest.mark.parametrize(
    ("sections", "mode", "disabled"),
    [
        ({"gsm_enabled": False, **EVERYTHING}, "sparse", False),
        (EVERYTHING, "sparse", True),
        ({"sparse_attention": SPARSE}, "dense", False),
    ],
    ids=["gsm_enabled_false", "gsm_disabled_context", "gate_dense_mode"],
)
def test_gsm_off_equals_base_exactly(
    family: str, sections: dict, mode: str, disabled: bool, base_logits: dict[str, Tensor]
) -> None:
    model = _injected(family, sections, mode)
    with gsm_disabled(model) if disabled else nullcontext():
        assert torch.equal(_logits(model), base_logits[family])
    assert gsm_settings(model).enabled == (sections.get("gsm_enabled", True))


@families
@pytest.mark.parametrize("mode", ["sparse", "oracle"])
def test_top_k_covering_the_sequence_equals_dense(family: str, mode: str, base_logits: dict[str, Tensor]) -> None:
    model = _injected(family, {"sparse_attention": {**SPARSE, "top_k": LENGTH, "k_min": LENGTH}}, mode)
    assert torch.allclose(_logits(model), base_logits[family], atol=1e-5, rtol=0)


@families
@pytest.mark.parametrize("heads", ["layer", "kv"])
@pytest.mark.parametrize("gate_init", ["random", "qk_svd"])
def test_oracle_captures_at_least_the_gate_mass(family: str, heads: str, gate_init: str) -> None:
    model = _injected(family, {"sparse_attention": {**SPARSE, "heads": heads, "gate_init": gate_init}})
    with gsm_collect(model, recall=(4, 8)) as records:
        _logits(model)
    assert sorted(records.layers) == list(range(4))
    selectors = 1 if heads == "layer" else 2
    for sums in (record.captured_mass for record in records.layers.values()):
        assert int(sums["queries"]) == 2 * selectors * (LENGTH - 7)
        assert 0 < float(sums["gate"]) <= float(sums["oracle"]) + 1e-9
        assert float(sums["oracle"]) <= float(sums["queries"]) + 1e-9


# --------------------------------------------------------------------------- cache bridge


@families
def test_bridge_mix_with_alpha_zero_is_exact(family: str, base_logits: dict[str, Tensor]) -> None:
    model = _injected(
        family, {"sparse_attention": NO_SPARSE, "cross_layer_sharing": {**BRIDGE, "mode": "mix", "alpha_init": 0.0}}
    )
    assert torch.equal(_logits(model), base_logits[family])


@families
def test_bridge_share_changes_target_layers_only(family: str) -> None:
    base, model = (
        tiny_model(family),
        _injected(family, {"sparse_attention": NO_SPARSE, "cross_layer_sharing": {**BRIDGE, "mode": "share"}}),
    )
    with torch.no_grad():
        expected = base(_ids(), output_hidden_states=True).hidden_states
        got = model(_ids(), output_hidden_states=True).hidden_states
    start = BRIDGE["bridge_to_start"]  # hidden_states[i] is the input of layer i
    for index, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(a, b) == (index <= start), f"hidden state {index}"


# --------------------------------------------------------------------------- causality


CAUSAL_CASES = {
    "dense": ({"sparse_attention": SPARSE}, "dense"),
    "sparse": ({"sparse_attention": SPARSE}, "sparse"),
    "oracle": ({"sparse_attention": SPARSE}, "oracle"),
    "asq": ({"sparse_attention": NO_SPARSE, "kv_compression": ASQ}, "dense"),
    "bridge_mix": ({"sparse_attention": NO_SPARSE, "cross_layer_sharing": {**BRIDGE, "mode": "mix"}}, "dense"),
    "bridge_share": ({"sparse_attention": NO_SPARSE, "cross_layer_sharing": {**BRIDGE, "mode": "share"}}, "dense"),
    "everything_sparse": (EVERYTHING, "sparse"),
    "everything_oracle": (EVERYTHING, "oracle"),
}


@families
@pytest.mark.parametrize("case", CAUSAL_CASES)
def test_future_tokens_do_not_change_past_logits(family: str, case: str) -> None:
    """The cut sits inside a block: ASQ's prototypes of that block use its later tokens, so queries must
    see their own block uncompressed (as at decode) and earlier blocks compressed."""
    sections, mode = CAUSAL_CASES[case]
    model = _injected(family, sections, mode)
    t = BLOCK + BLOCK // 2
    ids = _ids()
    changed = ids.clone()
    changed[:, t + 1 :] = _ids(seed=1)[:, t + 1 :]
    before, after = _logits(model, ids), _logits(model, changed)
    torch.testing.assert_close(after[:, : t + 1], before[:, : t + 1], atol=1e-6, rtol=0)
    assert not torch.allclose(after[:, t + 1 :], before[:, t + 1 :])


# --------------------------------------------------------------------------- refusals


def test_refuses_unsupported_family() -> None:
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=64))
    with pytest.raises(GSMError, match="gpt2") as err:
        inject_gsm(gpt2, GSMConfig())
    assert all(family in str(err.value) for family in TINY_FAMILIES)


def test_refuses_second_injection() -> None:
    model = _injected("llama", {})
    with pytest.raises(GSMError, match="fresh base model"):
        inject_gsm(model, GSMConfig())


def test_refuses_bridge_beyond_the_model() -> None:
    config = GSMConfig.model_validate({"cross_layer_sharing": {**BRIDGE, "bridge_to_start": 4}})
    with pytest.raises(GSMError, match="use a value below 4"):
        inject_gsm(tiny_model("llama"), config)


def test_refuses_rotated_residuals_for_a_head_size_that_is_no_power_of_two() -> None:
    """One error naming the field, the model's head size and the fix, before any module is built."""
    from transformers import AutoModelForCausalLM

    from gsm_train.models.model_zoo import tiny_config

    config = tiny_config("llama", 2)
    config.head_dim = 12
    model = AutoModelForCausalLM.from_config(config)
    gsm = GSMConfig.model_validate({"kv_compression": {"enabled": True, "rotate_residuals": True}})
    with pytest.raises(
        GSMError,
        match="rotate_residuals=true needs a power-of-two head_dim.* is 12; set kv_compression.rotate_residuals=false",
    ):
        inject_gsm(model, gsm)
    assert not any(hasattr(layer.self_attn, "gsm") for layer in model.model.layers)


def test_refuses_layer_bits_for_a_layer_the_model_lacks() -> None:
    """`layer_bits` naming layer 4 of a 4-layer model: one error with the model's layer count, nothing built."""
    model = tiny_model("llama")
    gsm = GSMConfig.model_validate({"kv_compression": {"enabled": True, "layer_bits": {1: (2, 2), 4: (8, 8)}}})
    with pytest.raises(GSMError, match=r"layer_bits names layer 4, but the model has 4 layers \(0 to 3\); drop it"):
        inject_gsm(model, gsm)
    assert not any(hasattr(layer.self_attn, "gsm") for layer in model.model.layers)


# --------------------------------------------------------------------------- seed API and dtypes


def _expect_gate(model: PreTrainedModel, layer: int, attn: nn.Module) -> None:
    assert isinstance(attn.gsm.gate, SparseGateHead) and attn.gsm.asq_k is None and attn.gsm.bridge is None
    sparse = gsm_settings(model).config.sparse_attention
    assert (sparse.top_k_schedule, sparse.top_k) == ("exp_decay", 128)


def _expect_asq(model: PreTrainedModel, layer: int, attn: nn.Module) -> None:
    assert attn.gsm.gate is None and attn.gsm.bridge is None
    for asq in (attn.gsm.asq_k, attn.gsm.asq_v):
        assert isinstance(asq, ASQCompressor) and (asq.cluster_num, asq.quant_bits) == (32, 8)


def _expect_bridge(model: PreTrainedModel, layer: int, attn: nn.Module) -> None:
    assert attn.gsm.gate is None and attn.gsm.asq_k is None
    assert attn.gsm.is_bridge_source == (layer == 1)
    assert isinstance(attn.gsm.bridge, CacheBridge) == (layer >= 2)
    if layer >= 2:
        assert attn.gsm.bridge.alpha.item() == pytest.approx(0.3)


@pytest.mark.parametrize(
    ("inject", "check"),
    [
        (lambda m: inject_sparse_gate(m, top_k_schedule="exp_decay", k_max=128), _expect_gate),
        (lambda m: inject_kv_compressor(m, cluster_num=32, quant_bits=8), _expect_asq),
        (lambda m: inject_cache_bridge(m, bridge_layers=(1, 2), alpha_init=0.3), _expect_bridge),
    ],
    ids=["sparse_gate", "kv_compressor", "cache_bridge"],
)
def test_seed_api_attaches_modules(inject, check) -> None:
    model = tiny_model("llama")
    inject(model)
    for layer, decoder in enumerate(model.model.layers):
        check(model, layer, decoder.self_attn)
    assert _logits(model).isfinite().all()


def test_gsm_parameters_are_fp32_on_a_bf16_base() -> None:
    model = tiny_model("llama").to(torch.bfloat16)
    inject_gsm(model, GSMConfig.model_validate(EVERYTHING))
    names = {name for name, _ in gsm_parameters(model)}
    assert all(any(part in name for name in names) for part in (".gate.", ".asq_k.", ".asq_v.", ".bridge."))
    assert all(param.dtype == torch.float32 for _, param in gsm_parameters(model))
    assert all(param.dtype == torch.bfloat16 for name, param in model.named_parameters() if name not in names)


@pytest.mark.parametrize("training", [False, True])
def test_modules_join_in_the_mode_of_the_model(training: bool) -> None:
    """A model in eval mode (as loaded models are) gets its GSM modules in eval mode, a training one in
    training mode: before this, a loaded model's GSM modules stayed in training mode and its inference ran
    training-only paths (on CUDA, the gate keys' compiled int8 rounding, which teacher forcing then took
    and the cached steps did not). In eval mode ASQ records the statistics of what it encoded."""
    model = tiny_model("llama").train(training)
    inject_gsm(model, GSMConfig.model_validate(EVERYTHING))
    modes = {module.training for name, module in model.named_modules() if ".gsm" in name}
    assert modes == {training}
    _logits(model)
    compressors = [module for module in model.modules() if isinstance(module, ASQCompressor)]
    assert compressors and all(bool(module.last_stats) != training for module in compressors)


@pytest.mark.parametrize("mode", ["dense", "sparse", "oracle"])
def test_bf16_base_runs_without_autocast(mode: str) -> None:
    model = tiny_model("llama").to(torch.bfloat16)
    inject_gsm(model, GSMConfig.model_validate(EVERYTHING), mode=mode)
    logits = _logits(model)
    assert logits.dtype == torch.bfloat16 and logits.isfinite().all()


def test_gsm_mask_is_none_only_for_an_unpadded_causal_pass_over_the_whole_sequence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from transformers import masking_utils
    from transformers.masking_utils import and_masks, causal_mask_function, sdpa_mask

    from gsm_train.attention.injection import gsm_mask

    # as transformers 5.17 does while a CUDA graph captures: never skip the causal mask
    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", lambda *args, **kwargs: False)
    assert sdpa_mask(batch_size=2, q_length=8, kv_length=8, device="cpu") is not None
    assert gsm_mask(batch_size=2, q_length=8, kv_length=8, device="cpu") is None
    padding = torch.ones(2, 8, dtype=torch.bool)
    padding[0, :3] = False
    packed = and_masks(causal_mask_function, lambda b, h, q, kv: (q < 4) == (kv < 4))
    for case in (
        {"q_length": 8, "kv_length": 8, "attention_mask": padding},
        {"q_length": 4, "kv_length": 8, "q_offset": 4},
        {"q_length": 8, "kv_length": 8, "kv_offset": 2, "q_offset": 2},
        {"q_length": 8, "kv_length": 8, "mask_function": packed},
        {"q_length": 8, "kv_length": 8, "allow_is_causal_skip": False},
    ):
        expected = sdpa_mask(batch_size=2, device="cpu", **case)
        assert expected is not None and torch.equal(gsm_mask(batch_size=2, device="cpu", **case), expected)


def test_a_pass_that_cannot_read_position_ids_keeps_the_causal_path_only_inside_rows_not_packed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from transformers import masking_utils

    from gsm_train.attention import dispatch as gsm_attention
    from gsm_train.attention.injection import rows_not_packed

    model = _injected("llama", {"sparse_attention": SPARSE})
    expected = _logits(model)
    masks: list[Tensor | None] = []
    real_sdpa = gsm_attention.sdpa_attention_forward

    def recording_sdpa(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, **kwargs):
        masks.append(mask)
        return real_sdpa(module, query, key, value, mask, **kwargs)

    monkeypatch.setattr(gsm_attention, "sdpa_attention_forward", recording_sdpa)
    monkeypatch.setattr(masking_utils, "is_tracing", lambda *args, **kwargs: True)  # as while a CUDA graph captures
    assume_packed = _logits(model)
    assert masks and all(mask is not None for mask in masks)  # transformers assumed packed rows: a full mask
    masks.clear()
    with rows_not_packed():
        causal = _logits(model)
    assert masks and all(mask is None for mask in masks)
    assert torch.allclose(causal, expected, atol=1e-6) and torch.allclose(assume_packed, expected, atol=1e-5)
    assert masking_utils.find_packed_sequence_indices(torch.tensor([[0, 1, 0, 1]])) is not None  # restored


@pytest.mark.parametrize(("heads", "route"), [("layer", "captured"), ("kv", "captured"), ("kv", "large")])
def test_captured_or_large_training_forwards_take_the_block_sparse_path_with_the_same_logits(
    heads: str, route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `captured_steps` (set by the trainer when it captures the step), or eagerly where a layer's
    attention work reaches `EAGER_MIN_WORK` (lowered here to 1), a training forward of an
    ASQ layer attends through `own_block_attention`, here run eagerly on CPU (its path is otherwise for
    CUDA only), and gives the masked SDPA's logits (fp64); an eager forward below the threshold and
    evaluation forwards keep the masked SDPA."""
    from gsm_train.functional import own_block_attention as own_block

    calls = []
    attend = own_block.own_block_attention
    monkeypatch.setattr(own_block, "fits", lambda query: True)
    monkeypatch.setattr(own_block, "TILE", BLOCK)  # tiles of one ASQ block at these lengths
    own_block._tile_structure.cache_clear()  # cached per length and block size: not across tile sizes
    monkeypatch.setattr(own_block, "own_block_attention", lambda *args: calls.append(1) or attend(*args))
    torch.manual_seed(0)
    model = _injected(
        "llama", {"sparse_attention": {**SPARSE, "heads": heads}, "kv_compression": ASQ}, mode="sparse"
    ).double()  # fp64: no fp32 rounding for ASQ's codes to amplify
    model.train()
    masked = _logits(model)
    assert not calls  # eager, and the tiny model's layers far below the threshold
    if route == "captured":
        configure_gsm(model, captured_steps=True)
    else:
        monkeypatch.setattr(own_block, "EAGER_MIN_WORK", 1)  # every call reaches it
    torch.testing.assert_close(_logits(model), masked, atol=1e-10, rtol=0)
    assert calls  # the block-sparse path ran
    calls.clear()
    model.eval()
    _logits(model)
    assert not calls
    own_block._tile_structure.cache_clear()


@pytest.mark.parametrize("baseline", ["per_token", "kivi"])
def test_plain_quantization_baselines_take_each_side_at_its_width(baseline: str) -> None:
    """With `value_quant_bits`, an evaluation's plain-quantization baseline rounds K at quant_bits and V at
    value_quant_bits, as ASQ stores them."""
    from gsm_train.attention.adapter import plain_kv_quant
    from gsm_train.attention.forward_state import ForwardState

    model = _injected("llama", {"kv_compression": {**ASQ, "value_quant_bits": 2}})
    adapter = model.model.layers[1].self_attn.gsm
    state = ForwardState(configure_gsm(model, kv_baseline=baseline))
    key, value = torch.randn(2, 2, LENGTH, 16), torch.randn(2, 2, LENGTH, 16)
    got_k, got_v, _ = adapter.transform_kv(key, value, state)
    assert torch.equal(got_k, plain_kv_quant(key, value, baseline, (4, 4), BLOCK)[0])
    assert torch.equal(got_v, plain_kv_quant(key, value, baseline, (2, 2), BLOCK)[1])
