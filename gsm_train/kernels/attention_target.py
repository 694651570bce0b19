"""Stage 1's target on the GPU (Triton): each selector's head-averaged attention probabilities for a set
of query rows, without materialising the per-head logits.

`attention_targets.head_averaged_probs` written in PyTorch forms the logits of every head, [B, Hq, R, S]
in fp32, then reads them twice more (softmax, then the mean over heads): for SmolLM2 at R = 256 sampled
rows, S = 2048 and batch 4 that is 75 MB written and read per layer. Here two kernels do it with the
logits in registers only: the first finds each (head, row)'s log-normaliser over the allowed keys (an
online softmax over key tiles, stopping at the row's key bound), the second recomputes each tile's
logits for the heads of a selector and writes their averaged probabilities, [B, n, R, S] fp32. Logits
are fp32 (bf16 products, fp32 accumulation), one rounding fewer than the PyTorch path under autocast.
The kernels read the allowed-key mask as given and never build a causal one, so a mask without the
forced keys (`sparse_attention.gate_target: beyond_forced`) is honoured as any other.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from gsm_train.kernels import kernel_fits

try:
    import triton
    import triton.language as tl
except ImportError:  # the PyTorch path in attention_targets serves
    triton = None

# The fastest of 27 tile and warp settings timed on the H200 (docs/design-decisions.md, 'The stage-1
# target comes from Triton kernels on the GPU').
BLOCK_ROWS = 32
BLOCK_KEYS = 128
NUM_WARPS = 4


def kernel_runs(query: Tensor, key: Tensor) -> bool:
    """Whether the kernels can take these queries and keys: Triton with a CUDA device (or its
    interpreter on the CPU), a head dimension that `tl.dot` takes (a power of two from 16 to 256), and
    offsets that fit 32 bits (64-bit ones would slow the kernels; larger problems take the PyTorch
    path)."""
    batch, heads, rows, head_dim = query.shape
    on_device = query.is_cuda or (query.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
    fits = batch * heads * rows * max(key.shape[2], head_dim) < 2**31 and key.numel() < 2**31
    return triton is not None and on_device and fits and kernel_fits(head_dim)


if triton is not None:

    @triton.jit
    def _allowed_tile(mask_row0, sm_r, rows, keys, row_ok, key_ok):
        """Which of `keys` each of `rows` may attend to ([rows, keys] bool) from one batch row's mask
        (`mask_row0`, rows `sm_r` apart; nonzero allows); False outside the bounds."""
        tile = mask_row0 + rows[:, None] * sm_r + keys[None, :]
        return tl.load(tile, mask=row_ok[:, None] & key_ok[None, :], other=0) != 0

    @triton.jit
    def _row_log_normaliser(
        q_ptr, k_ptr, mask_ptr, limit_ptr, lse_ptr, rows_total, keys_total, num_heads, groups,
        sq_b, sq_h, sq_r, sk_b, sk_h, sk_s, sm_b, sm_r, scale,  # strides of q, k and the mask
        D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, HAS_LIMIT: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        """lse[b, h, r] = log sum_j allowed exp(scale * q.k_j) for one head and a tile of rows (+inf for a
        row that sees no key, so that its probabilities come out 0)."""
        pid_bh = tl.program_id(0)
        b = pid_bh // num_heads
        h = pid_bh % num_heads
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < rows_total
        dims = tl.arange(0, D)
        q = tl.load(q_ptr + b * sq_b + h * sq_h + rows[:, None] * sq_r + dims[None, :], mask=row_ok[:, None], other=0.0)
        if HAS_LIMIT:
            stop = tl.load(limit_ptr + tl.program_id(1))
        else:
            stop = keys_total
        k_base = k_ptr + b * sk_b + (h // groups) * sk_h
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_R], tl.float32)
        for start in range(0, keys_total, BLOCK_S):  # tiles past the rows' bound are skipped
            if start < stop:
                keys = start + tl.arange(0, BLOCK_S)
                key_ok = keys < keys_total
                k = tl.load(k_base + keys[:, None] * sk_s + dims[None, :], mask=key_ok[:, None], other=0.0)
                logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
                allowed = _allowed_tile(mask_ptr + b * sm_b, sm_r, rows, keys, row_ok, key_ok)
                logits = tl.where(allowed, logits, float("-inf"))
                m_new = tl.maximum(m, tl.max(logits, 1))
                finite = m_new > float("-inf")
                rescale = tl.where(finite, tl.exp(m - m_new), 0.0)
                shifted = tl.where(finite, m_new, 0.0)
                total = total * rescale + tl.sum(tl.where(allowed, tl.exp(logits - shifted[:, None]), 0.0), 1)
                m = m_new
        lse = tl.where(total > 0, m + tl.log(total), float("inf"))
        tl.store(lse_ptr + pid_bh * rows_total + rows, lse, mask=row_ok)

    @triton.jit
    def _averaged_probs(
        q_ptr, k_ptr, mask_ptr, limit_ptr, lse_ptr, out_ptr, rows_total, keys_total, num_heads,
        num_selectors, groups,
        sq_b, sq_h, sq_r, sk_b, sk_h, sk_s, sm_b, sm_r, scale,  # strides of q, k and the mask
        HEADS_PER_SELECTOR: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
        HAS_LIMIT: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """out[b, s, rows, keys] = mean over the selector's heads of exp(scale * q.k - lse), 0 where not
        allowed; tiles past every row's key bound stay as allocated (zeros)."""
        pid_bs = tl.program_id(0)
        b = pid_bs // num_selectors
        selector = pid_bs % num_selectors
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        keys = tl.program_id(2) * BLOCK_S + tl.arange(0, BLOCK_S)
        row_ok = rows < rows_total
        key_ok = keys < keys_total
        if HAS_LIMIT:
            stop = tl.load(limit_ptr + tl.program_id(1))
        else:
            stop = keys_total
        if tl.program_id(2) * BLOCK_S < stop:
            dims = tl.arange(0, D)
            allowed = _allowed_tile(mask_ptr + b * sm_b, sm_r, rows, keys, row_ok, key_ok)
            acc = tl.zeros([BLOCK_R, BLOCK_S], tl.float32)
            for i in tl.static_range(HEADS_PER_SELECTOR):
                h = selector * HEADS_PER_SELECTOR + i
                q = tl.load(
                    q_ptr + b * sq_b + h * sq_h + rows[:, None] * sq_r + dims[None, :], mask=row_ok[:, None], other=0.0
                )
                k = tl.load(
                    k_ptr + b * sk_b + (h // groups) * sk_h + keys[:, None] * sk_s + dims[None, :],
                    mask=key_ok[:, None],
                    other=0.0,
                )
                logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
                lse = tl.load(lse_ptr + (b * num_heads + h) * rows_total + rows, mask=row_ok, other=float("inf"))
                acc += tl.where(allowed, tl.exp(logits - lse[:, None]), 0.0)
            out = out_ptr + ((b * num_selectors + selector) * rows_total + rows[:, None]) * keys_total + keys[None, :]
            tl.store(out, acc / HEADS_PER_SELECTOR, mask=row_ok[:, None] & key_ok[None, :])


def head_averaged_probs(
    query: Tensor, key: Tensor, allowed: Tensor, scaling: float, num_selectors: int, key_limit: Tensor | None = None
) -> Tensor:
    """As `attention_targets.head_averaged_probs` (query [B, Hq, R, D], key [B, Hkv, S, D], allowed
    [B|1, 1, R, S] bool; returns [B, n, R, S] fp32), computed by the two kernels. `key_limit` [R] (device,
    optional): row r sees no key at or past key_limit[r], so key tiles past the bound of every row of a
    row tile are skipped. The caller guarantees the bound: a row with allowed keys past it would be
    normalised over fewer keys, silently."""
    batch, num_heads, rows, head_dim = query.shape
    num_kv, keys = key.shape[1], key.shape[2]
    key = key.to(query.dtype)
    query = query if query.stride(-1) == 1 else query.contiguous()
    key = key if key.stride(-1) == 1 else key.contiguous()
    mask = allowed.expand(batch, 1, rows, keys)
    mask = (mask if mask.stride(-1) == 1 else mask.contiguous()).view(torch.uint8)
    row_tiles = triton.cdiv(rows, BLOCK_ROWS)
    if key_limit is not None:  # each row tile's bound: the most keys any of its rows sees
        padded = torch.nn.functional.pad(key_limit.to(torch.int32), (0, row_tiles * BLOCK_ROWS - rows))
        limit = padded.view(row_tiles, BLOCK_ROWS).amax(1)
    else:
        limit = mask  # never read
    lse = torch.empty(batch, num_heads, rows, dtype=torch.float32, device=query.device)
    probs = torch.zeros(batch, num_selectors, rows, keys, dtype=torch.float32, device=query.device)
    common = (rows, keys, num_heads)
    strides = (*query.stride()[:3], *key.stride()[:3], mask.stride(0), mask.stride(2), scaling)
    flags = {
        "D": head_dim,
        "BLOCK_R": BLOCK_ROWS,
        "BLOCK_S": BLOCK_KEYS,
        "HAS_LIMIT": key_limit is not None,
        "PRECISION": "ieee" if query.dtype == torch.float32 else None,
        "num_warps": NUM_WARPS,
    }
    _row_log_normaliser[(batch * num_heads, row_tiles)](
        query, key, mask, limit, lse, *common, num_heads // num_kv, *strides, **flags
    )
    _averaged_probs[(batch * num_selectors, row_tiles, triton.cdiv(keys, BLOCK_KEYS))](
        query,
        key,
        mask,
        limit,
        lse,
        probs,
        *common,
        num_selectors,
        num_heads // num_kv,
        *strides,
        HEADS_PER_SELECTOR=num_heads // num_selectors,
        **flags,
    )
    return probs
