"""The joint step's top-k selection of one query chunk, side by side in one run: `torch.topk` (unsorted)
and the scatter of its indices into a mask, against the Triton mask kernel (`gsm_train.kernels.selection`),
at SmolLM2's training shapes (batch 4, one selection per layer, 1,024 queries x 2,048 keys, top-256,
bf16 scores, as `select_top_k` ranks them). GPU kernel time per call (torch.profiler, mean of 3 calls).

python benchmarks/selection.py --result OUT.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import kernel_times, write_result  # noqa: E402

from gsm_train.kernels.selection import top_k_mask  # noqa: E402

BATCH, QUERIES, KEYS, TOP_K = 4, 1024, 2048, 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("this benchmark times GPU kernels; run it on a CUDA device")
    torch.manual_seed(0)
    scores = torch.randn(BATCH, 1, QUERIES, KEYS, device="cuda").to(torch.bfloat16)

    def topk_scatter() -> torch.Tensor:
        index = scores.topk(TOP_K, dim=-1, sorted=False).indices
        return torch.zeros(scores.shape, dtype=torch.bool, device="cuda").scatter(-1, index, True)

    def kept(mask: torch.Tensor) -> torch.Tensor:  # the multiset of kept scores (bf16 ties may keep other positions)
        return scores.masked_fill(~mask, float("-inf")).sort(dim=-1).values

    assert torch.equal(kept(topk_scatter()), kept(top_k_mask(scores, TOP_K))), "the two keep different scores"
    rows = {name: {"gpu_ms": sum(row["ms_per_step"] for row in kernel_times(fn))}
            for name, fn in {"torch_topk_scatter": topk_scatter, "triton_mask": lambda: top_k_mask(scores, TOP_K)}.items()}
    for name, row in rows.items():
        print(f"{name:20s} {row['gpu_ms'] * 1e3:8.1f} us of GPU kernels per chunk")
    write_result(Path(args.result), {"shape": {"batch": BATCH, "queries": QUERIES, "keys": KEYS, "top_k": TOP_K},
                                     "rows": rows})


if __name__ == "__main__":
    main()
