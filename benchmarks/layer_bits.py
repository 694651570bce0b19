r"""Per-layer residual widths (`kv_compression.layer_bits`) at the 0.30 KV budget, training-free, on SmolLM2-135M:
the loss increase over the unquantized model on `--windows` windows of `--seq-len` tokens of the training prose
(not the evaluation text) when every layer's keys and values go through rotated ASQ (`rotate_residuals`; 2
k-means prototypes per block of 128 standing in for trained ASQ's, as `residual_quantizers.py`'s `asq_rotated`
rows), each layer at the (K, V) widths an allocation gives it, beside the allocation's exact KV bytes over bf16
(`kv_budget.kv_bytes_ratio` at `--seq-len` tokens, 2048 by default, for the joint recipe with 2 clusters and
16-dim int8 gate keys: at 2048 the 4-bit K / 2-bit V allocation is the trained 0.297 point).

The allocations: every layer at 4-bit K / 2-bit V (the 0.297 point) and at 4/4; 4-bit V in the layers whose
values `layer_sensitivity.py` ranks most sensitive (the top five, 0, 1, 3, 18, 8, and the top four); the same
five paid for by 2-bit K in the five layers whose keys it ranks least sensitive (0, 29, 15, 13, 11); the top
four with 2-bit K in the first three of those (48 bytes a token over, within the 0.30 budget); and the five
2-bit keys alone.
Caveats as `residual_quantizers.py`: no training; every full block quantized (ASQ keeps a query's own block raw).
Prints the table and writes JSON.

python -m benchmarks.layer_bits --train-data ../shared/data/prose --result benchmarks/results/layer_bits.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.common import write_result
from benchmarks.prose_probe import (
    add_prose_arguments,
    kv_hooked_loss,
    prose_model_and_windows,
)
from benchmarks.residual_quantizers import _quantized
from gsm_train.config.schema import load_recipe
from gsm_train.models.families import model_dims
from gsm_train.tuning.kv_budget import kv_bytes_ratio

REPO = Path(__file__).resolve().parents[1]
CLUSTERS = 2
BUDGET_OVERRIDES = [
    "gsm.kv_compression.value_quant_bits=2",
    f"gsm.kv_compression.cluster_num={CLUSTERS}",
    "gsm.sparse_attention.gate_head_dim=16",
    "gsm.sparse_attention.gate_key_bits=8",
]
SENSITIVE_V = (0, 1, 3, 18, 8)  # by rank in benchmarks/results/layer_sensitivity.json, most sensitive first
CALM_K = (0, 29, 15, 13, 11)  # likewise, least sensitive first
# (name, default (K, V) widths, {layer: (K, V)})
ALLOCATIONS: tuple[tuple[str, tuple[int, int], dict[int, tuple[int, int]]], ...] = (
    ("K4 V2 everywhere", (4, 2), {}),
    ("V4 in 0,1,3,18,8", (4, 2), {layer: (4, 4) for layer in SENSITIVE_V}),
    ("V4 in 0,1,3,18", (4, 2), {layer: (4, 4) for layer in SENSITIVE_V[:4]}),
    (
        "V4 in 0,1,3,18,8; K2 in 0,29,15,13,11",
        (4, 2),
        {**{layer: (4, 4) for layer in SENSITIVE_V}, **{layer: (2, 2) for layer in CALM_K}, 0: (2, 4)},
    ),
    (
        "V4 in 0,1,3,18; K2 in 0,29,15",
        (4, 2),
        {**{layer: (4, 4) for layer in SENSITIVE_V[:4]}, **{layer: (2, 2) for layer in CALM_K[:3]}, 0: (2, 4)},
    ),
    ("K2 in 0,29,15,13,11", (4, 2), {layer: (2, 2) for layer in CALM_K}),
    ("K4 V4 everywhere", (4, 4), {}),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prose_arguments(parser)
    args = parser.parse_args()
    model, rows = prose_model_and_windows(args)
    dims = model_dims(model)
    widths: dict[int, tuple[int, int]] = {}  # empty: unquantized

    def quantized(module, key, value):  # noqa: ANN001, ANN202 (prose_probe's KVTransform)
        if not widths:
            return key, value
        key_bits, value_bits = widths[module.layer_idx]
        return (
            _quantized(key, "asq_rotated", CLUSTERS, key_bits, is_key=True),
            _quantized(value, "asq_rotated", CLUSTERS, value_bits, is_key=False),
        )

    loss = kv_hooked_loss(model, rows, "gsm_layer_bits", quantized)
    base = loss()
    print(f"base loss {base:.4f}\n{'allocation':40s} {'KV / bf16':>9s} {'loss increase':>13s}", flush=True)
    results = []
    for name, (key_bits, value_bits), layer_bits in ALLOCATIONS:
        config = load_recipe(
            str(REPO / "recipes" / "joint.yaml"),
            [
                *BUDGET_OVERRIDES,
                f"gsm.kv_compression.quant_bits={key_bits}",
                f"gsm.kv_compression.value_quant_bits={value_bits}",
            ],
        ).gsm
        config.kv_compression.layer_bits = layer_bits
        widths.update({layer: config.kv_compression.bits(layer) for layer in range(dims["layers"])})
        ratio = kv_bytes_ratio(config, dims, args.seq_len)
        results.append(
            {
                "allocation": name,
                "layer_bits": {str(k): list(v) for k, v in layer_bits.items()},
                "default_bits": [key_bits, value_bits],
                "kv_bytes_ratio": ratio,
                "loss_increase": loss() - base,
            }
        )
        print(f"{name:40s} {ratio:9.4f} {results[-1]['loss_increase']:+13.4f}", flush=True)
    write_result(
        Path(args.result),
        {"windows": len(rows), "seq_len": args.seq_len, "clusters": CLUSTERS, "base_loss": base, "rows": results},
    )


if __name__ == "__main__":
    main()
