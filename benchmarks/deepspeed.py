"""DeepSpeed ZeRO-2 and ZeRO-3 against FSDP2 on 2 GPUs: gate_only, then joint from that backend's
gate_only export (as recipes/joint.yaml does), each a short run started with `accelerate launch` and
the backend's config (launch/multi_gpu.yaml, launch/deepspeed_zero2.yaml, launch/deepspeed_zero3.yaml).
Reports the largest per-step loss difference against the FSDP2 run (per stage and overall) and the
perplexity of every export on WikiText-2 validation windows, which must agree across backends.

python -m benchmarks.deepspeed --train-data PATH/prose --eval-data PATH/wikitext-2/valid.txt --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import write_result
from gsm_train.commands.evaluate import evaluate_exports
from gsm_train.data.text import load_text_dataset
from gsm_train.models.model_zoo import load_model_and_tokenizer

REPO = Path(__file__).resolve().parents[1]
BACKENDS = {
    "fsdp2": ("multi_gpu.yaml", None),
    "zero2": ("deepspeed_zero2.yaml", 2),
    "zero3": ("deepspeed_zero3.yaml", 3),
}
STAGES = ("gate_only", "joint")


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train_sample(train_data: str, chars: int, out: Path) -> Path:
    """The first `chars` characters of the training text in one file, so that each run tokenizes little."""
    text, total = [], 0
    for row in load_text_dataset(train_data):
        text.append(row["text"][: chars - total])
        total += len(text[-1])
        if total >= chars:
            break
    path = out / "train_sample.txt"
    path.write_text("\n\n".join(text))
    return path


def _launch(backend: str, stage: str, overrides: list[str], run_dir: Path) -> dict:
    """One 2-process run; exits with the log's tail if it fails or ran another backend."""
    config_file, zero_stage = BACKENDS[backend]
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "launch" / config_file),
        "--num_processes",
        "2",
        "-m",
        "gsm_train.train",
        "--recipe",
        str(REPO / "recipes" / f"{stage}.yaml"),
        *overrides,
        f"output.dir={run_dir}",
    ]
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    log = run_dir.with_suffix(".log")
    print(f"[{backend} {stage}] {' '.join(cmd)}", flush=True)
    tic = time.perf_counter()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as handle:
        status = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, check=False).returncode
    setup = next((r for r in _records(run_dir) if r["kind"] == "setup"), {}) if status == 0 else {}
    if status != 0 or setup.get("zero_stage") != zero_stage or setup.get("world_size") != 2:
        tail = "\n".join(log.read_text().splitlines()[-60:])
        sys.exit(f"{tail}\n[{backend} {stage}] FAILED (exit {status}, setup {setup}); full log: {log}")
    losses = [r["loss"] for r in _records(run_dir) if r["kind"] == "train"]
    return {"losses": losses, "seconds": time.perf_counter() - tic, "setup": setup, "command": " ".join(cmd)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--train-data", required=True)
    parser.add_argument("--eval-data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--result", default=None, help="result JSON path (default OUT/deepspeed.json)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--train-chars", type=int, default=3_000_000)
    parser.add_argument("--windows", type=int, default=8, help="WikiText-2 windows for the export perplexity")
    parser.add_argument("--ppl-rtol", type=float, default=0.02, help="allowed relative perplexity difference")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sample = _train_sample(args.train_data, args.train_chars, out)
    load_model_and_tokenizer("smollm2-135m")  # converts the GGUF once, before two processes race to do it
    common = [
        f"data.train.path={sample}",
        f"data.eval.path={args.eval_data}",
        f"data.seq_len={args.seq_len}",
        f"train.steps={args.steps}",
        "train.batch_size=2",
        "optim.warmup_steps=5",
        "logging.eval_every=1000",
        "logging.eval_batches=2",
        "logging.progress_bar=false",
        "output.checkpoint_every=1000",
    ]
    runs: dict[str, dict[str, dict]] = {stage: {} for stage in STAGES}
    for backend in BACKENDS:
        gate_dir = out / backend / "gate_only"
        runs["gate_only"][backend] = _launch(backend, "gate_only", common, gate_dir)
        runs["joint"][backend] = _launch(
            backend, "joint", [*common, f"init_from={gate_dir / 'export'}"], out / backend / "joint"
        )
    result: dict = {"steps": args.steps, "seq_len": args.seq_len, "global_batch": 4, "runs": runs}
    for backend in ("zero2", "zero3"):
        per_stage = {
            stage: max(abs(a - b) for a, b in zip(runs[stage]["fsdp2"]["losses"], runs[stage][backend]["losses"]))
            for stage in STAGES
        }
        result |= {f"max_loss_diff_{backend}_{stage}": diff for stage, diff in per_stage.items()}
        result[f"max_loss_diff_{backend}"] = max(per_stage.values())
    write_result(Path(args.result) if args.result else out / "deepspeed.json", result)
    exports = {f"{stage}_{backend}": str(out / backend / stage / "export") for stage in STAGES for backend in BACKENDS}
    report = evaluate_exports("smollm2-135m", exports, args.eval_data, args.seq_len, args.windows, 1, "sparse", 512)
    ppl = {name: row["ppl"] for name, row in report["results"].items()}
    result |= {"ppl": ppl, "eval": report}
    for backend in ("zero2", "zero3"):
        result[f"max_ppl_rel_diff_{backend}"] = max(abs(ppl[f"{s}_{backend}"] / ppl[f"{s}_fsdp2"] - 1) for s in STAGES)
    result["exports_agree"] = all(result[f"max_ppl_rel_diff_{b}"] <= args.ppl_rtol for b in ("zero2", "zero3"))
    write_result(Path(args.result) if args.result else out / "deepspeed.json", result)
    print(f"{'stage':<10} {'backend':<7} {'final loss':>10} {'max |dloss|':>12} {'PPL':>9} {'run s':>6}")
    for stage in STAGES:
        for backend, run in runs[stage].items():
            diff = "-" if backend == "fsdp2" else f"{result[f'max_loss_diff_{backend}_{stage}']:.2e}"
            print(
                f"{stage:<10} {backend:<7} {run['losses'][-1]:>10.4f} {diff:>12} {ppl[f'{stage}_{backend}']:>9.3f} "
                f"{run['seconds']:>6.0f}"
            )
    print(
        f"base PPL {ppl['base']:.3f}; max loss diff vs FSDP2: ZeRO-2 {result['max_loss_diff_zero2']:.2e}, "
        f"ZeRO-3 {result['max_loss_diff_zero3']:.2e}; max relative PPL diff: ZeRO-2 "
        f"{result['max_ppl_rel_diff_zero2']:.2e}, ZeRO-3 {result['max_ppl_rel_diff_zero3']:.2e}; "
        f"exports agree within {args.ppl_rtol}: {result['exports_agree']}"
    )


if __name__ == "__main__":
    main()
