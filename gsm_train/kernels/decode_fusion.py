"""The decode step's small elementwise work of a Hugging Face decoder layer in one Triton launch each:
RMSNorm, the RoPE rotation of the token's query and key, and SwiGLU's SiLU(gate) * up.

Run eagerly, each is a handful of kernels over a few thousand values (an RMSNorm in bf16: cast to fp32,
pow, mean, add, rsqrt, mul, cast back, the weight's mul; RoPE: for q and k each two muls, a neg, a cat
and an add; SwiGLU: silu, mul), launched per layer and token: at batch 1 their launches, not their bytes,
are their cost. `gsm_train.inference.decode_fusion` swaps these in for a token step's known modules.

Each kernel computes in fp32 and rounds where PyTorch's ops round, to the input's dtype between the ops
and to the result's at the end (`rounding.rounded`: nearest even, exact under Triton's interpreter too),
so in bf16 or fp16 a result equals PyTorch's except where a value sits within an fp32 rounding error of a
rounding boundary of the narrow dtype (one step of it, rarely); in fp32 they agree to a few fp32 ulps.
What differs: the order of the RMSNorm's sum of squares (one tree reduction) and the implementations of
rsqrt and exp; the compiler may fuse a multiply and an add into an FMA.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from gsm_train.kernels.rounding import DTYPE_CODES

try:
    import triton
    import triton.language as tl
except ImportError:  # the modules' own forwards serve
    triton = None

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
NORM_MAX = 32768  # the widest row `rms_norm` takes in one program (a hidden size; Llama 3 70B's is 8192)
HEAD_MAX = 512  # the widest head `rope` takes
SWIGLU_BLOCK = 1024  # values per `silu_mul` program


def kernels_run(*tensors: Tensor) -> bool:
    """Whether the kernels serve these tensors: Triton is installed, every tensor is on a CUDA device (or
    Triton's interpreter runs the kernels on the CPU) and in fp32, bf16 or fp16, and autocast is off there
    (under it the modules' ops run in autocast's dtype, not their inputs')."""
    if triton is None or not tensors:
        return False
    device = tensors[0].device
    here = device.type == "cuda" or (INTERPRETED and device.type == "cpu")
    same_device = all(tensor.device == device for tensor in tensors)
    dtypes = all(tensor.dtype in DTYPE_CODES for tensor in tensors)
    return here and same_device and dtypes and not torch.is_autocast_enabled(device.type)


if triton is not None:
    from gsm_train.kernels.rounding import rounded

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, weight_ptr, out_ptr, x_row_stride, n, eps,
        BLOCK: tl.constexpr, IN: tl.constexpr, OUT: tl.constexpr,
    ):  # fmt: skip
        """One row of n values: x * rsqrt(mean(x^2) + eps) in fp32, rounded to x's dtype, times the weight,
        rounded to the output's dtype (`rounded` codes IN and OUT)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < n
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=inside, other=0.0).to(tl.float32)
        variance = tl.sum(x * x, 0) / n
        normed = rounded(x * tl.math.rsqrt(variance + eps), IN)
        weight = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n + cols, rounded(weight * normed, OUT), mask=inside)

    @triton.jit
    def _rope_half(x1, x2, c, s, CODE: tl.constexpr):
        """One half of `rotate_half` RoPE as PyTorch rounds it: round(round(x1 * c) + round(x2 * s))."""
        return rounded(rounded(x1 * c, CODE) + rounded(x2 * s, CODE), CODE)

    @triton.jit
    def _rope_kernel(
        q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
        q_batch_stride, q_head_stride, k_batch_stride, k_head_stride, rope_batch_stride, q_heads, k_heads, half,
        BLOCK: tl.constexpr, CODE: tl.constexpr,
    ):  # fmt: skip
        """One (batch row, head) of the query's heads followed by the key's: the head's pairs (i, i + D/2)
        rotated by the row's cos/sin, stored contiguously [B, heads, 1, D]."""
        batch = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        if head < q_heads:
            source = q_ptr + batch * q_batch_stride + head * q_head_stride
            target = q_out_ptr + (batch * q_heads + head) * 2 * half
        else:
            source = k_ptr + batch * k_batch_stride + (head - q_heads) * k_head_stride
            target = k_out_ptr + (batch * k_heads + head - q_heads) * 2 * half
        pairs = tl.arange(0, BLOCK)
        inside = pairs < half
        x1 = tl.load(source + pairs, mask=inside, other=0.0).to(tl.float32)
        x2 = tl.load(source + half + pairs, mask=inside, other=0.0).to(tl.float32)
        rope_at = batch * rope_batch_stride + pairs
        c1 = tl.load(cos_ptr + rope_at, mask=inside, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + rope_at + half, mask=inside, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + rope_at, mask=inside, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + rope_at + half, mask=inside, other=0.0).to(tl.float32)
        tl.store(target + pairs, _rope_half(x1, -x2, c1, s1, CODE), mask=inside)  # rotate_half: (-x2, x1)
        tl.store(target + half + pairs, _rope_half(x2, x1, c2, s2, CODE), mask=inside)

    @triton.jit
    def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr, CODE: tl.constexpr):
        """BLOCK values of round(round(silu(gate)) * up), silu(g) = g / (1 + exp(-g)) in fp32."""
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = at < n
        gate = tl.load(gate_ptr + at, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(up_ptr + at, mask=inside, other=0.0).to(tl.float32)
        silu = rounded(gate / (1.0 + tl.exp(-gate)), CODE)
        tl.store(out_ptr + at, rounded(silu * up, CODE), mask=inside)


def rms_norm_fits(x: Tensor, weight: Tensor) -> bool:
    """Whether `rms_norm` takes x [..., n] and weight [n]: `kernels_run`, x's last dimension contiguous and
    at most `NORM_MAX` wide."""
    n = x.shape[-1] if x.dim() else 0
    shapes = weight.dim() == 1 and weight.shape[0] == n and 0 < n <= NORM_MAX and x.stride(-1) == 1
    return shapes and kernels_run(x, weight)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`weight * (x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype)` with the mean in fp32, as transformers'
    Llama, Qwen2, Qwen3 and Mistral RMSNorm compute it, in one launch: x [..., n] (`rms_norm_fits`),
    weight [n]. Returns [..., n], contiguous, in the dtype PyTorch promotes weight's and x's to (x's when
    they agree). Agrees with those modules as the module docstring says."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    dtype = x.dtype if weight.dtype == x.dtype else torch.promote_types(weight.dtype, x.dtype)  # an op otherwise
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows.shape[0],)](
        rows, weight, out, rows.stride(0), n, eps,
        BLOCK=block, IN=DTYPE_CODES[x.dtype], OUT=DTYPE_CODES[out.dtype], num_warps=max(1, min(16, block // 512)),
    )  # fmt: skip
    return out


def rope_fits(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Whether `rope` takes these: one token's q [B, Hq, 1, D] and k [B, Hk, 1, D], cos and sin [B or 1,
    1, D] of one stride layout, all of one dtype (`kernels_run`), D even and at most `HEAD_MAX`, the
    last dimension of each contiguous."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape or cos.stride() != sin.stride():
        return False
    batch, _, tokens, dim = q.shape
    shapes = (
        tokens == 1
        and k.shape[0] == batch
        and k.shape[2:] == (1, dim)
        and cos.shape[0] in (1, batch)
        and cos.shape[1:] == (1, dim)
        and dim % 2 == 0
        and dim <= HEAD_MAX
    )
    contiguous = q.stride(-1) == k.stride(-1) == cos.stride(-1) == 1
    one_dtype = q.dtype == k.dtype == cos.dtype == sin.dtype
    return shapes and contiguous and one_dtype and kernels_run(q, k, cos, sin)


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """`q * cos + rotate_half(q) * sin` and the same of k, as transformers' `apply_rotary_pos_emb`
    (unsqueeze_dim 1) computes them, in one launch for both (`rope_fits`). Returns them contiguous, in
    q's shape and dtype."""
    batch, q_heads, _, dim = q.shape
    k_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _rope_kernel[(batch, q_heads + k_heads)](
        q, k, cos, sin, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0) if cos.shape[0] > 1 else 0,
        q_heads, k_heads, dim // 2,
        BLOCK=triton.next_power_of_2(dim // 2), CODE=DTYPE_CODES[q.dtype], num_warps=1,
    )  # fmt: skip
    return q_out, k_out


def silu_mul_fits(gate: Tensor, up: Tensor) -> bool:
    """Whether `silu_mul` takes these: one shape, one dtype, both contiguous (`kernels_run`)."""
    same = gate.shape == up.shape and gate.dtype == up.dtype
    return same and gate.is_contiguous() and up.is_contiguous() and kernels_run(gate, up)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """`silu(gate) * up` as transformers' SwiGLU MLPs compute it (`act_fn(gate_proj(x)) * up_proj(x)` with
    hidden_act silu), in one launch (`silu_mul_fits`). Returns it in gate's shape and dtype."""
    out = torch.empty_like(gate)
    n = gate.numel()
    _silu_mul_kernel[(triton.cdiv(n, SWIGLU_BLOCK),)](
        gate, up, out, n, BLOCK=SWIGLU_BLOCK, CODE=DTYPE_CODES[gate.dtype], num_warps=4
    )
    return out
