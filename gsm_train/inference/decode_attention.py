"""Attention for one generated token over a GSM cache (see `inference.cache.GSMCache`).

Per layer: score the cached gate keys with the new gate query, keep the top-k positions (the same
rule as training: own position, sinks and recent tokens forced; dense while k covers everything),
gather and dequantize only those K/V rows (the bridge maps the source layer's rows on the fly), and
attend. On CUDA with Triton, layers without a bridge gather, dequantize and attend in one fused
kernel (`gsm_train.kernels.sparse_decode`) when their head size suits it (`kernels.kernel_fits`: a
power of two from 16 to 256), as do the gate scores, and the top-k runs as a CUDA kernel
(`gsm_train.kernels.decode_topk`); everywhere else this PyTorch path runs.
"""

from __future__ import annotations

from types import ModuleType
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.integrations.sdpa_attention import repeat_kv

from gsm_train.kernels import kernel_fits
from gsm_train.kernels.decode_topk import unordered_top_k
from gsm_train.modules.adapter import GSMAttentionAdapter
from gsm_train.modules.errors import GSMError
from gsm_train.modules.forward_state import DecodeStep
from gsm_train.modules.layout import allowed_keys
from gsm_train.modules.sparse_gate import decode_gate_keys, scheduled_k
from gsm_train.inference.kv_store import KVStore


class CachedLayer(Protocol):
    """What decode attention reads of one layer's cache (`inference.cache.CachedLayer`): the K and V
    stores, the gate keys as stored (codes [B, n, S, dg] and, for int8, fp16 scales [B, n, S, 1]), the fused
    kernels' module (None: the PyTorch path) and, for a bridge target, the source layer's cache."""

    k_store: KVStore
    v_store: KVStore
    gate_keys: Tensor | None
    gate_key_scales: Tensor | None
    kernels: ModuleType | None
    source: CachedLayer | None

    def get_seq_length(self) -> int: ...

    def keep_gate_keys(self, gate_keys: Tensor, bits: int) -> None: ...


def forced_spans(position: int, sink_tokens: int, recent_tokens: int) -> tuple[int, int, int]:
    """The keys the query at `position` always keeps, as (sink_end, start, end): the sinks [0, sink_end) and
    the recent tokens with itself [start, end)."""
    recent_start = max(position - recent_tokens + 1, 0) if recent_tokens else position
    return sink_tokens, recent_start, position + 1


def forced_count(position: int, sink_tokens: int, recent_tokens: int) -> int:
    """How many keys the rule always keeps for the query at `position`: itself, sinks and recent tokens."""
    sink_end, start, end = forced_spans(position, sink_tokens, recent_tokens)
    return min(sink_end, start) + end - start


def top_k_positions(scores: Tensor, allowed: Tensor | None, k: int, position: int, sink_tokens: int,
                    recent_tokens: int, fused: bool = False,
                    forced_marked: bool = False) -> tuple[Tensor, Tensor | None]:
    """Key positions [B, n, k'] the newest query keeps (same rule as `select_top_k`) and which are valid.

    scores [B, n, S] over all cached keys (overwritten: forced keys get +inf; with `forced_marked` the
    caller has set them, e.g. `kernels.sparse_decode.gate_scores` given `forced_spans`); allowed [B, S] or
    None; `fused`: with no padding, take the top k with the CUDA kernel where it runs (`kernels.decode_topk`).
    """
    length = scores.shape[-1]
    if not forced_marked:
        sink_end, start, end = forced_spans(position, sink_tokens, recent_tokens)
        scores[..., start:end] = float("inf")
        if sink_end:
            scores[..., :sink_end] = float("inf")
    k_eff = min(length, max(k, forced_count(position, sink_tokens, recent_tokens)))
    if allowed is None:  # every forced key is visible: the top k_eff, in any order, are exactly the selection
        if fused:
            return unordered_top_k(scores, k_eff), None
        return scores.topk(k_eff, dim=-1, sorted=False).indices, None  # attention does not need them sorted
    values, index = scores.masked_fill(~allowed[:, None, :], float("-inf")).topk(k_eff, dim=-1)
    # as select_top_k: the k best visible keys plus every visible forced key (forced keys rank first)
    rank = torch.arange(k_eff, device=scores.device)
    valid = (values > float("-inf")) & ((values == float("inf")) | (rank < k))
    return index, valid


def _per_kv_head(index: Tensor, kv_heads: int) -> Tensor:
    """Selections [B, n, k] (n = 1 or one per KV head) as [B, kv_heads, k]."""
    return index.expand(-1, kv_heads, -1) if index.shape[1] == 1 else index


def _bridged_rows(adapter: GSMAttentionAdapter, layer_cache: CachedLayer, index: Tensor,
                  shared: bool) -> tuple[Tensor, Tensor]:
    """The bridge's K/V rows [B, out_heads, k, D] at the target heads' positions `index` [B, Hkv, k]
    (`shared`: every head has the same positions, so the source rows are mapped once)."""
    bridge, source = adapter.bridge, layer_cache.source
    first = index.shape[1] - bridge.out_heads  # share: the last heads; mix: all heads
    parts = []
    for head in [first] if shared else range(first, index.shape[1]):
        src_index = index[:, head:head + 1].expand(-1, source.k_store.heads, -1)
        mapped = bridge.bridged(source.k_store.gather(src_index), source.v_store.gather(src_index))
        parts.append(mapped if shared else tuple(rows[:, head - first:head - first + 1] for rows in mapped))
    return torch.cat([k for k, _ in parts], 1), torch.cat([v for _, v in parts], 1)


def gather_kv(adapter: GSMAttentionAdapter, layer_cache: CachedLayer, index: Tensor, shared: bool,
              mode: str) -> tuple[Tensor, Tensor]:
    """K/V rows [B, Hkv, k, D] at `index` [B, Hkv, k]: the layer's own heads dequantized, the bridge applied
    (`mode`: the bridge's, mix or share)."""
    own = layer_cache.k_store.heads
    keys = layer_cache.k_store.gather(index[:, :own])
    values = layer_cache.v_store.gather(index[:, :own])
    if adapter.bridge is None:
        return keys, values
    bridged_k, bridged_v = _bridged_rows(adapter, layer_cache, index, shared)
    bridged_k, bridged_v = bridged_k.to(keys.dtype), bridged_v.to(values.dtype)
    if mode == "mix":
        return keys + bridged_k, values + bridged_v
    return torch.cat((keys, bridged_k), 1), torch.cat((values, bridged_v), 1)


def attend(query: Tensor, keys: Tensor, values: Tensor, valid: Tensor | None, scaling: float) -> Tensor:
    """SDPA of query [B, Hq, 1, D] over gathered rows [B, Hkv, k, D] (valid [B, Hkv, k] or None) -> [B, 1, Hq, D]."""
    groups = query.shape[1] // keys.shape[1]
    mask = None if valid is None else repeat_kv(valid[..., None, :], groups)
    out = F.scaled_dot_product_attention(query, repeat_kv(keys, groups).to(query.dtype),
                                         repeat_kv(values, groups).to(query.dtype), attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous()


def decode_attention(step: DecodeStep, layer_cache: CachedLayer) -> Tensor:
    """Attention output [B, 1, Hq, D] of the newest token, read from the layer's GSM cache (already holding
    its K/V): select the keys (`select_keys`), then gather, dequantize and attend over them."""
    module, adapter, query = step.module, step.adapter, step.query
    if query.shape[2] != 1:
        raise GSMError(f"layer {adapter.layer_idx}: a GSM cache takes one new token per step after the prompt "
                       f"(got {query.shape[2]}); pass the whole prompt in the first call")
    length = layer_cache.get_seq_length()
    allowed = None if step.attention_mask is None else \
        allowed_keys(step.attention_mask, 1, length, query.device)[:, 0, -1]
    index, valid = select_keys(step, layer_cache, allowed, length)
    kernels = layer_cache.kernels
    if adapter.bridge is None and kernels is not None and kernel_fits(module.head_dim):
        stores = (layer_cache.k_store.packed_rows(), layer_cache.v_store.packed_rows())
        if None not in stores:  # stores the kernel reads (ASQ-packed or raw)
            return kernels.fused_decode_attention(query, *stores, index, valid, step.scaling)
    kv_heads = module.k_proj.out_features // module.head_dim
    shared = index.shape[1] == 1
    index = _per_kv_head(index, kv_heads)
    valid = None if valid is None else _per_kv_head(valid, kv_heads)
    keys, values = gather_kv(adapter, layer_cache, index, shared, step.settings.config.cross_layer_sharing.mode)
    return attend(query, keys, values, valid, step.scaling)


def select_keys(step: DecodeStep, layer_cache: CachedLayer, allowed: Tensor | None,
                length: int) -> tuple[Tensor, Tensor | None]:
    """The cached positions [B, n, k] the newest token attends to and which are valid ([B, n, k] or None):
    the gate's top-k in sparse mode (its key joins the cache first), every position in dense mode."""
    adapter, settings, query = step.adapter, step.settings, step.query
    cfg = settings.config.sparse_attention
    position = length - 1
    mode = "dense" if adapter.dense_layer or not cfg.enabled else settings.mode
    if mode == "oracle":
        raise GSMError("oracle mode needs the whole sequence; generate in sparse or dense mode")
    gate = adapter.gate
    if gate is not None:
        gate_q, gate_k = gate(step.hidden, step.cos, step.sin)
        layer_cache.keep_gate_keys(gate_k, gate.key_bits)
    if mode != "sparse" or gate is None:
        index = torch.arange(length, device=query.device).expand(query.shape[0], 1, length)
        return index, None if allowed is None else allowed[:, None, :]
    k = int(scheduled_k(torch.tensor([position]), cfg))
    keys, key_scales = layer_cache.gate_keys, layer_cache.gate_key_scales
    kernels = layer_cache.kernels
    forced_marked = kernels is not None and kernel_fits(gate.gate_head_dim)
    if forced_marked:  # the kernel writes the forced keys' +inf with the scores: no launches of their own
        scores = kernels.gate_scores(gate_q, keys, key_scales, forced_spans(position, cfg.sink_tokens,
                                                                             cfg.recent_tokens))
    else:
        scores = gate.score_stored(gate_q, decode_gate_keys(keys, key_scales))[:, :, 0]
    return top_k_positions(scores, allowed, k, position, cfg.sink_tokens, cfg.recent_tokens,
                           fused=kernels is not None, forced_marked=forced_marked)
