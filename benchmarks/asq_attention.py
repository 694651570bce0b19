"""Training attention of one ASQ layer, forward and backward, per way of computing it, side by side in
one run: the queries see earlier blocks' keys as stored and their own block's raw, restricted to the
gate's top-k, one selection for all heads, bf16. `--shape smollm2` (the default): SmolLM2-135M's batch 4,
9 query heads over 3 KV heads, head_dim 64, T 2048, ASQ blocks of 128, top-256; `--shape llama3-8b`:
`benchmarks/scale_8b.py`'s joint row, batch 1, 32 over 8 heads of 128, T 8192, blocks of 64, top-512
(the two sides of `own_block_attention.EAGER_MIN_WORK`).

- masked SDPA over both key versions side by side (2T keys, boolean mask): all T x 2T products;
- the masked SDPA in query chunks of `ATTENTION_CHUNK` over only the keys they can select
  (`chunked_masked_attention`: what eager training steps below `EAGER_MIN_WORK` run);
- FlexAttention over the tiles a query can see (`own_block_attention`), compiled as the trainer does,
  with the kernel options it passes on Hopper GPUs (`own_block_attention.HOPPER_KERNEL_OPTIONS`) and
  with Inductor's default configuration (its timing, like the masked SDPA's, includes putting the stored
  and raw keys side by side and making the mask's codes from the selection; the masked SDPA's its mask);
- two bounds, not the layer's attention (`bound_*`): FlexAttention over the same tiles with a mask that reads
  only the selection (the block rule left out), and with no mask function at all (every key of a visible
  tile): what the mask's parts cost;
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

python -m benchmarks.asq_attention --result OUT.json [--shape llama3-8b] [--only NAME ...]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from benchmarks.common import (
    kernel_benchmark_args,
    kernel_times,
    median_ms,
    write_result,
)
from gsm_train.attention.dispatch import chunked_masked_attention
from gsm_train.attention.layout import block_causal_kv
from gsm_train.compiled import compiled
from gsm_train.functional import own_block_attention as own_block
from gsm_train.functional.top_k import select_top_k


@dataclass(frozen=True)
class Shape:
    """One layer's attention: batch, query heads, KV heads, seq_len, head_dim, ASQ block, top-k."""

    batch: int
    heads: int
    kv_heads: int
    seq_len: int
    head_dim: int
    block_size: int
    top_k: int


SHAPES = {
    "smollm2": Shape(4, 9, 3, 2048, 64, 128, 256),
    "llama3-8b": Shape(1, 32, 8, 8192, 128, 64, 512),
}


def _inputs(shape: Shape) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(query, stored K, stored V, raw K, raw V) needing gradients, and a top-k selection [B, 1, T, T]."""
    torch.manual_seed(0)
    length = shape.seq_len

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(
            shape.batch, heads, length, shape.head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True
        )

    tensors = [rand(shape.heads), *(rand(shape.kv_heads) for _ in range(4))]
    positions = torch.arange(length, device="cuda")
    causal = (positions[None, :] <= positions[:, None])[None, None]
    scores = torch.randn(shape.batch, 1, length, length, device="cuda")
    k = torch.full((length,), shape.top_k, device="cuda")
    selection = select_top_k(scores, causal, k, positions, positions, k_max=shape.top_k, uniform_k=True)
    return tensors, selection


def _per_block_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    own: tuple[torch.Tensor, torch.Tensor],
    selection: torch.Tensor,
    scaling: float,
    block_size: int,
) -> torch.Tensor:
    """One masked SDPA per ASQ block of queries over earlier blocks' stored keys and its own block's raw
    ones (one selection for all heads) -> [B, H, T, D]."""
    outs = []
    length = query.shape[2]
    for start in range(0, length, block_size):
        stop = min(start + block_size, length)
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


def _flex_bound(
    query: torch.Tensor,
    stored: tuple[torch.Tensor, torch.Tensor],
    raw: tuple[torch.Tensor, torch.Tensor],
    selection: torch.Tensor,
    block_size: int,
    scaling: float,
    rule: str,
) -> torch.Tensor:
    """A bound, not the layer's attention: FlexAttention over `own_block_attention`'s tiles with a mask that
    reads only the selection (`rule` "selection": the block rule left out) or nothing (`rule` "tiles": every
    key of a visible tile, no mask function), compiled with the same options, to tell what the mask's
    parts cost. `selection` [B|1, 1, T, T]: one for all heads, as `_inputs` makes it."""
    if rule not in ("selection", "tiles") or selection.shape[1] != 1:
        raise ValueError(f"a bound of rule 'selection' or 'tiles' over one selection for all heads, not {rule!r}")
    length = query.shape[2]
    rows = selection.expand(query.shape[0], -1, -1, -1)

    def selected(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return rows[b, 0, q, torch.where(kv < length, kv, kv - length)]

    counts, indices = own_block._tile_structure(length, block_size, query.device)
    if rule == "tiles":
        mask = BlockMask.from_kv_blocks(
            torch.zeros_like(counts),
            indices,
            counts,
            indices,
            BLOCK_SIZE=own_block.TILE,
            seq_lengths=(length, 2 * length),
        )
    else:
        mask = BlockMask.from_kv_blocks(
            counts, indices, BLOCK_SIZE=own_block.TILE, mask_mod=selected, seq_lengths=(length, 2 * length)
        )
    attend = compiled(own_block._flex_attention_in)
    out = attend(
        query.dtype, query, stored, raw, block_mask=mask, scale=scaling, enable_gqa=True,
        kernel_options=own_block.kernel_options(query),
    )  # fmt: skip
    return out.transpose(1, 2)


def _fwd_bwd(attend: Callable[[], torch.Tensor], tensors: list[torch.Tensor]) -> Callable[[], None]:
    """One forward and backward of `attend` (gradients of every input it reads)."""

    def step() -> None:
        torch.autograd.grad(attend().float().sum(), tensors, allow_unused=True)

    return step


def _more_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2", help="the layer's shapes (see above)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="time only these ways (names as in the result)")


def main() -> None:
    args = kernel_benchmark_args(__doc__, _more_arguments)
    shape = SHAPES[args.shape]
    block = shape.block_size
    tensors, selection = _inputs(shape)
    query, stored_k, stored_v, raw_k, raw_v = tensors
    positions = torch.arange(shape.seq_len, device="cuda")
    scaling = shape.head_dim**-0.5

    def masked_sdpa() -> torch.Tensor:
        keys, values, mask = block_causal_kv(stored_k, stored_v, (raw_k, raw_v), selection, positions, block)
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=True)

    def chunked_masked() -> torch.Tensor:
        return chunked_masked_attention(query, (stored_k, stored_v), (raw_k, raw_v), selection, block, scaling, True)

    def flex(mode: str | None, tuned: bool, extra: dict | None = None) -> Callable[[], torch.Tensor]:
        return lambda: own_block.own_block_attention(
            query, (stored_k, stored_v), (raw_k, raw_v), selection, block, scaling, True, mode, tuned, extra
        )

    def dense_causal() -> torch.Tensor:
        return F.scaled_dot_product_attention(query, stored_k, stored_v, is_causal=True, scale=scaling, enable_gqa=True)

    def per_block() -> torch.Tensor:
        return _per_block_sdpa(query, stored_k, stored_v, (raw_k, raw_v), selection, scaling, block)

    ways = {
        "masked_sdpa_2T_keys": masked_sdpa,
        "chunked_masked_sdpa": chunked_masked,
        "flex_visible_tiles": flex(None, True),
        "flex_visible_tiles_default_options": flex(None, False),
        "flex_visible_tiles_rows_guaranteed_safe": flex(None, True, {"ROWS_GUARANTEED_SAFE": True}),
        "flex_visible_tiles_autotuned": flex("max-autotune-no-cudagraphs", False),
        "per_block_sdpa": per_block,
        "dense_causal_sdpa_T_keys": dense_causal,
        "bound_flex_mask_reads_only_the_selection": lambda: _flex_bound(
            query, (stored_k, stored_v), (raw_k, raw_v), selection, block, scaling, "selection"
        ),
        "bound_flex_visible_tiles_without_a_mask": lambda: _flex_bound(
            query, (stored_k, stored_v), (raw_k, raw_v), selection, block, scaling, "tiles"
        ),
    }
    unknown = sorted(set(args.only or ()) - set(ways))
    if unknown:
        raise SystemExit(f"--only: unknown way(s) {', '.join(unknown)}; choose from {', '.join(ways)}")
    rows = {}
    for name, attend in ways.items():
        if args.only and name not in args.only:
            continue
        step = _fwd_bwd(attend, tensors)
        try:
            rows[name] = {
                "fwd_bwd_gpu_ms": sum(row["ms_per_step"] for row in kernel_times(step)),
                "fwd_bwd_ms_eager": median_ms(step, warmup=3, repeat=20),
            }
        except Exception as err:  # a way that does not compile here is recorded, the others still run
            rows[name] = {"error": f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"}
            print(f"{name:30s} failed: {rows[name]['error']}", flush=True)
            continue
        print(
            f"{name:30s} {rows[name]['fwd_bwd_gpu_ms']:8.3f} ms of GPU kernels "
            f"{rows[name]['fwd_bwd_ms_eager']:8.3f} ms eager (forward + backward, one layer)",
            flush=True,
        )
    failed = [name for name, row in rows.items() if "error" in row]
    write_result(
        Path(args.result),
        {
            "hopper_kernel_options": own_block.kernel_options(query),
            "shape": {"name": args.shape, **asdict(shape)},
            "pays_off_eagerly": own_block.pays_off_eagerly(query),
            "rows": rows,
        },
    )
    if failed:
        raise SystemExit(f"these ways failed (their errors are in {args.result}): {', '.join(failed)}")


if __name__ == "__main__":
    main()
