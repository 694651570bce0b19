"""Top-k selection for one decoding query (Triton): the positions `top_k_positions` keeps, in two short
kernels instead of `torch.topk`'s radix passes (which took 47 of the 59 us a GSM decode step spent per
layer at context 32k, batch 1, on the H200).

1. `_count_keys_kernel` (many programs per row): every score, ranked as `top_k_positions` ranks it, is
   turned into an order-preserving 32-bit key. Forced keys (own position, sinks, recent tokens) that are
   visible are counted apart; the other visible keys go into a histogram of their key's top 16 bits
   (65,536 bins, global atomic adds) and a coarse one of its top 8 bits (256 bins, one local histogram
   per program, added once).
2. `_select_kernel` (one program per row): the coarse then the fine histogram give the 16-bit bin
   holding the k-th largest key, and how many keys lie above it; one pass over the row then writes the
   positions above that bin and the forced ones. The bin's own keys (scores equal at bf16 precision)
   are settled exactly: collected in a scratch row, searched bit by bit on their low 16 bits, and at
   equal scores the lowest positions win (`torch.topk` leaves that order open). A bin holding more
   keys than the scratch row (degenerate scores, e.g. all equal) is settled by the same search over
   the whole row: slower, the same result.

Positions come out in ascending order, except that a tied bin's chosen keys follow the rest.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # top_k_positions's torch.topk serves
    triton = None

FINE_BINS = 1 << 16
COARSE_BINS = 1 << 8
TIE_SCRATCH = 1024  # keys of the k-th key's 16-bit bin settled in registers; more take the whole-row search
COUNT_BLOCK = 1024  # scores per program of the counting kernel
LONGEST_SELECT_BLOCK = 8192  # scores per step of the selecting program (32 warps: 8 per thread)

if triton is not None:

    @triton.jit
    def _ranked_keys(scores_ptr, allowed_ptr, row, selectors, offs, length, position, sink_tokens, recent_tokens,
                     HAS_ALLOWED: tl.constexpr):
        """(high [N], low [N], counted [N], forced_kept [N]) of the row's positions `offs`: the top and bottom 16
        bits of each score's order-preserving 32-bit key (int32, as unsigned), whether it competes for the top
        k (visible, not forced) and whether it is a visible forced key."""
        live = offs < length
        x = tl.load(scores_ptr + row * length + offs, mask=live, other=0.0).to(tl.float32)
        bits = x.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed, ordered as the scores
        distance = position - offs
        forced = (offs == position) | (offs < sink_tokens) | ((distance >= 0) & (distance < recent_tokens))
        visible = live
        if HAS_ALLOWED:
            visible = live & (tl.load(allowed_ptr + (row // selectors) * length + offs, mask=live, other=0) != 0)
        return (ordered >> 16) + 32768, ordered & 0xFFFF, visible & ~forced, visible & forced

    @triton.jit
    def _count_keys_kernel(scores_ptr, allowed_ptr, counts_ptr, length, selectors, position, sink_tokens,
                           recent_tokens, HAS_ALLOWED: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        bin16, _, counted, forced_kept = _ranked_keys(scores_ptr, allowed_ptr, row, selectors, offs, length,
                                                      position, sink_tokens, recent_tokens, HAS_ALLOWED)
        base = counts_ptr + row * (65536 + 256 + 1)  # [fine 65,536 | coarse 256 | visible forced keys]
        tl.atomic_add(base + bin16, tl.full([BLOCK], 1, tl.int32), mask=counted, sem="relaxed")
        coarse = tl.histogram(bin16 >> 8, 256, mask=counted)
        bins = tl.arange(0, 256)
        tl.atomic_add(base + 65536 + bins, coarse, mask=coarse > 0, sem="relaxed")
        forced = tl.sum(forced_kept.to(tl.int32), 0)
        if forced > 0:
            tl.atomic_add(base + 65536 + 256, forced, sem="relaxed")

    @triton.jit
    def _highest_bin_reaching(counts, above, want):
        """Of 256 bin counts, the highest bin b with above + (keys in bins >= b) >= want (-1 if none), and the
        keys above it."""
        bins = tl.arange(0, 256)
        at_or_above = tl.cumsum(counts, 0, reverse=True) + above
        chosen = tl.max(tl.where(at_or_above >= want, bins, -1), 0)
        return chosen, above + tl.sum(tl.where(bins > chosen, counts, 0), 0)

    @triton.jit
    def _select_kernel(scores_ptr, allowed_ptr, counts_ptr, scratch_ptr, index_ptr, valid_ptr, length, selectors,
                       position, sink_tokens, recent_tokens, k, k_eff, HAS_ALLOWED: tl.constexpr,
                       BLOCK: tl.constexpr, SCRATCH: tl.constexpr):
        row = tl.program_id(0)
        base = counts_ptr + row * (65536 + 256 + 1)
        bins = tl.arange(0, 256)
        want = tl.maximum(k - tl.load(base + 65536 + 256), 0)  # competing keys to keep
        coarse = tl.load(base + 65536 + bins)
        coarse_bin, above = _highest_bin_reaching(coarse, 0, want)
        fine = tl.load(base + tl.maximum(coarse_bin, 0) * 256 + bins, mask=coarse_bin >= 0, other=0)
        fine_bin, above = _highest_bin_reaching(fine, above, want)
        every = tl.sum(coarse, 0) <= want  # no more competing keys than wanted: all of them
        threshold = tl.where(every, -1, coarse_bin * 256 + fine_bin)  # the 16-bit bin of the want-th largest key
        tied = tl.where(every, 0, tl.sum(tl.where(bins == fine_bin, fine, 0), 0))
        need = want - above  # of the `tied` keys in the threshold bin, the best `need`
        settle = (need > 0) & (need < tied)  # otherwise the bin is taken whole or not at all
        take_tied = (need > 0) & (need == tied)
        row_out = index_ptr + row * k_eff
        written = 0
        collected = 0
        for start in range(0, length, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            bin16, low, counted, forced_kept = _ranked_keys(scores_ptr, allowed_ptr, row, selectors, offs, length,
                                                            position, sink_tokens, recent_tokens, HAS_ALLOWED)
            in_bin = counted & (bin16 == threshold)
            keep = forced_kept | (counted & (bin16 > threshold)) | (in_bin & take_tied)
            slot = written + tl.cumsum(keep.to(tl.int32), 0) - 1
            tl.store(row_out + slot, offs.to(tl.int64), mask=keep)
            written += tl.sum(keep.to(tl.int32), 0)
            if settle & (tied <= SCRATCH):  # the bin's keys, in position order: low 16 bits << 32 | position
                spot = collected + tl.cumsum(in_bin.to(tl.int32), 0) - 1
                tl.store(scratch_ptr + row * SCRATCH + spot, (low.to(tl.int64) << 32) | offs, mask=in_bin)
                collected += tl.sum(in_bin.to(tl.int32), 0)
        if settle & (tied <= SCRATCH):
            spots = tl.arange(0, SCRATCH)
            entry = tl.load(scratch_ptr + row * SCRATCH + spots, mask=spots < tied, other=-1)
            low = tl.where(spots < tied, entry >> 32, -1)
            cut = tl.zeros([], tl.int64)  # grows to the need-th largest low half: most bits first
            for step in tl.static_range(16):
                candidate = cut | (1 << (15 - step))
                cut = tl.where(tl.sum((low >= candidate).to(tl.int32), 0) >= need, candidate, cut)
            ties = low == cut
            ties_left = need - tl.sum((low > cut).to(tl.int32), 0)
            keep = (low > cut) | (ties & (tl.cumsum(ties.to(tl.int32), 0) <= ties_left))
            slot = written + tl.cumsum(keep.to(tl.int32), 0) - 1
            tl.store(row_out + slot, entry & 0xFFFFFFFF, mask=keep)
            written += tl.sum(keep.to(tl.int32), 0)
        elif settle:  # a crowded bin: the same search, over the whole row
            cut = tl.zeros([], tl.int32)
            for step in tl.static_range(16):
                candidate = cut | (1 << (15 - step))
                reaching = 0
                for start in range(0, length, BLOCK):
                    offs = start + tl.arange(0, BLOCK)
                    bin16, low, counted, _ = _ranked_keys(scores_ptr, allowed_ptr, row, selectors, offs, length,
                                                          position, sink_tokens, recent_tokens, HAS_ALLOWED)
                    hit = counted & (bin16 == threshold) & (low >= candidate)
                    reaching += tl.sum(hit.to(tl.int32), 0)
                cut = tl.where(reaching >= need, candidate, cut)
            above_cut = 0
            for start in range(0, length, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                bin16, low, counted, _ = _ranked_keys(scores_ptr, allowed_ptr, row, selectors, offs, length, position,
                                                      sink_tokens, recent_tokens, HAS_ALLOWED)
                above_cut += tl.sum((counted & (bin16 == threshold) & (low > cut)).to(tl.int32), 0)
            ties_left = need - above_cut
            for start in range(0, length, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                bin16, low, counted, _ = _ranked_keys(scores_ptr, allowed_ptr, row, selectors, offs, length, position,
                                                      sink_tokens, recent_tokens, HAS_ALLOWED)
                in_bin = counted & (bin16 == threshold)
                ties = in_bin & (low == cut)
                tie_rank = tl.cumsum(ties.to(tl.int32), 0)
                keep = (in_bin & (low > cut)) | (ties & (tie_rank <= ties_left))
                ties_left -= tl.sum(ties.to(tl.int32), 0)
                slot = written + tl.cumsum(keep.to(tl.int32), 0) - 1
                tl.store(row_out + slot, offs.to(tl.int64), mask=keep)
                written += tl.sum(keep.to(tl.int32), 0)
        if HAS_ALLOWED:  # the slots past the selection: position 0, marked invalid
            for start in range(0, k_eff, BLOCK):
                slots = start + tl.arange(0, BLOCK)
                tl.store(valid_ptr + row * k_eff + slots, slots < written, mask=slots < k_eff)
                tl.store(row_out + slots, tl.zeros([BLOCK], tl.int64), mask=(slots >= written) & (slots < k_eff))


def top_k_indices(scores: Tensor, allowed: Tensor | None, k: int, k_eff: int, position: int, sink_tokens: int,
                  recent_tokens: int) -> tuple[Tensor, Tensor | None]:
    """`top_k_positions` for scores [B, n, S] (not modified): positions [B, n, k_eff] and, with `allowed`
    [B, S], which slots hold a selected key (None without: every slot does). Keeps every visible forced key
    and the best k minus their number of the other visible keys; at equal scores the lowest positions."""
    batch, selectors, length = scores.shape
    rows = batch * selectors
    scores = scores.contiguous()
    allowed_arg = allowed.to(torch.int8).contiguous() if allowed is not None else scores
    counts = torch.zeros(rows, FINE_BINS + COARSE_BINS + 1, device=scores.device, dtype=torch.int32)
    scratch = torch.empty(rows, TIE_SCRATCH, device=scores.device, dtype=torch.int64)
    index = torch.empty(batch, selectors, k_eff, device=scores.device, dtype=torch.int64)
    valid = None if allowed is None else torch.empty(batch, selectors, k_eff, device=scores.device, dtype=torch.bool)
    flags = {"HAS_ALLOWED": allowed is not None}
    block = min(LONGEST_SELECT_BLOCK, max(TIE_SCRATCH, triton.next_power_of_2(length)))
    _count_keys_kernel[(rows, triton.cdiv(length, COUNT_BLOCK))](
        scores, allowed_arg, counts, length, selectors, position, sink_tokens, recent_tokens, BLOCK=COUNT_BLOCK,
        **flags)
    _select_kernel[(rows,)](
        scores, allowed_arg, counts, scratch, index, valid if valid is not None else index, length, selectors,
        position, sink_tokens, recent_tokens, k, k_eff, BLOCK=block, SCRATCH=TIE_SCRATCH,
        num_warps=max(4, block // 256), **flags)
    return index, valid
