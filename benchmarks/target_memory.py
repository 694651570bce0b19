"""Peak memory of the stage-1 target + gate KL (forward and backward) for one SmolLM2-shaped layer at two
sequence lengths and two query chunks, against the full [B, H, T, T] fp32 attention tensor.

python -m benchmarks.target_memory --out DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.common import write_result
from gsm_train.functional.attention_targets import gate_distill_loss


def peak_bytes(length: int, chunk: int, device: torch.device) -> int:
    """Peak extra memory of one layer's gate_distill_loss forward+backward (batch 1, 9 heads / 3 KV heads)."""
    query = torch.randn(1, 9, length, 64, device=device, dtype=torch.bfloat16)
    key = torch.randn(1, 3, length, 64, device=device, dtype=torch.bfloat16)
    gate_q = torch.randn(1, 1, length, 64, device=device, requires_grad=True)
    gate_k = torch.randn(1, 1, length, 64, device=device, requires_grad=True)
    positions = torch.arange(length, device=device)
    allowed = (positions[None, :] <= positions[:, None])[None, None]
    counted = allowed.sum(-1) >= 64
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    total, _ = gate_distill_loss(query, key, gate_q, gate_k, allowed, counted, 0.125, chunk)
    total.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", type=int, nargs=2, default=[2048, 8192])
    parser.add_argument("--chunks", type=int, nargs=2, default=[128, 256])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    for length in args.lengths:
        for chunk in args.chunks:
            peak = peak_bytes(length, chunk, device)
            full = 9 * length * length * 4
            rows.append(
                {"seq_len": length, "chunk": chunk, "peak_mib": peak / 2**20, "full_attention_mib": full / 2**20}
            )
    write_result(
        Path(args.out) / "target_memory.json",
        {"rows": rows, "note": "the allowed mask [T, T] bool is an input, counted in peak"},
    )
    print(f"{'seq':>6} {'chunk':>6} {'peak MiB':>9} {'full [H,T,T] fp32 MiB':>22}")
    for r in rows:
        print(f"{r['seq_len']:>6} {r['chunk']:>6} {r['peak_mib']:9.1f} {r['full_attention_mib']:22.1f}")


if __name__ == "__main__":
    main()
