"""One attention function, registered with transformers, that runs every GSM layer.

Per layer it applies the K/V path (ASQ, then the cache bridge), runs main attention `dense`
(exactly the base SDPA path), `sparse` (the gate's top-k keys) or `oracle` (the true top-k of the
head-averaged attention), and, when asked, records what stage 1 needs (gate KL) and the
captured-mass metrics. Per-forward state lives in a `GSMRuntime` shared by the model's layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from gsm_train.config import GSMConfig
from gsm_train.modules import own_block_attention as own_block
from gsm_train.modules.attention_targets import (captured_mass, causal_visible, full_batch, gate_distill_loss,
                                                 head_averaged_probs)
from gsm_train.modules.cache_bridge import CacheBridge
from gsm_train.modules.compiled import compiled
from gsm_train.modules.decode_attention import decode_attention
from gsm_train.modules.errors import GSMError
from gsm_train.modules.gate_distill import DistillTarget, reads_weights_directly
from gsm_train.modules.kv_compressor import (ASQCompressor, fake_quant_kivi, fake_quant_per_token,
                                             paired_training_pass)
from gsm_train.modules.sparse_gate import SparseGateHead, k_per_query, select_top_k

ATTN_IMPLEMENTATION = "gsm"
MODES = ("dense", "sparse", "oracle")


@dataclass
class GSMRuntime:
    """Switches and per-forward records shared by all GSM layers of one model."""

    config: GSMConfig
    base_fingerprint: str = ""
    mode: str = "dense"
    enabled: bool = True
    distill: bool = False
    distill_on_selection: bool = False
    distill_queries: int = 0
    kv_baseline: str | None = None
    distill_rows: Tensor | None = None  # this forward's sampled query positions (device), see sampled_rows
    _kl_rows: tuple[Tensor, Tensor | None, Tensor, Tensor] | None = None  # see kl_rows
    detach_gate_input: bool = False
    captured_steps: bool = False  # steps replay from a CUDA graph: ASQ layers attend block-sparsely (flex)
    recall: tuple[int, int] | None = None
    layers_with_gate: list[int] = field(default_factory=list)
    distill_losses: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)
    recall_sums: dict[int, dict[str, Tensor]] = field(default_factory=dict)
    asq_losses: dict[int, Tensor] = field(default_factory=dict)
    bridge_source: tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None] | None = None
    cache_layer: Any = None  # the GSMLayerCache that the current layer's attention reads (generation)
    decode_kernels: Any = None  # gsm_train.kernels.sparse_decode, when the cache uses the fused kernels
    _layouts: dict[tuple, tuple[Tensor, ...]] = field(default_factory=dict)

    def clear(self) -> None:
        """Drop everything recorded by the last forward."""
        self.distill_losses.clear()
        self.recall_sums.clear()
        self.asq_losses.clear()
        self.bridge_source = None
        self.distill_rows = None
        self._kl_rows = None

    def layout(self, attention_mask: Tensor | None, q_len: int, kv_len: int,
               device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """(allowed keys, key positions, k per query, host-side visible-key bound, host-side k per query)
        for a forward; the same for every layer, so it is built once when there is no padding mask. The
        host copies let chunking and top-k sizes be decided without waiting for the device."""
        cfg = self.config.sparse_attention
        cache_key = (q_len, kv_len, str(device), cfg.top_k_schedule, cfg.top_k, cfg.k_min, cfg.decay_rate)
        if attention_mask is None and cache_key in self._layouts:
            return self._layouts[cache_key]
        positions = torch.arange(kv_len, device=device)
        visible = causal_visible(q_len, kv_len)
        layout = (allowed_keys(attention_mask, q_len, kv_len, device), positions,
                  k_per_query(positions, cfg.top_k_schedule, cfg.top_k, cfg.k_min, cfg.decay_rate), visible,
                  k_per_query(visible - 1, cfg.top_k_schedule, cfg.top_k, cfg.k_min, cfg.decay_rate))
        if attention_mask is None:
            self._layouts = {cache_key: layout}
        return layout

    def layouts_in_use(self) -> tuple[tuple[Tensor, ...], ...]:
        """The cached layouts (a captured step reads them; holding them keeps them allocated)."""
        return tuple(self._layouts.values())

    def sampled_rows(self, counted_host: Tensor, device: torch.device) -> Tensor | None:
        """Query positions (a sorted device index) the gate KL uses in this forward: all (None), or
        `distill_queries` drawn once per forward (shared by all layers) among the counted positions.

        Counted positions (at least k visible keys) form a suffix, as keys only grow and k only falls
        along the sequence, so the draw is made on the device from host-side bounds: no host-to-device
        copy and no wait, which lets a CUDA graph capture the step (each replay draws anew)."""
        if self.distill_queries <= 0:
            return None
        if self.distill_rows is None:
            length = len(counted_host)
            uncounted = (~counted_host).nonzero()
            first = int(uncounted[-1]) + 1 if len(uncounted) else 0  # start of the counted suffix
            if counted_host[:first].any():
                raise GSMError("the positions with at least k keys are not a suffix of the sequence; "
                               "use train.distill_queries=0 with this top-k schedule")
            if length - first <= self.distill_queries:
                self.distill_rows = torch.arange(first, length, device=device)
            else:
                draw = torch.rand(length - first, device=device).topk(self.distill_queries).indices
                self.distill_rows = draw.sort().values + first
        return self.distill_rows

    def kl_rows(self, allowed: Tensor, k_t: Tensor, index: Tensor | None, batch: int) -> tuple[Tensor, Tensor]:
        """The gate KL's query rows: their allowed keys [B|1, 1, R, S] and whether each has at least k of
        them [B|1, 1, R]; all rows, or the sampled `index` (then at the full batch and contiguous, the one
        shape the compiled KL takes). Built once per forward when the layers share one layout (no padding
        mask), as in every stage-1 step; `clear()` drops them with the rest of the forward's records."""
        cached = self._kl_rows
        if cached is not None and cached[0] is allowed and cached[1] is index and cached[2].shape[0] in (1, batch):
            return cached[2], cached[3]
        if index is None:
            rows_allowed, counted = allowed, allowed.sum(-1) >= k_t
        else:
            rows_allowed = allowed[..., index, :]
            rows_allowed, counted = full_batch(rows_allowed, rows_allowed.sum(-1) >= k_t[index], batch)
        self._kl_rows = (allowed, index, rows_allowed, counted)
        return rows_allowed, counted


class GSMAttentionAdapter(nn.Module):
    """The GSM modules of one attention layer (attached as `self_attn.gsm`, so FSDP wraps them with it)."""

    def __init__(self, layer_idx: int, runtime: GSMRuntime, gate: SparseGateHead | None,
                 asq_k: ASQCompressor | None, asq_v: ASQCompressor | None, bridge: CacheBridge | None,
                 is_bridge_source: bool, dense_layer: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.gate = gate
        self.asq_k = asq_k
        self.asq_v = asq_v
        self.bridge = bridge
        self.is_bridge_source = is_bridge_source
        self.dense_layer = dense_layer
        object.__setattr__(self, "runtime", runtime)  # shared, not a submodule
        object.__setattr__(self, "_inputs", None)

    def capture_inputs(self, hidden: Tensor, cos: Tensor, sin: Tensor) -> None:
        """Keep the attention module's input for the gate (called by a forward pre-hook)."""
        object.__setattr__(self, "_inputs", (hidden, cos, sin))

    def pop_inputs(self) -> tuple[Tensor, Tensor, Tensor]:
        inputs = self._inputs
        object.__setattr__(self, "_inputs", None)
        if inputs is None:
            raise GSMError(f"layer {self.layer_idx}: the gate's input was not captured; was the model injected?")
        return inputs

    def transform_kv(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None]:
        """ASQ on this layer's own K/V, then the bridge from the source layer's (compressed) K/V.

        Returns (K, V, own): K/V as earlier blocks are stored, and `own`, the K/V a query sees in its
        own (newest, uncompressed) block, or None where they are the same (no quantizer upstream).
        """
        runtime = self.runtime
        raw_key, raw_value = key, value
        if self.asq_k is not None and runtime.kv_baseline is not None:
            key, value = plain_kv_quant(key, value, runtime.kv_baseline, (self.asq_k.quant_bits, self.asq_v.quant_bits),
                                        self.asq_k.block_size)
        elif self.asq_k is not None and self.training:  # one encoding gives the reconstruction and its loss
            paired = paired_training_pass(self.asq_k, self.asq_v, key, value)  # K's and V's in one pass
            if paired is None:
                (key, loss_k), (value, loss_v) = self.asq_k(key, with_loss=True), self.asq_v(value, with_loss=True)
                paired = key, value, (loss_k + loss_v) / 2
            key, value, runtime.asq_losses[self.layer_idx] = paired
        elif self.asq_k is not None:
            key, value = self.asq_k(key), self.asq_v(value)
        own = (raw_key, raw_value) if self.asq_k is not None else None
        if self.is_bridge_source:
            runtime.bridge_source = (key, value, own)
        if self.bridge is not None:
            if runtime.bridge_source is None:
                raise GSMError(f"layer {self.layer_idx} is a bridge target but the source layer did not run first")
            src_k, src_v, src_own = runtime.bridge_source
            mode = runtime.config.cross_layer_sharing.mode
            if own is not None or src_own is not None:
                own_k, own_v = own or (raw_key, raw_value)
                own = self.bridge(own_k, own_v, *(src_own or (src_k, src_v)), mode)
            key, value = self.bridge(key, value, src_k, src_v, mode)
        return key, value, own


def plain_kv_quant(key: Tensor, value: Tensor, kind: str, bits: tuple[int, int],
                   block_size: int) -> tuple[Tensor, Tensor]:
    """The baselines ASQ must beat, at its (K, V) bits: `per_token` (K and V per token) or `kivi` (K per
    channel over blocks, V per token), newest incomplete block kept as is for `kivi`."""
    key_bits, value_bits = bits
    if kind == "per_token":
        return (fake_quant_per_token(key, key_bits).to(key.dtype),
                fake_quant_per_token(value, value_bits).to(value.dtype))
    if kind == "kivi":
        return (fake_quant_kivi(key, key_bits, block_size, per_channel=True).to(key.dtype),
                fake_quant_kivi(value, value_bits, block_size, per_channel=False).to(value.dtype))
    raise GSMError(f"unknown kv_baseline {kind!r}; use per_token or kivi")


def allowed_keys(attention_mask: Tensor | None, q_len: int, kv_len: int, device: torch.device) -> Tensor:
    """Boolean [B|1, 1, T, S]: which keys each query may see (causal, padding from the model's mask)."""
    if attention_mask is None:
        q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
        return (torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None])[None, None]
    if attention_mask.dtype == torch.bool:
        return attention_mask[..., -kv_len:]
    return attention_mask[..., -kv_len:] > torch.finfo(attention_mask.dtype).min / 2


def earlier_blocks(query_positions: Tensor, kv_len: int, block_size: int) -> Tensor:
    """Boolean [T, S]: key j lies in a block before query t's own block."""
    keys = torch.arange(kv_len, device=query_positions.device)
    return keys[None, :] // block_size < query_positions[:, None] // block_size


def block_causal_kv(key: Tensor, value: Tensor | None, own: tuple[Tensor, Tensor] | None, selection: Tensor,
                    query_positions: Tensor, block_size: int) -> tuple[Tensor, Tensor | None, Tensor]:
    """Keys, values and selection [.., T, S'] for queries that see earlier blocks as stored and their
    own block uncompressed (as at decode): with `own`, both versions side by side (S' = 2S)."""
    if own is None:
        return key, value, selection
    earlier = earlier_blocks(query_positions, key.shape[2], block_size)
    both_values = torch.cat((value, own[1]), 2) if value is not None else None
    return torch.cat((key, own[0]), 2), both_values, torch.cat((selection & earlier, selection & ~earlier), -1)


def _masked_sdpa(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, selection: Tensor,
                 scaling: float | None) -> Tensor:
    """Attention restricted to the selected keys; selection [B, n, T, S] is shared by n head groups.

    One selection for all heads (n = 1) is passed as a broadcast mask and the KV heads as they are
    (`enable_gqa`): on the H200 (batch 4, 9 heads over 3, T 2048, 2S keys) forward and backward took
    1.21 ms and 150 MiB instead of 2.55 ms and 1.5 GiB with the mask and K/V repeated per head, with
    the same output bit for bit. One selection per KV group still needs the mask per head."""
    heads = query.shape[1]
    mask = selection if selection.shape[1] == 1 else selection.repeat_interleave(heads // selection.shape[1], dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                           enable_gqa=module.num_key_value_groups > 1)
    return out.transpose(1, 2).contiguous()


def _chunks(length: int, chunk: int) -> list[tuple[int, int]]:
    return [(start, min(start + chunk, length)) for start in range(0, length, chunk)]


def gsm_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                          attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          **kwargs: Any) -> tuple[Tensor, None]:
    """The registered attention function (signature of transformers' attention interface)."""
    adapter: GSMAttentionAdapter | None = getattr(module, "gsm", None)
    if adapter is None or not adapter.runtime.enabled:
        if adapter is not None:
            adapter.pop_inputs()
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    runtime = adapter.runtime
    layer_cache, runtime.cache_layer = runtime.cache_layer, None
    if layer_cache is not None and layer_cache.cached_before_update > 0:
        allowed = None if attention_mask is None else \
            allowed_keys(attention_mask, 1, layer_cache.get_seq_length(), query.device)[:, 0, -1]
        return decode_attention(module, adapter, layer_cache, query, allowed,
                                module.scaling if scaling is None else scaling), None
    sparse_cfg = runtime.config.sparse_attention
    hidden, cos, sin = adapter.pop_inputs()
    key, value, own = adapter.transform_kv(key, value)
    mode = "dense" if adapter.dense_layer or not sparse_cfg.enabled else runtime.mode
    gate = adapter.gate
    q_len, kv_len = query.shape[2], key.shape[2]
    gate_needed_in_dense = gate is not None and (runtime.distill or runtime.recall is not None or layer_cache is not None)
    if mode == "dense" and own is None and not gate_needed_in_dense:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if q_len != kv_len:
        raise GSMError(f"layer {adapter.layer_idx}: {mode} attention, distillation and recall need the whole "
                       f"sequence (got {q_len} queries over {kv_len} cached keys); call the model with "
                       "use_cache=False for teacher-forced passes")
    scaling = module.scaling if scaling is None else scaling
    allowed, positions, k_t, visible, k_host = runtime.layout(attention_mask, q_len, kv_len, query.device)
    block_size = runtime.config.kv_compression.block_size
    chunk = sparse_cfg.query_chunk
    index = runtime.sampled_rows(visible >= k_host, query.device) if runtime.distill and gate is not None else None
    # stage 1: the gate feeds only its KL, on sampled rows that fit one chunk: the fused path needs no gate q/k
    gate_from_hidden = (mode == "dense" and own is None and runtime.recall is None and layer_cache is None
                        and index is not None and len(index) <= chunk and reads_weights_directly(gate)
                        and (runtime.detach_gate_input or not hidden.requires_grad))  # it gives hidden no gradient
    needs_gate = not gate_from_hidden and (gate_needed_in_dense or (gate is not None and mode == "sparse"))
    num_selectors = gate.num_selectors if gate is not None else 1
    gate_q = gate_k = stored_k = None
    if needs_gate:
        gate_input = hidden.detach() if runtime.detach_gate_input else hidden
        gate_q, gate_k = gate(gate_input, cos, sin)
        if layer_cache is not None:  # prefill of a generation: the cache keeps the prompt's gate keys
            layer_cache.append_gate_keys(gate_k, gate.key_bits)
        if mode == "sparse" or runtime.recall is not None:  # selecting: the keys as stored, rounded once
            stored_k = gate.stored_keys(gate_k)

    def gate_selection(start: int, stop: int, k: Tensor = k_t, k_max: int | None = None,
                       uniform: bool | None = None) -> Tensor:
        with torch.no_grad():
            scores = gate.score_stored(gate_q[:, :, start:stop], stored_k)
        fused = scores.is_cuda and module.training  # training shapes are fixed: the masking around top-k fuses
        if k_max is None:  # fused, every chunk takes the layer's largest k (the same selection: each query
            k_max = int((k_host if fused else k_host[start:stop]).max())  # keeps its own k), so one compile
        if uniform is None:  # the schedule's k: every query keeps k_max?
            uniform = bool((k_host[start:stop] == k_max).all())
        select = compiled(select_top_k) if fused else select_top_k
        return select(scores, allowed[..., start:stop, :], k[start:stop], positions[start:stop], positions,
                      sparse_cfg.sink_tokens, sparse_cfg.recent_tokens, k_max, uniform)

    def oracle_selection(start: int, stop: int) -> Tensor:
        keys, _, mask = block_causal_kv(key.detach(), None, own, allowed[..., start:stop, :],
                                        positions[start:stop], block_size)
        probs = head_averaged_probs(query[:, :, start:stop].detach(), keys.detach(), mask, scaling, num_selectors)
        probs = probs[..., :kv_len] + probs[..., kv_len:] if own is not None else probs  # fold the two versions
        return select_top_k(probs, allowed[..., start:stop, :], k_t[start:stop], positions[start:stop], positions,
                            sparse_cfg.sink_tokens, sparse_cfg.recent_tokens, int(k_host[start:stop].max()))

    if mode == "dense" and own is None:
        out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                     **kwargs)[0]
    else:
        selection = allowed
        if mode != "dense":
            pick = gate_selection if mode == "sparse" else oracle_selection
            with torch.no_grad():
                selection = torch.cat([pick(a, b) for a, b in _chunks(q_len, chunk)], dim=2)
        # from a CUDA graph, FlexAttention over only the tiles queries see (0.62 vs 1.31 ms of kernels per layer
        # on the H200); eagerly its Python and launches cost more than that (2.66 vs 1.46 ms per layer)
        if own is not None and runtime.captured_steps and module.training and own_block.fits(query):
            out = own_block.own_block_attention(query, (key, value), own, selection, block_size, scaling,
                                                module.num_key_value_groups > 1)
        else:
            out = _masked_sdpa(module, query, *block_causal_kv(key, value, own, selection, positions, block_size),
                               scaling)
    if runtime.distill and gate is not None:
        rows_allowed, rows_counted = runtime.kl_rows(allowed, k_t, index, query.shape[0])  # counted: >= k keys
        # DSA: in sparse training the gate learns the main attention's distribution over what it selected
        if runtime.distill_on_selection and mode == "sparse" and num_selectors == 1:
            rows_allowed = selection if index is None else selection[..., index, :]
        rows_q = query if index is None else query[:, :, index]
        if gate_from_hidden:
            loss = gate(hidden, cos, sin, DistillTarget(rows_q.detach(), key.detach(), rows_allowed, rows_counted,
                                                        index, scaling))
        else:  # sampled rows were drawn on the device: every key is in bounds (the mask holds each row to its own)
            rows_gq, rows_visible = (gate_q, visible) if index is None else (
                gate_q[:, :, index], torch.full((len(index),), kv_len))
            loss = gate_distill_loss(rows_q.detach(), key.detach(), rows_gq, gate_k, rows_allowed, rows_counted,
                                     scaling, chunk, rows_visible)
        runtime.distill_losses[adapter.layer_idx] = loss
    if runtime.recall is not None:
        k, min_keys = runtime.recall
        constant_k = torch.full_like(k_t, k)
        runtime.recall_sums[adapter.layer_idx] = captured_mass(
            query.detach(), key.detach(), allowed, scaling, k, min_keys, chunk, num_selectors,
            (lambda a, b: gate_selection(a, b, constant_k, k, uniform=True)) if gate is not None else None, visible)
    return out, None
