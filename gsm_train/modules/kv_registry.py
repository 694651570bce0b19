"""The K/V compressor variants by `kv_compression.method`, and what every variant provides.

A variant is a module class with the `KVCompressor` methods and two constructors-by-config
(`build`, `bytes_per_token`); its configuration class sits in `gsm_train.config.schema.KV_METHOD_CONFIGS`.
Adding one (docs/extending.md): its own module, its config class, and a line here.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from gsm_train.modules.kv_compressor import ASQCompressor
from gsm_train.modules.per_token_kv import PerTokenCompressor

KV_COMPRESSORS: dict[str, type] = {
    "asq": ASQCompressor,
    "per_token": PerTokenCompressor,
}


class KVCompressor(Protocol):
    """One layer's K (or V) compressor over [B, H, S, D] in blocks of `block_size` tokens: every block but
    the newest is stored compressed, the newest raw. `forward` (the teacher-forced pass) must give what
    `pack_blocks` then `gather_packed` give back, so that teacher forcing equals cached decoding."""

    quant_bits: int
    block_size: int

    def __call__(self, x: Tensor, with_loss: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """x with its full blocks as stored (differentiable), and with `with_loss` a 0-d training loss."""

    def field_specs(self, batch: int, heads: int, capacity: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The shape and dtype of each field `pack_blocks` returns, for `capacity` tokens (a whole number of
        blocks) of `heads` heads."""

    def pack_blocks(self, x: Tensor) -> dict[str, Tensor]:
        """Whole blocks [B, H, F, D] as stored fields, each with the token (or block) axis at dim 2."""

    def gather_packed(self, fields: dict[str, Tensor], at: Tensor, dtype: torch.dtype) -> Tensor:
        """Rows [B, H, k, D] at packed positions `at` [B, H, k] of fields joined along dim 2."""


def compressor_class(method: str) -> type:
    """The compressor class of a `kv_compression.method`."""
    return KV_COMPRESSORS[method]


def build_compressors(config, layer: int, num_kv_heads: int, head_dim: int) -> tuple[KVCompressor, KVCompressor]:
    """K's and V's compressors of `layer` from a `kv_compression` block."""
    return compressor_class(config.method).build(config, layer, num_kv_heads, head_dim)


def kv_bytes_per_token(config, layer: int, seq_len: int, head_dim: int) -> float:
    """Bytes K and V of one KV head of `layer` take per token in a cache of `seq_len` under `config`."""
    return compressor_class(config.method).bytes_per_token(config, layer, seq_len, head_dim)
