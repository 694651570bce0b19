"""Append-only storage of one layer's K or V for generation: compressed blocks plus a raw tail.

For a cache of S tokens every block but the newest is stored as its compressor packs it
(`KVCompressor.pack_blocks`: for ASQ cluster ids, residual codes, fp16 scales and fp16 prototypes) and
the newest block (1..block_size tokens) stays raw. A block is packed when the first token after it
arrives, so a query always sees its own block exactly, as training does. The bytes held are what the
compressor's byte account counts. Without a compressor the store is a plain growing tensor (the tail).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gsm_train.kernels.packed_rows import PackedRows
from gsm_train.modules.kv_compressor import ASQCompressor
from gsm_train.modules.kv_registry import KVCompressor
from gsm_train.quant import compute_dtype, stored_split


class KVStore:
    """K or V of one layer, [B, H, S, D], packed by `compressor` (or kept raw when it is None)."""

    def __init__(self, compressor: KVCompressor | None, heads: int) -> None:
        self.compressor = compressor
        self.heads = heads
        self.packed: dict[str, Tensor] | None = None  # the compressor's fields, joined along dim 2
        self.packed_len = 0  # tokens held packed (F)
        self.tail: Tensor | None = None  # raw [B, H, S - F, D]

    @property
    def seq_len(self) -> int:
        return self.packed_len + (0 if self.tail is None else self.tail.shape[-2])

    def append(self, states: Tensor) -> None:
        """Add new tokens [B, H, n, D]; pack every block that is no longer the newest."""
        states = states[:, : self.heads]
        self.tail = states.contiguous() if self.tail is None else torch.cat((self.tail, states), dim=-2)
        if self.compressor is None:
            return
        to_pack = stored_split(self.seq_len, self.compressor.block_size) - self.packed_len
        if to_pack <= 0:
            return
        new = self.compressor.pack_blocks(self.tail[:, :, :to_pack])
        self.tail = self.tail[:, :, to_pack:].contiguous()
        self.packed = new if self.packed is None else {
            name: torch.cat((self.packed[name], field), dim=2) for name, field in new.items()}
        self.packed_len += to_pack

    def gather(self, index: Tensor) -> Tensor:
        """Rows [B, H, k, D] at positions `index` [B, H, k] (each in [0, seq_len)), dequantized, in the tail's dtype."""
        in_tail = (index - self.packed_len).clamp_min(0)
        dim = self.tail.shape[-1]
        rows = torch.gather(self.tail, 2, in_tail.unsqueeze(-1).expand(*index.shape, dim))
        if self.packed_len == 0:
            return rows
        at = index.clamp_max(self.packed_len - 1)
        packed_rows = self.compressor.gather_packed(self.packed, at, compute_dtype(rows)).to(rows.dtype)
        return torch.where((index < self.packed_len).unsqueeze(-1), packed_rows, rows)

    def all_rows(self) -> Tensor:
        """Every token [B, H, S, D], dequantized."""
        batch, heads = self.tail.shape[:2]
        positions = torch.arange(self.seq_len, device=self.tail.device).expand(batch, heads, -1)
        return self.gather(positions)

    def packed_rows(self) -> PackedRows | None:
        """What the fused decode kernel reads (`kernels.packed_rows.PackedRows`); None where it cannot read
        this store (a compressor other than ASQ)."""
        asq = self.compressor
        if asq is not None and not isinstance(asq, ASQCompressor):
            return None
        signs = asq.rotation_signs if asq is not None and asq.rotate_residuals else None
        if self.packed_len == 0:
            return PackedRows(self.tail, rotation_signs=signs)
        fields = self.packed
        return PackedRows(self.tail, fields["ids"], fields["residual"], fields["scales"], fields["prototypes"],
                          asq.quant_bits, asq.cluster_num, asq.block_size, signs)

    def nbytes(self) -> int:
        """Bytes held."""
        tensors = [*(self.packed or {}).values(), self.tail]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)
