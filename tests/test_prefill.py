"""The two prefill modes of a GSM cache (CPU, tiny models): `dense` (the prompt attends as the base model)
fills the cache exactly as the cache writer fills it from the base model's own K/V, and gives the base
model's logits for the prompt; `sparse` is the teacher-forced GSM pass; with nothing that changes
attention switched on, the two are the same. Also the continuation-perplexity measure of
benchmarks/prefill_quality.py on a tiny model, and the prefill setting's bad values."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import Tensor

from benchmarks.prefill_quality import continuation_nll
from gsm_train import GSMModel
from gsm_train.attention import gsm_disabled, inject_gsm
from gsm_train.attention.dispatch import chunked_masked_attention, masked_sdpa
from gsm_train.attention.kv_store import CacheLengths, KVStore
from gsm_train.attention.layout import block_causal_kv
from gsm_train.config.schema import GSMConfig
from gsm_train.export.save_load import export_adapter, load_gsm
from gsm_train.functional.gate_keys import encode_gate_keys
from gsm_train.inference.cache import GSMCache, cache_kwargs
from gsm_train.inference.engine import enable_gsm_generation
from gsm_train.inference.prefill import causal_chunk_sdpa
from gsm_train.models.families import attention_modules
from gsm_train.models.model_zoo import tiny_model
from gsm_train.modules import GSMError
from gsm_train.quant import stored_split

BLOCK = 8
PROMPT = 29  # three full blocks and a partial one
LENGTH = 37
GATE = {"top_k": 4, "k_min": 2, "gate_head_dim": 16, "dense_layers": [0]}
ASQ = {"enabled": True, "block_size": BLOCK, "cluster_num": 4, "hidden_dim": 8}
# every GSM feature that changes attention off: the gate runs (its keys are stored) but selects nothing away
NOTHING_CHANGES_ATTENTION = {"sparse_attention": GATE}
EVERYTHING = {
    "sparse_attention": {**GATE, "heads": "kv", "gate_key_bits": 8, "sink_tokens": 1, "recent_tokens": 2},
    "kv_compression": {**ASQ, "value_quant_bits": 2, "rotate_residuals": True},
}
TOKENS = torch.randint(0, 256, (3, LENGTH), generator=torch.Generator().manual_seed(0))  # prompt and continuation


def _model(sections: dict[str, Any], mode: str, family: str = "llama") -> torch.nn.Module:
    model = tiny_model(family)
    inject_gsm(model, GSMConfig.model_validate(sections), mode=mode)
    return model


@torch.no_grad()
def _run(
    model: torch.nn.Module, ids: Tensor, prefill: str, chunks: tuple[int, ...], **cache_options: Any
) -> tuple[GSMCache, Tensor]:
    """The cache (made with `cache_options` besides the prefill) and the logits of `ids`: its first
    sum(chunks) tokens as a prompt in calls of `chunks` tokens, then the rest one token per call."""
    cache, logits, start = GSMCache(model, capacity=ids.shape[1], prefill=prefill, **cache_options), [], 0
    kwargs = cache_kwargs(model, cache)
    for size in (*chunks, *[1] * (ids.shape[1] - sum(chunks))):
        logits.append(model(ids[:, start : start + size], **kwargs, use_cache=True).logits)
        start += size
    return cache, torch.cat(logits, 1)


def _contents(cache: GSMCache) -> dict[str, Tensor]:
    """Everything a GSM cache stores, by name."""
    held = {"lengths": torch.tensor([cache.lengths.seq_len, cache.lengths.packed_len])}
    for i, layer in enumerate(cache.layers):
        for side, store in (("k", layer.k_store), ("v", layer.v_store)):
            held[f"{i}.{side}.tail"] = store.tail
            held |= {f"{i}.{side}.{name}": field for name, field in (store.fields or {}).items()}
        held |= {f"{i}.gate_keys": layer.gate_keys} if layer.gate_keys is not None else {}
        held |= {f"{i}.gate_key_scales": layer.gate_key_scales} if layer.gate_key_scales is not None else {}
    return held


@pytest.mark.parametrize("chunks", [(PROMPT,), (8, 16, 5), (5, 11, 13)], ids=["one_call", "aligned", "unaligned"])
def test_with_nothing_that_changes_attention_both_prefills_are_identical(chunks: tuple[int, ...]) -> None:
    """Gate on (its keys stored) in dense main attention, no compressor: both modes give the same cache and
    logits, bit for bit, for the prompt and the token steps after it, in one call or in chunks."""
    model = _model(NOTHING_CHANGES_ATTENTION, mode="dense")
    ids = TOKENS[:2]
    dense_cache, dense_logits = _run(model, ids, "dense", chunks)
    sparse_cache, sparse_logits = _run(model, ids, "sparse", chunks)
    assert torch.equal(dense_logits, sparse_logits)
    dense_held, sparse_held = _contents(dense_cache), _contents(sparse_cache)
    assert dense_held.keys() == sparse_held.keys() and any("gate_keys" in name for name in dense_held)
    for name, tensor in dense_held.items():
        assert torch.equal(tensor, sparse_held[name]), name


def test_with_a_top_k_that_keeps_every_key_both_prefills_agree_in_fp64() -> None:
    """Sparse main attention whose k covers every key selects nothing away: the two modes then compute the
    same attention through different kernels (masked SDPA against causal SDPA), equal to fp64 rounding."""
    model = _model({"sparse_attention": {**GATE, "top_k": LENGTH, "k_min": LENGTH}}, mode="sparse").double()
    ids = TOKENS[:2]
    dense_cache, dense_logits = _run(model, ids, "dense", (8, 21))
    sparse_cache, sparse_logits = _run(model, ids, "sparse", (8, 21))
    torch.testing.assert_close(dense_logits, sparse_logits, atol=1e-12, rtol=0)
    sparse_held = _contents(sparse_cache)
    for name, tensor in _contents(dense_cache).items():
        torch.testing.assert_close(tensor, sparse_held[name], atol=1e-12, rtol=0, msg=name)


@torch.no_grad()
def _dense_model_layers(model: torch.nn.Module, ids: Tensor) -> tuple[Tensor, list[tuple[Tensor, ...]]]:
    """The dense model's (GSM off) logits of `ids` and, per layer, its K, V (post-RoPE, as a cache gets them)
    and its attention input (hidden, cos, sin)."""
    from transformers import DynamicCache

    inputs: list[tuple[Tensor, Tensor, Tensor]] = []

    def keep(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        inputs.append((kwargs["hidden_states"], *kwargs["position_embeddings"]))

    hooks = [attn.register_forward_pre_hook(keep, with_kwargs=True) for attn in attention_modules(model)]
    cache = DynamicCache()
    try:
        with gsm_disabled(model):
            logits = model(ids, **cache_kwargs(model, cache), use_cache=True).logits
    finally:
        for hook in hooks:
            hook.remove()
    return logits, [(layer.keys, layer.values, *inputs[i]) for i, layer in enumerate(cache.layers)]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_dense_prefill_stores_what_the_cache_writer_makes_of_the_dense_models_kv(family: str) -> None:
    """Every GSM feature on (sparse gate per KV head with int8 keys, ASQ at 4/2 bits, rotated): a prompt in
    one call gives the dense model's logits exactly, and the cache holds exactly what a fresh store packs
    from the dense model's own K/V of each layer, and the gate keys of its own hidden states."""
    model = _model(EVERYTHING, mode="sparse", family=family)
    ids = TOKENS[:2, :PROMPT]
    cache, logits = _run(model, ids, "dense", (PROMPT,))
    dense_logits, layers = _dense_model_layers(model, ids)
    assert torch.equal(logits, dense_logits)
    assert (cache.lengths.seq_len, cache.lengths.packed_len) == (PROMPT, stored_split(PROMPT, BLOCK))
    for layer_cache, attn, (key, value, hidden, cos, sin) in zip(
        cache.layers, attention_modules(model), layers, strict=True
    ):
        lengths = CacheLengths(key.device)
        lengths.add_chunk(PROMPT, BLOCK)
        for store, states, compressor in (
            (layer_cache.k_store, key, attn.gsm.asq_k),
            (layer_cache.v_store, value, attn.gsm.asq_v),
        ):
            written = KVStore(
                compressor, *states.shape[:2], states.shape[3], cache.capacity, states.dtype, key.device, lengths
            )
            written.append(states)
            assert torch.equal(store.tail, written.tail)
            assert store.fields.keys() == written.fields.keys()
            for name, field in written.fields.items():
                assert torch.equal(store.fields[name], field), name
        gate = attn.gsm.gate
        if gate is None:  # a dense layer keeps no gate keys
            assert layer_cache.gate_keys is None
            continue
        codes, scales = encode_gate_keys(gate(hidden, cos, sin)[1], gate.key_bits)
        assert torch.equal(layer_cache.gate_keys[:, :, :PROMPT], codes)
        assert torch.equal(layer_cache.gate_key_scales[:, :, :PROMPT], scales)


def test_after_a_dense_prefill_decoding_runs_and_the_first_token_is_the_dense_models_in_fp64() -> None:
    """fp64, every feature on: generation after a dense prefill runs, its first token is the dense model's
    argmax (the prompt's logits are the dense model's, bit for bit, from one call). Fed in chunks with
    ASQ, later chunks read the earlier ones as stored, so their logits differ from the dense model's by
    ASQ's error; without a compressor, chunks read raw K/V and the logits are the dense model's to fp64
    rounding (1e-10 here)."""
    model = _model(EVERYTHING, mode="sparse").double()
    prompt = TOKENS[:2, :PROMPT]
    with torch.no_grad():
        generated = model.generate(
            prompt,
            **cache_kwargs(model, GSMCache(model, prefill="dense")),
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
        )
        with gsm_disabled(model):
            dense_first = model(prompt, use_cache=False).logits[:, -1].argmax(-1)
    assert generated.shape == (2, PROMPT + 6)
    assert torch.equal(generated[:, PROMPT], dense_first)
    gate_only = _model({"sparse_attention": GATE}, mode="sparse").double()
    _, chunked = _run(gate_only, prompt, "dense", (8, 16, 5))
    with torch.no_grad(), gsm_disabled(gate_only):
        torch.testing.assert_close(chunked, gate_only(prompt, use_cache=False).logits, atol=1e-10, rtol=0)


def test_enable_gsm_generation_sets_the_prefill_of_generate(tmp_path) -> None:
    """`enable_gsm_generation(prefill=...)` reaches the cache `model.generate` makes; a bad value is
    refused, naming it and the modes, before the model changes (by `GSMModel.from_pretrained` before the
    base loads)."""
    folder = export_adapter(_model(EVERYTHING, mode="sparse"), tmp_path / "export", base_name="tiny-llama")
    fresh = tiny_model("llama")
    with pytest.raises(GSMError, match="prefill 'flash'.*'dense'.*'sparse'"):
        GSMModel.from_pretrained(folder, base="no-such-base", prefill="flash")
    load_gsm(fresh, folder)
    with pytest.raises(GSMError, match="prefill 'flash'.*'dense'.*'sparse'"):
        enable_gsm_generation(fresh, prefill="flash")
    assert not hasattr(fresh, "gsm_generation")
    enable_gsm_generation(fresh, prefill="dense")
    with torch.no_grad():
        out = fresh.generate(
            TOKENS[:2, :PROMPT], max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True
        )
        with gsm_disabled(fresh):
            dense_first = fresh(TOKENS[:2, :PROMPT], use_cache=False).logits[:, -1].argmax(-1)
    cache = getattr(out, "cache", None) or out.past_key_values
    assert cache.prefill == "dense" and torch.equal(out.sequences[:, PROMPT], dense_first)
    with pytest.raises(GSMError, match="prefill 'Dense'"):
        GSMCache(fresh, prefill="Dense")


def test_continuation_perplexity_through_the_cache_on_a_tiny_model() -> None:
    """benchmarks/prefill_quality.py's measure: with nothing that changes attention, both prefills score
    the continuation alike and as the dense model does (fp32 rounding); with every feature on, the first
    continuation token (scored from the prompt alone) is scored as by the dense model after a dense
    prefill (to fp32 rounding: the dense model's pass runs over the whole window), the sparse prefill's not."""
    windows = TOKENS
    model = _model(NOTHING_CHANGES_ATTENTION, mode="dense")
    dense, sparse, base = (continuation_nll(model, windows, PROMPT, mode) for mode in ("dense", "sparse", None))
    assert dense.shape == (3, LENGTH - PROMPT) and torch.equal(dense, sparse)
    torch.testing.assert_close(dense, base, atol=1e-5, rtol=0)
    model = _model(EVERYTHING, mode="sparse")
    dense, sparse, base = (continuation_nll(model, windows, PROMPT, mode) for mode in ("dense", "sparse", None))
    torch.testing.assert_close(dense[:, 0], base[:, 0], atol=1e-5, rtol=0)  # the base's GEMMs over more rows
    assert (sparse[:, 0] - base[:, 0]).abs().max() > 1e-3
    assert torch.isfinite(dense).all() and torch.isfinite(sparse).all()


def _reference_attention(query: Tensor, stored: tuple, own: tuple | None, selection: Tensor, block: int) -> Tensor:
    """The sparse prefill's attention before it went in chunks: one masked SDPA of every query over the
    stored keys and the raw ones side by side (`block_causal_kv`)."""
    positions = torch.arange(query.shape[2])
    keys, values, mask = block_causal_kv(*stored, own, selection, positions, block)
    return masked_sdpa(query, keys, values, mask, 0.125, True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("with_own", [True, False], ids=["asq", "no_compressor"])
@pytest.mark.parametrize("selectors", [1, 2])
def test_the_sparse_prefills_attention_in_query_chunks_equals_one_masked_sdpa(
    dtype: torch.dtype, with_own: bool, selectors: int
) -> None:
    """`chunked_masked_attention` (query chunks reading only the keys they can select) computes what one masked
    SDPA of every query over all 2S keys computed, and the same gradients for the query and every K/V input
    (training runs it where FlexAttention does not serve): fp64 to rounding (1e-12), fp32 to 1e-6 (gradients
    1e-5); chunks aligned to blocks or not, one chunk, a selection per KV group or one for all, a padded row."""
    generator = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, length, dim = 2, 4, 2, LENGTH, 8

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator, dtype=dtype).requires_grad_()

    query = rand(batch, heads, length, dim)
    stored = (rand(batch, kv_heads, length, dim), rand(batch, kv_heads, length, dim))
    own = (rand(batch, kv_heads, length, dim), rand(batch, kv_heads, length, dim)) if with_own else None
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    selection = (torch.rand(batch, selectors, length, length, generator=generator) < 0.4) & causal
    selection |= torch.eye(length, dtype=torch.bool)  # each query keeps its own position
    selection[1, :, 3:, :3] = False  # row 1 left-padded by 3 tokens: later queries never see them
    inputs = [query, *stored, *(own or ())]
    upstream = torch.randn(batch, length, heads, dim, generator=generator, dtype=dtype)
    expected = _reference_attention(query, stored, own, selection, BLOCK)
    expected_grads = torch.autograd.grad(expected, inputs, upstream)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-6
    for chunk in (5, BLOCK, 16, length):
        got = chunked_masked_attention(query, stored, own, selection, BLOCK, 0.125, True, chunk)
        torch.testing.assert_close(got, expected, atol=tolerance, rtol=0, msg=f"chunk {chunk}")
        for want, grad in zip(expected_grads, torch.autograd.grad(got, inputs, upstream)):
            torch.testing.assert_close(grad, want, atol=10 * tolerance, rtol=0, msg=f"chunk {chunk}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sparse_prefills_attention_of_a_query_is_the_same_bits_in_a_shorter_pass(dtype: torch.dtype) -> None:
    """A query's row of `chunked_masked_attention` does not depend on how many tokens the pass holds after it:
    over the first T - j tokens it is bit for bit the row of the pass over all T (every j to a chunk and a
    half), as the base model's causal SDPA rows are. So a prompt's K/V, and the ASQ codes made from them, come
    out of a prefill exactly as teacher forcing over the longer sequence makes them (benchmarks.step_kl: before,
    the raw keys followed the stored ones at an index that moved with T, and the rows differed by rounding)."""
    generator = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, length, dim, chunk = 1, 4, 2, 3 * LENGTH, 16, 16

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    query = rand(batch, heads, length, dim)
    stored = (rand(batch, kv_heads, length, dim), rand(batch, kv_heads, length, dim))
    own = (rand(batch, kv_heads, length, dim), rand(batch, kv_heads, length, dim))
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    selection = ((torch.rand(1, 1, length, length, generator=generator) < 0.4) & causal) | torch.eye(length).bool()
    full = chunked_masked_attention(query, stored, own, selection, BLOCK, 0.125, True, chunk)
    for short in range(length - chunk - chunk // 2, length):
        cut = (query[:, :, :short], *(tuple(t[:, :, :short] for t in pair) for pair in (stored, own)))
        got = chunked_masked_attention(*cut, selection[..., :short, :short], BLOCK, 0.125, True, chunk)
        assert torch.equal(got, full[:, :short]), f"the first {short} of {length} tokens"


def test_a_teacher_forced_pass_selects_the_same_keys_in_a_shorter_pass() -> None:
    """The gate's selection of a query does not depend on how many tokens the pass holds after it: int8 gate
    keys score in ties, and `torch.topk` breaks ties by the row's length, so `GateSelector` ranks every query
    chunk over the same width (its keys up to the chunk's full end, padded): the selection over the first T - j
    tokens is the pass over all T's, row for row (before, some rows took other tied keys)."""
    from gsm_train.attention.layout import Layout, allowed_keys
    from gsm_train.attention.selection import GateSelector, chunks
    from gsm_train.config.schema import SparseAttentionConfig
    from gsm_train.functional.attention_targets import causal_visible
    from gsm_train.functional.top_k import scheduled_k
    from gsm_train.modules.sparse_gate import SparseGateHead

    torch.manual_seed(0)
    config = SparseAttentionConfig(top_k=12, k_min=4, gate_head_dim=8, query_chunk=16, gate_key_bits=8)
    gate = SparseGateHead(hidden_size=32, gate_head_dim=8, base_head_dim=16, key_bits=8)
    queries, keys = torch.randn(2, 1, 1, 70, 8).round()  # integer gate rows: many equal scores

    def selection(length: int) -> torch.Tensor:
        positions = torch.arange(length)
        gate_q, gate_k = queries[:, :, :length], keys[:, :, :length]
        visible = causal_visible(length, length)
        layout = Layout(
            allowed_keys(None, length, length, torch.device("cpu")),
            positions,
            scheduled_k(positions, config),
            visible,
            scheduled_k(visible - 1, config),
        )
        selector = GateSelector(gate, gate_q, gate_k, gate.stored_keys(gate_k), layout, config, False)
        return torch.cat([selector.select(a, b) for a, b in chunks(length, config.query_chunk)], 2)

    full = selection(70)
    for length in range(40, 70):
        assert torch.equal(selection(length), full[..., :length, :length]), f"the first {length} of 70 tokens"


@pytest.mark.parametrize("gqa", [True, False])
def test_the_lower_right_causal_bias_is_the_mask_a_dense_prefill_chunk_uses(gqa: bool) -> None:
    """`causal_chunk_sdpa`'s CUDA form (torch's lower-right causal bias, run here through its CPU fallback)
    attends exactly as its mask form: the chunk's last T queries over all S keys, aligned lower right."""
    generator = torch.Generator().manual_seed(0)
    kv_heads = 2 if gqa else 4
    query = torch.randn(2, 4, 11, 8, generator=generator, dtype=torch.float64)
    keys, values = (torch.randn(2, kv_heads, 30, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fallback warns that the CUDA kernels do not run
        biased = causal_chunk_sdpa(query, keys, values, 0.3, gqa, bias=True)
    masked = causal_chunk_sdpa(query, keys, values, 0.3, gqa, bias=False)
    torch.testing.assert_close(biased, masked, atol=1e-12, rtol=0)


def test_a_left_padded_batch_prefills_densely_as_the_dense_model() -> None:
    """Padding reaches a dense prefill in chunks (gate only, no compressor: chunks read raw K/V): the real
    tokens' logits are the dense model's (fp64 rounding) and the token steps after it run."""
    model = _model({"sparse_attention": GATE}, mode="sparse").double()
    ids, mask = TOKENS[:2, :PROMPT].clone(), torch.ones(2, PROMPT, dtype=torch.long)
    ids[1, :4], mask[1, :4] = 0, 0
    cache, logits, start = GSMCache(model, capacity=PROMPT + 2, prefill="dense"), [], 0
    with torch.no_grad():
        for size in (8, 16, 5):
            out = model(
                ids[:, start : start + size],
                attention_mask=mask[:, : start + size],
                **cache_kwargs(model, cache),
                use_cache=True,
            )
            logits.append(out.logits)
            start += size
        step = model(
            out.logits[:, -1:].argmax(-1), attention_mask=torch.ones(2, PROMPT + 1), **cache_kwargs(model, cache)
        )
        with gsm_disabled(model):
            dense = model(ids, attention_mask=mask, use_cache=False).logits
    logits = torch.cat(logits, 1)
    torch.testing.assert_close(logits[0], dense[0], atol=1e-10, rtol=0)
    torch.testing.assert_close(logits[1, 4:], dense[1, 4:], atol=1e-10, rtol=0)
    assert torch.isfinite(step.logits).all()
