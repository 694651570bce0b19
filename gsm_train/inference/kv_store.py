"""Append-only storage of one layer's K or V for generation: ASQ-packed blocks plus a raw tail.

A store holds exactly what the byte account (`quant.asq_bytes`) counts: for a cache of S
tokens, every block but the newest is packed (cluster ids, residual codes, fp16 scales, fp16
prototypes) and the newest block (1..block_size tokens) stays raw. A block is packed when the
first token after it arrives, so a query always sees its own block exactly, as training does.
Without ASQ the store is a plain growing tensor (the tail alone).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gsm_train.kernels.packed_rows import PackedRows
from gsm_train.functional.asq import PackedKV
from gsm_train.modules.kv_compressor import ASQCompressor
from gsm_train.quant import compute_dtype, stored_split, unpack_codes, unrotated


class KVStore:
    """K or V of one layer, [B, H, S, D], packed by `asq` (or kept raw when `asq` is None)."""

    def __init__(self, asq: ASQCompressor | None, heads: int) -> None:
        self.asq = asq
        self.heads = heads
        self.ids: Tensor | None = None  # uint8 [B, H, F]
        self.residual: Tensor | None = None  # uint8 [B, H, F, ceil(D * bits / 8)]
        self.scales: Tensor | None = None  # float16 [B, H, F]
        self.prototypes: Tensor | None = None  # float16 [B, H, F / block_size, C, D]
        self.tail: Tensor | None = None  # raw [B, H, S - F, D]

    @property
    def packed_len(self) -> int:
        """Tokens held packed (F)."""
        return 0 if self.ids is None else self.ids.shape[-1]

    @property
    def seq_len(self) -> int:
        return self.packed_len + (0 if self.tail is None else self.tail.shape[-2])

    def append(self, states: Tensor) -> None:
        """Add new tokens [B, H, n, D]; pack every block that is no longer the newest."""
        states = states[:, : self.heads]
        self.tail = states.contiguous() if self.tail is None else torch.cat((self.tail, states), dim=-2)
        if self.asq is None:
            return
        to_pack = stored_split(self.seq_len, self.asq.block_size) - self.packed_len
        if to_pack <= 0:
            return
        packed = self.asq.compress_blocks(self.tail[:, :, :to_pack])
        self.tail = self.tail[:, :, to_pack:].contiguous()
        new = (packed.ids, packed.residual, packed.scales, packed.prototypes)
        if self.ids is None:
            self.ids, self.residual, self.scales, self.prototypes = new
        else:
            old = (self.ids, self.residual, self.scales, self.prototypes)
            self.ids, self.residual, self.scales, self.prototypes = (
                torch.cat((a, b), dim=2) for a, b in zip(old, new, strict=True))

    def gather(self, index: Tensor) -> Tensor:
        """Rows [B, H, k, D] at positions `index` [B, H, k] (each in [0, seq_len)), dequantized, in the tail's dtype."""
        packed_len = self.packed_len
        in_tail = (index - packed_len).clamp_min(0)
        dim = self.tail.shape[-1]
        rows = torch.gather(self.tail, 2, in_tail.unsqueeze(-1).expand(*index.shape, dim))
        if packed_len == 0:
            return rows
        at = index.clamp_max(packed_len - 1)
        ids = torch.gather(self.ids, 2, at).long()
        nbytes = self.residual.shape[-1]
        dtype = compute_dtype(rows)
        codes = unpack_codes(torch.gather(self.residual, 2, at.unsqueeze(-1).expand(*at.shape, nbytes)),
                        self.asq.quant_bits, dim, dtype)
        scales = torch.gather(self.scales, 2, at).to(dtype).unsqueeze(-1)
        block = at // self.asq.block_size
        b, h, n_blocks, clusters, _ = self.prototypes.shape
        flat = self.prototypes.reshape(b, h, n_blocks * clusters, dim)
        protos = torch.gather(flat, 2, (block * clusters + ids).unsqueeze(-1).expand(*at.shape, dim)).to(dtype)
        packed_rows = unrotated(protos + codes * scales, self.asq.rotation).to(rows.dtype)
        return torch.where((index < packed_len).unsqueeze(-1), packed_rows, rows)

    def packed_rows(self) -> PackedRows:
        """What the fused decode kernel reads (`kernels.sparse_decode.PackedRows`)."""
        asq = self.asq
        signs = asq.rotation_signs if asq is not None and asq.rotate_residuals else None
        if self.packed_len == 0:
            return PackedRows(self.tail, rotation_signs=signs)
        return PackedRows(self.tail, self.ids, self.residual, self.scales, self.prototypes, asq.quant_bits,
                          asq.cluster_num, asq.block_size, signs)

    def all_rows(self) -> Tensor:
        """Every token [B, H, S, D], dequantized."""
        if self.packed_len == 0:
            return self.tail
        return ASQCompressor.decompress(PackedKV(self.ids, self.residual, self.scales, self.prototypes, self.tail,
                                                 self.asq.quant_bits, self.asq.block_size, self.asq.rotation))

    def nbytes(self) -> int:
        """Bytes held."""
        tensors = (self.ids, self.residual, self.scales, self.prototypes, self.tail)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)
