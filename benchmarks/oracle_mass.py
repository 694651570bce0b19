"""Oracle captured attention mass at k (one head-averaged top-k per query) on SmolLM2-135M, per layer,
over non-overlapping WikiText-2 validation windows; also the step-0 (qk_svd-initialised) gate's mass.

python -m benchmarks.oracle_mass --eval-data PATH/wikitext-2/valid.txt --out DIR [--windows 40 --k 64]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.common import write_result
from gsm_train.attention import gsm_collect, inject_gsm
from gsm_train.config.schema import GSMConfig
from gsm_train.data.text import load_text_dataset, pack_tokens
from gsm_train.models.model_zoo import load_model_and_tokenizer


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--eval-data", required=True)
    parser.add_argument("--windows", type=int, default=40)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--min-keys", type=int, default=512)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, tokenizer = load_model_and_tokenizer(args.model, dtype=dtype)
    model.to(device)
    inject_gsm(model, GSMConfig.model_validate({"sparse_attention": {"top_k": args.k, "k_min": min(32, args.k)}}))
    rows = pack_tokens(load_text_dataset(args.eval_data), tokenizer, args.seq_len)[: args.windows]
    layers = model.config.num_hidden_layers
    sums = torch.zeros(layers, 3, dtype=torch.float64)
    for row in rows:
        with gsm_collect(model, recall=(args.k, args.min_keys)) as records:
            model(input_ids=row[None].to(device), use_cache=False, logits_to_keep=1)
        for layer, record in records.layers.items():
            s = record.captured_mass
            sums[layer] += torch.stack([s["oracle"], s["gate"], s["queries"]]).cpu()
    oracle = (sums[:, 0] / sums[:, 2]).tolist()
    gate = (sums[:, 1] / sums[:, 2]).tolist()
    result = {
        "k": args.k,
        "windows": len(rows),
        "seq_len": args.seq_len,
        "min_keys": args.min_keys,
        f"oracle_mass_k{args.k}": sum(oracle) / layers,
        f"oracle_mass_k{args.k}_min": min(oracle),
        f"oracle_mass_k{args.k}_per_layer": oracle,
        f"gate_init_mass_k{args.k}": sum(gate) / layers,
        f"gate_init_mass_k{args.k}_per_layer": gate,
    }
    write_result(Path(args.out) / "oracle_mass.json", result)
    print(f"{'layer':>5} {'oracle':>7} {'gate@init':>9}")
    for layer in range(layers):
        print(f"{layer:>5} {oracle[layer]:7.3f} {gate[layer]:9.3f}")
    print(
        f"mean oracle mass @k={args.k}: {sum(oracle) / layers:.3f} (weakest layer {min(oracle):.3f}); "
        f"step-0 gate {sum(gate) / layers:.3f}"
    )


if __name__ == "__main__":
    main()
