"""The decode top-k (`gsm_train.kernels.decode_topk`) against `torch.topk(sorted=False)`, side by side in one
run: rows of fp32 scores as decoding gives them (one row per sequence and selector), 1 to 128 rows of 8k,
32k and 128k scores, k = 64 and 2048, with every blocks-per-row size this GPU runs (1 block of 1,024
threads, or a Hopper thread-block cluster of 2, 4 or 8) and the size `fastest_blocks_per_row` picks. Each
time is one launch captured alone in a CUDA graph (median of 50 replays), so it includes the graph's launch.
Every selection is checked against `torch.topk`'s values.

python -m benchmarks.decode_topk --result OUT.json
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.common import graph_ms, kernel_benchmark_args, write_result
from gsm_train.kernels.decode_topk import (
    blocks_per_row_options,
    chosen_blocks_per_row,
    decode_topk,
)

LENGTHS = (8192, 32768, 131072)
ROWS = (1, 8, 16, 17, 32, 64, 128)
KS = (64, 2048)


def main() -> None:
    args = kernel_benchmark_args(__doc__)
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    results = []
    for length in LENGTHS:
        sizes = blocks_per_row_options(length, device)
        for rows in ROWS:
            for k in KS:
                scores = torch.randn(rows, length, device=device, generator=generator)
                expected = scores.topk(k, -1).values
                row = {
                    "length": length,
                    "rows": rows,
                    "k": k,
                    "chosen_blocks_per_row": chosen_blocks_per_row(rows, length, device),
                    "torch_topk_us": graph_ms(lambda scores=scores, k=k: scores.topk(k, -1, sorted=False)) * 1e3,
                }
                for size in sizes:
                    got = decode_topk(scores, k, blocks_per_row=size)
                    if not torch.equal(scores.gather(-1, got).sort(-1, descending=True).values, expected):
                        raise AssertionError(f"{size} blocks per row selected other scores ({rows} x {length}, k={k})")
                    row[f"blocks_{size}_us"] = (
                        graph_ms(lambda s=size, scores=scores, k=k: decode_topk(scores, k, blocks_per_row=s)) * 1e3
                    )
                row["chosen_us"] = row[f"blocks_{row['chosen_blocks_per_row']}_us"]
                row["fastest_us"] = min(row[f"blocks_{size}_us"] for size in sizes)
                results.append(row)
                times = " ".join(f"{size}:{row[f'blocks_{size}_us']:6.1f}" for size in sizes)
                print(
                    f"{length:>7} x {rows:>3} k {k:>4}  torch.topk {row['torch_topk_us']:6.1f}  blocks per row "
                    f"{times}  chosen {row['chosen_blocks_per_row']} ({row['chosen_us']:.1f} us)",
                    flush=True,
                )
    lost = sum(row["chosen_us"] - row["fastest_us"] for row in results)
    print(f"the chosen sizes lose {lost:.1f} us in all against the fastest, over {len(results)} shapes")
    write_result(Path(args.result), {"rows": results, "chosen_loss_us": lost})


if __name__ == "__main__":
    main()
