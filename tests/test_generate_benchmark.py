"""benchmarks.generate's summary and benchmarks.bandwidth's byte account (CPU): GSM over the fastest dense
method, every method's bandwidth share, the TTFT ratio; the bytes a GSM step reads, counted from the
cache's buffers, against the same count from the config's shapes."""

from __future__ import annotations

import math

import torch

from benchmarks import bandwidth
from benchmarks.generate import (
    first_token_figures,
    generate_timed,
    plain_loop_generate,
    row_settings,
    settings_for,
    smollm2_extras,
    summarize,
)
from gsm_train.attention import gsm_adapters, inject_gsm
from gsm_train.config.schema import GSMConfig
from gsm_train.inference.cache import GSMCache, cache_kwargs
from gsm_train.inference.engine import enable_gsm_generation
from gsm_train.models.families import model_dims
from gsm_train.models.model_zoo import tiny_model

BLOCK, TOP_K = 8, 6
GSM = {
    "sparse_attention": {"top_k": TOP_K, "k_min": 2, "gate_head_dim": 16, "dense_layers": [0], "mode": "sparse"},
    "kv_compression": {"enabled": True, "block_size": BLOCK, "cluster_num": 4, "hidden_dim": 8},
}


def _method(tokens_per_s: float, share: float, ttft: float | None) -> dict:
    return {"decode_tokens_per_s": tokens_per_s, "bandwidth_share": share, "time_to_first_token_s": ttft}


def test_summary_sets_gsm_against_the_fastest_dense_method() -> None:
    rows = {
        "8b_32k_bs1": {
            "dense_eager": _method(25.0, 0.1, 2.0),
            "dense_static_compiled": _method(55.0, 0.2, 2.5),
            "dense_engine": _method(170.0, 0.8, 1.6),
            "gsm": _method(85.0, 0.3, 4.0),
        },
        "8b_128k_bs16": {"gsm": _method(500.0, 0.5, None)},  # no dense method fits
        "8b_32k_bs16": {"dense_eager": _method(100.0, 0.2, None)},  # cut short: no summary
        "smollm2_8k_bs1": {
            "dense_engine": _method(400.0, 0.5, 0.05),
            "gsm": _method(200.0, 0.2, 0.5),
            "step_kl": {"gsm_over_dense": 1.5},
        },
    }
    summary = summarize(rows)
    assert summary["e2e_speedup_8b_32k_bs1"] == 85.0 / 170.0
    assert summary["ttft_ratio_8b_32k_bs1"] == 4.0 / 1.6
    assert summary["bandwidth_share_dense_engine_8b_32k_bs1"] == 0.8
    assert summary["bandwidth_share_gsm_8b_128k_bs16"] == 0.5
    assert "e2e_speedup_8b_128k_bs16" not in summary and "ttft_ratio_8b_128k_bs16" not in summary
    assert not any(key.endswith("8b_32k_bs16") for key in summary)
    assert summary["step_kl_gsm_over_dense"] == 1.5
    assert row_settings(48) != row_settings(32)
    assert row_settings(48)["gsm_prefill"] == "dense" and row_settings(48) != row_settings(48, "sparse")
    # a prefill chunk other than the library's is part of the settings; the default leaves rows as they were
    assert (
        "gsm_prefill_chunk" not in row_settings(48) and row_settings(48, "dense", 32768)["gsm_prefill_chunk"] == 32768
    )
    # so are fused token steps and the dense methods measured
    assert "fused_decode" not in row_settings(48) and row_settings(48, fused_decode=True)["fused_decode"] is True
    assert row_settings(48, methods=("dense_engine",))["methods"] == ["dense_engine", "gsm"]


def test_warm_first_token_calls_give_the_median_and_keep_the_cold_one() -> None:
    samples = iter([0.05, 0.03, 0.04, 0.02, 0.06])
    figures = first_token_figures(0.09, 5, lambda: next(samples))
    assert figures["time_to_first_token_s"] == 0.04
    assert figures["time_to_first_token_cold_s"] == 0.09
    assert figures["time_to_first_token_samples_s"] == [0.05, 0.03, 0.04, 0.02, 0.06]
    # no calls, or no timed first token (batch > 1): the timed call's figure stands and nothing is called
    assert first_token_figures(0.09, 0, lambda: 1 / 0) == {} and first_token_figures(None, 5, lambda: 1 / 0) == {}


def test_only_rows_that_make_first_token_calls_name_them_in_their_settings() -> None:
    settings = row_settings(48)
    assert settings_for("smollm2_8k_bs1", settings) == settings | {"first_token_calls": 5}
    # the 8B rows' prefills take seconds: no calls, and rows measured before them stay complete
    for name in ("8b_32k_bs1", "8b_128k_bs1", "smollm2_8k_bs16", "8b_32k_bs16"):
        assert settings_for(name, settings) == settings


def test_the_cold_ratio_needs_every_methods_timed_call() -> None:
    def method(ttft: float, cold: float | None) -> dict:
        return _method(100.0, 0.5, ttft) | ({"time_to_first_token_cold_s": cold} if cold is not None else {})

    row = {"dense_eager": method(0.03, 0.04), "dense_engine": method(0.05, 0.13), "gsm": method(0.045, 0.096)}
    summary = summarize({"smollm2_8k_bs1": row})
    assert summary["ttft_ratio_smollm2_8k_bs1"] == 0.045 / 0.03
    assert summary["ttft_cold_ratio_smollm2_8k_bs1"] == 0.096 / 0.04
    row["dense_engine"] = method(0.05, None)  # a method measured before the calls existed
    assert "ttft_cold_ratio_smollm2_8k_bs1" not in summarize({"smollm2_8k_bs1": row})


def test_gsm_step_bytes_follow_the_caches_buffers() -> None:
    model = tiny_model("llama")
    torch.manual_seed(0)
    inject_gsm(model, GSMConfig.model_validate(GSM), mode="sparse")
    held, batch = 43, 2
    cache = GSMCache(model, capacity=48)
    with torch.no_grad():
        model(torch.randint(0, 256, (batch, held)), use_cache=True, **cache_kwargs(model, cache))
    packed = held // BLOCK * BLOCK if held % BLOCK else held - BLOCK
    dims = model_dims(model)
    heads, dim = dims["kv_heads"], dims["head_dim"]
    expected = 0
    for _, adapter in gsm_adapters(model):
        asq = adapter.asq_k
        packed_row = 1 + math.ceil(dim * asq.quant_bits / 8) + 2 + 2 * dim  # id, residual codes, scale, prototype
        raw = (held - packed) * dim * 4  # the newest block, fp32 here
        gate = adapter.gate
        if gate is None or adapter.dense_layer:
            expected += 2 * heads * (packed * packed_row + raw)
            continue
        key = gate.gate_head_dim + 2 if gate.key_bits == 8 else 2 * gate.gate_head_dim
        expected += gate.num_selectors * held * key + 2 * heads * (TOP_K * packed_row + raw)
    assert bandwidth.gsm_kv_read_bytes(model, cache) == expected * batch
    dense = bandwidth.dense_kv_bytes(model, held, batch)
    assert dense == 2 * 2 * heads * dim * dims["layers"] * held * batch


def test_share_is_bytes_over_time_over_peak() -> None:
    # 100 tokens/s at batch 4: a step every 40 ms reading 1e9 bytes is 2.5e10 B/s, a quarter of 1e11
    assert bandwidth.share(100.0, 4, 10**9, 1e11) == 0.25
    peak, source = bandwidth.peak_bandwidth()
    assert peak > 0 and source


def test_smollm2_extras_compare_against_the_sparse_prefill_when_the_row_prefills_densely() -> None:
    """The timed GSM row prefills densely (the default), its token agreement and step KL against teacher
    forcing prefill sparsely: in fp64 both are exact (agreement 1, KL ~ 0) while the dense prefill is not
    the teacher-forced function; the eager steps keep the row's own (dense) prefill."""
    model = tiny_model("llama").to(torch.float64)
    torch.manual_seed(0)
    inject_gsm(model, GSMConfig.model_validate(GSM), mode="sparse")
    enable_gsm_generation(model, cuda_graphs=False, prefill="dense")
    prompts = torch.randint(0, 256, (4, 40), generator=torch.Generator().manual_seed(0))
    new_tokens = 8
    generated, _ = generate_timed(model, prompts[:1, :-new_tokens], new_tokens)
    row = {"gsm_tokens": generated, "batch": 1}
    extras = smollm2_extras(model, row, new_tokens, prompts, "dense")
    assert extras["token_agreement"] == 1.0
    assert extras["captured_step_tokens_equal_eager"]
    assert abs(extras["step_kl"]["gsm_mean_kl"]) < 1e-12
    assert model.gsm_generation["prefill"] == "dense"


def test_the_plain_loop_chooses_the_tokens_generate_chooses() -> None:
    """The diagnostic loop drives the same forward calls as `model.generate` (prompt, then one token per
    step over the GSM cache): greedy tokens equal, in fp64 (on the GPU the benchmark checks it too)."""
    model = tiny_model("llama").double()
    torch.manual_seed(0)
    inject_gsm(model, GSMConfig.model_validate(GSM), mode="sparse")
    enable_gsm_generation(model, prefill_chunk=16)
    ids = torch.randint(1, 256, (1, 40))
    expected, _ = generate_timed(model, ids, 6)
    tokens, tokens_per_s = plain_loop_generate(model, ids, 6)
    assert torch.equal(tokens, expected) and tokens_per_s > 0
