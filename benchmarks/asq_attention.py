"""Training attention of one ASQ layer, forward and backward, per way of computing it, side by side in
one run: the queries see earlier blocks' keys as stored and their own block's raw, restricted to the
gate's top-k (SmolLM2-135M shapes: batch 4, 9 query heads over 3 KV heads, head_dim 64, T 2048, ASQ
blocks of 128, top-256, bf16).

- masked SDPA over both key versions side by side (2T keys, boolean mask): all T x 2T products;
- FlexAttention over the tiles a query can see (`own_block_attention`), compiled as the trainer does,
  with the kernel options it passes on Hopper GPUs (`own_block_attention.HOPPER_KERNEL_OPTIONS`) and
  with Inductor's default configuration (its timing, like the masked SDPA's, includes putting the stored
  and raw keys side by side; the masked SDPA's also its mask);
- a candidate: the same with FlexAttention's `ROWS_GUARANTEED_SAFE` (every query sees at least its own
  raw key, so the kernel may skip its empty-row checks; not used by the trainer until measured);
- the same, compiled with Inductor's autotuning (`max-autotune-no-cudagraphs`, from the default
  configuration: what the Hopper options were taken from);
- one masked SDPA per ASQ block of queries over only the keys it can see (a candidate that computes
  only the visible tiles' products with SDPA's kernels; measured slower, not used by the trainer);
- for scale: dense causal SDPA over T keys (a dense layer's attention).

Each is timed as the sum of its GPU kernels' times (what a CUDA graph replays, as the trainer runs a step
on one GPU; torch.profiler, mean of 3 calls) and eagerly, as under FSDP, where Python and launches count
too (CUDA events, median of 20 calls).

python -m benchmarks.asq_attention --result OUT.json
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import (
    kernel_benchmark_args,
    kernel_times,
    median_ms,
    write_result,
)
from gsm_train.attention.layout import block_causal_kv
from gsm_train.functional import own_block_attention as own_block
from gsm_train.functional.top_k import select_top_k

BATCH, HEADS, KV_HEADS, LENGTH, DIM, BLOCK, TOP_K = 4, 9, 3, 2048, 64, 128, 256


def _inputs() -> tuple[list[torch.Tensor], torch.Tensor]:
    """(query, stored K, stored V, raw K, raw V) needing gradients, and a top-k selection [B, 1, T, T]."""
    torch.manual_seed(0)
    tensors = [torch.randn(BATCH, HEADS, LENGTH, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)]
    tensors += [
        torch.randn(BATCH, KV_HEADS, LENGTH, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(4)
    ]
    positions = torch.arange(LENGTH, device="cuda")
    causal = (positions[None, :] <= positions[:, None])[None, None]
    scores = torch.randn(BATCH, 1, LENGTH, LENGTH, device="cuda")
    selection = select_top_k(
        scores, causal, torch.full((LENGTH,), TOP_K, device="cuda"), positions, positions, k_max=TOP_K, uniform_k=True
    )
    return tensors, selection


def _per_block_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    own: tuple[torch.Tensor, torch.Tensor],
    selection: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """One masked SDPA per ASQ block of queries over earlier blocks' stored keys and its own block's raw
    ones (one selection for all heads) -> [B, H, T, D]."""
    outs = []
    for start in range(0, LENGTH, BLOCK):
        stop = min(start + BLOCK, LENGTH)
        keys = torch.cat((key[:, :, :start], own[0][:, :, start:stop]), 2)
        values = torch.cat((value[:, :, :start], own[1][:, :, start:stop]), 2)
        outs.append(
            F.scaled_dot_product_attention(
                query[:, :, start:stop],
                keys,
                values,
                attn_mask=selection[:, :, start:stop, :stop],
                scale=scaling,
                enable_gqa=True,
            )
        )
    return torch.cat(outs, 2)


def _fwd_bwd(attend: Callable[[], torch.Tensor], tensors: list[torch.Tensor]) -> Callable[[], None]:
    """One forward and backward of `attend` (gradients of every input it reads)."""

    def step() -> None:
        torch.autograd.grad(attend().float().sum(), tensors, allow_unused=True)

    return step


def main() -> None:
    args = kernel_benchmark_args(__doc__)
    tensors, selection = _inputs()
    query, stored_k, stored_v, raw_k, raw_v = tensors
    positions = torch.arange(LENGTH, device="cuda")
    scaling = DIM**-0.5

    def masked_sdpa() -> torch.Tensor:
        keys, values, mask = block_causal_kv(stored_k, stored_v, (raw_k, raw_v), selection, positions, BLOCK)
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=True)

    def flex(mode: str | None, tuned: bool, extra: dict | None = None) -> Callable[[], torch.Tensor]:
        return lambda: own_block.own_block_attention(
            query, (stored_k, stored_v), (raw_k, raw_v), selection, BLOCK, scaling, True, mode, tuned, extra
        )

    def dense_causal() -> torch.Tensor:
        return F.scaled_dot_product_attention(query, stored_k, stored_v, is_causal=True, scale=scaling, enable_gqa=True)

    def per_block() -> torch.Tensor:
        return _per_block_sdpa(query, stored_k, stored_v, (raw_k, raw_v), selection, scaling)

    ways = {
        "masked_sdpa_2T_keys": masked_sdpa,
        "flex_visible_tiles": flex(None, True),
        "flex_visible_tiles_default_options": flex(None, False),
        "flex_visible_tiles_rows_guaranteed_safe": flex(None, True, {"ROWS_GUARANTEED_SAFE": True}),
        "flex_visible_tiles_autotuned": flex("max-autotune-no-cudagraphs", False),
        "per_block_sdpa": per_block,
        "dense_causal_sdpa_T_keys": dense_causal,
    }
    rows = {}
    for name, attend in ways.items():
        step = _fwd_bwd(attend, tensors)
        rows[name] = {
            "fwd_bwd_gpu_ms": sum(row["ms_per_step"] for row in kernel_times(step)),
            "fwd_bwd_ms_eager": median_ms(step, warmup=3, repeat=20),
        }
        print(
            f"{name:30s} {rows[name]['fwd_bwd_gpu_ms']:8.3f} ms of GPU kernels "
            f"{rows[name]['fwd_bwd_ms_eager']:8.3f} ms eager (forward + backward, one layer)",
            flush=True,
        )
    write_result(
        Path(args.result),
        {
            "hopper_kernel_options": own_block.kernel_options(query),
            "shape": {
                "batch": BATCH,
                "heads": HEADS,
                "kv_heads": KV_HEADS,
                "seq_len": LENGTH,
                "head_dim": DIM,
                "block_size": BLOCK,
                "top_k": TOP_K,
            },
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
