"""ASQ's math as plain tensor functions: soft cluster assignment, prototypes, residual codes, the
reconstruction and the clustering loss, on blocks [B, H, n, block_size, D] (see
`modules.kv_compressor.ASQCompressor` for the scheme). Imports only `gsm_train.quant`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from gsm_train.quant import EPS, compute_dtype, join_blocks, quantize, rotated, split_blocks, to_store, unrotated


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
class Encoded:
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
        return unrotated(gather_prototypes(self.prototypes, self.ids) + self.q * self.scale, self.rotation)


def gather_prototypes(prototypes: Tensor, ids: Tensor) -> Tensor:
    """prototypes [B, H, n, C, D], ids [B, H, n, bs] -> [B, H, n, bs, D]."""
    index = ids.unsqueeze(-1).expand(*ids.shape, prototypes.shape[-1])
    return torch.gather(prototypes, 3, index)


def soft_assignment(blocks: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, tau: float) -> Tensor:
    """Soft assignment [B, H, n, bs, C] of blocks [B, H, n, bs, D] by the per-head MLP (w1 [H, D, K], b1 [H, K],
    w2 [H, K, C], b2 [H, C]) from per-block standardized inputs, in the blocks' dtype.

    Each head's weights are broadcast over the B * n blocks rather than contracted in one einsum over
    heads, so the weights' gradient is a small product per block and a sum (docs/design-decisions.md)."""
    dtype = blocks.dtype
    centered = blocks - blocks.mean(dim=3, keepdim=True)
    rms = centered.pow(2).mean(dim=(3, 4), keepdim=True).add(EPS).sqrt()
    hidden = torch.matmul(centered / rms, w1.to(dtype)[:, None])
    hidden = F.gelu(hidden + b1.to(dtype)[:, None, None, :])
    logits = torch.matmul(hidden, w2.to(dtype)[:, None]) + b2.to(dtype)[:, None, None, :]
    return torch.softmax(logits if tau == 1 else logits / tau, dim=-1)  # x / 1 is x: one kernel fewer


def width_runs(bits: tuple[int, ...]) -> list[tuple[int, int]]:
    """(width, groups) of each run of neighbouring groups of one width in `bits`: (4, 4, 2) -> [(4, 2), (2, 1)]."""
    return [(width, len(list(run))) for width, run in itertools.groupby(bits)]


def quantize_groups(x: Tensor, bits: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """`_quantize` over the last dim of x [B, G * H, ...], whose heads are G = len(bits) groups side by side
    (K's and V's, of one layer or of several), each group at its own width; neighbouring groups of one width
    are quantized in one call (each head's values are its own either way)."""
    if len(set(bits)) == 1:
        return quantize(x, bits[0], dim=-1)
    heads = x.shape[1] // len(bits)
    runs = width_runs(bits)
    parts = x.split([count * heads for _, count in runs], 1)
    quantized = [quantize(part, width, dim=-1) for part, (width, _) in zip(parts, runs, strict=True)]
    return torch.cat([q for q, _ in quantized], 1), torch.cat([scale for _, scale in quantized], 1)


def encode_blocks(
    blocks: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
    tau: float,
    bits: int | tuple[int, ...],
    rotation: Tensor | None = None,
) -> Encoded:
    """Cluster, build prototypes and quantize residuals of blocks [B, H, n, bs, D] (`compute_dtype`), both
    of the rotated blocks (``blocks @ rotation``) when there is a rotation (the assignment reads the blocks
    as they are); `bits` a width, or one per group of heads side by side (`quantize_groups`)."""
    probs = soft_assignment(blocks, w1, b1, w2, b2, tau)
    rows = rotated(blocks, rotation)
    weighted = torch.matmul(probs.transpose(-1, -2), rows)
    mass = probs.sum(dim=3)
    prototypes = to_store(weighted / (mass.unsqueeze(-1) + EPS))
    ids = probs.argmax(dim=-1)
    residual = rows - gather_prototypes(prototypes, ids)
    q, scale = quantize_groups(residual, (bits,) if isinstance(bits, int) else bits)
    return Encoded(probs, weighted, mass, prototypes, ids, q, scale, rotation)


def distortion(enc: Encoded | None, blocks: Tensor, groups: int = 1) -> Tensor:
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
    return (distortion.clamp_min(0) / variance.clamp_min(EPS)).mean()


def reconstruction_and_distortion(
    blocks: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, tau: float, bits: int, rotation: Tensor | None
) -> tuple[Tensor, Tensor]:
    """A training pass over full blocks: the fake-quantized blocks and the distortion loss."""
    enc = encode_blocks(blocks, w1, b1, w2, b2, tau, bits, rotation)
    return enc.reconstruct(), distortion(enc, blocks)


def paired_reconstruction(
    key: Tensor,
    value: Tensor,
    mlps: tuple[tuple[Tensor, ...], tuple[Tensor, ...]],
    tau: float,
    bits: tuple[int, int],
    rotation: Tensor | None,
    block_size: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """K's and V's training passes as one: (K's reconstruction, V's, the mean of their losses), for key and
    value [B, H, S, D] whole and each side's assignment MLP (w1, b1, w2, b2). Their blocks lie side by side
    on the head axis, so each kernel and matrix product of the pass serves both, and the split into blocks,
    the casts and the join fuse into the compiled pass."""
    heads = key.shape[1]
    full, tail = split_blocks(torch.cat((key, value), 1), block_size)
    blocks = full.to(compute_dtype(full))
    w1, b1, w2, b2 = (torch.cat(pair, 0) for pair in zip(*mlps))
    enc = encode_blocks(blocks, w1, b1, w2, b2, tau, bits, rotation)
    out = join_blocks(enc.reconstruct(), tail)
    return out[:, :heads], out[:, heads:], distortion(enc, blocks, groups=2)
