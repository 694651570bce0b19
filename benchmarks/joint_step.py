"""Tokens/s of a joint (GSM) training step against a dense fine-tune step of the same model, batch and
length, side by side in one run: SmolLM2-135M, recipes/joint.yaml as shipped (batch 4 x 2048 tokens,
full base training, bf16 autocast over fp32 weights), and the same recipe with gsm.gsm_enabled=false.

Each step runs as the trainer runs it on one GPU (`train.cuda_graph: auto`: the micro-step replayed
from a CUDA graph, then clipping and fused AdamW) and eagerly (`train.cuda_graph: false`). The gate
starts untrained (`init_from=null`): a step's work does not depend on the gate's values.

python -m benchmarks.joint_step --result OUT.json [--gsm gsm.KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import add_gsm_argument, kernel_times, op_times, write_result
from gsm_train.config.schema import load_recipe
from gsm_train.training.session import TrainingSession
from gsm_train.training.stages import JointStage
from gsm_train.training.trainer import fp32_matmul_precision

REPO = Path(__file__).resolve().parents[1]


def _step_ms(
    gsm_enabled: bool, graphed: bool, overrides: list[str], steps: int, profile_rows: int = 0
) -> tuple[float, list[dict]]:
    """Median wall time of one training step as the trainer runs it (`TrainingSession.step`: the micro-step,
    clipping, the optimizer and the schedule), in milliseconds, and with `profile_rows` the largest kernels'
    GPU time per step (eager steps: per op and input shapes)."""
    config = load_recipe(
        str(REPO / "recipes" / "joint.yaml"),
        ["init_from=null", f"gsm.gsm_enabled={str(gsm_enabled).lower()}", *overrides],
    )
    session = TrainingSession.setup(config, JointStage())
    if graphed:
        session.capture()

    def step() -> None:
        session.step()
        torch.cuda.synchronize()

    with fp32_matmul_precision(config.train.fp32_matmul, session.info.device):  # as the trainer runs its steps
        for _ in range(3):
            step()
        times = []
        for _ in range(steps):
            tic = time.perf_counter()
            step()
            times.append((time.perf_counter() - tic) * 1e3)
        profile = kernel_times if graphed else op_times
        return statistics.median(times), profile(step)[:profile_rows] if profile_rows else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--result", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--train-data", default="embedded:sample_prose")
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="also record what takes the most GPU time per step, per setting: the N largest "
        "kernels of captured steps, the N largest ops (with input shapes) of eager ones",
    )
    parser.add_argument("--no-eager", action="store_true", help="time the captured steps only")
    add_gsm_argument(
        parser,
        "GSM settings on top of the shipped recipe for the joint step (the dense step has GSM "
        "off), e.g. a KV budget: gsm.kv_compression.value_quant_bits=2",
    )
    parser.add_argument(
        "--fp32-matmul",
        choices=("default", "tf32"),
        default=None,
        help="train.fp32_matmul for both steps (default: the recipe's)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("this benchmark times GPU training steps; run it on a CUDA device")
    overrides = [
        f"data.train.path={args.train_data}",
        "logging.progress_bar=false",
        *args.gsm,
        *([f"train.fp32_matmul={args.fp32_matmul}"] if args.fp32_matmul else []),
    ]
    config = load_recipe(str(REPO / "recipes" / "joint.yaml"), overrides)
    tokens = config.train.batch_size * config.data.seq_len
    rows = {}
    for graphed in (True,) if args.no_eager else (True, False):
        for gsm_enabled in (False, True):
            name = f"{'joint' if gsm_enabled else 'dense'}_{'graphed' if graphed else 'eager'}"
            ms, kernels = _step_ms(gsm_enabled, graphed, overrides, args.steps, args.profile)
            gc.collect()  # the model, optimizer and graph of the last setting
            torch.cuda.empty_cache()
            rows[name] = {"step_ms": ms, "tokens_per_s": tokens / ms * 1e3, **({"kernels": kernels} if kernels else {})}
            print(f"{name:14s} {ms:8.1f} ms/step {rows[name]['tokens_per_s']:10.0f} tokens/s", flush=True)
            for row in kernels:
                print(
                    f"    {row['ms_per_step']:8.2f} ms {row['calls_per_step']:6.0f}x  {row.get('kernel') or row['op']} "
                    f"{row.get('input_shapes', '')}"
                )
    result = {
        "batch_size": config.train.batch_size,
        "seq_len": config.data.seq_len,
        "steps_timed": args.steps,
        **({"gsm_overrides": args.gsm} if args.gsm else {}),
        "fp32_matmul": config.train.fp32_matmul,
        "joint_over_dense_tokens_per_s": rows["joint_graphed"]["tokens_per_s"] / rows["dense_graphed"]["tokens_per_s"],
        "rows": rows,
    }
    print(
        f"joint / dense tokens/s: {result['joint_over_dense_tokens_per_s']:.3f} as the trainer runs them (CUDA graph)"
    )
    if not args.no_eager:
        result["joint_over_dense_tokens_per_s_eager"] = (
            rows["joint_eager"]["tokens_per_s"] / rows["dense_eager"]["tokens_per_s"]
        )
        print(f"joint / dense tokens/s eager: {result['joint_over_dense_tokens_per_s_eager']:.3f}")
    write_result(Path(args.result), result)


if __name__ == "__main__":
    main()
