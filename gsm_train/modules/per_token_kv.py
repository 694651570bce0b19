"""Per-token K/V quantization: the worked example of a K/V compressor variant (docs/extending.md).

Every block of `block_size` tokens but the newest is stored as codes on the mid-rise grid of
`quant_bits` (`quant.quantize`) with one fp16 scale per token and head; the newest block stays raw, as
ASQ's does, so a query sees its own block exactly and teacher forcing equals cached decoding. Nothing
trains: the loss is zero.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from gsm_train.config.schema import PerTokenKVConfig
from gsm_train.quant import (
    STORE_DTYPE,
    compute_dtype,
    join_blocks,
    pack_codes,
    quantize,
    split_blocks,
    stored_split,
    unpack_codes,
)


class PerTokenCompressor(nn.Module):
    """One layer's K or V [B, H, S, D], quantized per token in blocks (see the module docstring)."""

    def __init__(self, head_dim: int, quant_bits: int, block_size: int) -> None:
        super().__init__()
        self.head_dim, self.quant_bits, self.block_size = head_dim, quant_bits, block_size

    @classmethod
    def build(
        cls, config: PerTokenKVConfig, layer: int, num_kv_heads: int, head_dim: int
    ) -> tuple[PerTokenCompressor, PerTokenCompressor]:
        """K's and V's compressors as `config` sets them."""
        return tuple(cls(head_dim, bits, config.block_size) for bits in config.bits(layer))

    @staticmethod
    def bytes_per_token(config: PerTokenKVConfig, layer: int, seq_len: int, head_dim: int) -> float:
        """Bytes K and V of one KV head take per token in a cache of `seq_len`: codes and a scale per packed
        token, bf16 rows for the newest block."""
        packed = stored_split(seq_len, config.block_size)
        per_side = [
            packed * (math.ceil(head_dim * bits / 8) + 2) + (seq_len - packed) * 2 * head_dim
            for bits in config.bits(layer)
        ]
        return sum(per_side) / max(seq_len, 1)

    def forward(self, x: Tensor, with_loss: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """x [B, H, S, D] with its full blocks as the cache stores them (straight-through rounding) and the
        trailing partial block as is; with `with_loss`, also the loss (zero: nothing trains)."""
        full, tail = split_blocks(x, self.block_size)
        q, scale = quantize(full.to(compute_dtype(x)), self.quant_bits, dim=-1)
        out = join_blocks(q * scale, tail)
        return (out, x.new_zeros((), dtype=torch.float32)) if with_loss else out

    def field_specs(self, batch: int, heads: int, capacity: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The shape and dtype of each `pack_blocks` field for `capacity` tokens of `heads` heads."""
        nbytes = math.ceil(self.head_dim * self.quant_bits / 8)
        return {
            "codes": ((batch, heads, capacity, nbytes), torch.uint8),
            "scales": ((batch, heads, capacity), STORE_DTYPE),
        }

    @torch.no_grad()
    def pack_blocks(self, x: Tensor) -> dict[str, Tensor]:
        """Whole blocks x [B, H, F, D]: `codes` uint8 [B, H, F, ceil(D * bits / 8)], `scales` fp16 [B, H, F]."""
        q, scale = quantize(x.to(compute_dtype(x)), self.quant_bits, dim=-1)
        return {"codes": pack_codes(q, self.quant_bits), "scales": scale.squeeze(-1).to(STORE_DTYPE)}

    def gather_packed(self, fields: dict[str, Tensor], at: Tensor, dtype: torch.dtype) -> Tensor:
        """Rows [B, H, k, D] in `dtype` at packed positions `at` [B, H, k] (exact but for `dtype`'s rounding)."""
        codes = fields["codes"]
        picked = torch.gather(codes, 2, at.unsqueeze(-1).expand(*at.shape, codes.shape[-1]))
        scales = torch.gather(fields["scales"], 2, at).to(dtype).unsqueeze(-1)
        return unpack_codes(picked, self.quant_bits, self.head_dim, dtype) * scales
