"""Gate keys as the KV cache stores them: bf16 at 16 bits, or int8 codes with one fp16 scale per key
at 8 bits; the stored forms are exact (integers, and scales on fp16's grid)."""

from __future__ import annotations

import torch
from torch import Tensor

from gsm_train.quant import FP16_TINY, INT8_LEVELS, fp16_grid

GATE_KEY_DTYPE = torch.bfloat16  # how the KV cache stores gate keys at 16 bits (2 bytes per dimension)


def _int8_levels(gate_k: Tensor) -> tuple[Tensor, Tensor]:
    """Gate keys [..., dg] at 8 bits: (codes, integers in [-127, 127], and the scale per key [..., 1], both
    fp32). The scale is max|k| / 127, at least fp16's smallest normal, on the fp16 grid; it is rounded in
    integer arithmetic (`fp16_grid`) because Inductor would fuse a plain fp16 cast away."""
    x = gate_k.detach().float()
    scale = fp16_grid((x.abs().amax(-1, keepdim=True) / INT8_LEVELS).clamp_min(FP16_TINY))
    return torch.round(x / scale).clamp(-INT8_LEVELS, INT8_LEVELS), scale


def encode_gate_keys(gate_k: Tensor, bits: int) -> tuple[Tensor, Tensor | None]:
    """Gate keys [..., dg] as the cache stores them: bf16 (bits 16, no scales), or int8 codes with an
    fp16 scale per key [..., 1] (bits 8: scale = max|k| / 127)."""
    if bits == 16:
        return gate_k.to(GATE_KEY_DTYPE), None
    codes, scale = _int8_levels(gate_k)
    return codes.to(torch.int8), scale.to(torch.float16)  # both exact: integers, and values on fp16's grid


def decode_gate_keys(codes: Tensor, scales: Tensor | None) -> Tensor:
    """fp32 gate keys from what `encode_gate_keys` stored."""
    return codes.float() if scales is None else codes.float() * scales.float()


def int8_stored_keys(gate_k: Tensor) -> Tensor:
    """fp32 gate keys [..., dg] as 8-bit storage holds them, `decode_gate_keys(*encode_gate_keys(gate_k, 8))`,
    without the int8 and fp16 tensors between: one expression for a compiled graph (zeros may keep their sign).
    Compiled on the GPU, Inductor's division may round differently in the last bit, so a rare key can land
    one code or one scale step from the cache's, as ASQ's compiled pass can (`kv_compressor`)."""
    codes, scale = _int8_levels(gate_k)
    return codes * scale


def gate_key_bytes(gate_head_dim: int, bits: int) -> int:
    """Bytes the cache holds per gate key: 2 per dimension at 16 bits; 1 per dimension plus the scale at 8."""
    return 2 * gate_head_dim if bits == 16 else gate_head_dim + 2
