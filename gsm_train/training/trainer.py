"""The training loop: a stage's `TrainingSession` stepped, evaluated, checkpointed and exported, with the
run's checks (`preflight`), its folder's lock (`run_folder`), the previous run kept aside by --overwrite until
this one has a good checkpoint (`set_aside`), the NaN guard and the run log.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from gsm_train.attention import gsm_settings
from gsm_train.config.schema import RecipeConfig, resolved_yaml
from gsm_train.errors import GSMError
from gsm_train.models.families import model_dims
from gsm_train.training.backend import select_backend
from gsm_train.training.backend_protocol import Backend
from gsm_train.training.distributed import DistInfo, barrier, init_distributed, raise_on_any_rank, teardown
from gsm_train.training.finite_guard import NonFiniteError, NonFiniteGuard
from gsm_train.training.preflight import RunPlan, StartOptions, plan_run
from gsm_train.training.run_folder import hold_run_folder, record_run
from gsm_train.training.run_log import RunLogger
from gsm_train.training.session import Stage, TrainingSession
from gsm_train.training.set_aside import SetAside
from gsm_train.training.step_graph import cuda_graph_blockers, use_cuda_graph
from gsm_train.tuning.kv_budget import kv_bytes_ratio


@dataclass
class TrainResult:
    """What a finished run leaves behind."""

    run_dir: Path
    model: nn.Module | None = None
    losses: list[float] = field(default_factory=list)
    final_metrics: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)


def run_training(
    config: RecipeConfig, stage: Stage, run_name: str | None = None, options: StartOptions | None = None
) -> TrainResult:
    """Run `stage` as the recipe says, resuming if asked; return losses, final metrics and summary.
    `run_name`: what trackers call the run (default: the run folder's name).
    Bad input raises before the model loads (`preflight`, which also resolves the recipe's tuning
    knobs against the base's config), with nothing written; the run holds its folder's lock
    throughout (`run_folder`). `options`: --overwrite and --allow-recipe-change (default: neither)."""
    backend = select_backend(config)
    info = init_distributed()
    try:
        plan = _plan(config, backend, info, options or StartOptions())
        with hold_run_folder(plan.run_dir, info), fp32_matmul_precision(config.train.fp32_matmul, info.device):
            result = _run(plan.config, stage, info, backend, run_name or plan.run_dir.resolve().name, plan)
        barrier()  # every rank is done with the group before any leaves it (how a rank then ends its
        # process: gsm_train.entry.exit_process)
        return result
    finally:
        teardown()


def _plan(config: RecipeConfig, backend: Backend, info: DistInfo, options: StartOptions) -> RunPlan:
    """`plan_run` on every rank; a rank's refusal raised on all of them (collective)."""
    plan, error = None, None
    try:
        plan = plan_run(config, backend.name, info.world_size, options)
    except (GSMError, ValueError) as err:  # ConfigError, CheckpointError, RunFolderError, ...
        error = err
    raise_on_any_rank(info, error)
    assert plan is not None
    return plan


@contextlib.contextmanager
def fp32_matmul_precision(precision: str, device: torch.device) -> Iterator[None]:
    """Run fp32 matrix products on CUDA on TF32 tensor cores inside when `precision` (`train.fp32_matmul`)
    is "tf32", and restore PyTorch's setting after; "default", or a device other than CUDA, changes
    nothing. A step captured in a CUDA graph inside keeps the kernels chosen while it was captured."""
    if precision != "tf32" or device.type != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    try:
        yield
    finally:
        matmul.fp32_precision = before


def _run(
    config: RecipeConfig, stage: Stage, info: DistInfo, backend: Backend, run_name: str, plan: RunPlan
) -> TrainResult:
    blockers = cuda_graph_blockers(
        info.device, info.world_size, backend.name, stage, config.train.activation_checkpointing
    )
    # checked before anything loads or is written
    capture_step = use_cuda_graph(config.train.cuda_graph, blockers)
    session = TrainingSession.setup(config, stage, info, backend)
    start = session.resume(plan.resume) if plan.resume is not None else 0
    # --overwrite: the previous run's files go aside until this run has a good checkpoint
    aside = SetAside.move(plan.run_dir) if info.is_main and plan.overwrite else None
    try:
        if info.is_main:
            record_run(plan.run_dir, plan.run_id, resolved_yaml(config), start)
        logger = RunLogger(
            plan.run_dir,
            config.logging,
            config.train.steps,
            start,
            info.is_main,
            run_name,
            config.model_dump(mode="json"),
            plan.run_id,
        )
        try:
            logger.log("setup", start, _setup_record(session, plan, capture_step))
            result = _train(session, stage, logger, plan, start, capture_step, aside)
        finally:
            logger.close()
    except BaseException:
        if aside is not None:
            aside.restore()
        raise
    if aside is not None:
        aside.discard()
    return result


def _train(
    session: TrainingSession,
    stage: Stage,
    logger: RunLogger,
    plan: RunPlan,
    start: int,
    capture_step: bool,
    aside: SetAside | None,
) -> TrainResult:
    """Steps `start + 1` to `train.steps`, evaluated and checkpointed as the recipe says, then the export;
    `aside` (the previous run's files, with --overwrite) is discarded once the first checkpoint is written."""
    config, info = session.config, session.info
    if capture_step:
        session.capture()
    result = TrainResult(run_dir=plan.run_dir, model=session.unwrapped)
    history: list[dict[str, Any]] = []
    guard = NonFiniteGuard(config.train.max_skipped_steps)
    for done in range(start + 1, config.train.steps + 1):
        _train_step(session, guard, logger, result, done)
        if done % config.logging.eval_every == 0 or done == config.train.steps:
            result.final_metrics = session.evaluate()
            history.append({"step": done, **result.final_metrics})
            logger.log("eval", done, result.final_metrics)
        if done % config.output.checkpoint_every == 0 or done == config.train.steps:
            session.save(plan.run_dir, done, {"run_id": plan.run_id, "recipe": plan.recipe})
            if aside is not None:
                aside.discard()
    if not result.final_metrics:
        result.final_metrics = session.evaluate()
    export_dir = session.export(plan.run_dir / "export", result.final_metrics)
    if info.is_main:
        result.summary = stage.report(plan.run_dir, result.final_metrics, history) | {"export": str(export_dir)}
        logger.log("report", config.train.steps, {"summary": result.summary})
    return result


def _setup_record(session: TrainingSession, plan: RunPlan, capture_step: bool) -> dict[str, Any]:
    """What the run's setup record says: where it runs, what trains, the data, the KV bytes as built."""
    info, config = session.info, session.config
    kv_ratio = kv_bytes_ratio(
        gsm_settings(session.unwrapped).config, model_dims(session.unwrapped), config.data.seq_len
    )
    return {
        "world_size": info.world_size,
        "device": str(info.device),
        **session.backend.describe(),
        "fsdp_sharded_params": sum(isinstance(p, DTensor) for p in session.model.parameters()),
        **session.counts,
        "train_rows": session.data.train_rows,
        "eval_rows": len(session.data.eval_rows),
        "kv_bytes_ratio": kv_ratio,
        "resumed_from": str(plan.resume) if plan.resume is not None else None,
        "cuda_graph": capture_step,
    }


def _train_step(
    session: TrainingSession, guard: NonFiniteGuard, logger: RunLogger, result: TrainResult, done: int
) -> None:
    """One optimizer step, checked by the NaN guard (which may skip it or stop the run), logged."""
    tic = time.perf_counter()
    step = session.step(guard.update_check)
    step_means = dict(zip(step.names, step.means.tolist()))
    mean_loss = step_means.pop("loss")
    record = {
        "loss": mean_loss,
        "grad_norm": float(step.grad_norm),
        "lr": session.scheduler.get_last_lr()[0],
        "tokens_per_s": session.tokens_per_step / (time.perf_counter() - tic),
        **step_means,
    }
    try:
        skipped = guard.observe(done, record)
    except NonFiniteError:
        logger.log("stopped", done, record)  # the values that stopped it
        raise
    if skipped:
        logger.log("skipped", done, record)
    else:
        result.losses.append(mean_loss)
        if done % session.config.logging.log_every == 0:
            logger.log("train", done, record)
    logger.progress(done, {"loss": mean_loss, "tok/s": record["tokens_per_s"]})
