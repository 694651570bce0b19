"""A layer that reads every key (GSM's dense layers, retrieval layers) decoding one token over its ASQ-packed
cache, three ways side by side in one run: the selection kernel over every position (`fused_decode_attention`
with the whole range as its selection, what such a layer ran before), the block kernel
(`dense_decode_attention`: a compressor block a tile, its prototypes read once), and dense SDPA over a bf16
cache of the same length (what the dense model reads). Llama-8B's layer shape, ASQ as recipes/joint.yaml
sets it, 32k and 128k tokens at batch 1 and 32k at batch 16; microseconds per layer in CUDA graphs of several
layers (as benchmarks/decode.py times them), the bytes each reads and their rate, and the block kernel's
largest difference from the selection kernel's output.

python -m benchmarks.dense_decode --result OUT.json
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.common import kernel_benchmark_args, write_result
from benchmarks.decode import REPO, SHAPES, compressors, dense_sdpa_ms, filled_stores, layers_per_graph, per_layer_ms
from gsm_train.config.schema import load_recipe
from gsm_train.kernels.dense_decode import dense_decode_attention
from gsm_train.kernels.sparse_decode import fused_decode_attention

ROWS = ((32768, 1), (131072, 1), (32768, 16))  # (context, batch): the 8B rows of benchmarks.generate


def packed_bytes(rows: tuple, length: int) -> int:
    """Bytes of the packed K and V a full read of `length` tokens of every row touches (codes, scales, ids,
    prototypes)."""
    total = 0
    for store in rows:
        batch, heads, capacity = store.ids.shape
        per_token = store.residual.shape[-1] + store.scales.element_size() + store.ids.element_size()
        blocks = -(-length // store.block_size)
        total += batch * heads * (length * per_token + blocks * store.cluster_num * store.prototypes.shape[-1] * 2)
    return total


def measure(context: int, batch: int, asqs: tuple, q_heads: int) -> dict:
    """One row of `context` tokens and `batch` sequences (module docstring)."""
    kv_heads, dim = asqs[0].num_kv_heads, asqs[0].head_dim
    dense = 2 * batch * kv_heads * context * dim * 2
    layers = layers_per_graph(dense)
    caches = [tuple(store.packed_rows() for store in filled_stores(asqs, batch, context)) for _ in range(layers)]
    query = torch.randn(batch, q_heads, 1, dim, device="cuda", dtype=torch.bfloat16)
    index = torch.arange(caches[0][0].ids.shape[2], device="cuda").expand(batch, 1, -1).contiguous()  # not in the graph
    valid = index < context

    def by_selection(rows: tuple) -> torch.Tensor:
        return fused_decode_attention(query, *rows, index, valid, dim**-0.5)

    def by_blocks(rows: tuple) -> torch.Tensor:
        return dense_decode_attention(query, *rows, None, dim**-0.5)

    selection = per_layer_ms([lambda rows=rows: by_selection(rows) for rows in caches])
    block = per_layer_ms([lambda rows=rows: by_blocks(rows) for rows in caches])
    sdpa = dense_sdpa_ms(query, kv_heads, context, layers)
    differs = (by_blocks(caches[0]).float() - by_selection(caches[0]).float()).abs().max().item()
    packed = packed_bytes(caches[0], context)
    return {
        "context": context,
        "batch": batch,
        "layers_per_graph": layers,
        "selection_kernel_us": selection * 1e3,
        "block_kernel_us": block * 1e3,
        "dense_sdpa_us": sdpa * 1e3,
        "packed_bytes": packed,
        "dense_bf16_bytes": dense,
        "block_kernel_tb_per_s": packed / (block * 1e-3) / 1e12,
        "selection_kernel_tb_per_s": packed / (selection * 1e-3) / 1e12,
        "dense_sdpa_tb_per_s": dense / (sdpa * 1e-3) / 1e12,
        "block_over_selection_speedup": selection / block,
        "max_abs_difference": differs,
    }


@torch.no_grad()
def main() -> None:
    args = kernel_benchmark_args(__doc__)
    gsm = load_recipe(str(REPO / "recipes" / "joint.yaml")).gsm
    q_heads, kv_heads, dim = SHAPES["llama8b"]
    asqs = compressors(gsm, kv_heads, dim)
    rows = []
    for context, batch in ROWS:
        row = measure(context, batch, asqs, q_heads)
        rows.append(row)
        print(
            f"{context:>7} tokens x {batch:>2}: selection kernel {row['selection_kernel_us']:7.1f} us, block kernel "
            f"{row['block_kernel_us']:7.1f} us ({row['block_over_selection_speedup']:.2f}x), dense SDPA over bf16 "
            f"{row['dense_sdpa_us']:7.1f} us; {row['packed_bytes'] / 1e6:.0f} MB packed at "
            f"{row['block_kernel_tb_per_s']:.2f} TB/s, max |difference| {row['max_abs_difference']:.2e}"
        )
        torch.cuda.empty_cache()
    write_result(Path(args.result), {"rows": rows})


if __name__ == "__main__":
    main()
