"""Quantization math shared by the ASQ compressor, the generation cache's packed store and the kernels.

A leaf: it imports nothing from gsm_train. It holds the residual grids, the fp16 storage grid, the
randomized Hadamard rotation, bit packing and the packed fields' zeroed storage, the block split of a
[B, H, S, D] sequence, the plain
quantization baselines ASQ is compared with, and the exact byte account of ASQ's storage.

Grids: every width is mid-rise, ``(code + 1/2) * scale`` with codes in ``[-2**(bits-1), 2**(bits-1) - 1]``,
so all ``2**bits`` codes are levels and none is zero. At 4 and 8 bits
``scale = absmax / (2**(bits-1) - 1/2)`` (a token's largest residual is a level); at 2 bits
``scale = 0.9957 * rms``, the step of the mean-squared-error-optimal uniform 4-level quantizer of a
Gaussian (Max, 1960). Scales are stored in fp16 and rounded to fp16 wherever they are computed, so a
fake-quantized value equals what the packed store gives back.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

VALID_BITS = (2, 4, 8)
STORE_DTYPE = torch.float16  # prototypes and scales are stored in fp16
FP16_MAX = torch.finfo(torch.float16).max
FP16_TINY = 2.0**-14  # fp16's smallest normal; below it fp16's values are multiples of 2**-24
INT8_LEVELS = 127  # gate keys at 8 bits: symmetric int8 codes with one fp16 scale per key
EPS = 1e-6
RMS_SCALED_BITS = 2  # the width whose scale comes from the rms (the others: from the absmax)
MIDRISE_STEP = 0.9957  # step / rms of the MSE-optimal uniform 4-level quantizer of a unit Gaussian
_FP16_SUBNORMAL_STEPS = 2.0**24
_FP32_LOW_BITS = 13  # fp32 mantissa bits that fp16 lacks
_FIELD_ALIGN = 64  # bytes: where each of `zeroed_fields`' tensors starts in their shared buffer
_SIGN_HASH = 0x9E3779B1  # Fibonacci hashing's multiplier: channel i's sign is the top bit of i * it (mod 2**32)


def check_bits(bits: int, name: str = "quant_bits") -> None:
    """Raise ValueError naming `name` unless `bits` is 2, 4 or 8."""
    if bits not in VALID_BITS:
        raise ValueError(f"{name} must be one of {VALID_BITS}, got {bits!r}")


def code_center(bits: int) -> float:
    """The offset from a stored code (0 .. 2**bits - 1) to the multiple of the scale it stands for,
    ``2**(bits-1) - 1/2`` on every (mid-rise) grid, which is also its outermost level: at 2 bits the
    levels are -1.5, -0.5, 0.5 and 1.5 times the scale, at 4 bits -7.5 .. 7.5."""
    return 2 ** (bits - 1) - 0.5


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype quantization computes in for input `x`: fp32, or fp64 for fp64 input (where cached
    decoding and teacher forcing can be compared free of rounding)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------- rotation


def hadamard_signs(dim: int) -> Tensor:
    """The row signs [dim] (fp64, +-1) of `hadamard_rotation(dim)`: with them and a fast Walsh-Hadamard
    transform a kernel applies the rotation without reading the matrix."""
    return torch.tensor(
        [-1.0 if ((i * _SIGN_HASH) & 0xFFFFFFFF) >> 31 else 1.0 for i in range(dim)], dtype=torch.float64
    )


def hadamard_rotation(dim: int) -> Tensor:
    """The orthonormal [dim, dim] fp64 rotation of `rotate_residuals`: Sylvester's Hadamard matrix with row
    i negated where bit 31 of ``(i * 0x9E3779B1) mod 2**32`` is set, over sqrt(dim) (a randomized Hadamard
    transform with fixed signs that any reader rebuilds from `dim` alone). `dim` must be a power of two."""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"head_dim must be a power of two to rotate residuals, got {dim}")
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < dim:
        matrix = torch.cat((torch.cat((matrix, matrix), 1), torch.cat((matrix, -matrix), 1)), 0)
    return hadamard_signs(dim)[:, None] * matrix / math.sqrt(dim)


def rotated(rows: Tensor, rotation: Tensor | None) -> Tensor:
    """Rows [..., D] in the rotated basis (``rows @ rotation``), or as they are without a rotation."""
    return rows if rotation is None else rows @ rotation.to(rows.dtype)


def unrotated(rows: Tensor, rotation: Tensor | None) -> Tensor:
    """Rotated rows [..., D] back in the channels' basis (``rows @ rotation.T``)."""
    return rows if rotation is None else rows @ rotation.to(rows.dtype).T


# --------------------------------------------------------------------------- rounding


def round_ste(x: Tensor) -> Tensor:
    """Round to nearest with a straight-through (identity) gradient."""
    return x + (torch.round(x) - x).detach()


def floor_ste(x: Tensor) -> Tensor:
    """Round down with a straight-through (identity) gradient. Without a gradient, ``floor(x)`` alone (one
    kernel, not three): the same value, since ``x + (floor(x) - x)`` rounds to ``floor(x)`` in binary
    floating point (Sterbenz's lemma where ``|x| >= 0.5``; in (-0.5, 0) the sum is within half an ulp of
    -1.0), except that -0.0 stays -0.0 where the gradient's form gives +0.0."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return torch.floor(x)
    return x + (torch.floor(x) - x).detach()


def fp16_grid(x: Tensor) -> Tensor:
    """fp32 `x` (within fp16's range: below 65520 in magnitude) rounded to the nearest fp16 value, ties to
    even, as `.half().float()` rounds. Below fp16's smallest normal the grid is multiples of 2**-24. NaN
    stays NaN, -0.0 stays -0.0. In eager code it is that cast (two kernels); while torch.compile traces,
    `fp16_grid_bits` (the same values in integer arithmetic, which a compiler cannot fuse away)."""
    if torch.compiler.is_compiling():
        return fp16_grid_bits(x)
    return x.to(torch.float16).to(torch.float32)


def fp16_grid_bits(x: Tensor) -> Tensor:
    """`fp16_grid` computed in integer arithmetic on x's bits (thirteen kernels eagerly): what a
    compiled graph runs, since Inductor would drop a plain `.half().float()`. Past fp16's range it gives
    65536 where the cast gives inf (fp16 storage makes either inf)."""
    bits = x.view(torch.int32)
    keep_lsb = (bits >> _FP32_LOW_BITS) & 1  # ties to even: round half up, less one when the kept bit is even
    normal = ((bits + (2 ** (_FP32_LOW_BITS - 1) - 1) + keep_lsb) & -(2**_FP32_LOW_BITS)).view(torch.float32)
    subnormal = torch.round(x * _FP16_SUBNORMAL_STEPS) / _FP16_SUBNORMAL_STEPS  # exact: powers of two
    return torch.where(x.abs() < FP16_TINY, subnormal, torch.where(torch.isnan(x), x, normal))


def to_store(x: Tensor) -> Tensor:
    """fp32 (or fp64) values rounded to the fp16 storage grid, in x's dtype. Differentiable: the gradient
    passes unchanged within fp16's range and is zero beyond it (where x clamps). Without a gradient the
    result is the rounded value itself (-0.0 kept); with one, ``clamped + (rounded - clamped)``, equal to
    it except that -0.0 comes out +0.0."""
    clamped = x.clamp(-FP16_MAX, FP16_MAX)
    with torch.no_grad():
        rounded = fp16_grid(clamped) if x.dtype == torch.float32 else clamped.to(STORE_DTYPE).to(x.dtype)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return rounded
    return clamped + (rounded - clamped).detach()


def nonzero_divisor(scale: Tensor) -> Tensor:
    """`scale` with zeros replaced by ones: a zero scale stands for all-zero values, which any divisor keeps."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize(x: Tensor, bits: int, dim: int) -> tuple[Tensor, Tensor]:
    """Quantization over `dim` on the mid-rise grid of `bits` (module docstring), straight-through.

    Returns ``(q, scale)`` with ``q * scale`` the dequantized value: `q` the levels in units of the scale
    (half-integers in ``[-2**(bits-1) + 1/2, 2**(bits-1) - 1/2]``) and the fp16-rounded `scale` (keepdim).
    """
    half = code_center(bits)  # the outermost level
    if bits == RMS_SCALED_BITS:  # the clamp keeps sqrt's gradient finite where a residual is exactly zero
        mean_square = x.pow(2).mean(dim=dim, keepdim=True)
        scale = to_store(mean_square.clamp_min(torch.finfo(x.dtype).tiny).sqrt() * MIDRISE_STEP)
    else:
        scale = to_store(x.abs().amax(dim=dim, keepdim=True) / half)
    return floor_ste(x / nonzero_divisor(scale)).clamp(-half - 0.5, half - 0.5) + 0.5, scale


def fake_quant(x: Tensor, bits: int, dim: int) -> Tensor:
    """`quantize` then dequantize: x on the grid of `bits` over `dim` (straight-through)."""
    q, scale = quantize(x, bits, dim)
    return q * scale


# --------------------------------------------------------------------------- blocks and packing


def split_blocks(x: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """[B, H, S, D] as its full blocks [B, H, S // block_size, block_size, D] and the tail [B, H, S % bs, D]."""
    b, h, s, d = x.shape
    s_full = (s // block_size) * block_size
    return x[:, :, :s_full].reshape(b, h, s // block_size, block_size, d), x[:, :, s_full:]


def join_blocks(full: Tensor, tail: Tensor) -> Tensor:
    """Inverse of `split_blocks` (the blocks cast to the tail's dtype)."""
    b, h, n, bs, d = full.shape
    return torch.cat([full.reshape(b, h, n * bs, d).to(tail.dtype), tail], dim=2)


def stored_split(seq_len: int, block_size: int) -> int:
    """Tokens a cache of `seq_len` holds compressed: every block but the newest (which may be full)."""
    return max(seq_len - 1, 0) // block_size * block_size


def pack_codes(q: Tensor, bits: int) -> Tensor:
    """Levels [..., D] (from `quantize`) as uint8 [..., ceil(D * bits / 8)]: codes ``q + code_center(bits)``,
    ``8 // bits`` per byte, code j of a row at bit ``j * bits`` of the row's bytes read little-endian."""
    per = 8 // bits
    u = (q + code_center(bits)).to(torch.uint8)
    pad = (-u.shape[-1]) % per
    if pad:
        u = torch.cat([u, u.new_zeros(*u.shape[:-1], pad)], dim=-1)
    u = u.reshape(*u.shape[:-1], u.shape[-1] // per, per)
    packed = u[..., 0]
    for j in range(1, per):  # disjoint bit fields ORed byte-wide: no integer reduction over a byte's few codes
        packed = packed | (u[..., j] << (j * bits))
    return packed


def unpack_codes(packed: Tensor, bits: int, dim: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Inverse of `pack_codes`: uint8 [..., nbytes] -> levels [..., dim] in `dtype` (exact)."""
    per = 8 // bits
    shifts = torch.arange(0, per * bits, bits, device=packed.device, dtype=torch.int32)
    u = torch.bitwise_right_shift(packed.to(torch.int32).unsqueeze(-1), shifts) & (2**bits - 1)
    u = u.reshape(*packed.shape[:-1], packed.shape[-1] * per)[..., :dim]
    return u.to(dtype) - code_center(bits)


def zeroed_fields(specs: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> dict[str, Tensor]:
    """Zeroed tensors of the shapes and dtypes `specs` names (a cache's stored fields), views of one zeroed
    byte buffer, each from a 64-byte boundary and none overlapping another: one allocation and one fill (on
    a GPU one kernel) for all of them, where a tensor of its own takes one each."""
    sizes = {name: math.prod(shape) * dtype.itemsize for name, (shape, dtype) in specs.items()}
    starts, total = {}, 0
    for name, size in sizes.items():
        starts[name], total = total, total + -(-size // _FIELD_ALIGN) * _FIELD_ALIGN
    buffer = torch.zeros(total, dtype=torch.uint8, device=device)
    return {
        name: buffer[starts[name] : starts[name] + sizes[name]].view(dtype).view(shape)
        for name, (shape, dtype) in specs.items()
    }


# --------------------------------------------------------------------------- baselines


def fake_quant_per_token(x: Tensor, bits: int) -> Tensor:
    """Baseline: every token of [..., D] on the mid-rise grid of `bits`, one scale per token."""
    check_bits(bits, "bits")
    return fake_quant(x.float(), bits, dim=-1).to(x.dtype)


def fake_quant_asymmetric(x: Tensor, bits: int, dim: int) -> Tensor:
    """Asymmetric min-max fake quantization over `dim`: 2**bits levels from the minimum (the zero point)
    to the maximum, fp16 scale and zero point (KIVI's quantizer)."""
    low = to_store(x.amin(dim=dim, keepdim=True))
    scale = to_store((x.amax(dim=dim, keepdim=True) - low) / (2**bits - 1))
    return round_ste((x - low) / nonzero_divisor(scale)).clamp(0, 2**bits - 1) * scale + low


def fake_quant_kivi(x: Tensor, bits: int, block_size: int, per_channel: bool) -> Tensor:
    """KIVI-like baseline on [B, H, S, D], asymmetric as KIVI quantizes: `per_channel` (keys) one scale and
    zero point per channel over each block of `block_size` tokens, else (values) one per token. The
    newest incomplete block stays in full precision."""
    check_bits(bits, "bits")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size!r}")
    full, tail = split_blocks(x, block_size)
    return join_blocks(fake_quant_asymmetric(full.float(), bits, dim=-2 if per_channel else -1), tail)


# --------------------------------------------------------------------------- byte account


def asq_bytes(
    seq_len: int,
    num_kv_heads: int,
    head_dim: int,
    cluster_num: int = 32,
    quant_bits: int = 4,
    block_size: int = 128,
    batch_size: int = 1,
    tail_bytes: int = 2,
) -> dict[str, float]:
    """Exact bytes of ASQ's packed storage of a cache of `seq_len` tokens.

    With ``n = batch_size * num_kv_heads``, ``F = stored_split(seq_len, block_size)`` compressed tokens in
    ``F / block_size`` blocks and ``T = seq_len - F`` raw tokens: ids ``n*F``, residual
    ``n*F*ceil(head_dim*quant_bits/8)``, scales ``2*n*F``, prototypes ``2*n*(F/block_size)*cluster_num*head_dim``,
    tail ``tail_bytes*n*T*head_dim``. Also ``total``, the bf16 reference ``bf16 = 2*n*seq_len*head_dim``,
    ``bytes_per_token`` (total per token per KV head), ``bf16_bytes_per_token`` and ``compression_ratio``.
    """
    n = batch_size * num_kv_heads
    s_full = stored_split(seq_len, block_size)
    out: dict[str, float] = {
        "ids": n * s_full,
        "residual": n * s_full * math.ceil(head_dim * quant_bits / 8),
        "scales": 2 * n * s_full,
        "prototypes": 2 * n * (s_full // block_size) * cluster_num * head_dim,
        "tail": tail_bytes * n * (seq_len - s_full) * head_dim,
    }
    out["total"] = sum(out.values())
    out["bf16"] = 2 * n * seq_len * head_dim
    out["bytes_per_token"] = out["total"] / max(n * seq_len, 1)
    out["bf16_bytes_per_token"] = 2 * head_dim
    out["compression_ratio"] = out["bf16"] / max(out["total"], 1)
    return out
