"""Attention for one generated token over a GSM cache (see `inference.cache.GSMCache`).

Per layer: score the cached gate keys with the new gate query, keep the top-k positions (the same rule
as training: own position, sinks and recent tokens forced; dense while k covers everything), gather and
dequantize only those K/V rows (the bridge maps the source layer's rows on the fly), and attend.

Two paths compute the same function. On CUDA with Triton (`layer_cache.kernels`), the gate's work on
the new token (`kernels.gate_token`: its query, and its key written into the cache), the gate scores, the
top-k (`kernels.decode_topk`) and the fused gather / dequantize / attend (`kernels.sparse_decode`) read
how many tokens the cache holds from the device (`CacheLengths.device`) and work on the buffers' full
capacity (keys past the length score -inf), so one launch sequence, captured in a CUDA graph, serves
every step (`inference.decode_graph`). Elsewhere, and for bridge targets, this PyTorch path runs with
host lengths.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.integrations.sdpa_attention import repeat_kv

from gsm_train.attention.adapter import GSMAttentionAdapter
from gsm_train.attention.cache_protocol import CachedStep, LayerCache
from gsm_train.attention.settings import GSMSettings
from gsm_train.functional.gate_keys import decode_gate_keys
from gsm_train.functional.top_k import k_per_query
from gsm_train.kernels import kernel_fits
from gsm_train.kernels.decode_topk import unordered_top_k
from gsm_train.kernels.dense_decode import dense_decode_applies, dense_decode_attention
from gsm_train.modules.errors import GSMError


def forced_spans(position: int, sink_tokens: int, recent_tokens: int) -> tuple[int, int, int]:
    """The keys the query at `position` always keeps, as (sink_end, start, end): the sinks [0, sink_end) and
    the recent tokens with itself [start, end)."""
    recent_start = max(position - recent_tokens + 1, 0) if recent_tokens else position
    return sink_tokens, recent_start, position + 1


def forced_count(position: int, sink_tokens: int, recent_tokens: int) -> int:
    """How many keys the rule always keeps for the query at `position`: itself, sinks and recent tokens."""
    sink_end, start, end = forced_spans(position, sink_tokens, recent_tokens)
    return min(sink_end, start) + end - start


def top_k_positions(
    scores: Tensor,
    allowed: Tensor | None,
    k: int,
    position: int,
    sink_tokens: int,
    recent_tokens: int,
    fused: bool = False,
    forced_marked: bool = False,
) -> tuple[Tensor, Tensor | None]:
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


def _bridged_rows(
    adapter: GSMAttentionAdapter, layer_cache: LayerCache, index: Tensor, shared: bool
) -> tuple[Tensor, Tensor]:
    """The bridge's K/V rows [B, out_heads, k, D] at the target heads' positions `index` [B, Hkv, k]
    (`shared`: every head has the same positions, so the source rows are mapped once)."""
    bridge, source = adapter.bridge, layer_cache.source
    first = index.shape[1] - bridge.out_heads  # share: the last heads; mix: all heads
    parts = []
    for head in [first] if shared else range(first, index.shape[1]):
        src_index = index[:, head : head + 1].expand(-1, source.k_store.heads, -1)
        mapped = bridge.bridged(source.k_store.gather(src_index), source.v_store.gather(src_index))
        parts.append(mapped if shared else tuple(rows[:, head - first : head - first + 1] for rows in mapped))
    return torch.cat([k for k, _ in parts], 1), torch.cat([v for _, v in parts], 1)


def gather_kv(
    adapter: GSMAttentionAdapter, layer_cache: LayerCache, index: Tensor, shared: bool, mode: str
) -> tuple[Tensor, Tensor]:
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
    out = F.scaled_dot_product_attention(
        query,
        repeat_kv(keys, groups).to(query.dtype),
        repeat_kv(values, groups).to(query.dtype),
        attn_mask=mask,
        scale=scaling,
    )
    return out.transpose(1, 2).contiguous()


def static_k(k: int, most_forced: int, capacity: int) -> int:
    """The top-k size the fused path takes at every step: `k`, or the most keys the rule can force
    (`most_forced`: `SparseAttentionConfig.most_forced_keys`) where that is more, within the capacity. Equal to
    `top_k_positions`' k_eff once the cache holds that many keys; before, the extra picks score -inf and
    are marked invalid, which selects every key held, as k_eff does."""
    return min(capacity, max(k, most_forced))


def decode_k(settings_config, position: int) -> int:
    """The schedule's k for the token at `position` (`sparse_attention` of a GSM config): `scheduled_k`'s,
    computed once per position and schedule, not once per layer of every step (`_k_at`)."""
    cfg = settings_config.sparse_attention
    return _k_at(position, cfg.top_k_schedule, cfg.top_k, cfg.k_min, cfg.decay_rate, cfg.top_k_fraction)


@functools.lru_cache(maxsize=64)  # a step's layers (and its driver) ask for one position, the next step the next
def _k_at(position: int, schedule: str, top_k: int, k_min: int, decay_rate: float, fraction: float | None) -> int:
    """`k_per_query`'s k at `position` (what `scheduled_k` gives for a config of these fields); a constant
    schedule's without tensor ops (the captured steps' driver asks once per new token)."""
    if schedule == "constant":
        return top_k
    return int(k_per_query(torch.tensor([position]), schedule, top_k, k_min, decay_rate, fraction))


K_STEP = 256  # a schedule whose k varies is captured for k rounded up to a multiple of this


def captured_k(settings_config, position: int) -> int:
    """The top-k size the fused token step at `position` is built for: the schedule's k when it is
    constant; when it varies (fraction, decays), that k rounded up to a multiple of `K_STEP` within
    `top_k`, so one captured step serves every position of the same multiple (a fraction of 0.25
    changes k every 4 tokens) and picks past the position's own k are marked invalid on the device
    (`ranked_selection`)."""
    k = decode_k(settings_config, position)
    cfg = settings_config.sparse_attention
    if cfg.top_k_schedule == "constant":
        return k
    return min(cfg.top_k, -(-k // K_STEP) * K_STEP)


def ranks_picks(settings_config, position: int, k_static: int) -> bool:
    """Whether the fused token step at `position`, taking `k_static` picks (`static_k` of `captured_k`), ranks
    them (`ranked_selection`) to keep the position's k of them: a schedule whose k varies, at a position whose
    k is below `k_static`. Where the two are equal, as for a `fraction` schedule once k reached its ceiling
    `top_k` (8192 keys for recipes/joint_long.yaml), every pick held is kept, as with a constant schedule, and
    no sort runs; the captured steps are keyed by it as well as by k (`decode_graph.StepGraphs`)."""
    schedule = settings_config.sparse_attention.top_k_schedule
    return schedule != "constant" and decode_k(settings_config, position) < k_static


def ranked_selection(scores: Tensor, k_static: int, k_now: Tensor) -> tuple[Tensor, Tensor]:
    """The `k_static` best keys [B, n, k_static] of `scores` [B, n, S] (forced keys +inf, keys not held
    -inf) in rank order, and which are kept: held, and forced or ranked below `k_now` (int64 [1] on the
    scores' device, the position's k; no host sync, so it runs inside a captured step). The same set as
    `top_k_positions` keeps for k = k_now. The k_static are taken unordered (`unordered_top_k`: on CUDA the
    top-k kernel) and only they are sorted, not the whole row (docs/design-decisions.md, "Decoding a schedule
    whose k varies")."""
    index = unordered_top_k(scores, k_static)
    values, order = torch.gather(scores, -1, index).sort(dim=-1, descending=True)
    index = torch.gather(index, -1, order)
    rank = torch.arange(k_static, device=scores.device)
    return index, (values > float("-inf")) & ((values == float("inf")) | (rank < k_now))


def decode_attention(step: CachedStep, layer_cache: LayerCache) -> Tensor:
    """Attention output [B, 1, Hq, D] of the newest token, read from the layer's GSM cache (already holding
    its K/V): select the keys (`select_keys`), then gather, dequantize and attend over them."""
    module, adapter, query = step.module, step.adapter, step.query
    if query.shape[2] != 1:
        raise GSMError(
            f"layer {adapter.layer_idx}: a GSM cache takes one new token per step after the prompt "
            f"(got {query.shape[2]}); pass the whole prompt in the first call"
        )
    kernels = layer_cache.kernels
    fused = adapter.bridge is None and kernels is not None and kernel_fits(module.head_dim)
    stores = (layer_cache.k_store.packed_rows(), layer_cache.v_store.packed_rows()) if fused else (None,)
    if (
        None not in stores
        and layer_cache.dense_block_kernel
        and _reads_every_key(step)
        and dense_decode_applies(*stores)
    ):
        # every key, a block a tile: the block's prototypes read once, not once a row
        return dense_decode_attention(query, *stores, layer_cache.key_valid, step.scaling)
    index, valid = select_keys(step, layer_cache)
    if None not in stores:  # stores the kernel reads (ASQ-packed or raw)
        return kernels.fused_decode_attention(query, *stores, index, valid, step.scaling)
    kv_heads = module.k_proj.out_features // module.head_dim
    shared = index.shape[1] == 1
    index = _per_kv_head(index, kv_heads)
    valid = None if valid is None else _per_kv_head(valid, kv_heads)
    keys, values = gather_kv(adapter, layer_cache, index, shared, step.settings.config.cross_layer_sharing.mode)
    return attend(query, keys, values, valid, step.scaling)


def _reads_every_key(step: CachedStep) -> bool:
    """Whether the token attends to every key held (dense mode, or no gate): `select_keys`' every position
    (oracle mode is left to it, which refuses it)."""
    mode = step.adapter.attention_mode(step.settings)
    return mode == "dense" or (mode != "oracle" and step.adapter.gate is None)


def fused_scores(gate_head_dim: int, query_heads: int) -> bool:
    """Whether the gate-score kernel scores this gate: one query head of a size the kernels take (else
    `SparseGateHead.score_stored`, which reads the host length, so such a step is not captured)."""
    return query_heads == 1 and kernel_fits(gate_head_dim)


def _fused_selection(layer_cache: LayerCache) -> bool:
    """Whether this layer selects on the device path (CUDA kernels; no bridge target reading host lengths)."""
    return layer_cache.kernels is not None and layer_cache.source is None


def select_keys(step: CachedStep, layer_cache: LayerCache) -> tuple[Tensor, Tensor | None]:
    """The cached positions [B, n, k] the newest token attends to and which are valid ([B, n, k] or None):
    the gate's top-k in sparse mode (its key is held already), every position in dense mode. What the cache
    selected ahead of the layer's projections (`LayerCache.select_ahead`), where it did."""
    early = layer_cache.take_early_selection()
    if early is not None:
        return early.joined()
    adapter, settings = step.adapter, step.settings
    cfg = settings.config.sparse_attention
    mode = adapter.attention_mode(settings)
    if mode == "oracle":
        raise GSMError("oracle mode needs the whole sequence; generate in sparse or dense mode")
    gate, gate_q = adapter.gate, step.gate_query  # the token's gate key is in the cache already
    if _reads_every_key(step):
        return _every_position(step, layer_cache)
    if selects_on_device(adapter, settings, layer_cache):
        return device_selection(settings, gate_q, layer_cache)
    length = layer_cache.lengths.seq_len
    position = length - 1
    keys = decode_gate_keys(layer_cache.gate_keys[:, :, :length], _held(layer_cache.gate_key_scales, length))
    scores = gate.score_stored(gate_q, keys)[:, :, 0]
    allowed = None if layer_cache.key_valid is None else layer_cache.key_valid[:, :length]
    k = decode_k(settings.config, position)
    fused = layer_cache.kernels is not None
    return top_k_positions(scores, allowed, k, position, cfg.sink_tokens, cfg.recent_tokens, fused=fused)


def selects_on_device(adapter: GSMAttentionAdapter, settings: GSMSettings, layer_cache: LayerCache) -> bool:
    """Whether a token step of this layer takes its gate's top-k on the device path (`device_selection`): sparse
    mode with a gate the score kernel serves, over a cache whose kernels run and which is no bridge target."""
    gate = adapter.gate
    return (
        gate is not None
        and adapter.attention_mode(settings) == "sparse"
        and _fused_selection(layer_cache)
        and fused_scores(gate.gate_head_dim, gate.query_heads)
    )


def device_selection(settings: GSMSettings, gate_q: Tensor, layer_cache: LayerCache) -> tuple[Tensor, Tensor | None]:
    """The gate's top-k positions [B, n, k] of the newest token and which are valid ([B, n, k] or None), from
    its gate query [B, n, 1, dg] (its key held already) by the score and top-k kernels, which read the
    lengths on the device: no host value of the step's but the schedule's k enters, so a CUDA graph captures
    it (`selects_on_device` says where it serves)."""
    cfg = settings.config.sparse_attention
    position = layer_cache.lengths.seq_len - 1  # on the host: the schedule's k (a captured step bakes it)
    capacity = layer_cache.gate_keys.shape[2]
    scores = layer_cache.kernels.gate_scores(
        gate_q,
        layer_cache.gate_keys,
        layer_cache.gate_key_scales,
        layer_cache.lengths.device,
        cfg.sink_tokens,
        cfg.recent_tokens,
        layer_cache.key_valid,
    )
    k_static = static_k(captured_k(settings.config, position), cfg.most_forced_keys(), capacity)
    if ranks_picks(settings.config, position, k_static):  # k read on the device: one captured step per K_STEP of k
        k_now = layer_cache.k_by_position[layer_cache.lengths.slots[0:1]]
        return ranked_selection(scores, k_static, k_now)
    index = unordered_top_k(scores, k_static)
    if layer_cache.key_valid is None and layer_cache.lengths.seq_len >= k_static:
        return index, None  # every pick is a held key, at this step and (lengths only grow) every later one
    return index, torch.gather(scores, -1, index) > float("-inf")


def _held(scales: Tensor | None, length: int) -> Tensor | None:
    return None if scales is None else scales[:, :, :length]


def _every_position(step: CachedStep, layer_cache: LayerCache) -> tuple[Tensor, Tensor | None]:
    """Dense mode: every position held. On the device path the capacity's positions, those past the
    length (read on the device) marked invalid; on the PyTorch path the held positions (host length)."""
    batch, positions = step.query.shape[0], layer_cache.positions
    valid_keys = layer_cache.key_valid
    if _fused_selection(layer_cache):
        capacity = positions.shape[0]
        valid = (positions < layer_cache.lengths.device[0])[None].expand(batch, -1)
        valid = valid if valid_keys is None else valid & valid_keys
        return positions.expand(batch, 1, capacity), valid[:, None, :]
    length = layer_cache.lengths.seq_len
    index = positions[:length].expand(batch, 1, length)
    return index, None if valid_keys is None else valid_keys[:, None, :length]
