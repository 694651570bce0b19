"""The new token's gate work at decode in two Triton kernels per layer: the gate's query and key projections
of the token's normed hidden state, their RoPE by each selector's chosen frequencies, the key encoded as
the cache stores it and written at the token's slot, the query returned for `sparse_decode.gate_scores`.

In PyTorch that work (`SparseGateHead.forward` on one token, then `GSMCacheLayer.keep_gate_keys`) is about
25 small kernels per layer: casts and copies of the hidden state, two fp32 GEMVs, the gathers of the RoPE
tables and the rotation's multiplies, negation and concatenation, the int8 encoding's abs, amax, divide,
round and clamp, and the `index_copy_` into the buffers (docs/design-decisions.md, 'The decode step's gate
work is one kernel per layer', has the measurements).

The projections are split over the hidden dimension d (split-K): the partial kernel runs one program per
(batch row, selector) and chunk of `SPLIT` columns of d, streams that chunk of the selector's rows of both
projections (fp32, 2 x dg rows) against the hidden state, sums it in fp32 and stores the four partial sums
(q and k, each pair's first and second halves) in an fp32 scratch [B * n, splits, 4, dg / 2]. The finish
kernel, one program per (batch row, selector), sums the splits (one load, one reduction whose order
depends only on the shapes: no atomics, the same bits on every call), rotates the pairs (i, i + dg/2) by
the model's cos/sin at `rope_freq_index` (cast to fp32, as `rope_tables` casts them to the projections'
dtype; cos 1 and sin 0 for a pair marked unrotated), encodes the key and stores. The split count comes
from d alone and the slot from the cache's device lengths (`lengths[0] - 1`), so no host value of the
step's enters either launch and one captured pair of launches serves every step.

What is exact and what is not: the hidden state and the RoPE tables are taken in fp32 exactly as the
PyTorch path takes them, and the encoding is `encode_gate_keys`' to the bit for the same fp32 key (the
scale max|k| / 127 divided with IEEE rounding, at least fp16's smallest normal, rounded to fp16 ties to
even; codes rounded half to even and clamped to +-127; bf16 at 16 bits rounded to nearest even).
The projections' sums run in another order than cuBLAS's GEMV (within each chunk, then over the chunks),
and the rotation's products may be fused into FMAs, so q and k agree with the PyTorch gate's to about
1e-6 relative (the tests hold them to 1e-5), not bit for bit; an int8 code then differs from the PyTorch
path's only where that moves k / scale across a rounding boundary, by one (and a scale by one fp16 step
where max|k| / 127 sits on a boundary of fp16's grid). Teacher forcing's own keys (a batched matmul)
already differ from the PyTorch decode's GEMV the same way.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from gsm_train.kernels import kernel_fits
from gsm_train.quant import FP16_TINY, INT8_LEVELS

try:
    import triton
    import triton.language as tl
except ImportError:  # decode_attention's PyTorch gate serves
    triton = None

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TILE = 2048  # weight elements per program and step of each of the four row blocks (q and k, each half of the pairs)
SPLIT = 128  # columns of d per projections' program (a power of two): 32 per (row, selector) at d 4096, 5 at 576
ROUNDER = 12582912.0  # 1.5 * 2**23: (y + ROUNDER) - ROUNDER is y rounded half to even in fp32, for |y| < 2**22


def kernel_runs(hidden: Tensor, q_weight: Tensor, k_weight: Tensor, gate_head_dim: int) -> bool:
    """Whether `gate_token` serves a gate with these projection weights ([n * dg, d] each) for hidden
    [B, 1, d]: Triton with a CUDA tensor (or Triton's interpreter), fp32 weights of one shape (one query
    row per key row: a gate with one query head per selector), a gate head the kernels fit
    (`kernel_fits`), and no autocast (under it the PyTorch gate projects in autocast's dtype)."""
    here = hidden.is_cuda or INTERPRETED
    fp32 = q_weight.dtype == k_weight.dtype == torch.float32
    autocast = torch.is_autocast_enabled(hidden.device.type)
    one_token = hidden.dim() == 3 and hidden.shape[1] == 1
    return (
        triton is not None
        and here
        and fp32
        and not autocast
        and one_token
        and q_weight.shape == k_weight.shape
        and kernel_fits(gate_head_dim)
    )


if triton is not None:
    from gsm_train.kernels.rounding import bf16_grid

    @triton.jit
    def _gate_token_partial_kernel(
        hidden_ptr, q_weight_ptr, k_weight_ptr, partial_ptr, hidden_stride, selectors, splits, d,
        DG: tl.constexpr, SPLIT: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """One (batch row, selector) x one chunk of SPLIT columns of d: the chunk's share of the four
        projections q1, q2, k1, k2 ([DG / 2] each: the pairs' first and second halves), summed over the
        chunk in a fixed order and stored in `partial` [B * n, splits, 4, DG / 2] (fp32)."""
        row = tl.program_id(0)  # one (batch row, selector)
        split = tl.program_id(1)
        batch = row // selectors
        selector = row % selectors
        HALF: tl.constexpr = DG // 2
        pairs = tl.arange(0, HALF)
        first = (selector * DG + pairs).to(tl.int64) * d  # the weight rows of the pairs' first halves
        second = first + HALF * d  # and of their second halves (rotate-half layout)
        cols = tl.arange(0, BLOCK_D)
        q1 = tl.zeros([HALF, BLOCK_D], tl.float32)
        q2 = tl.zeros([HALF, BLOCK_D], tl.float32)
        k1 = tl.zeros([HALF, BLOCK_D], tl.float32)
        k2 = tl.zeros([HALF, BLOCK_D], tl.float32)
        for offset in range(0, SPLIT, BLOCK_D):
            at = split * SPLIT + offset + cols
            inside = at < d
            h = tl.load(hidden_ptr + batch * hidden_stride + at, mask=inside, other=0.0).to(tl.float32)[None, :]
            mask = inside[None, :]
            q1 += tl.load(q_weight_ptr + first[:, None] + at[None, :], mask=mask, other=0.0) * h
            q2 += tl.load(q_weight_ptr + second[:, None] + at[None, :], mask=mask, other=0.0) * h
            k1 += tl.load(k_weight_ptr + first[:, None] + at[None, :], mask=mask, other=0.0) * h
            k2 += tl.load(k_weight_ptr + second[:, None] + at[None, :], mask=mask, other=0.0) * h
        out_at = ((row * splits + split) * 4).to(tl.int64) * HALF + pairs
        tl.store(partial_ptr + out_at, tl.sum(q1, 1))
        tl.store(partial_ptr + out_at + HALF, tl.sum(q2, 1))
        tl.store(partial_ptr + out_at + 2 * HALF, tl.sum(k1, 1))
        tl.store(partial_ptr + out_at + 3 * HALF, tl.sum(k2, 1))

    @triton.jit
    def _split_sum(partial_ptr, row, part, splits, HALF: tl.constexpr, SPLITS: tl.constexpr):
        """The sum over the splits of one of the four projections' partials of `row`, [HALF] fp32: one load
        of all splits ([SPLITS, HALF], SPLITS the splits' count rounded up to a power of two, zeros past
        it) and one reduction, whose order depends only on the shapes (deterministic)."""
        chunks = tl.arange(0, SPLITS)
        at = (row * splits + chunks).to(tl.int64)[:, None] * (4 * HALF) + part * HALF + tl.arange(0, HALF)[None, :]
        return tl.sum(tl.load(partial_ptr + at, mask=(chunks < splits)[:, None], other=0.0), 0)

    @triton.jit
    def _gate_token_kernel(
        partial_ptr, cos_ptr, sin_ptr, freq_ptr,  # the projections' partial sums, RoPE
        keys_ptr, scales_ptr, q_out_ptr, lengths_ptr,  # the cache's gate-key buffers, the query out, lengths
        rope_stride, rope_dim_stride, base_half, capacity, selectors, splits,
        DG: tl.constexpr, SPLITS: tl.constexpr, INT8: tl.constexpr, LEVELS: tl.constexpr, TINY: tl.constexpr,
        ROUND: tl.constexpr,
    ):  # fmt: skip
        """One (batch row, selector): the projections' splits summed, RoPE, the key encoded and written at
        its slot, the query stored."""
        row = tl.program_id(0)  # one (batch row, selector)
        batch = row // selectors
        selector = row % selectors
        HALF: tl.constexpr = DG // 2
        pairs = tl.arange(0, HALF)
        q1 = _split_sum(partial_ptr, row, 0, splits, HALF, SPLITS)
        q2 = _split_sum(partial_ptr, row, 1, splits, HALF, SPLITS)
        k1 = _split_sum(partial_ptr, row, 2, splits, HALF, SPLITS)
        k2 = _split_sum(partial_ptr, row, 3, splits, HALF, SPLITS)
        # RoPE by the selector's frequencies: the model's cos/sin [..., head_dim] at rope_freq_index, in fp32;
        # an index of base_half (`gate_rope.unrotated_index`) leaves its pair unrotated: cos 1, sin 0
        freq = tl.load(freq_ptr + selector * HALF + pairs)
        rotated = freq < base_half
        rope_at = batch * rope_stride + freq * rope_dim_stride
        c = tl.load(cos_ptr + rope_at, mask=rotated, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + rope_at, mask=rotated, other=0.0).to(tl.float32)
        out_at = row * DG + pairs
        tl.store(q_out_ptr + out_at, q1 * c - q2 * s)
        tl.store(q_out_ptr + out_at + HALF, q2 * c + q1 * s)
        r1 = k1 * c - k2 * s
        r2 = k2 * c + k1 * s
        slot = tl.load(lengths_ptr).to(tl.int64) - 1  # the new token's slot, read when the kernel runs
        held_at = row.to(tl.int64) * capacity + slot
        key_at = held_at * DG + pairs
        if INT8:  # encode_gate_keys at 8 bits: scale = fp16(max(max|k| / 127, fp16's smallest normal))
            amax = tl.maximum(tl.max(tl.abs(r1), 0), tl.max(tl.abs(r2), 0))
            scale16 = tl.maximum(tl.math.div_rn(amax, LEVELS), TINY).to(tl.float16)
            scale = scale16.to(tl.float32)
            code1 = (tl.math.div_rn(r1, scale) + ROUND) - ROUND  # round half to even, as torch.round
            code2 = (tl.math.div_rn(r2, scale) + ROUND) - ROUND
            tl.store(keys_ptr + key_at, tl.minimum(tl.maximum(code1, -LEVELS), LEVELS).to(tl.int8))
            tl.store(keys_ptr + key_at + HALF, tl.minimum(tl.maximum(code2, -LEVELS), LEVELS).to(tl.int8))
            tl.store(scales_ptr + held_at, scale16)
        else:  # bf16, rounded to nearest even (then the cast is exact)
            tl.store(keys_ptr + key_at, bf16_grid(r1).to(tl.bfloat16))
            tl.store(keys_ptr + key_at + HALF, bf16_grid(r2).to(tl.bfloat16))


def gate_token(
    hidden: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    cos: Tensor,
    sin: Tensor,
    freq_index: Tensor,
    gate_keys: Tensor,
    key_scales: Tensor | None,
    lengths: Tensor,
) -> Tensor:
    """The new token's gate query [B, n, 1, dg] (fp32), its gate key written into the cache's buffers.

    hidden [B, 1, d] (bf16, fp16 or fp32): the token's normed layer input; q_weight, k_weight [n * dg, d]
    (fp32): the gate's projections (`SparseGateHead.q_proj` / `k_proj`); cos, sin [B or 1, 1, head_dim]:
    the model's RoPE at the token's position; freq_index [n, dg / 2] (int64): `rope_freq_index` (a pair at
    head_dim // 2, one past the model's frequencies (`gate_rope.unrotated_index`), is not rotated);
    gate_keys [B, n, C, dg]: int8 codes with `key_scales` fp16 [B, n, C, 1] (8 bits), or bf16 with
    `key_scales` None (16 bits); lengths int32 [2] on the device (`CacheLengths.device`): the key goes to
    slot lengths[0] - 1, read when the kernel runs (capture-safe). The query equals
    `SparseGateHead.forward`'s and the stored key `encode_gate_keys` of its key, up to the summation
    order of the projections (split over d in chunks of `SPLIT` columns, summed in a fixed order: the
    same inputs give the same bits; module docstring)."""
    batch, tokens, d = hidden.shape
    _, selectors, capacity, dim = gate_keys.shape
    int8 = key_scales is not None
    expected_dtype = torch.int8 if int8 else torch.bfloat16
    if tokens != 1 or gate_keys.dtype != expected_dtype or q_weight.shape != (selectors * dim, d):
        raise ValueError(
            f"gate_token: takes hidden [B, 1, d], projection weights [n * dg, d] and gate-key buffers "
            f"[B, n, C, dg] ({expected_dtype} {'with' if int8 else 'without'} scales); got hidden "
            f"{tuple(hidden.shape)}, weights {tuple(q_weight.shape)}, "
            f"buffers {gate_keys.dtype} {tuple(gate_keys.shape)}"
        )
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    if cos.stride() != sin.stride():  # the kernel reads both at the same offsets
        cos, sin = cos.contiguous(), sin.contiguous()
    gate_q = torch.empty(batch, selectors, 1, dim, device=hidden.device, dtype=torch.float32)
    half = dim // 2
    rows, splits = batch * selectors, triton.cdiv(d, SPLIT)
    partial = torch.empty(rows, splits, 4, half, device=hidden.device, dtype=torch.float32)
    _gate_token_partial_kernel[(rows, splits)](
        hidden, q_weight.contiguous(), k_weight.contiguous(), partial, hidden.stride(0), selectors, splits, d,
        DG=dim, SPLIT=SPLIT, BLOCK_D=min(SPLIT, max(16, TILE // half)), num_warps=4,
    )  # fmt: skip
    _gate_token_kernel[(rows,)](
        partial, cos, sin, freq_index.contiguous(),
        gate_keys, key_scales if int8 else gate_keys, gate_q, lengths,
        cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(-1), cos.shape[-1] // 2, capacity, selectors, splits,
        DG=dim, SPLITS=triton.next_power_of_2(splits), INT8=int8, LEVELS=float(INT8_LEVELS), TINY=FP16_TINY,
        ROUND=ROUNDER, num_warps=4,
    )  # fmt: skip
    return gate_q
