"""Exact top-k positions of each row of fp32 scores (Triton), spread over many programs per row.

Decode attention needs only the *set* of the k best keys. `torch.topk` of 2,048 among 32,768 took
49 us in a CUDA graph on the H200, and one program per row doing the whole selection took 81 us
(one SM's passes over the row). Here the row is cut into chunks of CHUNK scores and five small
kernels share the work:
1. each chunk's range of finite scores;
2. each chunk's histogram over BINS equal-width bins of the row's range (any monotone binning
   separates the k best from the rest except inside one bin: the boundary bin);
3. per row: the boundary bin, and where each chunk writes (exclusive prefix sums over chunks);
4. each chunk writes the positions above the boundary bin to the output and those in it to a
   candidate list, both in position order;
5. per row: the k-th largest score among the candidates (three radix passes of 11, 11 and 10 bits
   over an order-preserving integer form of the float), then the candidates above it and the first
   (lowest-position) ties at it.
The result equals `torch.topk(scores, k).indices` as a set whenever the k-th and (k+1)-th scores
differ; on a tie at the boundary, the lowest positions win. It is deterministic.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # decode_attention's torch.topk serves
    triton = None

CHUNK = 2048  # scores per program of the per-chunk kernels
BINS = 256  # value bins: about 1/250 of a row of Gaussian-like scores falls in the boundary bin
CANDIDATES = 1024  # candidates per load of the last kernel

if triton is not None:

    @triton.jit
    def _ordered(scores):
        """int32 keys in the order of the fp32 `scores` (negative floats have their magnitude bits flipped)."""
        bits = scores.to(tl.int32, bitcast=True)
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _chunk(scores_ptr, row, chunk, length, CHUNK: tl.constexpr):
        """(positions, scores, live) of one chunk of a row."""
        offs = chunk * CHUNK + tl.arange(0, CHUNK)
        live = offs < length
        return offs, tl.load(scores_ptr + row * length + offs, mask=live, other=0.0), live

    @triton.jit
    def _row_range(range_ptr, row, chunks, CHUNKS: tl.constexpr):
        """(lo, hi, scale) of a row from its chunks' ranges: bins are (x - lo) * scale."""
        at = tl.arange(0, CHUNKS)
        live = at < chunks
        lo = tl.min(tl.load(range_ptr + (row * chunks + at) * 2, mask=live, other=float("inf")), 0)
        hi = tl.max(tl.load(range_ptr + (row * chunks + at) * 2 + 1, mask=live, other=float("-inf")), 0)
        return lo, hi, tl.maximum(hi - lo, 1.0e-30)

    @triton.jit
    def _value_bin(x, lo, hi, span, BINS: tl.constexpr):
        """Bin 0..BINS-1 of `x` in [lo, hi] (infinities clamped to the ends): monotone in `x`."""
        t = (tl.minimum(tl.maximum(x, lo), hi) - lo) * (BINS / span)
        return tl.minimum(tl.maximum(t, 0.0), BINS - 1).to(tl.int32)

    @triton.jit
    def _boundary(hist, wanted, BINS: tl.constexpr):
        """(bin holding the `wanted`-th largest entry, how many entries lie in higher bins) of a histogram."""
        bins = tl.arange(0, BINS)
        at_or_above = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
        above = at_or_above - hist
        boundary = (above < wanted) & (at_or_above >= wanted)
        return tl.sum(tl.where(boundary, bins, 0), 0), tl.sum(tl.where(boundary, above, 0), 0)

    @triton.jit
    def _chunk_range_kernel(scores_ptr, range_ptr, length, CHUNK: tl.constexpr):
        row, chunk = tl.program_id(0), tl.program_id(1)
        _, x, live = _chunk(scores_ptr, row, chunk, length, CHUNK)
        finite = live & (tl.abs(x) < float("inf"))
        at = range_ptr + (row * tl.num_programs(1) + chunk) * 2
        tl.store(at, tl.min(tl.where(finite, x, float("inf")), 0))
        tl.store(at + 1, tl.max(tl.where(finite, x, float("-inf")), 0))

    @triton.jit
    def _chunk_histogram_kernel(scores_ptr, range_ptr, hist_ptr, length, CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
                                BINS: tl.constexpr):
        row, chunk = tl.program_id(0), tl.program_id(1)
        chunks = tl.num_programs(1)
        lo, hi, span = _row_range(range_ptr, row, chunks, CHUNKS)
        _, x, live = _chunk(scores_ptr, row, chunk, length, CHUNK)
        hist = tl.histogram(_value_bin(x, lo, hi, span, BINS), BINS, mask=live)
        tl.store(hist_ptr + (row * chunks + chunk) * BINS + tl.arange(0, BINS), hist)

    @triton.jit
    def _boundary_kernel(hist_ptr, offset_ptr, meta_ptr, chunks, k, BINS: tl.constexpr, CHUNK_BLOCK: tl.constexpr):
        """Per row: the boundary bin and, per chunk, where its positions above the bin and its candidates go."""
        row = tl.program_id(0)
        bins = tl.arange(0, BINS)
        total = tl.zeros([BINS], tl.int32)
        for first in range(0, chunks, CHUNK_BLOCK):
            at = first + tl.arange(0, CHUNK_BLOCK)
            hist = tl.load(hist_ptr + ((row * chunks + at) * BINS)[:, None] + bins[None, :],
                           mask=(at < chunks)[:, None], other=0)
            total += tl.sum(hist, 0)
        boundary, above_total = _boundary(total, k, BINS)
        above_carry = 0
        candidate_carry = 0
        for first in range(0, chunks, CHUNK_BLOCK):
            at = first + tl.arange(0, CHUNK_BLOCK)
            live = at < chunks
            hist = tl.load(hist_ptr + ((row * chunks + at) * BINS)[:, None] + bins[None, :], mask=live[:, None],
                           other=0)
            above = tl.sum(tl.where(bins[None, :] > boundary, hist, 0), 1)
            candidates = tl.sum(tl.where(bins[None, :] == boundary, hist, 0), 1)
            tl.store(offset_ptr + (row * chunks + at) * 2, above_carry + tl.cumsum(above, 0) - above, mask=live)
            tl.store(offset_ptr + (row * chunks + at) * 2 + 1, candidate_carry + tl.cumsum(candidates, 0) - candidates,
                     mask=live)
            above_carry += tl.sum(above, 0)
            candidate_carry += tl.sum(candidates, 0)
        tl.store(meta_ptr + row * 3, boundary)
        tl.store(meta_ptr + row * 3 + 1, above_total)
        tl.store(meta_ptr + row * 3 + 2, candidate_carry)

    @triton.jit
    def _chunk_scatter_kernel(scores_ptr, range_ptr, offset_ptr, meta_ptr, out_ptr, cand_ptr, length, k,
                              CHUNK: tl.constexpr, CHUNKS: tl.constexpr, BINS: tl.constexpr):
        row, chunk = tl.program_id(0), tl.program_id(1)
        chunks = tl.num_programs(1)
        lo, hi, span = _row_range(range_ptr, row, chunks, CHUNKS)
        offs, x, live = _chunk(scores_ptr, row, chunk, length, CHUNK)
        bins = _value_bin(x, lo, hi, span, BINS)
        boundary = tl.load(meta_ptr + row * 3)
        take = (live & (bins > boundary)).to(tl.int32)
        slot = tl.load(offset_ptr + (row * chunks + chunk) * 2) + tl.cumsum(take, 0) - take
        tl.store(out_ptr + row.to(tl.int64) * k + slot, offs.to(tl.int64), mask=take != 0)
        candidate = (live & (bins == boundary)).to(tl.int32)
        slot = tl.load(offset_ptr + (row * chunks + chunk) * 2 + 1) + tl.cumsum(candidate, 0) - candidate
        tl.store(cand_ptr + row.to(tl.int64) * length + slot, offs, mask=candidate != 0)

    @triton.jit
    def _candidates(scores_ptr, cand_ptr, row, length, start, count, BLOCK: tl.constexpr):
        """(positions, ordered keys, live) of candidates start..start+BLOCK of a row."""
        at = start + tl.arange(0, BLOCK)
        live = at < count
        pos = tl.load(cand_ptr + row.to(tl.int64) * length + at, mask=live, other=0)
        return pos, _ordered(tl.load(scores_ptr + row.to(tl.int64) * length + pos, mask=live, other=0.0)), live

    @triton.jit
    def _refine_kernel(scores_ptr, cand_ptr, meta_ptr, out_ptr, length, k, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        written = tl.load(meta_ptr + row * 3 + 1)
        count = tl.load(meta_ptr + row * 3 + 2)
        wanted = k - written
        prefix = 0
        for digit_pass in tl.static_range(3):  # bits 31-21, 20-10, 9-0
            hist = tl.zeros([2048], tl.int32)
            for start in range(0, count, BLOCK):
                _, key, live = _candidates(scores_ptr, cand_ptr, row, length, start, count, BLOCK)
                if digit_pass == 0:
                    hist += tl.histogram((key >> 21) + 1024, 2048, mask=live)
                elif digit_pass == 1:
                    hist += tl.histogram((key >> 10) & 2047, 2048, mask=live & ((key >> 21) == prefix))
                else:
                    hist += tl.histogram(key & 1023, 2048, mask=live & ((key >> 10) == prefix))
            digit, above = _boundary(hist, wanted, 2048)
            if digit_pass == 0:
                prefix = digit - 1024  # the top bits of the k-th largest key, signed as keys are
            else:
                prefix = (prefix << (11 if digit_pass == 1 else 10)) | digit
            wanted -= above
        ties_seen = 0  # prefix is now the k-th largest key; `wanted` of its ties are kept
        for start in range(0, count, BLOCK):
            pos, key, live = _candidates(scores_ptr, cand_ptr, row, length, start, count, BLOCK)
            tie = (live & (key == prefix)).to(tl.int32)
            take = ((live & (key > prefix)) | ((tie != 0) & (ties_seen + tl.cumsum(tie, 0) <= wanted))).to(tl.int32)
            tl.store(out_ptr + row.to(tl.int64) * k + written + tl.cumsum(take, 0) - take, pos.to(tl.int64),
                     mask=take != 0)
            written += tl.sum(take, 0)
            ties_seen += tl.sum(tie, 0)


def top_k_indices(scores: Tensor, k: int) -> Tensor:
    """Positions [..., k] (int64) of the k largest of each row of fp32 `scores` [..., S], those above the
    boundary bin first, in position order; the same set as `scores.topk(k).indices` unless the k-th and
    (k+1)-th scores tie (then the lowest positions)."""
    length = scores.shape[-1]
    if not 0 < k <= length:
        raise ValueError(f"top_k_indices: k={k} must be in 1..{length} (the row length)")
    rows = scores.reshape(-1, length).float().contiguous()
    count, chunks = rows.shape[0], triton.cdiv(length, CHUNK)
    device = scores.device
    ranges = torch.empty(count, chunks, 2, device=device, dtype=torch.float32)
    hists = torch.empty(count, chunks, BINS, device=device, dtype=torch.int32)
    offsets = torch.empty(count, chunks, 2, device=device, dtype=torch.int32)
    meta = torch.empty(count, 3, device=device, dtype=torch.int32)
    candidates = torch.empty(count, length, device=device, dtype=torch.int32)
    out = torch.empty(count, k, device=device, dtype=torch.int64)
    grid = (count, chunks)
    chunk_pow2 = triton.next_power_of_2(chunks)
    _chunk_range_kernel[grid](rows, ranges, length, CHUNK=CHUNK)
    _chunk_histogram_kernel[grid](rows, ranges, hists, length, CHUNK=CHUNK, CHUNKS=chunk_pow2, BINS=BINS)
    _boundary_kernel[(count,)](hists, offsets, meta, chunks, k, BINS=BINS, CHUNK_BLOCK=min(16, chunk_pow2))
    _chunk_scatter_kernel[grid](rows, ranges, offsets, meta, out, candidates, length, k, CHUNK=CHUNK,
                                CHUNKS=chunk_pow2, BINS=BINS)
    _refine_kernel[(count,)](rows, candidates, meta, out, length, k, BLOCK=CANDIDATES, num_warps=8)
    return out.reshape(*scores.shape[:-1], k)
