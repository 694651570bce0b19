"""The joint step's top-k selection of one query chunk, side by side in one run: `select_top_k`'s PyTorch
path for a uniform k (rank forced keys first and hidden ones last, unsorted `torch.topk`, scatter of its
indices, then the forced keys and the causal mask again) against the one-pass Triton kernel
(`gsm_train.kernels.selection.top_k_selection`), at SmolLM2's training shapes (batch 4, one selection per
layer, the second chunk of 1,024 queries over 2,048 causal keys, top-256, bf16 scores). GPU kernel time per
call (torch.profiler, mean of 3 calls); both run eagerly (the trainer compiles the PyTorch path's masking).

python -m benchmarks.selection --result OUT.json
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.common import kernel_benchmark_args, kernel_times, write_result
from gsm_train.kernels.selection import top_k_selection

BATCH, QUERIES, KEYS, TOP_K = 4, 1024, 2048, 256


def main() -> None:
    args = kernel_benchmark_args(__doc__)
    torch.manual_seed(0)
    positions = torch.arange(KEYS, device="cuda")
    queries = positions[KEYS - QUERIES :]
    allowed = (positions[None, :] <= queries[:, None])[None, None]
    scores = torch.randn(BATCH, 1, QUERIES, KEYS, device="cuda").to(torch.bfloat16)

    def pytorch_path() -> torch.Tensor:
        forced = positions[None, :] == queries[:, None]
        ranked = scores.masked_fill(forced, float("inf")).masked_fill(~allowed, float("-inf"))
        index = ranked.topk(TOP_K, dim=-1, sorted=False).indices
        selected = torch.zeros(scores.shape, dtype=torch.bool, device="cuda").scatter(-1, index, True)
        return (selected | (forced & allowed)) & allowed

    def kernel() -> torch.Tensor:
        return top_k_selection(scores, allowed, TOP_K, queries, positions)

    def kept(mask: torch.Tensor) -> torch.Tensor:  # the multiset of kept scores (bf16 ties may keep other positions)
        return scores.masked_fill(~mask, float("-inf")).sort(dim=-1).values

    assert torch.equal(kept(pytorch_path()), kept(kernel())), "the two keep different scores"
    rows = {
        name: {"gpu_ms": sum(row["ms_per_step"] for row in kernel_times(fn))}
        for name, fn in {"pytorch_topk_scatter": pytorch_path, "triton_selection": kernel}.items()
    }
    for name, row in rows.items():
        print(f"{name:22s} {row['gpu_ms'] * 1e3:8.1f} us of GPU kernels per chunk")
    write_result(
        Path(args.result), {"shape": {"batch": BATCH, "queries": QUERIES, "keys": KEYS, "top_k": TOP_K}, "rows": rows}
    )


if __name__ == "__main__":
    main()
