"""Which keys each query may see and keeps, computed once per forward and shared by the layers.

A `Layout` holds, for a teacher-forced pass of T queries over S keys, the allowed keys (causal and
padding), the key positions, the schedule's k per query, and host-side copies of the visible-key bound
and k, so that chunking and top-k sizes are decided without waiting for the device. Without a padding
mask every layer shares one layout per forward (`forward_layout` keeps it in the forward's scratch);
likewise the gate KL's sampled query rows and their masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gsm_train.attention.forward_state import ForwardState
from gsm_train.config.schema import SparseAttentionConfig
from gsm_train.functional.attention_targets import causal_visible, full_batch
from gsm_train.functional.top_k import forced_keys, scheduled_k
from gsm_train.modules.errors import GSMError


@dataclass(frozen=True)
class Layout:
    """allowed [B|1, 1, T, S] bool; positions [S] (device); k [T] keys each query keeps (device);
    visible [T] and k_host [T]: the most keys each query can see and its k, on the host."""

    allowed: Tensor
    positions: Tensor
    k: Tensor
    visible: Tensor
    k_host: Tensor


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


def block_causal_kv(
    key: Tensor,
    value: Tensor | None,
    own: tuple[Tensor, Tensor] | None,
    selection: Tensor,
    query_positions: Tensor,
    block_size: int,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Keys, values and selection [.., T, S'] for queries that see earlier blocks as stored and their
    own block uncompressed (as at decode): with `own`, both versions side by side (S' = 2S)."""
    if own is None:
        return key, value, selection
    earlier = earlier_blocks(query_positions, key.shape[2], block_size)
    both_values = torch.cat((value, own[1]), 2) if value is not None else None
    return torch.cat((key, own[0]), 2), both_values, torch.cat((selection & earlier, selection & ~earlier), -1)


def forward_layout(
    state: ForwardState, attention_mask: Tensor | None, q_len: int, kv_len: int, device: torch.device
) -> Layout:
    """The layout of this forward's pass (built once per forward when there is no padding mask)."""
    cfg: SparseAttentionConfig = state.settings.config.sparse_attention
    key = ("layout", q_len, kv_len, str(device))
    if attention_mask is None and key in state.scratch:
        return state.scratch[key]
    positions = torch.arange(kv_len, device=device)
    visible = causal_visible(q_len, kv_len)
    layout = Layout(
        allowed_keys(attention_mask, q_len, kv_len, device),
        positions,
        scheduled_k(positions, cfg),
        visible,
        scheduled_k(visible - 1, cfg),
    )
    if attention_mask is None:
        state.scratch[key] = layout
    return layout


def sampled_rows(state: ForwardState, counted_host: Tensor, device: torch.device) -> Tensor | None:
    """Query positions (a sorted device index) the gate KL uses in this forward: all (None), or
    `distill_queries` drawn once per forward (shared by all layers) among the counted positions.

    Counted positions (at least k visible keys) form a suffix, as the visible keys grow by one per
    position while k falls (or, on the `fraction` schedule, grows by at most one), so the draw is
    made on the device from host-side bounds: no host-to-device copy and no wait, which lets a CUDA
    graph capture the step (each replay draws anew)."""
    wanted = state.request.distill_queries
    if wanted <= 0:
        return None
    if "sampled_rows" not in state.scratch:
        length = len(counted_host)
        uncounted = (~counted_host).nonzero()
        first = int(uncounted[-1]) + 1 if len(uncounted) else 0  # start of the counted suffix
        if counted_host[:first].any():
            raise GSMError(
                "the positions with at least k keys are not a suffix of the sequence; "
                "use train.distill_queries=0 with this top-k schedule"
            )
        if length - first <= wanted:
            rows = torch.arange(first, length, device=device)
        else:
            rows = torch.rand(length - first, device=device).topk(wanted).indices.sort().values + first
        state.scratch["sampled_rows"] = rows
    return state.scratch["sampled_rows"]


def kl_candidates(layout: Layout, config: SparseAttentionConfig) -> Tensor:
    """Host bool [T]: the query rows the gate KL may count (`sampled_rows` draws among them): those that see
    at least k keys, and with `gate_target: beyond_forced` also a key the selection does not force. A suffix."""
    candidates = layout.visible >= layout.k_host
    if config.gate_target == "beyond_forced":
        candidates &= layout.visible - 1 >= config.most_forced_keys()
    return candidates


def without_forced(
    rows_allowed: Tensor, counted: Tensor, layout: Layout, index: Tensor | None, config: SparseAttentionConfig
) -> tuple[Tensor, Tensor]:
    """The gate KL's keys [B|1, 1, R, S] and counted rows [B|1, 1, R] of the query rows `index` (None: all
    T, the last T key positions) for `gate_target`: as given ("all"), or ("beyond_forced") without the keys
    `top_k.forced_keys` names, so that the target and the gate renormalise over the rest; a row left
    with no key is not counted (it adds nothing to the KL sum either)."""
    if config.gate_target == "all":
        return rows_allowed, counted
    positions = layout.positions[-rows_allowed.shape[-2] :] if index is None else layout.positions[index]
    rows_allowed = rows_allowed & ~forced_keys(positions, layout.positions, config.sink_tokens, config.recent_tokens)
    return rows_allowed, counted * rows_allowed.any(-1)  # bool or fp32 (`full_batch`), as given


def kl_rows(state: ForwardState, layout: Layout, index: Tensor | None, batch: int) -> tuple[Tensor, Tensor]:
    """The gate KL's query rows: their keys [B|1, 1, R, S] (allowed, less the forced ones where
    `gate_target` says so: `without_forced`) and whether each counts [B|1, 1, R] (at least k allowed keys);
    all rows, or the sampled `index` (then at the full batch and contiguous, the one shape the compiled KL
    takes). Shared by the layers of a forward that use the same `allowed` and `index`."""
    allowed, k = layout.allowed, layout.k
    cached = state.scratch.get("kl_rows")
    if cached is not None and cached[0] is allowed and cached[1] is index and cached[2].shape[0] in (1, batch):
        return cached[2], cached[3]
    if index is None:
        rows_allowed, counted = allowed, allowed.sum(-1) >= k
    else:
        rows_allowed = allowed[..., index, :]
        rows_allowed, counted = full_batch(rows_allowed, rows_allowed.sum(-1) >= k[index], batch)
    rows_allowed, counted = without_forced(rows_allowed, counted, layout, index, state.settings.config.sparse_attention)
    state.scratch["kl_rows"] = (allowed, index, rows_allowed, counted)
    return rows_allowed, counted
