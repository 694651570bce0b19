"""Fused sparse decode (Triton): gate scores over the cached gate keys; then, over the top-k, gather
the selected K/V rows, dequantize ASQ on the fly and attend, in one pass over the selected rows (split
over the selection, flash-decoding style).

Per (batch, KV head, split) one program loads the GQA group's queries once, then for each tile of
selected positions reads only what the cache stores for them: cluster id (1 byte), packed residual
codes (D * bits / 8 bytes at K's or V's width, read as whole rows of 32-bit words and unpacked in
registers, each code turned into a float by its bits: `_unpacked_levels`), scale (2 bytes) and the
id's prototype row, or the raw row for positions in the newest block (read only by tiles holding
one). All of a tile's K and V loads are issued before any of them is used, so their latencies
overlap. A second small kernel merges the splits. Bytes moved per selected token and KV head: about
``2 * (3 + D * bits / 8 + 2 * D)`` (K and V, the prototype row counted in full), against ``4 * D``
for a bf16 cache read densely.

With rotated residuals (`kv_compression.rotate_residuals`) the store holds prototypes and residuals
of the rotated rows (``k R``), so the kernel rotates the query once (``(k R) . (q R) = k . q``; the
group's real heads only, not the dot's padding to 16 rows) and sums the packed rows' values in the
rotated basis; the merge, being linear, sums the splits there and rotates the sum back (``R^T``)
once per head. The newest block's raw rows are never rotated (faster than rotating them in each tile
that holds them, and they meet the query as stored): a tile holding some takes their products
against the unrotated query and adds their values to a second sum, in the rows' own basis, which the
merge sums apart. Each rotation is a fast Walsh-Hadamard transform with the rotation's signs
(``R = diag(signs) H / sqrt(D)``, `hadamard_rotation`): no matrix is read and no kernel is launched
for them. Why: the kernel is latency-bound, so rotations inside it beat launches around it; and at
small grids its instructions per de-quantized element set the time, which the word reads, the codes
made floats by their bits, the missing select and the rotations at the real heads and in the merge
each cut.

Loads that decide other loads' addresses run ahead: each tile's positions are read two tiles before
it and its cluster ids one tile before, so a tile waits for one round trip to memory, not three.

Timings behind each choice: docs/design-decisions.md, 'The fused decode kernel splits the selection
across programs' and the entries after it ('Rotated ASQ keeps its prototypes in the rotated basis',
'At batch 1 the fused decode kernel is bound by its instructions', 'Fewer instructions per
de-quantized element').
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch import Tensor

from gsm_train.kernels.packed_rows import PackedRows
from gsm_train.quant import code_center

try:
    import triton
    import triton.language as tl
except ImportError:  # the PyTorch path in decode_attention serves
    triton = None


def triton_available() -> bool:
    """Whether the fused kernels can run here (Triton importable and a CUDA device, or Triton's interpreter)."""
    return triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

    @triton.jit
    def _unpacked_levels(word, BITS: tl.constexpr, CENTER: tl.constexpr, IN_THREAD: tl.constexpr):
        """Residual levels [N, D] (fp32, in units of the scale) from packed words [N, D * BITS / 32] (int32):
        code j of a row sits at bit j * BITS of the row's bytes read little-endian, as `kv_compressor` packs
        them, less CENTER. A code c becomes the float 2**22 + c by its bits (0x4A800000 | c << 1; floats in
        [2**22, 2**23) step by 1/2, so 2**22 + CENTER is one too), so a level costs integer shifts and masks
        and one exact subtraction, no integer-to-float conversion. IN_THREAD: a word's codes stay in the
        thread that loaded it (`_joined_codes`), the faster form for the block kernel (`dense_decode`), whose
        dots take a block's levels from shared memory; otherwise they are spread over a new axis of shifts, the
        faster form for the selection kernel (timed: docs/results.md, "Unpacking the codes")."""
        PER_WORD: tl.constexpr = 32 // BITS
        if IN_THREAD:
            bits = tl.reshape(_joined_codes(word, 0, 1, PER_WORD, BITS), [word.shape[0], word.shape[1] * PER_WORD])
        else:
            shifts = tl.arange(0, PER_WORD) * BITS
            codes = (word[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
            codes = tl.reshape(codes, [word.shape[0], word.shape[1] * PER_WORD])
            bits = (codes << 1) | 0x4A800000
        return bits.to(tl.float32, bitcast=True) - (4194304.0 + CENTER)

    @triton.jit
    def _joined_codes(word, START: tl.constexpr, STEP: tl.constexpr, COUNT: tl.constexpr, BITS: tl.constexpr):
        """Codes START, START + STEP, ... (COUNT of them, a power of two) of each word [N, W] as the bits of
        the floats 2**22 + code (int32), [N, W, 2, ..., 2] with log2(COUNT) axes of 2 that read in code order
        when flattened: each split is a `tl.join` (a new last axis, held in the thread) of the even and the odd
        codes, so no code moves between threads."""
        if COUNT == 1:
            mask: tl.constexpr = ((1 << BITS) - 1) << 1
            if START == 0:
                return ((word << 1) & mask) | 0x4A800000
            else:
                return ((word >> (START * BITS - 1)) & mask) | 0x4A800000
        else:
            return tl.join(
                _joined_codes(word, START, STEP * 2, COUNT // 2, BITS),
                _joined_codes(word, START + STEP, STEP * 2, COUNT // 2, BITS),
            )

    @triton.jit
    def _tile_positions(index_ptr, valid_ptr, row_start, offs, hi, HAS_VALID: tl.constexpr):
        """The selected positions at `offs` of a selection row (from `row_start`) and which are live: within
        the program's share (below `hi`) and, with HAS_VALID, marked valid."""
        live = offs < hi
        pos = tl.load(index_ptr + row_start + offs, mask=live, other=0)
        if HAS_VALID:
            live = live & (tl.load(valid_ptr + row_start + offs, mask=live, other=0) != 0)
        return pos, live

    @triton.jit
    def _cluster_ids(ids_ptr, bh, pos, live, packed_len, capacity):
        """The prototype ids (int32) of the packed rows at `pos` (0 elsewhere)."""
        in_packed = live & (pos < packed_len)
        return tl.load(ids_ptr + bh * capacity + pos, mask=in_packed, other=0).to(tl.int32)

    @triton.jit
    def _packed_parts(
        cluster,
        res_ptr,
        scale_ptr,
        proto_ptr,
        bh,
        pos,
        in_packed,
        capacity,
        n_blocks,
        dims,
        D: tl.constexpr,
        BITS: tl.constexpr,
        C: tl.constexpr,
        TOKENS_PER_BLOCK: tl.constexpr,
    ):
        """What the store holds for the packed rows at `pos` with prototype ids `cluster` (zeros elsewhere):
        prototype rows [N, D], residual codes as words [N, D * BITS / 32] (int32, read whole) and scales [N];
        the buffers hold `capacity` tokens and `n_blocks` blocks per (batch, head)."""
        flat = bh * capacity + pos
        NWORDS: tl.constexpr = D * BITS // 32
        # one expression: naming the word pointers made Triton 3.6's layout pass fail on the ids' load
        word = tl.load(
            res_ptr.to(tl.pointer_type(tl.int32)) + flat[:, None] * NWORDS + tl.arange(0, NWORDS)[None, :],
            mask=in_packed[:, None],
            other=0,
        )
        scale = tl.load(scale_ptr + flat, mask=in_packed, other=0.0)
        proto_row = (bh * n_blocks + pos // TOKENS_PER_BLOCK) * C + cluster
        proto = tl.load(proto_ptr + proto_row[:, None] * D + dims[None, :], mask=in_packed[:, None], other=0.0)
        return proto, word, scale

    @triton.jit
    def _walsh_hadamard(x, ROWS: tl.constexpr, D: tl.constexpr, LOG_D: tl.constexpr):
        """x [ROWS, D] @ H / sqrt(D), H Sylvester's (symmetric) Hadamard matrix of order D = 2**LOG_D, by
        LOG_D butterfly stages on pairs (1 << stage) apart: fp32 sums, and no matrix read."""
        for stage in tl.static_range(LOG_D):
            pairs = tl.permute(tl.reshape(x, [ROWS, D >> (stage + 1), 2, 1 << stage]), (0, 1, 3, 2))
            low, high = tl.split(pairs)
            x = tl.reshape(tl.permute(tl.join(low + high, low - high), (0, 1, 3, 2)), [ROWS, D])
        return x * tl.rsqrt(tl.full([1, 1], D, tl.float32))

    @triton.jit
    def _packed_rows(
        proto,
        word,
        scale,
        in_packed,
        D: tl.constexpr,
        BITS: tl.constexpr,
        CENTER: tl.constexpr,
        PACKED: tl.constexpr,
        DTYPE: tl.constexpr,
    ):
        """Rows [N, D] (DTYPE) rebuilt from `_packed_parts` (prototype + residual) where `in_packed`, zeros
        elsewhere (in the rotated basis when the store rotates its residuals): the parts' masked loads give
        zero prototypes and scales there, so no select is spent on it."""
        rows = tl.zeros([in_packed.shape[0], D], DTYPE)
        if PACKED:
            residual = _unpacked_levels(word, BITS, CENTER, False) * scale.to(tl.float32)[:, None]
            rows = (proto.to(tl.float32) + residual).to(DTYPE)
        return rows

    @triton.jit
    def _tail_rows(tail_ptr, bh, pos, in_tail, packed_len, tail_slots, dims, D: tl.constexpr, DTYPE: tl.constexpr):
        """The raw rows [N, D] (DTYPE, never rotated) at `pos` where `in_tail` (slot pos - packed_len of
        `tail_slots` per (batch, head)), zeros elsewhere."""
        return tl.load(
            tail_ptr + (bh * tail_slots + (pos - packed_len))[:, None] * D + dims[None, :],
            mask=in_tail[:, None],
            other=0.0,
        ).to(DTYPE)

    @triton.jit
    def _group_query(
        q_ptr, signs_ptr, bh, G: tl.constexpr, GP: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr,
        LOG_D: tl.constexpr, ROTATED: tl.constexpr,
    ):  # fmt: skip
        """The queries of KV head `bh`'s group, transposed for the dots: q_t [D, GP] (in the rotated basis
        where ROTATED) and q_raw_t [D, GP] (as given, for the newest block's raw rows, which are never
        rotated); rows past the group's G heads (the dot's padding to GP) are zero; the queries' dtype."""
        heads = tl.arange(0, GP)
        dims = tl.arange(0, D)
        q = tl.load(q_ptr + ((bh * G + heads) * D)[:, None] + dims[None, :], mask=(heads < G)[:, None], other=0.0)
        q_raw_t = tl.trans(q)
        if ROTATED:  # rows in the rotated basis: the query too. R = diag(signs) H / sqrt(D) (`hadamard_rotation`),
            signs = tl.load(signs_ptr + dims).to(tl.float32)  # so q R = ((q * signs) H) / sqrt(D)
            group = tl.arange(0, GQ)  # the group's heads without the dot's padding: 4x fewer rows to rotate at G 4
            q_group = tl.load(
                q_ptr + ((bh * G + group) * D)[:, None] + dims[None, :], mask=(group < G)[:, None], other=0.0
            )
            q_group = _walsh_hadamard(q_group.to(tl.float32) * signs[None, :], GQ, D, LOG_D)
            q = tl.reshape(tl.broadcast_to(q_group[None, :, :], [GP // GQ, GQ, D]), [GP, D])
            q = tl.where((heads < G)[:, None], q, 0.0).to(q_ptr.dtype.element_ty)
        return tl.trans(q), q_raw_t

    @triton.jit
    def _store_partials(
        acc_ptr, raw_ptr, max_ptr, sum_ptr, part, real, dims, acc, acc_raw, m_i, l_i, D: tl.constexpr,
        ROTATED: tl.constexpr,
    ):  # fmt: skip
        """One split's partials of the heads `part` where `real`: the running max and sum of the softmax
        and the weighted value sums [GP, D] (fp32). With ROTATED the packed rows' sum (rotated basis) and
        the raw rows' sum go apart, for the merge to rotate the first back once per head."""
        if ROTATED:
            tl.store(acc_ptr + (part * D)[:, None] + dims[None, :], acc, mask=real[:, None])
            tl.store(raw_ptr + (part * D)[:, None] + dims[None, :], acc_raw, mask=real[:, None])
        else:
            tl.store(acc_ptr + (part * D)[:, None] + dims[None, :], acc + acc_raw, mask=real[:, None])
        tl.store(max_ptr + part, m_i, mask=real)
        tl.store(sum_ptr + part, l_i, mask=real)

    # Gathers of scattered rows are latency-bound: how many rows a program takes (BLOCK_N x TILES),
    # how many warps it runs and how deep Triton pipelines its loop trade parallelism against
    # per-program overhead; Triton picks per shape. Long programs without pipelining (64 x 16 rows
    # in 1 stage) suit full grids; with few programs (batch 1, or k=64) a tile's instructions, not
    # its loads, set the time, so there 8 warps per program, each with half the instructions of 4,
    # are faster. Tiles of 16 rows with 2 warps compiled to wrong bf16 outputs, so none is listed;
    # tests/test_decode.py runs every configuration here on the GPU. The list was tuned on the H200:
    # each entry was the fastest, or within 0.5 us of it, at one of the shapes
    # `benchmarks/decode_configs.py` times (docs/design-decisions.md, 'At batch 1 the fused decode
    # kernel is bound by its instructions'); 64 x 4 rows (not yet timed) gives a dense layer of a mid-length
    # cache more programs than 64 x 16 within `MOST_SPLITS` (`few_splits`).
    @triton.autotune(
        configs=[
            triton.Config({"BLOCK_N": block, "TILES": tiles}, num_warps=warps, num_stages=stages)
            for block, tiles, warps, stages in (
                (32, 1, 8, 3),
                (64, 1, 8, 3),
                (32, 2, 4, 3),
                (64, 1, 4, 3),
                (64, 4, 4, 3),
                (64, 16, 4, 3),
                (64, 16, 4, 1),
            )
        ],
        key=["size_class", "rows", "D", "G", "PACKED", "ROTATED"],
        prune_configs_by={
            "early_config_prune": lambda configs, named_args, **_: few_splits(configs, named_args["size_class"])
        },
    )
    @triton.jit
    def _sparse_decode_kernel(
        q_ptr, signs_ptr, index_ptr, valid_ptr,  # the queries, the rotation's signs, the selection
        k_ids, k_res, k_scales, k_protos, k_tail, v_ids, v_res, v_scales, v_protos, v_tail,  # the store
        acc_ptr, raw_ptr, max_ptr, sum_ptr,  # the split partials out
        lengths_ptr, capacity, tail_slots, n_blocks, selected, size_class, rows, scaling,
        KV_HEADS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr,
        LOG_D: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_CENTER: tl.constexpr,
        V_CENTER: tl.constexpr, C: tl.constexpr, TOKENS_PER_BLOCK: tl.constexpr, PACKED: tl.constexpr,
        ROTATED: tl.constexpr, HAS_VALID: tl.constexpr, PRECISION: tl.constexpr,
        SHARED_SELECTION: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
    ):  # fmt: skip
        bh = tl.program_id(0)
        split = tl.program_id(1)
        splits = tl.num_programs(1)
        packed_len = 0  # tokens packed, read when the kernel runs (a captured launch serves every step)
        if PACKED:
            packed_len = tl.load(lengths_ptr + 1)
        selection_row = bh // KV_HEADS if SHARED_SELECTION else bh  # one selection per layer or per KV head
        heads = tl.arange(0, GP)
        dims = tl.arange(0, D)
        q_t, q_raw_t = _group_query(q_ptr, signs_ptr, bh, G, GP, GQ, D, LOG_D, ROTATED)
        m_i = tl.full([GP], -1.0e30, tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)  # the packed rows' sum: with ROTATED, in the rotated basis until the end
        acc_raw = tl.zeros([GP, D], tl.float32)  # the raw rows' sum, in the rows' own basis
        lo = split * BLOCK_N * TILES
        hi = tl.minimum(lo + BLOCK_N * TILES, selected)
        # Each tile's reads depend on its positions, and its prototype rows on its ids: positions are read two
        # tiles ahead and ids one, so a tile waits for one round trip to memory, not three.
        row_start = selection_row * selected
        offs = lo + tl.arange(0, BLOCK_N)
        pos, live = _tile_positions(index_ptr, valid_ptr, row_start, offs, hi, HAS_VALID)
        next_pos, next_live = _tile_positions(index_ptr, valid_ptr, row_start, offs + BLOCK_N, hi, HAS_VALID)
        k_cluster, v_cluster = pos, pos
        if PACKED:
            k_cluster = _cluster_ids(k_ids, bh, pos, live, packed_len, capacity)
            v_cluster = _cluster_ids(v_ids, bh, pos, live, packed_len, capacity)
        for start in range(0, BLOCK_N * TILES, BLOCK_N):
            in_packed = live & (pos < packed_len)
            if PACKED:  # every load of the tile is issued before any of it is used
                k_proto, k_word, k_scale = _packed_parts(
                    k_cluster, k_res, k_scales, k_protos, bh, pos, in_packed, capacity, n_blocks, dims, D,
                    K_BITS, C, TOKENS_PER_BLOCK,
                )  # fmt: skip
                v_proto, v_word, v_scale = _packed_parts(
                    v_cluster, v_res, v_scales, v_protos, bh, pos, in_packed, capacity, n_blocks, dims, D,
                    V_BITS, C, TOKENS_PER_BLOCK,
                )  # fmt: skip
                next_k_cluster = _cluster_ids(k_ids, bh, next_pos, next_live, packed_len, capacity)
                next_v_cluster = _cluster_ids(v_ids, bh, next_pos, next_live, packed_len, capacity)
            else:
                k_proto, k_word, k_scale = pos, pos, pos
                v_proto, v_word, v_scale = pos, pos, pos
                next_k_cluster, next_v_cluster = pos, pos
            after_pos, after_live = _tile_positions(
                index_ptr, valid_ptr, row_start, offs + start + 2 * BLOCK_N, hi, HAS_VALID
            )
            in_tail = live & (pos >= packed_len)
            has_tail = tl.max(in_tail.to(tl.int32), 0) > 0  # only the tiles holding newest rows read the tail
            keys = _packed_rows(k_proto, k_word, k_scale, in_packed, D, K_BITS, K_CENTER, PACKED, q_t.dtype)
            logits = tl.dot(keys, q_t, input_precision=PRECISION)  # [BLOCK_N, GP]; (k R) . (q R) = k . q
            if has_tail:  # raw rows against the unrotated query; zero rows on either side add nothing
                raw_keys = _tail_rows(k_tail, bh, pos, in_tail, packed_len, tail_slots, dims, D, q_t.dtype)
                logits += tl.dot(raw_keys, q_raw_t, input_precision=PRECISION)
            logits = logits * scaling
            logits = tl.where(live[:, None], logits, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(logits, 0))
            alpha = tl.exp(m_i - m_new)
            p = tl.trans(tl.exp(logits - m_new[None, :]))
            values = _packed_rows(v_proto, v_word, v_scale, in_packed, D, V_BITS, V_CENTER, PACKED, q_t.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(q_t.dtype), values, input_precision=PRECISION)
            acc_raw = acc_raw * alpha[:, None]
            if has_tail:
                raw_values = _tail_rows(v_tail, bh, pos, in_tail, packed_len, tail_slots, dims, D, q_t.dtype)
                acc_raw += tl.dot(p.to(q_t.dtype), raw_values, input_precision=PRECISION)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
            pos, live, next_pos, next_live = next_pos, next_live, after_pos, after_live
            k_cluster, v_cluster = next_k_cluster, next_v_cluster
        part = (bh * splits + split) * G + heads  # the group's real heads only, not the dot's padding
        _store_partials(acc_ptr, raw_ptr, max_ptr, sum_ptr, part, heads < G, dims, acc, acc_raw, m_i, l_i, D, ROTATED)

    @triton.jit
    def _merge_splits_kernel(
        acc_ptr,
        raw_ptr,
        max_ptr,
        sum_ptr,
        signs_ptr,
        out_ptr,
        splits,
        G: tl.constexpr,
        D: tl.constexpr,
        LOG_D: tl.constexpr,
        ROTATED: tl.constexpr,
        SPLIT_BLOCK: tl.constexpr,
    ):
        """One query head: the softmax-weighted sum of its splits' partial results, SPLIT_BLOCK splits
        per load (one round trip to memory for up to SPLIT_BLOCK splits, not one per split). With ROTATED
        the packed rows' partial sums are in the rotated basis: their sum is rotated back here, once per
        head (acc R^T = signs * (acc H) / sqrt(D), in fp32), and the raw rows' sums added after."""
        row = tl.program_id(0)  # (batch, KV head, head of the group)
        bh = row // G
        head = row % G
        dims = tl.arange(0, D)
        m_all = tl.full([1], -1.0e30, tl.float32)
        total = tl.zeros([1], tl.float32)
        out = tl.zeros([1, D], tl.float32)
        out_raw = tl.zeros([1, D], tl.float32)
        for first in range(0, splits, SPLIT_BLOCK):
            split = first + tl.arange(0, SPLIT_BLOCK)
            live = split < splits
            part = (bh * splits + split) * G + head
            maxes = tl.load(max_ptr + part, mask=live, other=-1.0e30)
            m_new = tl.maximum(m_all, tl.max(maxes, 0))
            weight = tl.where(live, tl.exp(maxes - m_new), 0.0)
            rescale = tl.exp(m_all - m_new)
            total = total * rescale + tl.sum(tl.load(sum_ptr + part, mask=live, other=0.0) * weight, 0)
            at = (part * D)[:, None] + dims[None, :]
            partial = tl.load(acc_ptr + at, mask=live[:, None], other=0.0)
            out = out * rescale[:, None] + tl.sum(partial * weight[:, None], 0, keep_dims=True)
            if ROTATED:
                partial_raw = tl.load(raw_ptr + at, mask=live[:, None], other=0.0)
                out_raw = out_raw * rescale[:, None] + tl.sum(partial_raw * weight[:, None], 0, keep_dims=True)
            m_all = m_new
        if ROTATED:
            out = tl.load(signs_ptr + dims).to(tl.float32)[None, :] * _walsh_hadamard(out, 1, D, LOG_D) + out_raw
        out = out / tl.maximum(total, 1e-30)[:, None]
        tl.store(out_ptr + row * D + dims[None, :], out.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _gate_scores_kernel(
        q_ptr,
        k_ptr,
        scale_ptr,
        valid_ptr,
        out_ptr,
        lengths_ptr,
        capacity,
        selectors,
        scale,
        sink_end,
        recent,
        DG: tl.constexpr,
        BLOCK_S: tl.constexpr,
        SCALED: tl.constexpr,
        HAS_VALID: tl.constexpr,
    ):
        row = tl.program_id(0)  # one (batch, selector)
        tile = tl.program_id(1)
        length = tl.load(lengths_ptr)  # the keys held, read when the kernel runs
        dims = tl.arange(0, DG)
        keys_at = tile * BLOCK_S + tl.arange(0, BLOCK_S)
        in_buffer = keys_at < capacity
        live = keys_at < length
        q = tl.load(q_ptr + row * DG + dims).to(tl.float32)
        keys = tl.load(
            k_ptr + ((row * capacity + keys_at) * DG)[:, None] + dims[None, :], mask=live[:, None], other=0
        ).to(tl.float32)
        logits = tl.sum(keys * q[None, :], 1) * scale
        if SCALED:  # int8 codes: one fp16 scale per key
            logits = logits * tl.load(scale_ptr + row * capacity + keys_at, mask=live, other=0.0).to(tl.float32)
        # the rule's forced keys: the sinks, the recent tokens and the newest position itself
        forced_start = tl.maximum(length - tl.maximum(recent, 1), 0)
        forced = (keys_at < sink_end) | (keys_at >= forced_start)
        logits = tl.where(forced, float("inf"), logits)
        if HAS_VALID:  # padding: keys the row may not see
            live = live & (tl.load(valid_ptr + (row // selectors) * capacity + keys_at, mask=live, other=0) != 0)
        tl.store(out_ptr + row * capacity + keys_at, tl.where(live, logits, float("-inf")), mask=in_buffer)


SCORE_PROGRAMS = 512  # the score kernel takes as few keys per program (64..1024) as keep about this many busy


def _score_block(rows: int, length: int) -> int:
    """Gate keys per program of the score kernel for `rows` rows of `length` keys: 1,024 (tuned at
    batch 16 on the H200) while that still gives SCORE_PROGRAMS programs, fewer (down to 64) for
    fewer rows, so that short grids at batch 1 still fill the SMs (docs/design-decisions.md, 'Decode
    attention is timed per layer in graphs of many layers')."""
    return max(64, min(1024, triton.next_power_of_2(rows * length // SCORE_PROGRAMS + 1) // 2))


SMALLEST_CHUNK = 32  # the fewest rows a program of the autotuned decode kernel takes (32 x 1)
# the most splits per (row, KV head) the autotuner may pick for the decode kernel: each split's partial result is
# written, then read by `_merge_splits_kernel`, whose one program per query head loops over them, so past this
# the merge costs more than the parallelism gains (docs/design-decisions.md, 'The decode kernel caps its splits')
MOST_SPLITS = 128


def _rows_per_program(config: triton.Config) -> int:
    return config.kwargs["BLOCK_N"] * config.kwargs["TILES"]


def few_splits(configs: list[triton.Config], size_class: int) -> list[triton.Config]:
    """The decode kernel's configurations that split a selection of `size_class` keys (its size rounded up to
    a power of two, the autotuner's key) into at most `MOST_SPLITS` programs per (row, KV head); where none
    does (a layer reading every key of a long cache), those taking the most rows per program. Never empty."""
    fitting = [config for config in configs if math.ceil(size_class / _rows_per_program(config)) <= MOST_SPLITS]
    most = max(_rows_per_program(config) for config in configs)
    return fitting or [config for config in configs if _rows_per_program(config) == most]


def _store_args(rows: PackedRows, like: Tensor) -> tuple[Tensor, ...]:
    """(ids, residual, scales, prototypes, tail) pointers; placeholders where nothing is packed."""
    if not rows.packed:
        return like, like, like, like, rows.tail
    return rows.ids, rows.residual, rows.scales, rows.prototypes, rows.tail


def kernel_constants(
    query: Tensor, k_store: PackedRows, v_store: PackedRows, shared_selection: bool, has_valid: bool
) -> dict[str, object]:
    """The fused decode kernel's compile-time arguments for a query [B, Hq, 1, D] over these stores, with
    one selection for all KV heads or not and with a valid mask or not: what a launch specializes on
    (`benchmarks/decode_sass.py` compiles the same)."""
    _, q_heads, _, dim = query.shape
    kv_heads = k_store.tail.shape[1]
    groups = q_heads // kv_heads
    packed = k_store.packed
    k_bits, v_bits = (k_store.bits, v_store.bits) if packed else (8, 8)  # no codes read unpacked
    return dict(
        KV_HEADS=kv_heads,
        G=groups,
        GP=max(16, triton.next_power_of_2(groups)),
        GQ=triton.next_power_of_2(groups),
        D=dim,
        LOG_D=dim.bit_length() - 1,
        K_BITS=k_bits,
        V_BITS=v_bits,
        K_CENTER=code_center(k_bits),
        V_CENTER=code_center(v_bits),
        C=k_store.cluster_num if packed else 1,
        TOKENS_PER_BLOCK=k_store.block_size if packed else 1,
        PACKED=packed,
        # prototypes and residual codes in the rotated basis, K's and V's alike
        ROTATED=packed and k_store.rotation_signs is not None,
        HAS_VALID=has_valid,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",  # fp32: exact
        SHARED_SELECTION=shared_selection,
    )


def fused_decode_attention(
    query: Tensor,
    k_store: PackedRows,
    v_store: PackedRows,
    index: Tensor,
    valid: Tensor | None,
    scaling: float,
    config: triton.Config | None = None,
) -> Tensor:
    """Attention of query [B, Hq, 1, D] over the rows `index` [B, n, k] of the stores (n = 1: one selection
    for all KV heads; n = Hkv: one per KV head; `valid` alike or None; every position below the stores'
    `lengths[0]`) -> [B, 1, Hq, D]. The lengths are read on the device: no host value of the step's enters
    the launch, so it can be captured once and replayed every step. `config`: one of the kernel's
    autotuned configurations (`decode_configs()`) to run instead of the autotuner's pick."""
    k_rotates, v_rotates = (store.rotation_signs is not None for store in (k_store, v_store))
    if k_rotates != v_rotates:
        raise ValueError(
            f"k_store and v_store must both rotate residuals or neither (got {k_rotates} and "
            f"{v_rotates}); build both compressors with the same rotate_residuals"
        )
    batch, q_heads, _, dim = query.shape
    constants = kernel_constants(query, k_store, v_store, index.shape[1] == 1, valid is not None)
    kv_heads, groups, packed = constants["KV_HEADS"], constants["G"], constants["PACKED"]
    selected = index.shape[2]
    most_splits = math.ceil(selected / SMALLEST_CHUNK)
    q = query.reshape(batch, q_heads, dim).contiguous()
    index = index.contiguous()
    valid_arg = valid.to(torch.int8).contiguous() if valid is not None else index
    acc, raw, maxes, sums = split_partials(batch * kv_heads * most_splits * groups, dim, constants, query.device)
    capacity = k_store.ids.shape[2] if packed else k_store.tail.shape[2]
    n_blocks = k_store.prototypes.shape[2] if packed else 0
    # V's rotation signs are K's: both are hadamard_signs(D), D the one head size both stores are read at
    signs = k_store.rotation_signs if constants["ROTATED"] else q

    def grid(meta: dict) -> tuple[int, int]:
        return batch * kv_heads, math.ceil(selected / (meta["BLOCK_N"] * meta["TILES"]))

    kernel, fixed = _kernel_for(config)
    kernel[grid](
        q, signs, index, valid_arg, *_store_args(k_store, index), *_store_args(v_store, index),
        acc, raw, maxes, sums, k_store.lengths, capacity, k_store.tail.shape[2], n_blocks, selected,
        triton.next_power_of_2(selected), batch * kv_heads, scaling, **constants, **fixed,
    )  # fmt: skip
    splits = grid(fixed or _sparse_decode_kernel.best_config.kwargs)[1]
    return merged_splits((acc, raw, maxes, sums), signs, query, splits, constants)


def split_partials(parts: int, dim: int, constants: dict, device: torch.device) -> tuple[Tensor, ...]:
    """Buffers for `parts` (row, KV head, split, head of the group) partial results of a split decode kernel:
    the value sums [parts * dim], the raw rows' sums apart where ROTATED (else the same buffer), the softmax
    maxima and sums [parts] (fp32)."""
    acc = torch.empty(parts * dim, device=device, dtype=torch.float32)
    maxes = torch.empty(parts, device=device, dtype=torch.float32)
    raw = torch.empty_like(acc) if constants["ROTATED"] else acc  # the raw rows' partial sums, when kept apart
    return acc, raw, maxes, torch.empty_like(maxes)


def merged_splits(partials: tuple[Tensor, ...], signs: Tensor, query: Tensor, splits: int, constants: dict) -> Tensor:
    """The `splits` partial results (`split_partials`, written by a split decode kernel) merged per query head
    (`_merge_splits_kernel`) -> [B, 1, Hq, D] in the query's dtype."""
    batch, q_heads, _, dim = query.shape
    out = torch.empty(batch, q_heads, dim, device=query.device, dtype=query.dtype)
    _merge_splits_kernel[(batch * q_heads,)](
        *partials, signs, out, splits, G=constants["G"], D=dim, LOG_D=constants["LOG_D"],
        ROTATED=constants["ROTATED"], SPLIT_BLOCK=min(64, triton.next_power_of_2(splits)),
    )  # fmt: skip
    return out.reshape(batch, 1, q_heads, dim)


def _kernel_for(config: triton.Config | None) -> tuple[Any, dict[str, Any]]:
    """The decode kernel to launch and the meta-parameters to fix: the autotuner's pick (config None on
    a GPU), or `config` (and under Triton's interpreter, which has no device to time on, a default)."""
    if config is None and os.environ.get("TRITON_INTERPRET") == "1":
        config = triton.Config({"BLOCK_N": 32, "TILES": 2})
    if config is None:
        return _sparse_decode_kernel, {}
    rows = config.kwargs.get("BLOCK_N", 0) * config.kwargs.get("TILES", 0)
    if rows < SMALLEST_CHUNK:  # the partial results are sized for programs of at least this many rows
        raise ValueError(
            f"fused_decode_attention: config must take at least {SMALLEST_CHUNK} rows per program "
            f"(BLOCK_N x TILES), got {config}; pick one of decode_configs()"
        )
    return _sparse_decode_kernel.fn, {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def decode_configs() -> list[triton.Config]:
    """The fused decode kernel's autotuned configurations (rows per tile and tiles per program, warps,
    pipeline stages)."""
    return list(_sparse_decode_kernel.configs)


def autotuned_config() -> triton.Config:
    """The configuration the autotuner picked for the fused decode kernel's latest autotuned launch (one
    given `config=` does not change it)."""
    return _sparse_decode_kernel.best_config


def autotuned_configs() -> dict[tuple, triton.Config]:
    """The configuration the autotuner picked for each key it has tuned in this process (the key: the
    selection's size class, rows, D, G, PACKED, ROTATED, then the arguments' dtypes)."""
    return dict(_sparse_decode_kernel.cache)


def gate_scores(
    gate_q: Tensor,
    gate_keys: Tensor,
    key_scales: Tensor | None,
    lengths: Tensor,
    sink_tokens: int,
    recent_tokens: int,
    key_valid: Tensor | None = None,
) -> Tensor:
    """fp32 gate logits [B, n, C] of one query per row, gate_q [B, n, 1, dg], over the cached gate keys
    [B, n, C, dg] of a cache of capacity C (bf16, or int8 codes with fp16 `key_scales` [B, n, C, 1]): the
    same products as `SparseGateHead.score_stored`, reading the keys once as stored. `lengths[0]` (int32,
    on the device) keys are held; the rest get -inf, as do keys `key_valid` [B, C] marks False (padding).
    The keys a selection always keeps (`decode_attention.forced_spans`: sinks, the recent tokens and the
    newest position) get +inf, so no kernel of their own writes them. One gate query head only (a query as
    wide as the keys); several take the PyTorch path (`decode_attention.fused_scores`)."""
    batch, selectors, capacity, dim = gate_keys.shape
    if gate_q.shape[-1] != dim:
        raise ValueError(f"gate_scores takes one gate query head (queries of {dim} values), got {gate_q.shape[-1]}")
    out = torch.empty(batch, selectors, capacity, device=gate_keys.device, dtype=torch.float32)
    scales = key_scales.contiguous() if key_scales is not None else out
    valid = key_valid.to(torch.int8).contiguous() if key_valid is not None else out
    block = _score_block(batch * selectors, capacity)
    _gate_scores_kernel[(batch * selectors, triton.cdiv(capacity, block))](
        gate_q.float().contiguous(),
        gate_keys.contiguous(),
        scales,
        valid,
        out,
        lengths,
        capacity,
        selectors,
        dim**-0.5,
        sink_tokens,
        recent_tokens,
        DG=dim,
        BLOCK_S=block,
        SCALED=key_scales is not None,
        HAS_VALID=key_valid is not None,
    )
    return out
