"""Top-k selection masks for training (Triton): one program per query row.

The joint step selects the k best-scored keys of every query row (4 x 1,024 rows of 2,048 gate
scores per chunk at SmolLM2's shapes); `torch.topk` over them took 4.8 ms of a 112.5 ms captured
joint step on the H200, in several radix passes across blocks, and the mask is then scattered from
its indices. Here each program holds one row in registers, finds the row's k-th largest score by a
bitwise search over an order-preserving integer form of the scores (16 steps for bf16, whose top 16
bits as fp32 tell every value apart; 32 otherwise), and writes the mask directly: the scores above
it, then the ties at it in position order until k are marked (the lowest positions win a tie;
`torch.topk` leaves that order open).
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
    """Whether `top_k_mask` serves these scores: Triton with a CUDA tensor (or Triton's interpreter), rows
    no longer than LONGEST_ROW."""
    here = scores.is_cuda or INTERPRETED
    return triton is not None and here and scores.shape[-1] <= LONGEST_ROW


if triton is not None:

    @triton.jit
    def _top_k_mask_kernel(scores_ptr, out_ptr, length, k, BLOCK: tl.constexpr, SEARCH_BITS: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        live = offs < length
        x = tl.load(scores_ptr + row * length + offs, mask=live, other=float("-inf")).to(tl.float32)
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
        tl.store(out_ptr + row * length + offs, keep, mask=live)


def top_k_mask(scores: Tensor, k: int) -> Tensor:
    """Boolean mask shaped like `scores` [..., S]: the k largest scores of each row (all of a row when
    k >= S; at a tie with the k-th largest, the lowest positions)."""
    length = scores.shape[-1]
    rows = scores.reshape(-1, length).contiguous()
    out = torch.empty(rows.shape, dtype=torch.bool, device=scores.device)  # no int8 view: Inductor cannot view as bool
    search_bits = 16 if scores.dtype == torch.bfloat16 else 32
    _top_k_mask_kernel[(rows.shape[0],)](rows, out, length, k, BLOCK=triton.next_power_of_2(length),
                                         SEARCH_BITS=search_bits, num_warps=4 if length <= 2048 else 8)
    return out.view(scores.shape)
