"""Top-k selection masks for training (Triton): one program per query row.

The joint step selects the k best-scored keys of every query row (4 x 1,024 rows of 2,048 gate
scores per chunk at SmolLM2's shapes). The PyTorch path runs `torch.topk` in several radix passes
across blocks, scatters the mask from its indices, and ranks (forced keys first, hidden ones last)
and masks in two more passes over the scores. Here each program holds one row in registers, ranks it
as `select_top_k` does, finds the row's k-th largest score by a bitwise search over an
order-preserving integer form of the scores (16 steps for bf16, whose top 16 bits as fp32 tell every
value apart; 32 otherwise), and writes the selection directly: the scores above it, then the ties at
it in position order until k are marked (the lowest positions win a tie; `torch.topk` leaves that
order open), with the forced keys, where allowed: one pass over the scores instead of several
(timings: docs/design-decisions.md, 'Selection with one k for every query takes the top-k
unsorted').
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # select_top_k's torch.topk serves
    triton = None

LONGEST_ROW = 8192  # longer rows take torch.topk (a row lives in one program's registers)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read once: compiled callers trace a constant


def kernel_runs(scores: Tensor) -> bool:
    """Whether `top_k_selection` serves these scores [B, n, T, S] (`kernel_serves`)."""
    return scores.dim() == 4 and kernel_serves(scores.device, scores.dtype, scores.shape[-1])


def kernel_serves(device: torch.device, dtype: torch.dtype, row_length: int) -> bool:
    """Whether `top_k_selection` serves scores of `dtype` on `device` in rows of `row_length` keys: Triton on
    CUDA (or Triton's interpreter), bf16, fp16 or fp32, rows no longer than LONGEST_ROW."""
    here = device.type == "cuda" or INTERPRETED
    searched = dtype in (torch.bfloat16, torch.float16, torch.float32)  # fp64 would be searched as fp32
    return triton is not None and here and searched and row_length <= LONGEST_ROW


if triton is not None:

    @triton.jit
    def _top_k_selection_kernel(
        scores_ptr,
        allowed_ptr,
        query_pos_ptr,
        key_pos_ptr,
        out_ptr,
        length,
        queries,
        selectors,
        k,
        sink_tokens,
        recent_tokens,
        allowed_batch_stride,
        allowed_selector_stride,
        allowed_query_stride,
        allowed_key_stride,
        BLOCK: tl.constexpr,
        SEARCH_BITS: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # (batch, selector, query) of scores [B, n, T, S]; int64 offsets
        query = row % queries
        selector = (row // queries) % selectors
        batch = row // (queries * selectors)
        offs = tl.arange(0, BLOCK)
        live = offs < length
        allowed = (
            tl.load(
                allowed_ptr
                + batch * allowed_batch_stride
                + selector * allowed_selector_stride
                + query * allowed_query_stride
                + offs * allowed_key_stride,
                mask=live,
                other=0,
            )
            != 0
        )
        query_pos = tl.load(query_pos_ptr + query)
        key_pos = tl.load(key_pos_ptr + offs, mask=live, other=0)
        distance = query_pos - key_pos
        forced = (key_pos == query_pos) | (key_pos < sink_tokens) | ((distance >= 0) & (distance < recent_tokens))
        x = tl.load(scores_ptr + row * length + offs, mask=live, other=float("-inf")).to(tl.float32)
        x = tl.where(forced, float("inf"), x)  # as select_top_k ranks them: forced first, hidden last
        x = tl.where(allowed, x, float("-inf"))
        bits = x.to(tl.int32, bitcast=True)
        key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) + 2147483648  # in [0, 2^32), ordered as x
        key = key >> (32 - SEARCH_BITS)  # bf16: the top 16 bits tell every value apart
        key = tl.where(live, key, 0)  # below every score, -inf included
        threshold = tl.zeros([], tl.int64)  # grows to the k-th largest key: most bits first
        for step in tl.static_range(SEARCH_BITS):
            candidate = threshold | (1 << (SEARCH_BITS - 1 - step))
            enough = tl.sum((key >= candidate).to(tl.int32), 0) >= k
            threshold = tl.where(enough, candidate, threshold)
        above = key > threshold
        ties = key == threshold
        tie_rank = tl.cumsum(ties.to(tl.int32), 0)  # 1 for the lowest tied position
        keep = above | (ties & (tie_rank <= k - tl.sum(above.to(tl.int32), 0)))
        tl.store(out_ptr + row * length + offs, (keep | forced) & allowed, mask=live)


def top_k_selection(
    scores: Tensor,
    allowed: Tensor,
    k: int,
    query_positions: Tensor,
    key_positions: Tensor,
    sink_tokens: int = 0,
    recent_tokens: int = 0,
) -> Tensor:
    """`select_top_k`'s selection [B, n, T, S] for a k every query keeps, in one pass over the scores: each
    row's k best allowed keys (at a tie with the k-th largest, the lowest positions; all of a row when k
    covers it), plus its forced ones (own position, the first `sink_tokens`, the `recent_tokens` latest),
    only where `allowed` [B|1, n|1, T, S] is true. Positions are read as int32 (training rows are at most
    LONGEST_ROW long)."""
    batch, selectors, queries, length = scores.shape
    rows = scores.contiguous()
    allowed = allowed.expand(batch, selectors, queries, length)  # read in place: broadcast dims have stride 0
    out = torch.empty(scores.shape, dtype=torch.bool, device=scores.device)
    search_bits = 16 if scores.dtype == torch.bfloat16 else 32
    _top_k_selection_kernel[(batch * selectors * queries,)](
        rows,
        allowed,
        query_positions.to(torch.int32),
        key_positions.to(torch.int32),
        out,
        length,
        queries,
        selectors,
        k,
        sink_tokens,
        recent_tokens,
        *allowed.stride(),
        BLOCK=triton.next_power_of_2(length),
        SEARCH_BITS=search_bits,
        num_warps=4 if length <= 2048 else 8,
    )
    return out
