"""RoPE for the Sparse Gate Head: each selector rotates its gate query/key pairs by a chosen subset of
the base model's frequencies (`rope_freq_index`), so that gate scores commute with RoPE like q.k does.

An index of `head_dim // 2` (one past the model's last frequency, `unrotated_index`) marks a pair that is
not rotated (cos 1, sin 0): its part of the score depends on the content alone, not on the distance
(`gate_rotated_pairs` in the recipe)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F


def unrotated_index(base_head_dim: int) -> int:
    """The `rope_freq_index` value of a gate pair that is not rotated: one past the base model's last
    frequency (`base_head_dim // 2` frequencies, 0 to base_head_dim // 2 - 1)."""
    return base_head_dim // 2


def rotate(x: Tensor, c: Tensor, s: Tensor) -> Tensor:
    """Apply RoPE (rotate-half layout) with per-pair cos `c` and sin `s`; with `-s` it applies the inverse
    (the transpose), which is how gradients go back through it."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def rope_tables(cos: Tensor, sin: Tensor, freq_index: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Each selector's chosen base frequencies (`freq_index` [n, dg/2]) of the model's cos/sin
    [B, T, head_dim]: cos and sin tables [B, n, T, dg/2] in `dtype`; cos 1 and sin 0 where the index is
    `unrotated_index(head_dim)` (the tables gather from the model's frequencies and one column past them)."""
    half = cos.shape[-1] // 2
    selectors = freq_index.shape[0]
    gather = freq_index[None, :, None, :].expand(cos.shape[0], -1, cos.shape[1], -1)
    c, s = (
        torch.gather(
            F.pad(table[..., :half], (0, 1), value=fill)[:, None].expand(-1, selectors, -1, -1), -1, gather
        ).to(dtype)
        for table, fill in ((cos, 1.0), (sin, 0.0))
    )
    return c, s


def rope_pair(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, freq_index: Tensor) -> tuple[Tensor, Tensor]:
    """Gate q and k [B, n, T, dg] rotated by each selector's frequencies of the model's cos/sin."""
    c, s = rope_tables(cos, sin, freq_index, q.dtype)
    return rotate(q, c, s), rotate(k, c, s)


@dataclass(frozen=True, eq=False)  # tensors: compared by identity, never elementwise
class GateKeyRotation:
    """The RoPE a gate's projected keys [B, n, T, dg] still need: the model's cos/sin [B, T, head_dim] of their
    positions and the gate's `rope_freq_index` [n, dg/2]. `apply` rotates them as `SparseGateHead.keys` does;
    `apply_joined` rotates several gates' keys of the same positions in one call, the same bits as each
    alone (elementwise work on the same values)."""

    cos: Tensor
    sin: Tensor
    freq_index: Tensor

    def apply(self, keys: Tensor) -> Tensor:
        return rotate(keys, *rope_tables(self.cos, self.sin, self.freq_index, keys.dtype))

    @staticmethod
    def apply_joined(rotations: list[GateKeyRotation], keys: list[Tensor]) -> Tensor:
        """`keys` side by side along dim 1 [B, sum n, T, dg], each rotated by its rotation of `rotations` (the
        same cos/sin, keys of one shape but their selectors n and one dtype): one `rope_tables` and one `rotate`."""
        joined = GateKeyRotation(rotations[0].cos, rotations[0].sin, torch.cat([r.freq_index for r in rotations]))
        return joined.apply(torch.cat(keys, 1))
