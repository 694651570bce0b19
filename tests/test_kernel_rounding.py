"""`gsm_train.kernels.rounding`: the kernels' roundings to bf16 and fp16 equal PyTorch's casts at every value
class (exact: both round to nearest, ties to even), and a kernel that rounds between its narrow ops keeps
them in fp32 once compiled for a GPU (a cast round trip there let the compiler fuse them into fp16 FMAs)."""

from __future__ import annotations

import os
import re

import pytest
import torch
from run_helpers import KERNEL_DEVICE, triton_kernel_test

from gsm_train.kernels import decode_fusion
from gsm_train.kernels.rounding import DTYPE_CODES

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402  (after the skip: Triton is optional)

from gsm_train.kernels.rounding import rounded  # noqa: E402

BLOCK = 4096


@triton.jit
def _rounding_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, CODE: tl.constexpr):
    """`rounded` of BLOCK fp32 values."""
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = at < n
    tl.store(out_ptr + at, rounded(tl.load(x_ptr + at, mask=inside, other=0.0), CODE), mask=inside)


def _grid_and_ties(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of the 16-bit `dtype` as fp32, the midpoints between neighbours and the fp32
    values either side of each midpoint."""
    grid = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).float()
    grid = grid[torch.isfinite(grid)].sort().values
    ties = ((grid[1:].double() + grid[:-1].double()) / 2).float()
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    return torch.cat([grid, ties, torch.nextafter(ties, up), torch.nextafter(ties, down)])


@triton_kernel_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounded_equals_the_cast_at_every_tie_subnormal_and_overflow(dtype: torch.dtype) -> None:
    """Both dtypes' grids, ties and their neighbours, fp16's subnormals and the values past its range
    (inf), +-inf, NaN, +-0.0, fp32 subnormals and 100,000 random values of many scales: `rounded` gives
    the values and signs of `x.to(dtype).float()`."""
    special = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-40, -1e-40, -1e-8, 2.0**-25, -(2.0**-25)]
    special += [65504.0, 65519.0, 65520.0, -65520.0, 70000.0, 3.0e38, -3.4e38]
    generator = torch.Generator().manual_seed(0)
    scales = 10.0 ** torch.randint(-9, 6, (100_000,), generator=generator)
    x = torch.cat([_grid_and_ties(torch.float16), _grid_and_ties(torch.bfloat16), torch.tensor(special)])
    x = torch.cat([x, torch.randn(100_000, generator=generator) * scales]).to(KERNEL_DEVICE)
    got = torch.empty_like(x)
    _rounding_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, got, x.numel(), BLOCK=BLOCK, CODE=DTYPE_CODES[dtype])
    expected = x.to(dtype).float()
    numbers = ~expected.isnan()
    assert torch.equal(got.isnan(), ~numbers) and torch.equal(got[numbers].signbit(), expected[numbers].signbit())
    assert torch.equal(got[numbers], expected[numbers])


NARROW_ARITHMETIC = re.compile(r"\b(?:fma|add|sub|mul)(?:\.rn)?\.(?:f16|bf16)(?:x2)?\b")
ROPE_SIGNATURE = dict.fromkeys(
    ["q_ptr", "k_ptr", "cos_ptr", "sin_ptr", "q_out_ptr", "k_out_ptr"], "*fp16"
) | dict.fromkeys(
    ["q_batch_stride", "q_head_stride", "k_batch_stride", "k_head_stride", "rope_batch_stride", "q_heads",
     "k_heads", "half"], "i32",
)  # fmt: skip


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles the kernel (no interpreter)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_rope_kernel_compiled_for_hopper_rounds_each_product_in_fp32(dtype: torch.dtype) -> None:
    """The fp16 and bf16 RoPE kernels compiled for sm_90 (no GPU needed): no fp16 or bf16 arithmetic in the PTX,
    so each product is rounded before the add, as PyTorch's eager ops round it."""
    from triton.backends.compiler import GPUTarget

    narrow = "*fp16" if dtype == torch.float16 else "*bf16"
    signature = {name: narrow if kind == "*fp16" else kind for name, kind in ROPE_SIGNATURE.items()}
    source = triton.compiler.ASTSource(
        fn=decode_fusion._rope_kernel,
        signature=signature | {"BLOCK": "constexpr", "CODE": "constexpr"},
        constexprs={"BLOCK": 8, "CODE": DTYPE_CODES[dtype]},
    )
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert "cvt.f32." in ptx  # it loads the narrow values into fp32
    assert not NARROW_ARITHMETIC.findall(ptx)
