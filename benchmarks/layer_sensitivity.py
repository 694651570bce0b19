"""Which layers' keys and values suffer most from low-bit residuals, training-free, on SmolLM2-135M: for each
layer alone (and for all layers at once), K or V of every full block of 128 tokens is replaced by its
block mean plus the per-token residual fake-quantized at `--bits` on ASQ's grid (`fake_quant_per_token`),
and the loss increase over the unquantized model is measured on `--windows` windows of the training prose
(not the evaluation text). A proxy for where extra bits pay off: no training, the block mean in place of
ASQ's prototypes, and every full block quantized (ASQ keeps a query's own block raw). Prints the table,
writes JSON and a plot (loss increase per layer, K and V).

python -m benchmarks.layer_sensitivity --train-data PATH/prose --result OUT.json --plot OUT.png [--bits 2]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.common import write_result
from benchmarks.prose_probe import (
    add_prose_arguments,
    kv_hooked_loss,
    prose_model_and_windows,
)
from gsm_train.plots import plot_layer_sensitivity
from gsm_train.quant import fake_quant_per_token, join_blocks, split_blocks

BLOCK = 128


def _quantized(x: torch.Tensor, bits: int) -> torch.Tensor:
    """[B, H, S, D] with every full block's tokens as block mean + per-token fake-quantized residual."""
    blocks, tail = split_blocks(x, BLOCK)
    mean = blocks.float().mean(dim=3, keepdim=True)
    return join_blocks(fake_quant_per_token(blocks.float() - mean, bits) + mean, tail)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prose_arguments(parser)
    parser.add_argument("--plot", required=True)
    parser.add_argument("--bits", type=int, default=2, choices=(2, 4, 8))
    args = parser.parse_args()
    model, rows = prose_model_and_windows(args, "cuda" if torch.cuda.is_available() else "cpu")
    target: dict[str, object] = {"layer": None, "side": "V"}

    def quantized(module: torch.nn.Module, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if target["layer"] in ("all", module.layer_idx):
            if target["side"] == "K":
                return _quantized(key, args.bits), value
            return key, _quantized(value, args.bits)
        return key, value

    loss = kv_hooked_loss(model, rows, "gsm_layer_sensitivity", quantized)
    base = loss()
    layers = range(model.config.num_hidden_layers)
    increase: dict[str, list[float]] = {}
    all_layers: dict[str, float] = {}
    for side in ("K", "V"):
        target["side"] = side
        target["layer"] = "all"
        all_layers[side] = loss() - base
        increase[side] = []
        for layer in layers:
            target["layer"] = layer
            increase[side].append(loss() - base)
            print(f"{side} layer {layer:2d}: loss +{increase[side][-1]:.4f}", flush=True)
        print(
            f"{side} all layers at once: loss +{all_layers[side]:.4f}; sum of single layers +{sum(increase[side]):.4f}",
            flush=True,
        )
    plot_layer_sensitivity(increase, args.bits, Path(args.plot))
    write_result(
        Path(args.result),
        {
            "bits": args.bits,
            "windows": len(rows),
            "seq_len": args.seq_len,
            "base_loss": base,
            "all_layers_loss_increase": all_layers,
            "loss_increase_per_layer": increase,
            "plot": args.plot,
        },
    )


if __name__ == "__main__":
    main()
