"""Rounding fp32 values to a narrower float's grid inside Triton kernels, exact on every backend.

A kernel that must reproduce PyTorch's rounding between steps (an op's bf16 result that the next op reads)
rounds with these instead of a plain cast: Triton's interpreter casts fp32 to bf16 by truncation, so a cast
alone would differ from the GPU (and from PyTorch) by one bf16 step at half of all values."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the callers check for Triton before they launch
    triton = None

# a tensor dtype's code for `rounded`
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


if triton is not None:

    @triton.jit
    def bf16_grid(x):
        """fp32 `x` rounded to the nearest bf16 value, ties to even, in integer arithmetic on its bits (exact
        on every backend: Triton's interpreter rounds a bf16 cast otherwise), still fp32."""
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def rounded(x, CODE: tl.constexpr):
        """fp32 `x` rounded to the grid of the dtype `CODE` names (`DTYPE_CODES`: 0 fp32, unchanged; 1 bf16;
        2 fp16), to nearest even, still fp32: what PyTorch stores for an op computed in fp32 in that dtype."""
        if CODE == 1:
            x = bf16_grid(x)
        elif CODE == 2:
            x = x.to(tl.float16).to(tl.float32)
        return x
