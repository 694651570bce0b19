"""A prompt chunk's attention over a GSM cache that already holds earlier tokens (chunked prefill).

A long prompt is fed in chunks so that no [T, T] selection or mask of the whole prompt exists. The
cache is filled the same way in both prefill modes (`GSMCache(prefill=...)`): each chunk's raw K/V go
into the stores (packed by the compressor block by block, the newest block raw) and its gate keys
into the gate-key buffer; the modes differ only in how the chunk's queries attend.

- `sparse` (`chunk_attention`): the first chunk runs through the training-time attention; each further
  chunk (queries at positions [before, end)) attends over every key held, with the same rule as the
  teacher-forced pass of the whole prompt: keys in blocks before a query's own block as stored (the
  compressor's packed rows, or its fake-quantized rows for blocks this chunk completes), keys in its
  own block raw, and the gate's top-k of them in sparse mode (dense mode: all). Teacher forcing the
  whole prompt computes the same.
- `dense` (`dense_chunk_attention`): the first chunk attends as the base model does (transformers'
  causal SDPA over its raw K/V, the attention dispatcher's base path); each further chunk attends
  causally over every key: those the cache held packed when the chunk started as stored, every later
  one raw (the rest of the newest block and the chunk's own). A prompt in one chunk is the base
  model's prefill exactly; in several, later chunks read the earlier ones as a GSM cache holds them
  (the memory of a GSM cache, not a dense one, during the prefill).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from gsm_train.attention.cache_protocol import CachedStep, LayerCache
from gsm_train.attention.dispatch import masked_sdpa
from gsm_train.attention.layout import earlier_blocks
from gsm_train.attention.selection import chunks
from gsm_train.functional.attention_targets import causal_visible
from gsm_train.functional.gate_keys import decode_gate_keys
from gsm_train.functional.top_k import scheduled_k, select_top_k
from gsm_train.modules.errors import GSMError
from gsm_train.quant import stored_split


def _refuse_bridge(step: CachedStep) -> None:
    if step.adapter.bridge is not None:
        raise GSMError(
            "a prompt fed in chunks does not reach a cache bridge's targets; pass the prompt in "
            "one call, or use a model without cross_layer_sharing"
        )


def dense_chunk_attention(step: CachedStep, layer_cache: LayerCache) -> Tensor:
    """Attention [B, T, Hq, D] of a prompt chunk's queries [B, Hq, T, D] in dense prefill (module docstring):
    causal over every key held, those packed before the chunk as stored, the later ones raw
    (`causal_chunk_sdpa`: flash kernels on CUDA). The cache holds the chunk's gate keys already."""
    _refuse_bridge(step)
    keys, values, _ = _keys_as_seen(layer_cache, step.query.dtype, recent_as_stored=False)
    gqa = step.module.num_key_value_groups > 1
    return causal_chunk_sdpa(step.query, keys, values, step.scaling, gqa, layer_cache.key_valid)


def causal_chunk_sdpa(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    scaling: float,
    gqa: bool,
    key_valid: Tensor | None = None,
    bias: bool | None = None,
) -> Tensor:
    """Causal attention [B, T, Hq, D] of the last T positions (queries [B, Hq, T, D]) over all S keys
    [B, Hkv, S, D], aligned lower right (query t sees keys up to S - T + t) and, with `key_valid` [B, >= S],
    only valid keys. `bias` (default: on CUDA without `key_valid`): one SDPA with torch's lower-right
    causal bias, which runs the flash or memory-efficient kernels; else the same mask materialized."""
    length, held = query.shape[2], keys.shape[2]
    if bias if bias is not None else (query.is_cuda and key_valid is None):
        out = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=causal_lower_right(length, held), scale=scaling, enable_gqa=gqa
        )
        return out.transpose(1, 2).contiguous()
    return masked_sdpa(query, keys, values, _allowed(key_valid, held - length, held, query.device), scaling, gqa)


def chunk_attention(step: CachedStep, layer_cache: LayerCache) -> Tensor:
    """Attention [B, T, Hq, D] of a prompt chunk's queries [B, Hq, T, D] over the cache (which holds them)."""
    adapter, settings = step.adapter, step.settings
    _refuse_bridge(step)
    mode = adapter.attention_mode(settings)
    if mode == "oracle":
        raise GSMError("oracle mode needs the whole sequence; generate in sparse or dense mode")
    lengths = layer_cache.lengths
    before, end = lengths.before, lengths.seq_len
    keys, values, raw_from = _keys_as_seen(layer_cache, step.query.dtype)
    allowed = _allowed(layer_cache.key_valid, before, end, step.query.device)
    selection = allowed
    if adapter.gate is not None and mode == "sparse":  # the chunk's gate keys are in the cache already
        selection = _gate_selection(step, layer_cache, step.gate_query, allowed)
    query_positions = torch.arange(before, end, device=step.query.device)
    compressor = layer_cache.k_store.compressor
    mask = _block_mask(selection, query_positions, end, raw_from, compressor.block_size if compressor else None)
    return masked_sdpa(step.query, keys, values, mask, step.scaling, step.module.num_key_value_groups > 1)


def _keys_as_seen(
    layer_cache: LayerCache, dtype: torch.dtype, recent_as_stored: bool = True
) -> tuple[Tensor, Tensor, int]:
    """Keys and values [B, Hkv, S', D] in `dtype`: the positions packed before the chunk as stored, then,
    with a compressor and `recent_as_stored`, the later positions as stored too (the blocks this chunk
    completes as the compressor's forward gives them), then the raw rows from `raw_from` (the first
    position not packed before the chunk) on, for queries' own blocks. Without `recent_as_stored` only
    the raw rows follow the packed ones (S' = end: dense prefill)."""
    k_store, v_store = layer_cache.k_store, layer_cache.v_store
    if k_store.compressor is None:
        return k_store.all_rows().to(dtype), v_store.all_rows().to(dtype), layer_cache.lengths.seq_len
    raw_from = stored_split(layer_cache.lengths.before, k_store.compressor.block_size)
    sides = []
    for store, raw in zip((k_store, v_store), layer_cache.recent_raw, strict=True):
        parts = [store.packed_prefix(raw_from)]
        if recent_as_stored:
            with torch.no_grad():
                parts.append(store.compressor(raw))  # whole blocks as stored, the newest (partial) block raw
        sides.append(torch.cat([*parts, raw.to(parts[0].dtype)], 2).to(dtype))
    layer_cache.recent_raw = None
    return sides[0], sides[1], raw_from


def _allowed(key_valid: Tensor | None, before: int, end: int, device: torch.device) -> Tensor:
    """[B|1, 1, T, end] for queries at [before, end): causal, and the keys each row may see (`key_valid`
    [B, >= end], padding; None: all)."""
    query_positions = torch.arange(before, end, device=device)
    allowed = (torch.arange(end, device=device)[None, :] <= query_positions[:, None])[None, None]
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, None, :end]
    return allowed


def _gate_selection(step: CachedStep, layer_cache: LayerCache, gate_q: Tensor, allowed: Tensor) -> Tensor:
    """The gate's top-k per query [B, n, T, end], as the teacher-forced pass selects (`select_top_k`),
    scored against the gate keys as the cache stores them, `query_chunk` rows at a time."""
    cfg = step.settings.config.sparse_attention
    before, end = layer_cache.lengths.before, layer_cache.lengths.seq_len
    gate = step.adapter.gate
    scales = layer_cache.gate_key_scales
    stored = decode_gate_keys(layer_cache.gate_keys[:, :, :end], None if scales is None else scales[:, :, :end])
    device = step.query.device
    key_positions = torch.arange(end, device=device)
    query_positions = torch.arange(before, end, device=device)
    k_t = scheduled_k(query_positions, cfg)
    k_host = scheduled_k(causal_visible(end - before, end) - 1, cfg)
    parts = []
    with torch.no_grad():
        for start, stop in chunks(end - before, cfg.query_chunk):
            scores = gate.score_stored(gate_q[:, :, start:stop], stored)
            parts.append(
                select_top_k(
                    scores,
                    allowed[..., start:stop, :],
                    k_t[start:stop],
                    query_positions[start:stop],
                    key_positions,
                    cfg.sink_tokens,
                    cfg.recent_tokens,
                    int(k_host[start:stop].max()),
                )
            )
    return torch.cat(parts, dim=2)


def _block_mask(selection: Tensor, query_positions: Tensor, end: int, raw_from: int, block_size: int | None) -> Tensor:
    """The mask [B|1, n, T, S'] over `_keys_as_seen`: a selected key in a block before the query's own
    as stored, one in its own block raw (the raw copy, from `raw_from` on). Without a compressor
    (`block_size` None) the selection itself."""
    if block_size is None:
        return selection
    earlier = earlier_blocks(query_positions, end, block_size)
    return torch.cat((selection & earlier, selection[..., raw_from:] & ~earlier[:, raw_from:]), -1)
