"""Every autotune configuration of the fused decode kernel (`gsm_train.kernels.sparse_decode`) against the one
Triton's autotuner picks, side by side in one run: how much time the pick leaves, and which configuration
each shape wants. SmolLM2 and Llama-8B layer shapes, 32k context, batch 1 and 16, k 64 and 2048, ASQ and gate
keys as recipes/joint.yaml sets them, each time per layer in CUDA graphs of up to 16 layers as
benchmarks/decode.py times them. Every configuration's largest error against the PyTorch path is recorded,
and those past bf16's bound are listed (the GPU tests are the gate: this only reports).

python -m benchmarks.decode_configs --result OUT.json
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.common import kernel_benchmark_args, write_result
from benchmarks.decode import (
    REPO,
    SHAPES,
    compressors,
    config_name,
    layer_caches,
    layers_per_graph,
    per_layer_ms,
    selection,
)
from gsm_train.config.schema import load_recipe
from gsm_train.inference.decode_attention import attend
from gsm_train.kernels.sparse_decode import (
    autotuned_config,
    decode_configs,
    fused_decode_attention,
)

CONTEXT = 32768
BATCHES = (1, 16)
KS = (64, 2048)
BF16_ATOL, BF16_RTOL = 3e-3, 1e-2  # the per-configuration test's atol, plus 1% for bf16 rounding of larger outputs


@torch.no_grad()
def main() -> None:
    args = kernel_benchmark_args(__doc__)
    gsm = load_recipe(str(REPO / "recipes" / "joint.yaml")).gsm
    configs = decode_configs()
    results, off_bound = [], []
    for shape, (q_heads, kv_heads, dim) in SHAPES.items():
        stores_asq = compressors(gsm, kv_heads, dim)
        for batch in BATCHES:
            layers = layers_per_graph(2 * batch * kv_heads * CONTEXT * dim * 2)
            caches = layer_caches(gsm, stores_asq, batch, CONTEXT, layers)
            query = torch.randn(batch, q_heads, 1, dim, device="cuda", dtype=torch.bfloat16)
            gate_q = torch.randn(batch, 1, 1, caches[0][2].shape[-1], device="cuda")
            for k in KS:
                index = selection(gate_q, caches[0], k)
                rows = index.expand(-1, kv_heads, -1)
                expected = attend(
                    query.float(), *(store.gather(rows).float() for store in caches[0][:2]), None, dim**-0.5
                )
                row = {"shape": shape, "context": CONTEXT, "batch": batch, "k": k, "layers_per_graph": layers}
                for config in (*configs, None):
                    got = fused_decode_attention(
                        query,
                        caches[0][0].packed_rows(),
                        caches[0][1].packed_rows(),
                        index,
                        None,
                        dim**-0.5,
                        config=config,
                    )
                    name = "autotuned" if config is None else config_name(config)
                    row[name + "_max_error"] = (got.float() - expected).abs().max().item()
                    if not torch.allclose(got.float(), expected, atol=BF16_ATOL, rtol=BF16_RTOL):
                        off_bound.append(f"{name} ({shape}, batch {batch}, k={k}): {row[name + '_max_error']:.2g}")
                    us = (
                        per_layer_ms(
                            [
                                lambda c=c, config=config, query=query, index=index, dim=dim: fused_decode_attention(
                                    query, c[0].packed_rows(), c[1].packed_rows(), index, None, dim**-0.5, config=config
                                )
                                for c in caches
                            ]
                        )
                        * 1e3
                    )
                    row[name + "_us"] = us
                fastest = config_name(min(configs, key=lambda c: row[config_name(c) + "_us"]))
                row.update(
                    autotuned_config=config_name(autotuned_config()),
                    fastest_config=fastest,
                    fastest_us=row[fastest + "_us"],
                )
                results.append(row)
                times = " ".join(f"{config_name(c)}:{row[config_name(c) + '_us']:.1f}" for c in configs)
                print(
                    f"{shape:>8} bs {batch:>2} k {k:>4}  autotuned {row['autotuned_config']} "
                    f"{row['autotuned_us']:.1f} us, fastest {row['fastest_us']:.1f}  |  {times}",
                    flush=True,
                )
            del caches
            torch.cuda.empty_cache()
    lost = sum(row["autotuned_us"] - row["fastest_us"] for row in results)  # net: a pick may time below by noise
    print(
        f"the autotuner's picks lose {lost:.1f} us net against the fastest configurations, over {len(results)} shapes"
    )
    print("outputs off the PyTorch path by more than bf16's bound:", ", ".join(off_bound) or "none")
    write_result(
        Path(args.result),
        {
            "rows": results,
            "autotuned_loss_us": lost,
            "off_bound": off_bound,
            "bound": {"atol": BF16_ATOL, "rtol": BF16_RTOL},
        },
    )


if __name__ == "__main__":
    main()
