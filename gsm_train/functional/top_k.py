"""The top-k schedule (how many keys each query keeps) and the top-k selection over gate scores."""

from __future__ import annotations

import torch
from torch import Tensor

from gsm_train.config.schema import SparseAttentionConfig
from gsm_train.kernels.selection import kernel_runs as selection_kernel_runs
from gsm_train.kernels.selection import kernel_serves as selection_kernel_serves
from gsm_train.kernels.selection import top_k_selection

SCHEDULES = ("constant", "exp_decay", "linear_decay", "fraction")
FRACTION_DECIMALS = 6  # fraction x visible keys is rounded to this many decimals before its ceiling


def k_per_query(
    query_positions: Tensor, schedule: str, top_k: int, k_min: int, decay_rate: float, fraction: float | None = None
) -> Tensor:
    """Keys to keep per query at positions t (int64, same shape), in [min(k_min, top_k), top_k]:

    - `constant`: top_k;
    - `exp_decay`: floor(top_k * exp(-decay_rate * t));
    - `linear_decay`: floor(top_k - decay_rate * t);
    - `fraction`: ceil(fraction * (t + 1)), a share of the t + 1 keys the query at t sees, so k
      grows with the context (top_k is its ceiling). The product is rounded to `FRACTION_DECIMALS`
      decimals first, so that e.g. 0.1 x 30 keeps 3 keys, not the 4 its binary rounding gives.
    """
    t = query_positions.double()
    if schedule == "constant":
        k = torch.full_like(t, float(top_k))
    elif schedule == "exp_decay":
        k = torch.floor(top_k * torch.exp(-decay_rate * t))
    elif schedule == "linear_decay":
        k = torch.floor(top_k - decay_rate * t)
    elif schedule == "fraction":
        if fraction is None or not 0 < fraction <= 1:
            raise ValueError(f"the fraction schedule needs a fraction in (0, 1], got {fraction!r}")
        k = torch.ceil(torch.round(fraction * (t + 1), decimals=FRACTION_DECIMALS))
    else:
        raise ValueError(f"unknown top_k_schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    return k.clamp(min=min(k_min, top_k), max=top_k).long()


def scheduled_k(query_positions: Tensor, config: SparseAttentionConfig) -> Tensor:
    """`k_per_query` on the schedule `config` names: what training, evaluation and decoding keep."""
    return k_per_query(
        query_positions, config.top_k_schedule, config.top_k, config.k_min, config.decay_rate, config.top_k_fraction
    )


def forced_keys(query_positions: Tensor, key_positions: Tensor, sink_tokens: int, recent_tokens: int) -> Tensor:
    """Boolean [T, S]: the keys every selection keeps whatever the scores, where allowed: the query's own
    position, the first `sink_tokens` positions and the `recent_tokens` latest (0 <= t - j < recent_tokens)."""
    forced = key_positions[None, :] == query_positions[:, None]
    if sink_tokens:
        forced = forced | (key_positions[None, :] < sink_tokens)
    if recent_tokens:
        distance = query_positions[:, None] - key_positions[None, :]
        forced = forced | ((distance >= 0) & (distance < recent_tokens))
    return forced


def ties_fall_by_row_length(device: torch.device, dtype: torch.dtype, row_length: int, uniform_k: bool) -> bool:
    """Whether `select_top_k` over scores of `dtype` on `device` in rows of `row_length` keys takes `torch.topk`,
    which chooses among keys tied with the k-th score by the row's length (the selection kernel, which
    serves a uniform k, takes the lowest positions whatever the length)."""
    return not (uniform_k and selection_kernel_serves(device, dtype, row_length))


def select_top_k(
    scores: Tensor,
    allowed: Tensor,
    k: Tensor,
    query_positions: Tensor,
    key_positions: Tensor,
    sink_tokens: int = 0,
    recent_tokens: int = 0,
    k_max: int | None = None,
    uniform_k: bool = False,
) -> Tensor:
    """Boolean selection [B, n, T, S]: the k[t] best allowed keys per query, own position always kept.

    Queries with at most k allowed keys keep all of them (dense). Sink tokens (the first
    `sink_tokens` positions) and the `recent_tokens` latest keys are always kept too. `k_max`: max(k)
    when the caller knows it on the host (else it is read from the device, which waits for it).
    `uniform_k`: every k[t] equals k_max (the caller knows), so the top-k set needs no ranking and
    is taken unsorted (sorting the k winners is a kernel of its own: docs/design-decisions.md,
    'Selection with one k for every query takes the top-k unsorted'), on CUDA by one kernel that
    ranks, finds each row's k-th score and writes the selection (`gsm_train.kernels.selection`).
    """
    k_top = min(int(k.max()) if k_max is None else k_max, scores.shape[-1])
    if uniform_k and selection_kernel_runs(scores):  # one pass: ranking, k-th score, mask
        return top_k_selection(scores, allowed, k_top, query_positions, key_positions, sink_tokens, recent_tokens)
    forced = forced_keys(query_positions, key_positions, sink_tokens, recent_tokens)
    ranked = scores.masked_fill(forced, float("inf")).masked_fill(~allowed, float("-inf"))
    index = ranked.topk(k_top, dim=-1, sorted=not uniform_k).indices
    keep_rank = True if uniform_k else (torch.arange(k_top, device=k.device)[None, :] < k[:, None]).expand(index.shape)
    selected = torch.zeros_like(allowed.expand(scores.shape)).scatter(-1, index, keep_rank)
    return (selected | (forced & allowed)) & allowed
