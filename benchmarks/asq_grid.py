"""Error of ASQ's residual grids on SmolLM2-135M's real keys and values, side by side in one run (CPU is
enough): the residual of each token after its block's prototype, quantized per token at 2 and 4 bits on

- the mid-rise 2-bit grid ASQ uses since format 2 (levels ±0.5, ±1.5 times 0.9957 rms; `kv_compressor`),
- the symmetric grid with an absmax scale (ASQ's 4- and 8-bit grid; at 2 bits it has three levels and was
  ASQ's 2-bit grid before format 2).

Keys (after RoPE) and values of every layer and KV head come from `--windows` windows of `--seq-len` tokens
of the training prose (not the evaluation text). The prototypes stand in for trained ASQ's: k-means with
`c` clusters per block of 128 tokens (10 Lloyd steps), for c in 1 (the block mean), 2, 4 and 16. Errors
are ||x_hat - x|| / ||x|| over all packed tokens.

python -m benchmarks.asq_grid --train-data PATH/prose --result OUT.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from benchmarks.common import write_result
from benchmarks.prose_probe import add_prose_arguments, prose_model_and_windows
from gsm_train.quant import fake_quant_per_token, split_blocks

BLOCK = 128
CLUSTERS = (1, 2, 4, 16)


def _captured_kv(model, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [layers * windows, H, T, D] as every attention layer receives them."""
    keys, values = [], []

    def capture(module, query, key, value, *args, **kwargs):
        keys.append(key.detach().float())
        values.append(value.detach().float())
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS["gsm_capture"] = capture
    model.config._attn_implementation = "gsm_capture"
    with torch.no_grad():
        for row in rows:
            model(row[None])
    return torch.cat(keys), torch.cat(values)


def _kmeans_prototypes(blocks: torch.Tensor, clusters: int, steps: int = 10) -> torch.Tensor:
    """Each token's prototype [..., bs, D]: k-means over the tokens of its block (the mean when clusters is 1)."""
    if clusters == 1:
        return blocks.mean(dim=-2, keepdim=True).expand_as(blocks)
    start = torch.linspace(0, blocks.shape[-2] - 1, clusters).long()
    centers = blocks[..., start, :]
    for _ in range(steps):
        member = torch.nn.functional.one_hot(torch.cdist(blocks, centers).argmin(-1), clusters).float()
        count = member.sum(-2).unsqueeze(-1)
        centers = torch.where(count > 0, member.transpose(-1, -2) @ blocks / count.clamp_min(1), centers)
    nearest = torch.cdist(blocks, centers).argmin(-1)
    return torch.gather(centers, -2, nearest.unsqueeze(-1).expand_as(blocks))


def _symmetric(residual: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-token symmetric absmax quantization (2**(bits-1) - 1 levels each side of zero)."""
    qmax = 2 ** (bits - 1) - 1
    scale = (residual.abs().amax(-1, keepdim=True) / qmax).half().float()
    return (residual / scale.clamp_min(1e-12)).round().clamp(-qmax, qmax) * scale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prose_arguments(parser)
    args = parser.parse_args()
    model, rows = prose_model_and_windows(args)
    keys, values = _captured_kv(model, rows)
    result: dict = {"windows": len(rows), "seq_len": args.seq_len, "block_size": BLOCK, "errors": {}}
    print(f"{'side':5s} {'c':>3s} {'residual':>9s} {'2b mid-rise':>12s} {'2b symmetric':>13s} {'4b symmetric':>13s}")
    for side, x in (("K", keys), ("V", values)):
        blocks = split_blocks(x, BLOCK)[0]
        norm = blocks.norm()
        for clusters in CLUSTERS:
            residual = blocks - _kmeans_prototypes(blocks, clusters)
            row = {
                "residual": residual.norm() / norm,
                "2bit_midrise": (fake_quant_per_token(residual, 2) - residual).norm() / norm,
                "2bit_symmetric_absmax": (_symmetric(residual, 2) - residual).norm() / norm,
                "4bit_symmetric_absmax": (fake_quant_per_token(residual, 4) - residual).norm() / norm,
            }
            row = {name: round(float(value), 4) for name, value in row.items()}
            result["errors"][f"{side}_c{clusters}"] = row
            print(
                f"{side:5s} {clusters:3d} {row['residual']:9.3f} {row['2bit_midrise']:12.3f} "
                f"{row['2bit_symmetric_absmax']:13.3f} {row['4bit_symmetric_absmax']:13.3f}"
            )
    write_result(Path(args.result), result)


if __name__ == "__main__":
    main()
