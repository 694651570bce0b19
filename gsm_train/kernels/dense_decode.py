"""Fused decode attention of a layer that reads every key it holds (a dense layer) over ASQ-packed stores
(Triton): positions [0, length) stream through one compressor block a tile, so a tile's prototypes are its
block's C rows, read once, where the selection kernel (`sparse_decode`), whose tiles hold positions of any
block, gathers one prototype row per position (four times the bytes of a row's 4-bit codes).

A packed row is its block's prototype P[c] plus its scale s times its residual levels r (integers, exact in
the query's dtype), so over a tile

    k_i . q = s_i (r_i . q) + (P q)[c_i]
    sum_i p_i v_i = (p * s) r + sum_c (sum_{i: c_i = c} p_i) P[c]

two dots over the levels and, per prototype, a product and a masked sum; no row is rebuilt. The newest block's raw
rows (the tail) are read as `sparse_decode` reads them, and with rotated residuals the rotated query meets
the packed rows and the plain one the raw rows, as there. Each split's partial results are `sparse_decode`'s
and its merge kernel sums them. The lengths are read on the device: a launch captured in a CUDA graph
serves every step.

Exactness: the levels and their products are exact; the prototype terms are fp32 (one row of P at a time:
no padding to a dot's 16 rows); the value sums round `p * s` to the query's dtype (fp32 queries: IEEE fp32
throughout)."""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from gsm_train.kernels.packed_rows import PackedRows
from gsm_train.kernels.sparse_decode import MOST_SPLITS, kernel_constants, merged_splits, split_partials, triton

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read once, at import, as the other kernels do

if triton is not None:
    import triton.language as tl

    from gsm_train.kernels.sparse_decode import _group_query, _store_partials, _tail_rows, _unpacked_levels

    @triton.jit
    def _block_rows(ids_ptr, res_ptr, scale_ptr, flat, live, D: tl.constexpr, BITS: tl.constexpr):
        """A packed block's rows at `flat` (batch-head offset plus position) as stored: residual codes as words
        [N, D * BITS / 32] (int32; `_unpacked_levels` makes them levels where used, so the block's levels are
        never all held at once), scales [N] (fp32, 0 where not `live`) and prototype ids [N] (int32)."""
        NWORDS: tl.constexpr = D * BITS // 32
        word = tl.load(
            res_ptr.to(tl.pointer_type(tl.int32)) + flat[:, None] * NWORDS + tl.arange(0, NWORDS)[None, :],
            mask=live[:, None],
            other=0,
        )
        scale = tl.load(scale_ptr + flat, mask=live, other=0.0).to(tl.float32)
        ids = tl.load(ids_ptr + flat, mask=live, other=0).to(tl.int32)
        return word, scale, ids

    @triton.jit
    def _online_softmax(logits, live, scaling, m_i, l_i):
        """One tile's softmax weights p [GP, N] (0 where not `live`) from its logits [GP, N] against the
        running max and sum, the factor `alpha` [GP] earlier sums are rescaled by, and the new max and sum."""
        logits = tl.where(live[None, :], logits * scaling, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(logits - m_new[:, None])
        return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)

    # Blocks per program, warps and pipeline stages. One tile is one compressor block, so a program's share of
    # a long cache is a run of BLOCKS blocks; `_few_block_splits` keeps the splits within `MOST_SPLITS`. At the
    # 8B shape (sm_90) 4 warps take 168 registers a thread (three programs an SM), 8 warps 127 (two); with 2
    # stages the next block's loads are issued during this one's math, at 212-234 registers (a test compiles
    # every configuration for sm_90 and asserts no stack).
    @triton.autotune(
        configs=[
            triton.Config({"BLOCKS": blocks}, num_warps=warps, num_stages=stages)
            for blocks, warps, stages in (
                (2, 4, 1),
                (4, 4, 1),
                (8, 4, 1),
                (16, 4, 1),
                (8, 8, 1),
                (16, 8, 1),
                (16, 4, 2),
                (16, 8, 2),
            )
        ],
        key=["block_class", "D", "G", "ROTATED", "HAS_VALID"],
        prune_configs_by={
            "early_config_prune": lambda configs, named_args, **_: _few_block_splits(configs, named_args["block_class"])
        },
    )
    @triton.jit
    def _dense_decode_kernel(
        q_ptr, signs_ptr, valid_ptr,  # the queries, the rotation's signs, the keys' valid mask (padding)
        k_ids, k_res, k_scales, k_protos, k_tail, v_ids, v_res, v_scales, v_protos, v_tail,  # the store
        acc_ptr, raw_ptr, max_ptr, sum_ptr,  # the split partials out
        lengths_ptr, capacity, tail_slots, n_blocks, block_class, scaling,
        KV_HEADS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr,
        LOG_D: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_CENTER: tl.constexpr,
        V_CENTER: tl.constexpr, C: tl.constexpr, TOKENS_PER_BLOCK: tl.constexpr,
        ROTATED: tl.constexpr, HAS_VALID: tl.constexpr, PRECISION: tl.constexpr, BLOCKS: tl.constexpr,
    ):  # fmt: skip
        bh = tl.program_id(0)
        split = tl.program_id(1)
        length = tl.load(lengths_ptr)  # tokens held and packed, read when the kernel runs
        packed_len = tl.load(lengths_ptr + 1)
        heads = tl.arange(0, GP)
        dims = tl.arange(0, D)
        rows = tl.arange(0, TOKENS_PER_BLOCK)
        q_t, q_raw_t = _group_query(q_ptr, signs_ptr, bh, G, GP, GQ, D, LOG_D, ROTATED)
        q_rows = tl.trans(q_t)  # [GP, D]: the logits of a tile are [GP, N], the heads' rows a dot's M
        q_f32 = q_rows.to(tl.float32)
        m_i = tl.full([GP], -1.0e30, tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)  # the packed rows' sum: with ROTATED, in the rotated basis
        first = split * BLOCKS
        packed_blocks = packed_len // TOKENS_PER_BLOCK  # blocks are packed whole
        # the split's packed blocks: no branch in the loop, so the next block's loads can be issued early
        for block in tl.range(first, tl.minimum(first + BLOCKS, packed_blocks)):
            pos = block * TOKENS_PER_BLOCK + rows
            live = pos < length
            if HAS_VALID:
                live = live & (tl.load(valid_ptr + (bh // KV_HEADS) * capacity + pos, mask=live, other=0) != 0)
            flat = bh * capacity + pos
            k_word, k_scale, k_cluster = _block_rows(k_ids, k_res, k_scales, flat, live, D, K_BITS)
            v_word, v_scale, v_cluster = _block_rows(v_ids, v_res, v_scales, flat, live, D, V_BITS)
            first_row = (bh * n_blocks + block) * C
            k_levels = _unpacked_levels(k_word, K_BITS, K_CENTER, True).to(q_t.dtype)
            logits = k_scale[None, :] * tl.dot(q_rows, tl.trans(k_levels), input_precision=PRECISION)  # [GP, N]
            for c in tl.static_range(C):  # each row's prototype logit (P q)[c], in fp32
                proto = tl.load(k_protos + (first_row + c) * D + dims).to(tl.float32)
                proto_logit = tl.sum(q_f32 * proto[None, :], 1)  # [GP]
                logits += tl.where((k_cluster == c)[None, :], proto_logit[:, None], 0.0)
            p, alpha, m_i, l_i = _online_softmax(logits, live, scaling, m_i, l_i)
            v_levels = _unpacked_levels(v_word, V_BITS, V_CENTER, True).to(q_t.dtype)
            acc = acc * alpha[:, None] + tl.dot(
                (p * v_scale[None, :]).to(q_t.dtype), v_levels, input_precision=PRECISION
            )
            for c in tl.static_range(C):  # each prototype times the softmax mass of its rows, in fp32
                proto = tl.load(v_protos + (first_row + c) * D + dims).to(tl.float32)
                mass = tl.sum(tl.where((v_cluster == c)[None, :], p, 0.0), 1)  # [GP]
                acc += mass[:, None] * proto[None, :]
        acc_raw = tl.zeros([GP, D], tl.float32)  # the raw rows' sum, in the rows' own basis
        if (first <= packed_blocks) & (packed_blocks < first + BLOCKS) & (packed_len < length):
            pos = packed_blocks * TOKENS_PER_BLOCK + rows  # the newest block, raw: in this split's share
            in_tail = pos < length
            if HAS_VALID:
                in_tail = in_tail & (tl.load(valid_ptr + (bh // KV_HEADS) * capacity + pos, mask=in_tail, other=0) != 0)
            raw_keys = _tail_rows(k_tail, bh, pos, in_tail, packed_len, tail_slots, dims, D, q_t.dtype)
            logits = tl.dot(tl.trans(q_raw_t), tl.trans(raw_keys), input_precision=PRECISION)  # [GP, N]
            p, alpha, m_i, l_i = _online_softmax(logits, in_tail, scaling, m_i, l_i)
            raw_values = _tail_rows(v_tail, bh, pos, in_tail, packed_len, tail_slots, dims, D, q_t.dtype)
            acc = acc * alpha[:, None]
            acc_raw = tl.dot(p.to(q_t.dtype), raw_values, input_precision=PRECISION)
        splits = tl.num_programs(1)
        part = (bh * splits + split) * G + heads  # the group's real heads only, not the dot's padding
        _store_partials(acc_ptr, raw_ptr, max_ptr, sum_ptr, part, heads < G, dims, acc, acc_raw, m_i, l_i, D, ROTATED)


def _few_block_splits(configs: list, block_class: int) -> list:
    """The configurations that split `block_class` blocks (a power of two) into at most `MOST_SPLITS`
    programs per (row, KV head), or, where none does, those taking the most blocks per program. Never empty."""
    fitting = [config for config in configs if math.ceil(block_class / config.kwargs["BLOCKS"]) <= MOST_SPLITS]
    most = max(config.kwargs["BLOCKS"] for config in configs)
    return fitting or [config for config in configs if config.kwargs["BLOCKS"] == most]


def dense_decode_applies(k_store: PackedRows, v_store: PackedRows) -> bool:
    """Whether `dense_decode_attention` reads these stores: both ASQ-packed in blocks of at least 16 tokens (a
    tile is a block, and Triton's dot wants 16 rows) of a power-of-two size."""
    block = k_store.block_size
    return (
        k_store.packed and v_store.packed and block == v_store.block_size and block >= 16 and block & (block - 1) == 0
    )


def dense_decode_attention(
    query: Tensor, k_store: PackedRows, v_store: PackedRows, key_valid: Tensor | None, scaling: float
) -> Tensor:
    """Attention of query [B, Hq, 1, D] over every position the stores hold (`lengths[0]`, read on the
    device) -> [B, 1, Hq, D]; `key_valid` [B, capacity] bool marks padding (None: every key valid). The stores
    must suit it (`dense_decode_applies`)."""
    if not dense_decode_applies(k_store, v_store):
        raise ValueError("dense_decode_attention reads ASQ-packed K and V stores in blocks of 16 or more tokens")
    batch, q_heads, _, dim = query.shape
    constants = kernel_constants(query, k_store, v_store, shared_selection=True, has_valid=key_valid is not None)
    for name in ("PACKED", "SHARED_SELECTION"):
        constants.pop(name)
    kv_heads, groups = constants["KV_HEADS"], constants["G"]
    capacity = k_store.ids.shape[2]
    n_blocks = k_store.prototypes.shape[2]
    fixed = {"BLOCKS": 2} if INTERPRETED else {}  # no device to tune on
    kernel = _dense_decode_kernel.fn if fixed else _dense_decode_kernel
    choices = [fixed["BLOCKS"]] if fixed else [c.kwargs["BLOCKS"] for c in _few_block_splits(
        _dense_decode_kernel.configs, triton.next_power_of_2(n_blocks))]  # fmt: skip
    most_splits = max(math.ceil(n_blocks / blocks) for blocks in choices)  # what any pick writes
    q = query.reshape(batch, q_heads, dim).contiguous()
    acc, raw, maxes, sums = split_partials(batch * kv_heads * most_splits * groups, dim, constants, query.device)
    signs = k_store.rotation_signs if constants["ROTATED"] else q
    valid = key_valid.to(torch.int8).contiguous() if key_valid is not None else q

    def grid(meta: dict) -> tuple[int, int]:
        return batch * kv_heads, math.ceil(n_blocks / meta["BLOCKS"])

    kernel[grid](
        q, signs, valid, k_store.ids, k_store.residual, k_store.scales, k_store.prototypes, k_store.tail,
        v_store.ids, v_store.residual, v_store.scales, v_store.prototypes, v_store.tail,
        acc, raw, maxes, sums, k_store.lengths, capacity, k_store.tail.shape[2], n_blocks,
        triton.next_power_of_2(n_blocks), scaling, **constants, **fixed,
    )  # fmt: skip
    splits = grid(fixed or _dense_decode_kernel.best_config.kwargs)[1]
    return merged_splits((acc, raw, maxes, sums), signs, query, splits, constants)
