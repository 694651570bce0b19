"""ASQ KV compressor: adaptive-cluster prototypes plus low-bit per-token residuals.

Tokens are compressed causally in blocks of ``block_size`` along the sequence axis.
For each full block and KV head a small MLP softly assigns every token to one of
``cluster_num`` clusters; the prototypes are the assignment-weighted means of the
block's own tokens. Each token stores its cluster id (uint8), its residual
``x - prototype[id]`` (of the rotated rows with ``rotate_residuals``, below) quantized to 2/4/8 bits,
and a per-token fp16 scale. The newest, incomplete block is kept uncompressed.

Every width uses a mid-rise grid, ``(code + 1/2) * scale`` with codes in ``[-2**(bits-1), 2**(bits-1) - 1]``:
all 2**bits codes are levels and none is zero (see :func:`code_center`). At 4 and 8 bits
``scale = absmax / (2**(bits-1) - 1/2)``, so a token's largest residual is a level. At 2 bits
``scale = 0.9957 * rms``, the step of the mean-squared-error-optimal uniform 4-level quantizer of
a Gaussian (Max, 1960): an absmax scale rounds most of a token's channels to the inner levels (on
SmolLM2's keys and values a symmetric 2-bit grid left 1.9x and 2.1x the error of this one). The 4-bit
grid was symmetric (``code * absmax / 7``, codes in ``[-7, 7]``, one code unused) up to export format 4;
with rotated residuals the 16-level grid costs SmolLM2 +0.023 nats training-free against +0.033 before
(benchmarks/results/residual_quantizers.json, docs/design-decisions.md).

With ``rotate_residuals`` the block's rows are rotated (``x @ R``, a randomized Hadamard
`hadamard_rotation`) before the prototypes are averaged and the residuals taken: prototypes and residual
codes are both of the rotated rows and a reader adds them in that basis, rotating the sum back once
(``x_hat = (prototype[id] + residual) @ R.T``). The assignment MLP still reads the rows unrotated; since R
is orthogonal, the rotated prototypes are the plain ones rotated, up to their float16 rounding. A decode
kernel then needs one product per row, against the rotated query (docs/design-decisions.md).

Prototypes and scales are stored in float16 and the fake-quant path rounds them
the same way, so eval ``forward(x)`` equals ``decompress(compress(x))``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from gsm_train.modules.compiled import compiled

_VALID_BITS = (2, 4, 8)
_STORE_DTYPE = torch.float16
_FP16_MAX = torch.finfo(torch.float16).max
_EPS = 1e-6

__all__ = [
    "ASQCompressor",
    "PackedKV",
    "asq_bytes",
    "fake_quant_kivi",
    "fake_quant_per_token",
    "paired_training_pass",
]


# --------------------------------------------------------------------------- helpers


def _check(ok: bool, name: str, msg: str) -> None:
    """Raise ``ValueError`` naming the offending argument when ``ok`` is false."""
    if not ok:
        raise ValueError(f"{name} {msg}")


def _check_bits(bits: int, name: str = "quant_bits") -> None:
    _check(bits in _VALID_BITS, name, f"must be one of {_VALID_BITS}, got {bits!r}")


_RMS_SCALED_BITS = 2  # the width whose scale comes from the rms (the others: from the absmax)
_MIDRISE_STEP = 0.9957  # step / rms of the MSE-optimal uniform 4-level quantizer of a unit Gaussian (Max, 1960)


def code_center(bits: int) -> float:
    """The offset from a stored code (0 .. 2**bits - 1) to the multiple of the scale it stands for,
    ``2**(bits-1) - 1/2`` on every (mid-rise) grid, which is also its outermost level: at 2 bits the
    levels are -1.5, -0.5, 0.5 and 1.5 times the scale, at 4 bits -7.5 .. 7.5."""
    return 2 ** (bits - 1) - 0.5


_SIGN_HASH = 0x9E3779B1  # Fibonacci hashing's multiplier: channel i's sign is the top bit of i * it (mod 2**32)


def hadamard_rotation(dim: int) -> Tensor:
    """The orthonormal [dim, dim] rotation applied to the rows with `rotate_residuals`, in fp64 (callers
    round it to the dtype they compute in): Sylvester's Hadamard matrix with row i negated where bit 31 of
    ``(i * 0x9E3779B1) mod 2**32`` is set, over sqrt(dim) (a randomized Hadamard transform, as QuaRot
    rotates KV caches, with fixed signs that any reader rebuilds from `dim` alone). `dim` must be a power
    of two."""
    _check(dim >= 1 and dim & (dim - 1) == 0, "head_dim", f"must be a power of two to rotate residuals, got {dim}")
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < dim:
        matrix = torch.cat((torch.cat((matrix, matrix), 1), torch.cat((matrix, -matrix), 1)), 0)
    return hadamard_signs(dim)[:, None] * matrix / math.sqrt(dim)


def hadamard_signs(dim: int) -> Tensor:
    """The row signs [dim] (fp64, +-1) of `hadamard_rotation(dim)`: with them and a fast Walsh-Hadamard
    transform a kernel applies the rotation without reading the matrix."""
    return torch.tensor([-1.0 if ((i * _SIGN_HASH) & 0xFFFFFFFF) >> 31 else 1.0 for i in range(dim)],
                        dtype=torch.float64)


def _rotated(rows: Tensor, rotation: Tensor | None) -> Tensor:
    """Rows [..., D] in the rotated basis (``rows @ rotation``), or as they are without a rotation."""
    return rows if rotation is None else rows @ rotation.to(rows.dtype)


def _unrotated(rows: Tensor, rotation: Tensor | None) -> Tensor:
    """Rotated rows [..., D] back in the channels' basis (``rows @ rotation.T``)."""
    return rows if rotation is None else rows @ rotation.to(rows.dtype).T


def _round_ste(x: Tensor) -> Tensor:
    """Round to nearest with a straight-through (identity) gradient."""
    return x + (torch.round(x) - x).detach()


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype ASQ computes in for input `x`: fp32, or fp64 for fp64 input (where cached decoding
    and teacher forcing can be checked free of rounding)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


FP16_TINY = 2.0**-14  # fp16's smallest normal; below it fp16's values are multiples of 2**-24
_FP16_SUBNORMAL_STEPS = 2.0**24
_FP32_LOW_BITS = 13  # fp32 mantissa bits that fp16 lacks


def fp16_grid(x: Tensor) -> Tensor:
    """fp32 `x` (within fp16's range) rounded to the nearest fp16 value, ties to even, as `.half().float()`
    rounds, in integer arithmetic on x's bits: Inductor fuses a `.half().float()` chain into its neighbours
    and drops the rounding (torch 2.11 on the H200, even with `emulate_precision_casts`), and training must see
    the grid that inference reads. Normal fp16 values keep 10 of fp32's 23 mantissa bits; below fp16's
    smallest normal the grid is multiples of 2**-24. NaN stays NaN."""
    bits = x.view(torch.int32)
    keep_lsb = (bits >> _FP32_LOW_BITS) & 1  # ties to even: round half up, less one when the kept bit is even
    normal = ((bits + (2 ** (_FP32_LOW_BITS - 1) - 1) + keep_lsb) & -(2**_FP32_LOW_BITS)).view(torch.float32)
    subnormal = torch.round(x * _FP16_SUBNORMAL_STEPS) / _FP16_SUBNORMAL_STEPS  # exact: powers of two
    return torch.where(x.abs() < FP16_TINY, subnormal, torch.where(torch.isnan(x), x, normal))


def _to_store(x: Tensor) -> Tensor:
    """Round fp32 (or fp64) values to the float16 storage grid (keeps x's dtype, differentiable: the
    gradient passes unchanged where x is within fp16's range, and is zero beyond it, where x clamps).
    Without a gradient to pass it is the rounded value itself, -0.0 included, as `.half()` stores it; with
    one, the straight-through sum ``clamped + (rounded - clamped)``, equal to it except that -0.0 comes out
    +0.0 (the difference is exact). A single form that keeps -0.0 cost the compiled training pass 0.4-0.5 ms
    per joint step (docs/design-decisions.md)."""
    clamped = x.clamp(-_FP16_MAX, _FP16_MAX)
    with torch.no_grad():
        rounded = fp16_grid(clamped) if x.dtype == torch.float32 else clamped.to(_STORE_DTYPE).to(x.dtype)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return rounded
    return clamped + (rounded - clamped).detach()


def _divisor(scale: Tensor) -> Tensor:
    """`scale` with zeros replaced by ones: a zero scale stands for all-zero values, which any divisor keeps."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _floor_ste(x: Tensor) -> Tensor:
    """Round down with a straight-through (identity) gradient."""
    return x + (torch.floor(x) - x).detach()


def _quantize(x: Tensor, bits: int, dim: int) -> tuple[Tensor, Tensor]:
    """Quantization over ``dim`` on the mid-rise grid of ``bits`` (module docstring, straight-through
    rounding).

    Returns ``(q, scale)`` with ``q * scale`` the dequantized value: ``q`` the levels in units of the
    scale (half-integers in ``[-2**(bits-1) + 1/2, 2**(bits-1) - 1/2]``) and the fp16-rounded ``scale``
    (keepdim).
    """
    half = code_center(bits)  # the outermost level
    if bits == _RMS_SCALED_BITS:  # the clamp keeps sqrt's gradient finite where a residual is exactly zero
        mean_square = x.pow(2).mean(dim=dim, keepdim=True)
        scale = _to_store(mean_square.clamp_min(torch.finfo(x.dtype).tiny).sqrt() * _MIDRISE_STEP)
    else:
        scale = _to_store(x.abs().amax(dim=dim, keepdim=True) / half)
    return _floor_ste(x / _divisor(scale)).clamp(-half - 0.5, half - 0.5) + 0.5, scale


def _fake_quant(x: Tensor, bits: int, dim: int) -> Tensor:
    q, scale = _quantize(x, bits, dim)
    return q * scale


def _split_blocks(x: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Split [B, H, S, D] into full blocks [B, H, n, block_size, D] and the tail [B, H, S % bs, D]."""
    b, h, s, d = x.shape
    s_full = (s // block_size) * block_size
    full = x[:, :, :s_full].reshape(b, h, s // block_size, block_size, d)
    return full, x[:, :, s_full:]


def stored_split(seq_len: int, block_size: int) -> int:
    """Tokens a cache of ``seq_len`` holds compressed: every block but the newest (which may be full)."""
    return max(seq_len - 1, 0) // block_size * block_size


def _join_blocks(full: Tensor, tail: Tensor) -> Tensor:
    b, h, n, bs, d = full.shape
    return torch.cat([full.reshape(b, h, n * bs, d).to(tail.dtype), tail], dim=2)


def _pack(q: Tensor, bits: int) -> Tensor:
    """Pack levels [..., D] (from `_quantize`) into uint8 [..., ceil(D * bits / 8)] as codes ``q + code_center``."""
    per = 8 // bits
    u = (q + code_center(bits)).to(torch.int32)
    pad = (-u.shape[-1]) % per
    if pad:
        u = torch.cat([u, u.new_zeros(*u.shape[:-1], pad)], dim=-1)
    u = u.reshape(*u.shape[:-1], u.shape[-1] // per, per)
    shifts = torch.arange(per, device=u.device, dtype=torch.int32) * bits
    return torch.bitwise_left_shift(u, shifts).sum(dim=-1).to(torch.uint8)


def _unpack(packed: Tensor, bits: int, dim: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Inverse of :func:`_pack`: uint8 [..., nbytes] -> levels [..., dim] as `dtype`."""
    per = 8 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    u = torch.bitwise_right_shift(packed.to(torch.int32).unsqueeze(-1), shifts) & (2**bits - 1)
    u = u.reshape(*packed.shape[:-1], packed.shape[-1] * per)[..., :dim]
    return u.to(dtype) - code_center(bits)


# --------------------------------------------------------------------------- baselines


def fake_quant_per_token(x: Tensor, bits: int) -> Tensor:
    """Baseline: per-token fake quantization of every token of [..., D] on ASQ's mid-rise grid for `bits`
    (absmax-scaled at 4 and 8 bits, rms-scaled at 2)."""
    _check_bits(bits, "bits")
    return _fake_quant(x.float(), bits, dim=-1).to(x.dtype)


def _fake_quant_asymmetric(x: Tensor, bits: int, dim: int) -> Tensor:
    """Asymmetric min-max fake quantization over ``dim``: 2**bits levels from the minimum (the zero point)
    to the maximum, fp16 scale and zero point (KIVI's quantizer)."""
    low = _to_store(x.amin(dim=dim, keepdim=True))
    scale = _to_store((x.amax(dim=dim, keepdim=True) - low) / (2**bits - 1))
    return _round_ste((x - low) / _divisor(scale)).clamp(0, 2**bits - 1) * scale + low


def fake_quant_kivi(x: Tensor, bits: int, block_size: int, per_channel: bool) -> Tensor:
    """KIVI-like baseline on [B, H, S, D], asymmetric (min-max with a zero point) as KIVI quantizes.

    ``per_channel=True`` (keys): one scale and zero point per channel over each block of
    ``block_size`` tokens; ``per_channel=False`` (values): one per token. As in KIVI (and ASQ),
    the newest incomplete block is kept in full precision.
    """
    _check_bits(bits, "bits")
    _check(block_size >= 1, "block_size", f"must be >= 1, got {block_size!r}")
    full, tail = _split_blocks(x, block_size)
    deq = _fake_quant_asymmetric(full.float(), bits, dim=-2 if per_channel else -1)
    return _join_blocks(deq, tail)


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
    """Exact storage of :meth:`ASQCompressor.compress` output, in bytes.

    With ``n = batch_size * num_kv_heads``, ``F = stored_split(seq_len, block_size)``
    compressed tokens in ``F / block_size`` blocks and ``T = seq_len - F`` tail tokens:
    ids ``n*F``, residual ``n*F*ceil(head_dim*quant_bits/8)``, scales ``2*n*F``,
    prototypes ``2*n*(F/block_size)*cluster_num*head_dim``, tail ``tail_bytes*n*T*head_dim``.
    Also returns ``total``, the bf16 reference ``2*n*seq_len*head_dim``, ``bytes_per_token``
    (total per token per KV head), ``bf16_bytes_per_token`` (``2*head_dim``) and
    ``compression_ratio`` (bf16 / total).
    """
    n = batch_size * num_kv_heads
    s_full = stored_split(seq_len, block_size)
    n_blocks = s_full // block_size
    out: dict[str, float] = {
        "ids": n * s_full,
        "residual": n * s_full * math.ceil(head_dim * quant_bits / 8),
        "scales": 2 * n * s_full,
        "prototypes": 2 * n * n_blocks * cluster_num * head_dim,
        "tail": tail_bytes * n * (seq_len - s_full) * head_dim,
    }
    out["total"] = sum(out.values())
    out["bf16"] = 2 * n * seq_len * head_dim
    out["bytes_per_token"] = out["total"] / max(n * seq_len, 1)
    out["bf16_bytes_per_token"] = 2 * head_dim
    out["compression_ratio"] = out["bf16"] / max(out["total"], 1)
    return out


# --------------------------------------------------------------------------- compressor


@dataclass
class PackedKV:
    """Packed ASQ storage of a [B, H, S, D] tensor.

    ``ids`` uint8 [B, H, F]; ``residual`` uint8 [B, H, F, ceil(D*bits/8)] (codes ``level +
    code_center(bits)``, ``8 // bits`` per byte); ``scales`` float16 [B, H, F]; ``prototypes`` float16
    [B, H, F // block_size, C, D]; ``tail`` the uncompressed last ``S - F`` tokens in the
    input dtype. ``F`` is the number of tokens in full blocks. With ``rotation`` set, prototypes and
    residuals are of the rotated rows: a row is ``(prototype + residual) @ rotation.T``.
    """

    ids: Tensor
    residual: Tensor
    scales: Tensor
    prototypes: Tensor
    tail: Tensor
    bits: int
    block_size: int
    rotation: Tensor | None = None  # the compressor's rotation (`hadamard_rotation`), not stored bytes

    @property
    def head_dim(self) -> int:
        return self.tail.shape[-1]

    @property
    def seq_len(self) -> int:
        return self.ids.shape[-1] + self.tail.shape[-2]

    def nbytes(self) -> int:
        """Bytes held by the stored tensors."""
        tensors = (self.ids, self.residual, self.scales, self.prototypes, self.tail)
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class _Encoded:
    """Intermediate results of encoding the full blocks (all fp32, [B, H, n, bs, ...])."""

    probs: Tensor  # [B, H, n, bs, C]
    weighted: Tensor  # [B, H, n, C, D]: sum over the block of probs * x (x @ rotation with a rotation)
    mass: Tensor  # [B, H, n, C]: sum over the block of probs
    prototypes: Tensor  # [B, H, n, C, D], fp16-rounded weighted / mass
    ids: Tensor  # [B, H, n, bs] int64
    q: Tensor  # [B, H, n, bs, D] levels in units of the scale (see `_quantize`)
    scale: Tensor  # [B, H, n, bs, 1] fp16-rounded
    rotation: Tensor | None = None  # the rows' rotation (prototypes, q and scale are of the rotated rows)

    def reconstruct(self) -> Tensor:
        return _unrotated(_gather_prototypes(self.prototypes, self.ids) + self.q * self.scale, self.rotation)


def _gather_prototypes(prototypes: Tensor, ids: Tensor) -> Tensor:
    """prototypes [B, H, n, C, D], ids [B, H, n, bs] -> [B, H, n, bs, D]."""
    index = ids.unsqueeze(-1).expand(*ids.shape, prototypes.shape[-1])
    return torch.gather(prototypes, 3, index)


def _soft_assignment(blocks: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, tau: float) -> Tensor:
    """Soft assignment [B, H, n, bs, C] of blocks [B, H, n, bs, D] by the per-head MLP (w1 [H, D, K], b1 [H, K],
    w2 [H, K, C], b2 [H, C]) from per-block standardized inputs, in the blocks' dtype.

    Each head's weights are broadcast over the B * n blocks (not an einsum over heads): the weights'
    gradient is then one small product per block and a sum, where the einsum's was one product per head
    reducing over all B * n * bs tokens, which cuBLAS ran on a dozen thread blocks (33 of the 199 ms of a
    captured SmolLM2 joint step on the H200)."""
    dtype = blocks.dtype
    centered = blocks - blocks.mean(dim=3, keepdim=True)
    rms = centered.pow(2).mean(dim=(3, 4), keepdim=True).add(_EPS).sqrt()
    hidden = torch.matmul(centered / rms, w1.to(dtype)[:, None])
    hidden = F.gelu(hidden + b1.to(dtype)[:, None, None, :])
    logits = torch.matmul(hidden, w2.to(dtype)[:, None]) + b2.to(dtype)[:, None, None, :]
    return torch.softmax(logits / tau, dim=-1)


def _quantize_groups(x: Tensor, bits: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """`_quantize` over the last dim of x [B, G * H, ...], whose heads are G = len(bits) groups side by side
    (K's and V's), each group at its own width."""
    if len(set(bits)) == 1:
        return _quantize(x, bits[0], dim=-1)
    parts = [_quantize(group, width, dim=-1) for group, width in zip(x.chunk(len(bits), 1), bits)]
    return torch.cat([q for q, _ in parts], 1), torch.cat([scale for _, scale in parts], 1)


def _encode_blocks(blocks: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, tau: float,
                   bits: int | tuple[int, ...], rotation: Tensor | None = None) -> _Encoded:
    """Cluster, build prototypes and quantize residuals of blocks [B, H, n, bs, D] (`compute_dtype`), both
    of the rotated blocks (``blocks @ rotation``) when there is a rotation (the assignment reads the blocks
    as they are); `bits` a width, or one per group of heads side by side (`_quantize_groups`)."""
    probs = _soft_assignment(blocks, w1, b1, w2, b2, tau)
    rows = _rotated(blocks, rotation)
    weighted = torch.matmul(probs.transpose(-1, -2), rows)
    mass = probs.sum(dim=3)
    prototypes = _to_store(weighted / (mass.unsqueeze(-1) + _EPS))
    ids = probs.argmax(dim=-1)
    residual = rows - _gather_prototypes(prototypes, ids)
    q, scale = _quantize_groups(residual, (bits,) if isinstance(bits, int) else bits)
    return _Encoded(probs, weighted, mass, prototypes, ids, q, scale, rotation)


def _distortion(enc: _Encoded | None, blocks: Tensor, groups: int = 1) -> Tensor:
    """Soft k-means distortion of the encoding over the within-block variance (see `reconstruction_loss`);
    with `groups` groups of heads side by side (K's and V's), the mean of the groups' ratios."""
    if enc is None:
        return blocks.new_zeros(())

    def group_sums(x: Tensor) -> Tensor:  # [groups]: over every axis but the heads, then over each group's heads
        if groups == 1:  # one sum over everything, in the order a single compressor always summed
            return x.sum().reshape(1)
        return x.sum(dim=[axis for axis in range(x.dim()) if axis != 1]).view(groups, -1).sum(-1)

    # sum_t sum_c p_tc ||x_t - m_c||^2 = sum ||x||^2 - 2 sum_c <sum_t p_tc x_t, m_c> + sum_c (sum_t p_tc) ||m_c||^2
    # (with a rotation x_t and m_c are rotated; ||x||^2 and the variance below are the same in either basis)
    protos = enc.prototypes
    energy = group_sums(blocks.pow(2))
    distortion = energy - 2 * group_sums(enc.weighted * protos) + group_sums(enc.mass * protos.pow(2).sum(-1))
    variance = group_sums((blocks - blocks.mean(dim=3, keepdim=True)).pow(2))  # direct: no cancellation
    return (distortion.clamp_min(0) / variance.clamp_min(_EPS)).mean()


def _reconstruction_and_distortion(blocks: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, tau: float,
                                   bits: int, rotation: Tensor | None) -> tuple[Tensor, Tensor]:
    """A training pass over full blocks: the fake-quantized blocks and the distortion loss."""
    enc = _encode_blocks(blocks, w1, b1, w2, b2, tau, bits, rotation)
    return enc.reconstruct(), _distortion(enc, blocks)


def _paired_training_pass(key: Tensor, value: Tensor, mlps: tuple[tuple[Tensor, ...], tuple[Tensor, ...]], tau: float,
                          bits: tuple[int, int], rotation: Tensor | None,
                          block_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """K's and V's training passes as one: (K's reconstruction, V's, the mean of their losses), for key and
    value [B, H, S, D] whole and each side's assignment MLP (w1, b1, w2, b2). Their blocks lie side by side
    on the head axis, so each kernel and matrix product of the pass serves both, and the split into blocks,
    the casts and the join fuse into the compiled pass."""
    heads = key.shape[1]
    full, tail = _split_blocks(torch.cat((key, value), 1), block_size)
    blocks = full.to(compute_dtype(full))
    w1, b1, w2, b2 = (torch.cat(pair, 0) for pair in zip(*mlps))
    enc = _encode_blocks(blocks, w1, b1, w2, b2, tau, bits, rotation)
    out = _join_blocks(enc.reconstruct(), tail)
    return out[:, :heads], out[:, heads:], _distortion(enc, blocks, groups=2)


def _alike(asq_k: ASQCompressor, asq_v: ASQCompressor) -> bool:
    """Whether two compressors differ at most in their residual bits."""
    fields = ("num_kv_heads", "head_dim", "cluster_num", "hidden_dim", "block_size", "tau", "rotate_residuals")
    return all(getattr(asq_k, name) == getattr(asq_v, name) for name in fields)


def _plain_parameters(module: nn.Module) -> bool:
    """Not an FSDP2 unit or ZeRO-3 partitions: both gather a module's parameters only when it is called."""
    return not isinstance(module, FSDPModule) and not any(hasattr(p, "ds_id") for p in module.parameters())


def paired_training_pass(asq_k: ASQCompressor, asq_v: ASQCompressor, key: Tensor,
                         value: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """K's and V's training passes as one (`_paired_training_pass`, compiled on the GPU): (K's
    reconstruction, V's, the mean of their reconstruction losses), what `asq_k(key, with_loss=True)` and
    `asq_v(value, with_loss=True)` give (fp32 sums in another order); None where the two must run apart:
    outside training, before a first full block, K and V of other shapes or dtypes, compressors that differ
    in more than their bits, or parameters that only the modules' own calls gather. On a captured SmolLM2 joint step on the H200 this
    halves the number of ASQ's kernels, most of them a few microseconds long (docs/design-decisions.md)."""
    if not (asq_k.training and asq_v.training and key.shape == value.shape and key.dtype == value.dtype
            and key.shape[2] >= asq_k.block_size and _alike(asq_k, asq_v)
            and _plain_parameters(asq_k) and _plain_parameters(asq_v)):
        return None
    asq_k._check_input(key)
    asq_v._check_input(value)
    heads = key.shape[1]
    training_pass = compiled(_paired_training_pass) if key.is_cuda else _paired_training_pass
    with torch.autocast(device_type=key.device.type, enabled=False):
        return training_pass(key, value, (asq_k._mlp(heads), asq_v._mlp(heads)), asq_k.tau,
                             (asq_k.quant_bits, asq_v.quant_bits), asq_k.rotation, asq_k.block_size)


class ASQCompressor(nn.Module):
    """Causal block-wise ASQ compressor for one layer's K or V ([B, H, S, D]).

    ``forward`` returns the fake-quantized reconstruction (straight-through rounding);
    ``compress`` / ``decompress`` give the real packed storage. Detached logging stats
    of the last forward in eval mode are kept in ``last_stats``.
    """

    def __init__(
        self,
        num_kv_heads: int,
        head_dim: int,
        cluster_num: int = 32,
        hidden_dim: int = 64,
        quant_bits: int = 4,
        block_size: int = 128,
        tau: float = 1.0,
        rotate_residuals: bool = False,
    ) -> None:
        super().__init__()
        _check(num_kv_heads >= 1, "num_kv_heads", f"must be >= 1, got {num_kv_heads!r}")
        _check(head_dim >= 1, "head_dim", f"must be >= 1, got {head_dim!r}")
        _check(2 <= cluster_num <= 256, "cluster_num", f"must be in [2, 256], got {cluster_num!r}")
        _check(hidden_dim >= 1, "hidden_dim", f"must be >= 1, got {hidden_dim!r}")
        _check_bits(quant_bits)
        _check(block_size >= 1, "block_size", f"must be >= 1, got {block_size!r}")
        _check(tau > 0, "tau", f"must be > 0, got {tau!r}")
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.cluster_num = cluster_num
        self.hidden_dim = hidden_dim
        self.quant_bits = quant_bits
        self.block_size = block_size
        self.tau = tau
        self.rotate_residuals = rotate_residuals
        # rebuilt from head_dim wherever the compressor is built, so not part of its state (or an export's tensors);
        # kept in fp64 whatever the module is cast to (`_apply`), and rounded where it is used
        self.register_buffer("rotation", hadamard_rotation(head_dim) if rotate_residuals else None, persistent=False)
        # its row signs (+-1, exact in any dtype), for the fused decode kernel's Walsh-Hadamard transform
        self.register_buffer("rotation_signs", hadamard_signs(head_dim).float() if rotate_residuals else None,
                             persistent=False)
        self.w1 = nn.Parameter(torch.randn(num_kv_heads, head_dim, hidden_dim) / math.sqrt(head_dim))
        self.b1 = nn.Parameter(torch.zeros(num_kv_heads, hidden_dim))
        self.w2 = nn.Parameter(torch.randn(num_kv_heads, hidden_dim, cluster_num) / math.sqrt(hidden_dim))
        self.b2 = nn.Parameter(torch.zeros(num_kv_heads, cluster_num))
        self.last_stats: dict[str, Tensor] = {}

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 (nn.Module's signature)
        """nn.Module's `_apply` (`.to()`, `.cuda()`, `.half()`, ...), then the rotation rebuilt exactly in
        fp64 on its new device: a cast to bf16 would otherwise round its entries for good."""
        super()._apply(fn, recurse)
        if self.rotation is not None and self.rotation.dtype != torch.float64:
            self.rotation = hadamard_rotation(self.head_dim).to(self.rotation.device)
        return self

    def extra_repr(self) -> str:
        return (
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"cluster_num={self.cluster_num}, hidden_dim={self.hidden_dim}, "
            f"quant_bits={self.quant_bits}, block_size={self.block_size}, tau={self.tau}, "
            f"rotate_residuals={self.rotate_residuals}"
        )

    # ---------------------------------------------------------------- internals

    def _check_input(self, x: Tensor, leading_heads: bool = False) -> None:
        """``x`` is [B, H, S, D] with this compressor's H (or, with ``leading_heads``, its first H heads)."""
        _check(x.dim() == 4, "x", f"must be [B, H, S, D], got shape {tuple(x.shape)}")
        heads_ok = 1 <= x.shape[1] <= self.num_kv_heads if leading_heads else x.shape[1] == self.num_kv_heads
        _check(
            heads_ok and x.shape[3] == self.head_dim,
            "x",
            f"must have H={self.num_kv_heads}, D={self.head_dim}, got shape {tuple(x.shape)}",
        )

    def _mlp(self, heads: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The assignment MLP's (w1, b1, w2, b2) for an input of the first `heads` heads (heads are
        independent): the parameters themselves for all heads, whose gradients then need no slice's
        backward (a zero fill and a copy per parameter, eight small kernels per layer in a training step)."""
        params = self.w1, self.b1, self.w2, self.b2
        return params if heads == self.num_kv_heads else tuple(p[:heads] for p in params)

    def _encode(self, blocks: Tensor) -> _Encoded:
        """Cluster, build prototypes and quantize residuals of blocks [B, H, n, bs, D] (`compute_dtype`)."""
        return _encode_blocks(blocks, *self._mlp(blocks.shape[1]), self.tau, self.quant_bits, self.rotation)

    def _split_input(self, x: Tensor, leading_heads: bool = False) -> tuple[Tensor, Tensor]:
        """Validate ``x``; its full blocks in `compute_dtype` and its tail."""
        self._check_input(x, leading_heads)
        full, tail = _split_blocks(x, self.block_size)
        return full.to(compute_dtype(full)), tail

    def _encode_input(self, x: Tensor, leading_heads: bool = False) -> tuple[_Encoded | None, Tensor, Tensor]:
        """Validate and split ``x``; returns (encoding or None if no full block, blocks in `compute_dtype`, tail)."""
        blocks, tail = self._split_input(x, leading_heads)
        with torch.autocast(device_type=x.device.type, enabled=False):
            enc = self._encode(blocks) if blocks.shape[2] > 0 else None
        return enc, blocks, tail

    @torch.no_grad()
    def _record_stats(self, enc: _Encoded | None, blocks: Tensor, x_hat: Tensor) -> None:
        if enc is None:
            nan = torch.tensor(float("nan"), device=blocks.device)
            self.last_stats = {"recon_rel_error": nan, "cluster_usage": nan, "dead_clusters": nan}
            return
        err = (x_hat - blocks).norm() / blocks.norm().clamp_min(_EPS)
        used = torch.zeros(*enc.ids.shape[:3], self.cluster_num, dtype=torch.bool, device=blocks.device)
        used.scatter_(-1, enc.ids, True)
        self.last_stats = {
            "recon_rel_error": err.detach(),
            "cluster_usage": used.float().mean(),
            "dead_clusters": (~used).sum(dim=-1).float().mean(),
        }

    # ---------------------------------------------------------------- public API

    def forward(self, x: Tensor, with_loss: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Fake-quantized reconstruction of ``x`` [B, H, S, D]; the trailing partial block is returned as is.
        With ``with_loss``, ``(reconstruction, reconstruction_loss(x))`` from the one encoding (a method of
        its own would bypass FSDP2's and ZeRO-3's parameter gathering, which hook ``forward``). In eval
        mode it also records ``last_stats`` (training steps skip that work). A training pass with
        ``with_loss`` runs `_reconstruction_and_distortion`, compiled on the GPU (once per input shape:
        training steps have one; `_to_store` rounds in integer arithmetic that the compiler keeps): its fused
        kernels sum in another order, so a token near a tie may take another cluster or code than the
        eager pass (about 0.01% of the elements on the test's data)."""
        if with_loss and self.training and x.shape[2] >= self.block_size:
            blocks, tail = self._split_input(x)
            training_pass = compiled(_reconstruction_and_distortion) if x.is_cuda else _reconstruction_and_distortion
            with torch.autocast(device_type=x.device.type, enabled=False):
                x_hat, loss = training_pass(blocks, *self._mlp(x.shape[1]), self.tau, self.quant_bits,
                                            self.rotation)
            return _join_blocks(x_hat, tail), loss
        enc, blocks, tail = self._encode_input(x)
        x_hat = enc.reconstruct() if enc is not None else blocks
        if not self.training:
            self._record_stats(enc, blocks, x_hat)
        out = _join_blocks(x_hat, tail) if enc is not None else x
        return (out, _distortion(enc, blocks)) if with_loss else out

    def reconstruction_loss(self, x: Tensor) -> Tensor:
        """Clustering loss for the assignment MLP (differentiable, fp32 scalar).

        Soft k-means distortion ``sum_t sum_c p_tc ||x_t - prototype_c||^2`` over full blocks,
        divided by the within-block variance ``sum_t ||x_t - mean_block||^2``. It lies in
        [0, 1] (1 = no better than one prototype per block); it is the residual energy the
        quantizer must encode. Zero when ``x`` has no full block.
        """
        enc, blocks, _ = self._encode_input(x)
        return _distortion(enc, blocks)

    @torch.no_grad()
    def compress(self, x: Tensor) -> PackedKV:
        """Pack ``x`` [B, H, S, D] as a cache of S tokens stores it (see :class:`PackedKV`): every
        block but the newest compressed, the newest (1..block_size tokens) kept raw in the tail."""
        self._check_input(x)
        s_full = stored_split(x.shape[2], self.block_size)
        packed = self.compress_blocks(x[:, :, :s_full])
        packed.tail = x[:, :, s_full:].clone()
        return packed

    @torch.no_grad()
    def compress_blocks(self, x: Tensor) -> PackedKV:
        """Pack whole blocks ``x`` [B, H, n * block_size, D] (the tail of the result is empty); ``x`` may
        hold only the first H heads (a bridge target caches only the heads it keeps)."""
        _check(x.shape[-2] % self.block_size == 0, "x", f"must hold whole blocks of {self.block_size} tokens, "
               f"got {x.shape[-2]}")
        enc, blocks, tail = self._encode_input(x, leading_heads=True)
        b, h, n, bs, d = blocks.shape
        if enc is None:
            ids = torch.zeros(b, h, 0, dtype=torch.long, device=x.device)
            q = blocks.new_zeros(b, h, 0, d)
            scale = blocks.new_zeros(b, h, 0)
            prototypes = blocks.new_zeros(b, h, 0, self.cluster_num, d)
        else:
            ids, q = enc.ids.reshape(b, h, n * bs), enc.q.reshape(b, h, n * bs, d)
            scale, prototypes = enc.scale.reshape(b, h, n * bs), enc.prototypes
        return PackedKV(
            ids=ids.to(torch.uint8),
            residual=_pack(q, self.quant_bits),
            scales=scale.to(_STORE_DTYPE),
            prototypes=prototypes.to(_STORE_DTYPE),
            tail=tail.clone(),
            bits=self.quant_bits,
            block_size=self.block_size,
            rotation=self.rotation,
        )

    @staticmethod
    def decompress(packed: PackedKV) -> Tensor:
        """Rebuild [B, H, S, D] (in the tail's dtype) from :class:`PackedKV`."""
        b, h, s_full = packed.ids.shape
        n, d = packed.prototypes.shape[2], packed.head_dim
        ids = packed.ids.long().reshape(b, h, n, packed.block_size)
        dtype = compute_dtype(packed.tail)
        q = _unpack(packed.residual, packed.bits, d, dtype).reshape(b, h, n, packed.block_size, d)
        scale = packed.scales.to(dtype).reshape(b, h, n, packed.block_size, 1)
        x_hat = _unrotated(_gather_prototypes(packed.prototypes.to(dtype), ids) + q * scale, packed.rotation)
        return _join_blocks(x_hat, packed.tail)

    def byte_account(self, seq_len: int, batch_size: int = 1, tail_bytes: int = 2) -> dict[str, float]:
        """:func:`asq_bytes` for this compressor's configuration."""
        return asq_bytes(
            seq_len,
            self.num_kv_heads,
            self.head_dim,
            self.cluster_num,
            self.quant_bits,
            self.block_size,
            batch_size,
            tail_bytes,
        )

    def bytes_per_token(self, seq_len: int, tail_bytes: int = 2) -> float:
        """Amortized stored bytes per token per KV head at ``seq_len`` (bf16 is ``2 * head_dim``)."""
        return self.byte_account(seq_len, tail_bytes=tail_bytes)["bytes_per_token"]
