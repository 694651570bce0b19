"""Stage 1 (recipes/gate_only.yaml) on SmolLM2-135M: gate/oracle captured mass at k=64 per layer,
one training step (as the trainer runs it on one GPU: captured in a CUDA graph, its gate paths
compiled) against one plain forward of the base (eager, and captured too), and 1 vs 2 GPU loss curves.

python -m benchmarks.gate_warmup --train-data PATH/prose --eval-data PATH/wikitext-2/valid.txt --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import torch

from benchmarks.common import graph_ms, median_ms, write_result
from gsm_train.attention import gsm_disabled
from gsm_train.attention.injection import rows_not_packed
from gsm_train.config.schema import RecipeConfig, load_recipe
from gsm_train.train import train_recipe
from gsm_train.training.session import TrainingSession
from gsm_train.training.stages import GateWarmupStage

REPO = Path(__file__).resolve().parents[1]


def _losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "train"]


def _time_step_vs_forward(config: RecipeConfig, distill_queries: int) -> dict[str, float]:
    """One training step as the trainer runs it on one GPU (`TrainingSession.step`: the micro-step
    replayed from a CUDA graph, then the backend's clipping and fused AdamW, the schedule, and the loss
    read on the host) and the same step run eagerly; one plain forward of the base, eagerly (as
    `model(...)` runs) and replayed from a CUDA graph (captured as the step is, see `rows_not_packed`)."""
    config = config.model_copy(update={"train": config.train.model_copy(update={"distill_queries": distill_queries})})
    session = TrainingSession.setup(config, GateWarmupStage())
    model = session.unwrapped
    batch = session.loader.next_batch().to(session.info.device)

    def step() -> None:
        float(session.step().means[0])

    @torch.no_grad()
    def forward() -> None:
        with gsm_disabled(model), torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            model(input_ids=batch, use_cache=False)

    def captured_forward() -> None:
        with rows_not_packed():
            forward()

    eager_ms = median_ms(step)
    session.capture()
    step_ms, forward_ms, forward_graphed_ms = median_ms(step), median_ms(forward), graph_ms(captured_forward)
    return {
        "step_ms": step_ms,
        "forward_ms": forward_ms,
        "step_over_forward": step_ms / forward_ms,
        "step_ms_eager": eager_ms,
        "forward_ms_graphed": forward_graphed_ms,
        "step_over_graphed_forward": step_ms / forward_graphed_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "gate_only.yaml"))
    parser.add_argument("--train-data", required=True)
    parser.add_argument("--eval-data", required=True)
    parser.add_argument("--out", required=True, help="folder for the runs and the result JSON")
    parser.add_argument("--result", default=None, help="result JSON path (default OUT/gate_warmup.json)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    out = Path(args.out)
    data = [f"data.train.path={args.train_data}", f"data.eval.path={args.eval_data}", "logging.progress_bar=false"]
    one = train_recipe(args.recipe, [*data, *args.overrides, f"output.dir={out / 'one_gpu'}"])
    metrics = one.final_metrics
    config = load_recipe(args.recipe, [*data, *args.overrides, f"output.dir={out / 'timing'}"])
    timing = _time_step_vs_forward(config, config.train.distill_queries)
    every_query = _time_step_vs_forward(config, 0)
    timing |= {
        "distill_queries": config.train.distill_queries,
        "step_ms_all_queries": every_query["step_ms"],
        "step_over_forward_all_queries": every_query["step_over_forward"],
        "step_ms_eager_all_queries": every_query["step_ms_eager"],
    }
    result = {
        "recall_ratio_k64": metrics["recall_ratio_k64"],
        "recall_ratio_k64_per_layer": metrics["recall_ratio_k64_per_layer"],
        "oracle_mass_k64": metrics["oracle_mass_k64"],
        "gate_mass_k64": metrics["gate_mass_k64"],
        "gate_mass_k64_per_layer": metrics["gate_mass_k64_per_layer"],
        "oracle_mass_k64_per_layer": metrics["oracle_mass_k64_per_layer"],
        "kl_final": metrics["kl"],
        "losses_one_gpu": one.losses,
        **timing,
    }
    del one
    torch.cuda.empty_cache()
    result_path = Path(args.result) if args.result else out / "gate_warmup.json"
    write_result(result_path, result)  # the one-GPU figures stand even if the two-GPU run fails
    if torch.cuda.device_count() >= 2:
        env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
        two_dir = out / "two_gpu"
        cmd = [
            "accelerate",
            "launch",
            "--config_file",
            str(REPO / "launch" / "multi_gpu.yaml"),
            "--num_processes",
            "2",
            "-m",
            "gsm_train.train",
            "--recipe",
            args.recipe,
            *data,
            *args.overrides,
            "train.batch_size=2",
            f"output.dir={two_dir}",
        ]
        subprocess.run(cmd, check=True, env=env)
        two = _losses(two_dir)
        result["losses_two_gpu"] = two
        result["two_gpu_command"] = " ".join(cmd)
        result["two_gpu_max_loss_diff"] = max(abs(a - b) for a, b in zip(result["losses_one_gpu"], two))
    else:
        result["two_gpu_max_loss_diff"] = None
    write_result(result_path, result)
    per_layer = result["recall_ratio_k64_per_layer"]
    print(f"{'layer':>5} {'gate':>7} {'oracle':>7} {'ratio':>6}")
    for layer, (g, o, r) in enumerate(
        zip(result["gate_mass_k64_per_layer"], result["oracle_mass_k64_per_layer"], per_layer)
    ):
        print(f"{layer:>5} {g:7.3f} {o:7.3f} {r:6.3f}")
    print(
        f"mean ratio {result['recall_ratio_k64']:.3f}  gate {result['gate_mass_k64']:.3f}  "
        f"oracle {result['oracle_mass_k64']:.3f}  step/forward {result['step_over_forward']:.2f} "
        f"({result['step_ms']:.1f} / {result['forward_ms']:.1f} ms)  2-GPU max loss diff "
        f"{result['two_gpu_max_loss_diff']}"
    )


if __name__ == "__main__":
    main()
