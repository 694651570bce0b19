"""ASQ's encoding of whole blocks into the cache's packed fields in one Triton kernel: for each (batch row, head,
block) the soft assignment MLP, the argmax ids, the prototypes, the residuals, their scales and codes, packed.

In PyTorch (`functional.asq.encode_blocks`, then the casts and `quant.pack_codes`) that is about 25 passes over
every row in fp32, each with its own temporary: for a prompt of 8k tokens on SmolLM2 the largest part of the
prefill's kernels beyond the dense model's and most of its allocations (docs/design-decisions.md, 'A prompt's
blocks pack in one kernel'). Here one program holds one block's rows in registers from the load of the raw
rows to the stores of its fields.

What is exact and what is not: every step is `encode_blocks`' in fp32 (the standardization, the MLP with the
exact erf GELU, the softmax over the clusters, the first of equal probabilities as the id, the prototypes rounded
to fp16 ties to even after the same clamp, the residual against the chosen prototype, the scale from the
absmax, or at 2 bits from the mean square, rounded to fp16, the codes floored after an IEEE division), but
the sums of the mean, the norms and the matrix products run in another order than PyTorch's, so a prototype or
a scale may differ from the PyTorch path's by one fp16 step and a code by one level where a value sits on a
rounding boundary, and an id where two clusters' probabilities are within that rounding of each other (the
softmax's exponential is the GPU's fast one). The products take `DOT_PRECISION`, three TF32 products a product
(Triton's "tf32x3": fp32's accuracy within a unit or two of the last place, on the tensor cores; IEEE fp32 on
the CUDA cores made this kernel 7.5 ms of an 8k SmolLM2 prefill on an H100, docs/results.md), the divisions and
square roots round to nearest; the gather of a row's prototype is a product of a one-hot row with the fp16-grid
prototypes, exact in a single TF32 product (TF32 holds every fp16 value; one term is not 0). Rows holding
NaN or inf: PyTorch's fields carry the NaN, the kernel's clamps may not (on the GPU min/max drop NaN).
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import Tensor

from gsm_train.kernels import kernel_fits
from gsm_train.quant import EPS, FP16_MAX, MIDRISE_STEP, RMS_SCALED_BITS, STORE_DTYPE, code_center

try:
    import triton
    import triton.language as tl
except ImportError:  # the PyTorch encoding serves
    triton = None

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MAX_CLUSTERS = 64  # the most clusters a program holds (padded to a power of two, at least 16: tl.dot's least)
MAX_HIDDEN = 256  # the widest assignment MLP a program holds (padded likewise)
MAX_BLOCK_VALUES = 8192  # the most values of a block (tokens x head) a program holds: 64 x 128 spills a little
DOT_PRECISION = "tf32x3"  # the products' (module docstring): fp32's accuracy on the tensor cores


def kernel_runs(rows: Tensor, block_size: int, cluster_num: int, hidden_dim: int) -> bool:
    """Whether `pack_blocks` serves whole blocks `rows` [B, H, n * block_size, D]: Triton with a CUDA tensor
    (or Triton's interpreter), bf16, fp16 or fp32 rows (fp64 keeps the PyTorch path's fp64 encoding), a head
    and a block the kernels fit (`kernel_fits`: powers of two from 16 to 256) of at most `MAX_BLOCK_VALUES`
    values, at most `MAX_CLUSTERS` clusters and a hidden layer of at most `MAX_HIDDEN` (`packed_together` calls it
    with autocast off, as it encodes)."""
    return (
        triton is not None
        and (rows.is_cuda or INTERPRETED)
        and rows.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and kernel_fits(rows.shape[-1])
        and kernel_fits(block_size)
        and block_size * rows.shape[-1] <= MAX_BLOCK_VALUES
        and cluster_num <= MAX_CLUSTERS
        and hidden_dim <= MAX_HIDDEN
    )


if triton is not None:
    from gsm_train.kernels.rounding import fp16_grid

    @triton.jit
    def _asq_pack_kernel(
        x_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, rotation_ptr,  # the rows, the assignment MLP, the rotation
        ids_ptr, residual_ptr, scales_ptr, prototypes_ptr,  # the fields out
        run_heads, heads, first_head, n_blocks, stride_b, stride_h, stride_s, tau,
        HIDDEN: tl.constexpr, CLUSTERS: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, KP: tl.constexpr,
        CP: tl.constexpr, BITS: tl.constexpr, ROTATE: tl.constexpr, EPS: tl.constexpr, FP16_MAX: tl.constexpr,
        MIDRISE_STEP: tl.constexpr, RMS_SCALED_BITS: tl.constexpr, HALF: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """One (batch row, head of this width's run) x one block: its fields (one program per block of each
        row, in a one-dimensional grid). `heads` is the count of the ids', scales' and prototypes' heads, of
        which this run's start at `first_head`; the residual codes have only the run's `run_heads`. The
        constants are `gsm_train.quant`'s (a compiled kernel reads no module global); HALF is
        `code_center(BITS)`, the outermost level."""
        program = tl.program_id(0)
        row = program // n_blocks
        block = program % n_blocks
        batch = row // run_heads
        run_head = row % run_heads
        head = first_head + run_head
        tokens = tl.arange(0, BS)
        dims = tl.arange(0, D)
        units = tl.arange(0, KP)
        clusters = tl.arange(0, CP)
        position = block * BS + tokens  # within the head's sequence
        x_at = batch.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h + position.to(tl.int64)[:, None] * stride_s
        x = tl.load(x_ptr + x_at + dims[None, :]).to(tl.float32)  # [BS, D]
        # the soft assignment of the rows as they are, standardized over the block
        centered = x - (tl.sum(x, 0) / BS)[None, :]
        rms = tl.sqrt_rn(tl.sum(tl.sum(centered * centered, 1), 0) / (BS * D) + EPS)
        in_hidden = units < HIDDEN
        w1 = tl.load(w1_ptr + (head * D + dims)[:, None] * HIDDEN + units[None, :], mask=in_hidden[None, :], other=0.0)
        b1 = tl.load(b1_ptr + head * HIDDEN + units, mask=in_hidden, other=0.0)
        standardized = tl.math.div_rn(centered, rms)
        hidden = tl.dot(standardized, w1.to(tl.float32), input_precision=PRECISION) + b1.to(tl.float32)[None, :]
        hidden = 0.5 * hidden * (1.0 + tl.math.erf(hidden * 0.7071067811865476))  # exact GELU
        in_clusters = clusters < CLUSTERS
        w2_mask = in_hidden[:, None] & in_clusters[None, :]
        w2 = tl.load(w2_ptr + (head * HIDDEN + units)[:, None] * CLUSTERS + clusters[None, :], mask=w2_mask, other=0.0)
        b2 = tl.load(b2_ptr + head * CLUSTERS + clusters, mask=in_clusters, other=0.0)
        logits = tl.dot(hidden, w2.to(tl.float32), input_precision=PRECISION) + b2.to(tl.float32)[None, :]
        logits = tl.where(in_clusters[None, :], tl.math.div_rn(logits, tau), float("-inf"))
        exp = tl.exp(logits - tl.max(logits, 1)[:, None])
        probs = tl.math.div_rn(exp, tl.sum(exp, 1)[:, None])  # [BS, CP], zero past the clusters
        ids = tl.argmax(probs, 1, tie_break_left=True)
        # prototypes and residuals of the rows in the rotated basis (with a rotation)
        rows = x
        if ROTATE:
            rotation = tl.load(rotation_ptr + dims[:, None] * D + dims[None, :])
            rows = tl.dot(x, rotation, input_precision=PRECISION)
        weighted = tl.dot(tl.trans(probs), rows, input_precision=PRECISION)  # [CP, D]
        mass = tl.sum(probs, 0)
        prototypes = tl.math.div_rn(weighted, mass[:, None] + EPS)
        prototypes = fp16_grid(tl.minimum(tl.maximum(prototypes, -FP16_MAX), FP16_MAX))
        block_at = (batch * heads + head).to(tl.int64) * n_blocks + block
        proto_at = (block_at * CLUSTERS + clusters)[:, None] * D + dims[None, :]
        tl.store(prototypes_ptr + proto_at, prototypes.to(tl.float16), mask=in_clusters[:, None])
        one_hot = (ids[:, None] == clusters[None, :]).to(tl.float32)
        residual = rows - tl.dot(one_hot, prototypes, input_precision="tf32")  # exact (module docstring)
        if BITS == RMS_SCALED_BITS:
            mean_square = tl.sum(residual * residual, 1) / D
            scale = tl.sqrt_rn(tl.maximum(mean_square, 1.1754943508222875e-38)) * MIDRISE_STEP
        else:
            scale = tl.math.div_rn(tl.max(tl.abs(residual), 1), HALF)
        scale = fp16_grid(tl.minimum(scale, FP16_MAX))
        divisor = tl.where(scale > 0, scale, 1.0)
        level = tl.floor(tl.math.div_rn(residual, divisor[:, None]))
        codes = (tl.minimum(tl.maximum(level, -HALF - 0.5), HALF - 0.5) + 0.5 + HALF).to(tl.int32)  # 0 .. 2**BITS - 1
        token_at = (batch * heads + head).to(tl.int64) * (n_blocks * BS) + position
        tl.store(ids_ptr + token_at, ids.to(tl.uint8))
        tl.store(scales_ptr + token_at, scale.to(tl.float16))
        PER: tl.constexpr = 8 // BITS
        BYTES: tl.constexpr = D // PER
        if PER == 1:
            packed = codes
        else:
            shifts = tl.arange(0, PER) * BITS
            packed = tl.sum(tl.reshape(codes, (BS, BYTES, PER)) << shifts[None, None, :], 2)  # disjoint bits
        run_at = (batch * run_heads + run_head).to(tl.int64) * (n_blocks * BS) + position
        tl.store(residual_ptr + run_at[:, None] * BYTES + tl.arange(0, BYTES)[None, :], packed.to(tl.uint8))


def _padded(count: int) -> int:
    """`count` rounded up to a power of two, at least 16 (tl.dot's least)."""
    return max(16, 1 << (count - 1).bit_length())


def pack_blocks(
    rows: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
    tau: float,
    runs: list[tuple[int, int]],
    rotation: Tensor | None,
    block_size: int,
) -> tuple[Tensor, list[Tensor], Tensor, Tensor]:
    """The packed fields of whole blocks `rows` [B, H, n * block_size, D] (bf16, fp16 or fp32; the last dim
    contiguous): (ids uint8 [B, H, n * bs], the residual codes of each run (uint8 [B, heads of the run, n * bs,
    D * width / 8]), scales fp16 [B, H, n * bs], prototypes fp16 [B, H, n, C, D]). `runs` are (width, groups)
    of neighbouring groups of heads of one residual width (`functional.asq.width_runs`), the H heads split into
    groups of one size; w1 [H, D, K], b1 [H, K], w2 [H, K, C], b2 [H, C] each head's assignment MLP;
    `rotation` [D, D] the rows' rotation or None. What `encode_blocks` and the casts give, up to the summation
    order (module docstring). `kernel_runs` says where it serves."""
    batch, heads, seq, dim = rows.shape
    clusters, hidden = w2.shape[-1], w2.shape[-2]
    groups = sum(count for _, count in runs)
    if seq % block_size or rows.stride(-1) != 1 or heads % groups:
        raise ValueError(
            f"rows {tuple(rows.shape)} (strides {rows.stride()}) must hold whole blocks of {block_size} tokens, "
            f"a contiguous last dim, and {groups} equal groups of heads"
        )
    n_blocks, group = seq // block_size, heads // groups
    device = rows.device
    ids = torch.empty(batch, heads, seq, dtype=torch.uint8, device=device)
    scales = torch.empty(batch, heads, seq, dtype=STORE_DTYPE, device=device)
    prototypes = torch.empty(batch, heads, n_blocks, clusters, dim, dtype=STORE_DTYPE, device=device)
    parameters = [p.detach().float().contiguous() for p in (w1, b1, w2, b2)]
    rotate = rotation is not None
    rotation_matrix = rotation.to(device, torch.float32).contiguous() if rotate else parameters[1]  # unread
    residuals, first_head = [], 0
    with torch.cuda.device(device) if rows.is_cuda else contextlib.nullcontext():  # launch on the rows' GPU
        for width, count in runs:
            run_heads = count * group
            residual = torch.empty(batch, run_heads, seq, dim * width // 8, dtype=torch.uint8, device=device)
            if n_blocks and batch:  # (a launch over an empty grid fails)
                _asq_pack_kernel[(batch * run_heads * n_blocks,)](
                    rows, *parameters, rotation_matrix, ids, residual, scales, prototypes,
                    run_heads, heads, first_head, n_blocks, rows.stride(0), rows.stride(1), rows.stride(2),
                    float(tau), HIDDEN=hidden, CLUSTERS=clusters, BS=block_size, D=dim, KP=_padded(hidden),
                    CP=_padded(clusters), BITS=width, ROTATE=rotate, EPS=EPS, FP16_MAX=FP16_MAX,
                    MIDRISE_STEP=MIDRISE_STEP, RMS_SCALED_BITS=RMS_SCALED_BITS, HALF=code_center(width),
                    PRECISION=DOT_PRECISION, num_warps=4 if block_size * dim <= 4096 else 8,
                )  # fmt: skip
            residuals.append(residual)
            first_head += run_heads
    return ids, residuals, scales, prototypes
