"""A Llama-3-8B-shaped model on one GPU: every stage's step beside a plain dense fine-tune step.

The model is `random-llama3-8b` (32 layers, hidden 4096, 32 query / 8 KV heads of 128, intermediate
14336, vocabulary 128256: 8.03e9 parameters), built from its config with random weights directly on
the GPU (nothing downloaded), at data.seq_len 8192, one row a step. Each row runs a stage as the
trainer does (`TrainingSession`: setup, `step()` timed over --steps after two warm-up steps):

- gate_warmup: stage 1 (recipes/gate_only.yaml: frozen bf16 base, dense attention, the gate learning
  its KL; the step captured in a CUDA graph where the trainer would), beside one forward of the base
  (GSM off, bf16, no gradients).
- dense_lora / joint_lora: recipes/joint.yaml with `train.base: lora` (bf16 base), GSM off / on.
- dense_full / joint_full: the same with `train.base: full` (fp32 weights, `optim.state_dtype:
  bf16`). Every training row but stage 1 runs with `train.activation_checkpointing: true` (--checkpointing
  layer) or `mlp` (--checkpointing mlp: only the MLPs run again in the backward).

After its timed steps every row saves a checkpoint (`TrainingSession.save`: the trainables and their
optimizer state; its time and bytes against the base's bf16 bytes), takes one more step, and resumes
from it in a stage set up again (the first one released: the time of setup and load) to take the same
step, whose loss must be the same (`resumed_loss_abs_diff`). A checkpoint the --scratch disk cannot hold
(its trainables and Adam moments against the free bytes) is not written: the row says so
(`checkpoint_error`). With --profile-steps N, N more steps run under torch.profiler and the row keeps
its largest kernels and, on CUDA, `kernel_ms` (every kernel's time of one step, summed) and `gpu_busy`
(that over the step's median time: well below 1, the step waits on the host, not on the GPU) and `host_syncs`
(one more step under torch's CUDA sync debug mode: the Python lines that made the host wait for the GPU,
counted; a sync inside a layer runs once a layer and leaves the GPU idle while the host catches up). Each row
records the median step time, tokens/s, the peak GPU memory from before its model was built to its last
timed step, and model FLOPs utilisation: model FLOPs per token over the GPU's dense bf16 peak (989 TFLOP/s
for an H100 or H200), where, with N the parameters of the matrix products (every linear layer and the
output head; not the embedding lookup), L layers, H query heads of Dh and T = seq_len:

    full training  6 N + 12 L H Dh T   (torchtitan's formula; attention without the causal half)
    LoRA training  4 N + 12 L H Dh T   (no gradient for the base's weights; LoRA's FLOPs left out)
    forward        2 N +  4 L H Dh T   (stage 1's step: a forward of the base, plus the small gate)

The joint rows count the same FLOPs as their dense rows (the work the model stands for, whatever GSM
skips), so their MFU ratio is their tokens/s ratio.

    python -m benchmarks.scale_8b --result benchmarks/results/scale_8b.json

Resumable: each row is written to --result as soon as it is measured, and rows already there (of the
same model, seq_len, steps and settings) are skipped, so a run cut short continues where it stopped
(--redo ROW measures one again). A row that fails (e.g. out of memory) records its error. On the
CPU, `--model tiny-llama --seq-len 64 --steps 1 --set ...` runs every row as a smoke test
(tests/test_scale_benchmark.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import REPO, git_commit, write_result
from benchmarks.decode_step_profile import profile_step
from gsm_train.attention import gsm_disabled
from gsm_train.config.schema import RecipeConfig, load_recipe
from gsm_train.export.save_load import AdapterNames
from gsm_train.models.model_zoo import read_model_config
from gsm_train.training.session import Stage, TrainingSession
from gsm_train.training.stages import GateWarmupStage, JointStage
from gsm_train.training.step_graph import cuda_graph_blockers, use_cuda_graph
from gsm_train.training.trainer import fp32_matmul_precision

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}  # dense bf16 tensor-core peak per GPU
WARMUP_STEPS = 2
PROFILE_TOP = 40  # kernels kept per profiled row
LORA = ["train.base=lora", "model.dtype=bfloat16"]
FULL = ["train.base=full", "optim.state_dtype=bf16"]
JOINT = ["init_from=null"]
DENSE = ["init_from=null", "gsm.gsm_enabled=false"]
# --checkpointing -> train.activation_checkpointing of every training row but stage 1's
CHECKPOINTING = {"layer": "true", "mlp": "mlp"}
# row -> (recipe, overrides, FLOPs kind); each runs on its own model
ROWS: dict[str, tuple[str, list[str], str]] = {
    "gate_warmup": ("gate_only.yaml", [], "forward"),
    "dense_lora": ("joint.yaml", [*DENSE, *LORA], "lora"),
    "joint_lora": ("joint.yaml", [*JOINT, *LORA], "lora"),
    "dense_full": ("joint.yaml", [*DENSE, *FULL], "full"),
    "joint_full": ("joint.yaml", [*JOINT, *FULL], "full"),
}


def model_flops_per_token(config: Any, seq_len: int, kind: str) -> float:
    """Model FLOPs per token of `kind` ("full", "lora", "forward") for a Llama-style config (module
    docstring)."""
    d, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    per_layer = d * head_dim * (2 * heads + 2 * kv_heads) + 3 * d * config.intermediate_size
    matmul_params = layers * per_layer + d * config.vocab_size
    attention = 4 * layers * heads * head_dim * seq_len  # one forward
    return {
        "full": 6 * matmul_params + 3 * attention,
        "lora": 4 * matmul_params + 3 * attention,
        "forward": 2 * matmul_params + attention,
    }[kind]


def _peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((flops for gpu, flops in PEAK_BF16_FLOPS.items() if gpu in name), None)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def _median_ms(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        _sync()
        tic = time.perf_counter()
        fn()
        _sync()
        times.append((time.perf_counter() - tic) * 1e3)
    return statistics.median(times)


def _session(config: RecipeConfig, stage: Stage, resume: Path | None = None) -> tuple[TrainingSession, bool]:
    """The stage set up as the trainer sets it up (resumed from `resume`, a checkpoint, if given), its step
    captured where the trainer would capture it."""
    session = TrainingSession.setup(config, stage)
    if resume is not None:
        session.resume(resume)
    blockers = cuda_graph_blockers(
        session.info.device,
        session.info.world_size,
        session.backend.name,
        stage,
        config.train.activation_checkpointing,
    )
    captured = use_cuda_graph(config.train.cuda_graph, blockers)
    if captured:
        session.capture()
    return session, captured


def _time_steps(session: TrainingSession, steps: int) -> float:
    def step() -> None:
        float(session.step().means[0])  # the loss read on the host, as the trainer's log does

    for _ in range(WARMUP_STEPS):
        step()
    return _median_ms(step, steps)


def _stage(recipe: str) -> Stage:
    return GateWarmupStage() if recipe == "gate_only.yaml" else JointStage()


def _save_and_step(session: TrainingSession, folder: Path) -> tuple[Path, dict[str, Any]]:
    """Save a checkpoint of the session into `folder` (time, bytes on disk, against the base's bytes in
    bf16), then take one more step: the checkpoint and its figures with that step's loss."""
    _sync()
    tic = time.perf_counter()
    path = session.save(folder, WARMUP_STEPS + 1, {"run_id": "scale_8b", "recipe": {}})
    save_s = time.perf_counter() - tic
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    adapter = AdapterNames.of(session.unwrapped)
    base_params = sum(p.numel() for n, p in session.unwrapped.named_parameters() if n not in adapter)
    base_bytes = 2 * base_params
    return path, {
        "checkpoint_s": save_s,
        "checkpoint_bytes": size,
        "base_bf16_bytes": base_bytes,
        "checkpoint_over_base": size / base_bytes,
        "next_step_loss": float(session.step().means[0]),
    }


def _checkpoint_bytes_estimate(session: TrainingSession, config: RecipeConfig) -> int:
    """Bytes a checkpoint of `session` takes at least: every trainable parameter as stored and its two Adam
    moments in `optim.state_dtype` (what `TrainingSession.save` writes; the small metadata left out)."""
    state_bytes = 2 if config.optim.state_dtype == "bf16" else 4
    trainables = [p for p in session.unwrapped.parameters() if p.requires_grad]
    return sum(p.numel() * (p.element_size() + 2 * state_bytes) for p in trainables)


def _resume_and_step(config: RecipeConfig, recipe: str, checkpoint: Path, next_loss: float) -> dict[str, Any]:
    """Set the stage up again, resume from `checkpoint` and take the step `_save_and_step` took after
    saving it: the time of setup and load, and how far its loss is from `next_loss` (0 on the CPU; on a
    GPU within what its non-deterministic kernels change)."""
    tic = time.perf_counter()
    resumed, _ = _session(config, _stage(recipe), resume=checkpoint)
    resume_s = time.perf_counter() - tic
    loss = float(resumed.step().means[0])
    return {"resume_s": resume_s, "resumed_next_step_loss": loss, "resumed_loss_abs_diff": abs(loss - next_loss)}


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One row (module docstring)."""
    recipe, overrides, kind = ROWS[name]
    config = load_recipe(
        str(REPO / "recipes" / recipe),
        [
            f"model.name_or_path={args.model}",
            f"data.seq_len={args.seq_len}",
            "train.batch_size=1",
            "data.eval_rows=2",
            "logging.progress_bar=false",
            "gsm.sparse_attention.gate_init=random",
            *overrides,
            *([] if kind == "forward" else [f"train.activation_checkpointing={CHECKPOINTING[args.checkpointing]}"]),
            *args.set,
        ],
    )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with fp32_matmul_precision(config.train.fp32_matmul, device):  # as the trainer runs its steps
        return _measured(config, recipe, kind, args)


def _measured(config: RecipeConfig, recipe: str, kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """`measure`'s row of `config` (the recipe file `recipe`, FLOPs `kind`)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    tic = time.perf_counter()
    session, captured = _session(config, _stage(recipe))
    row: dict[str, Any] = {
        "setup_s": time.perf_counter() - tic,
        "cuda_graph": captured,
        "activation_checkpointing": config.train.activation_checkpointing,
        "optimizer_state_dtype": config.optim.state_dtype,
        **session.counts,
    }
    step_ms = _time_steps(session, args.steps)
    tokens = config.train.batch_size * config.data.seq_len
    flops = model_flops_per_token(session.unwrapped.config, config.data.seq_len, kind)
    row |= {
        "step_ms": step_ms,
        "tokens_per_s": tokens / step_ms * 1e3,
        "model_flops_per_token": flops,
        "flops_kind": kind,
    }
    if kind == "forward":
        row["forward_ms"] = _forward_ms(session, args.steps)
        row["step_over_forward"] = step_ms / row["forward_ms"]
    peak = _peak_flops()
    row["mfu"] = flops * row["tokens_per_s"] / peak if peak else None
    row["peak_gib"] = _peak_gib()  # of the timed steps: the stage is built again below
    if args.profile_steps:
        row |= _profile(session, args.profile_steps, step_ms)
    with tempfile.TemporaryDirectory(prefix="scale_8b_ckpt", dir=args.scratch) as folder:
        needed, free = _checkpoint_bytes_estimate(session, config), shutil.disk_usage(folder).free
        if needed > 0.95 * free:
            return row | {
                "checkpoint_error": f"not saved: about {needed / 1e9:.0f} GB of trainables and optimizer state, "
                f"{free / 1e9:.0f} GB free in {folder}; give --scratch a folder on a disk with more room"
            }
        checkpoint, saved = _save_and_step(session, Path(folder))
        del session  # the first stage's memory goes before the second is built
        _release()
        return row | saved | _resume_and_step(config, recipe, checkpoint, saved["next_step_loss"])


def _profile(session: TrainingSession, steps: int, step_ms: float) -> dict[str, Any]:
    """`steps` more training steps profiled: the `PROFILE_TOP` largest kernels (ops on the CPU) per step, and on
    CUDA every kernel's time of a step summed (`kernel_ms`), its share of the timed steps' `step_ms`
    (`gpu_busy`) and where one more step waits for the GPU (`_host_syncs`)."""
    cuda = session.info.device.type == "cuda"
    kernels = profile_step(lambda: session.step().means[0].item(), steps, cuda)
    figures: dict[str, Any] = {"kernels": kernels[:PROFILE_TOP]}
    if cuda:
        kernel_ms = sum(row["total_us"] for row in kernels) / 1e3
        figures |= {"kernel_ms": kernel_ms, "gpu_busy": kernel_ms / step_ms, "host_syncs": _host_syncs(session)}
    return figures


def _host_syncs(session: TrainingSession) -> dict[str, int]:
    """Where one training step (its loss read on the host, as the trainer's log does) makes the host wait for
    the GPU: the Python line of each synchronizing CUDA call torch's sync debug mode warns of, counted, the
    most first."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            session.step().means[0].item()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    return dict(sites.most_common())


def _forward_ms(session: TrainingSession, steps: int) -> float:
    """Median time of one forward of the base (GSM off, no gradients) over a training batch."""
    batch = session.loader.next_batch().to(session.info.device)

    @torch.no_grad()
    def forward() -> None:
        with gsm_disabled(session.unwrapped), session.autocast():
            session.unwrapped(input_ids=batch, use_cache=False)

    forward()
    return _median_ms(forward, steps)


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": args.model,
        "seq_len": args.seq_len,
        "batch_size": 1,
        "steps": args.steps,
        "set": args.set,
    } | ({} if args.checkpointing == "layer" else {"checkpointing": args.checkpointing})  # earlier files: "layer"


def _earlier_rows(path: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The rows an earlier run of the same settings wrote to `path` (none otherwise)."""
    if not path.exists():
        return {}
    earlier = json.loads(path.read_text())
    return earlier.get("rows", {}) if earlier.get("settings") == settings else {}


def _summary(rows: dict[str, Any]) -> dict[str, Any]:
    """The ratios the issue asks for, where their rows are there."""

    def ratio(a: str, b: str, key: str) -> float | None:
        if key in rows.get(a, {}) and key in rows.get(b, {}):
            return rows[a][key] / rows[b][key]
        return None

    gate = rows.get("gate_warmup", {})
    return {
        "stage1_step_over_forward": gate.get("step_over_forward"),
        "joint_lora_over_dense_lora_tokens_per_s": ratio("joint_lora", "dense_lora", "tokens_per_s"),
        "joint_full_over_dense_full_tokens_per_s": ratio("joint_full", "dense_full", "tokens_per_s"),
        "joint_full_mfu": rows.get("joint_full", {}).get("mfu"),
        "gate_checkpoint_over_base": gate.get("checkpoint_over_base"),
        "gate_checkpoint_s": gate.get("checkpoint_s"),
        **{
            f"{name}_{key}": rows[name][key]
            for name in ("joint_lora", "joint_full")
            for key in ("checkpoint_bytes", "checkpoint_s", "resume_s", "resumed_loss_abs_diff")
            if key in rows.get(name, {})
        },
    }


def _print_table(rows: dict[str, Any]) -> None:
    print(f"{'row':12s} {'step ms':>9s} {'tokens/s':>9s} {'MFU':>6s} {'peak GiB':>9s}  other")
    for name, row in rows.items():
        if "error" in row:
            print(f"{name:12s} error: {row['error'][:100]}")
            continue
        mfu = f"{row['mfu']:.3f}" if row.get("mfu") is not None else "-"
        peak = f"{row['peak_gib']:.1f}" if row.get("peak_gib") is not None else "-"
        other = (
            f"forward {row['forward_ms']:.1f} ms (step/forward {row['step_over_forward']:.2f}); "
            if "forward_ms" in row
            else ""
        )
        if "checkpoint_bytes" in row:
            other += (
                f"checkpoint {row['checkpoint_bytes'] / 2**20:.1f} MiB "
                f"({row['checkpoint_over_base']:.2%} of the bf16 base) saved in {row['checkpoint_s']:.2f} s, "
                f"resumed in {row['resume_s']:.1f} s, next-step loss off by {row['resumed_loss_abs_diff']:.2g}"
            )
        other += row.get("checkpoint_error", "")
        step = f"{row['step_ms']:9.1f} {row['tokens_per_s']:9.0f}"
        print(f"{name:12s} {step} {mfu:>6s} {peak:>9s}  {other}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--result", required=True, type=Path)
    parser.add_argument("--model", default="random-llama3-8b")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row, after two warm-up steps")
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="recipe overrides for every row (e.g. sizes a small --model needs)",
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="after the timed steps, profile this many more: the row's largest kernels (ops on the CPU) per step",
    )
    parser.add_argument(
        "--checkpointing",
        choices=list(CHECKPOINTING),
        default="layer",
        help="what the training rows but stage 1 run again in the backward: each decoder layer, or its MLP alone",
    )
    parser.add_argument("--only", nargs="*", choices=list(ROWS), default=list(ROWS), help="rows to run")
    parser.add_argument("--redo", nargs="*", choices=list(ROWS), default=[], help="measure these rows again")
    parser.add_argument(
        "--scratch",
        type=Path,
        default=None,
        help="folder for the checkpoint written (default: tmp)",
    )
    args = parser.parse_args(argv)
    settings = _settings(args)
    rows = {name: row for name, row in _earlier_rows(args.result, settings).items() if name not in args.redo}
    full_flops = model_flops_per_token(read_model_config(args.model), args.seq_len, "full")
    for name in args.only:
        if name in rows:
            print(f"{name}: measured already (in {args.result})", flush=True)
            continue
        print(f"{name}: measuring", flush=True)
        try:
            rows[name] = measure(name, args)
        except torch.cuda.OutOfMemoryError as err:
            rows[name] = {
                "error": f"out of memory: {' '.join(str(err).split())[:300]}",
                "peak_gib": _peak_gib(),
            }
        _release()
        write_result(
            args.result,
            {
                "commit": git_commit(),
                "settings": settings,
                "full_model_flops_per_token": full_flops,
                "summary": _summary(rows),
                "rows": {n: rows[n] for n in ROWS if n in rows},
            },
        )
    _print_table({n: rows[n] for n in ROWS if n in rows})
    print(json.dumps(_summary(rows), indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
