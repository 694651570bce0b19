"""Rounding fp32 values to a narrower float's grid inside Triton kernels, exact on every backend.

A kernel that must reproduce PyTorch's rounding between steps (an op's bf16 or fp16 result that the next op
reads) rounds with these instead of a cast round trip: Triton's interpreter casts fp32 to bf16 by truncation,
so a cast alone would differ from the GPU (and from PyTorch) by one bf16 step at half of all values; and the
GPU compiler narrows an op whose fp32 result is cast to fp16 and back into the fp16 op itself, fusing a
multiply into the next add unrounded (`fma.rn.f16`), so a rotation's two products and their sum would round
once where PyTorch rounds three times (four fp16 steps off where the sum cancels)."""

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
    def fp16_grid(x):
        """fp32 `x` rounded to the nearest fp16 value, ties to even, still fp32, as a cast to fp16 rounds it
        (beyond fp16's largest finite value +-inf, NaN kept), in integer arithmetic on its bits and exact
        power-of-two scaling, which no compiler narrows to fp16 arithmetic."""
        bits = x.to(tl.uint32, bitcast=True)
        sign = bits & 0x80000000
        magnitude = bits ^ sign
        normal = (magnitude + 0xFFF + ((magnitude >> 13) & 1)) & 0xFFFFE000  # 10 of fp32's 23 fraction bits kept
        # below fp16's smallest normal value 2^-14 its grid is the multiples of 2^-24: in those units (exact),
        # rounded to a whole number by the fp32 grid of [2^23, 2^24) (ties to even), scaled back (exact)
        steps = tl.minimum(magnitude.to(tl.float32, bitcast=True), 6.103515625e-05) * 16777216.0
        subnormal = (((steps + 12582912.0) - 12582912.0) * 5.9604644775390625e-08).to(tl.uint32, bitcast=True)
        out = tl.where(magnitude < 0x38800000, subnormal, normal)  # below 2^-14
        out = tl.where(out > 0x477FE000, 0x7F800000, out)  # beyond 65504, fp16's largest finite value: inf
        out = tl.where(magnitude > 0x7F800000, magnitude, out)  # NaN kept
        return (out | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def rounded(x, CODE: tl.constexpr):
        """fp32 `x` rounded to the grid of the dtype `CODE` names (`DTYPE_CODES`: 0 fp32, unchanged; 1 bf16;
        2 fp16), to nearest even, still fp32: what PyTorch stores for an op computed in fp32 in that dtype."""
        if CODE == 1:
            x = bf16_grid(x)
        elif CODE == 2:
            x = fp16_grid(x)
        return x
