"""The shared training loop: data, AdamW with warm-up + cosine, clipping, checkpoints, logging.

A stage (see `gsm_train/stages/`) says which parameters train, what the loss is, how to evaluate
and what to report; this loop does everything else, the same way for every stage. Sharding,
gradient reduction and clipping go through the distributed backend (`gsm_train/backend.py`):
FSDP2, or DeepSpeed ZeRO when the accelerate config asks for it.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from gsm_train.backend import Backend, FSDP2Backend, select_backend
from gsm_train.checkpoint import load_checkpoint, save_checkpoint
from gsm_train.config import (
    ConfigError,
    DataSourceConfig,
    RecipeConfig,
    check_against_model,
    resolved_yaml,
)
from gsm_train.data import PackedBatches, load_text_dataset, pack_tokens, split_eval
from gsm_train.distributed import (
    DistInfo,
    all_reduce_sum,
    init_distributed,
    raise_on_any_rank,
    teardown,
)
from gsm_train.export import AdapterNames, export_adapter
from gsm_train.finite_guard import NonFiniteError, NonFiniteGuard, refuse_non_finite
from gsm_train.kv_budget import apply_kv_budget, kv_bytes_ratio
from gsm_train.model_zoo import load_model_and_tokenizer
from gsm_train.families import model_dims
from gsm_train.modules import configure_gsm, gsm_parameters, gsm_settings
from gsm_train.preflight import RunPlan, StartOptions, plan_run
from gsm_train.run_folder import hold_run_folder, record_run
from gsm_train.run_log import RunLogger
from gsm_train.step_graph import GraphedLoss, cuda_graph_blockers, use_cuda_graph


class Stage(Protocol):
    """What a training stage supplies to the loop."""

    name: str
    # why the step cannot be captured in a CUDA graph (train.cuda_graph), or None if it can: a capturable step
    # reads no device values on the host and gives every trainable parameter a gradient
    graph_blocker: str | None

    def prepare(self, model: nn.Module, config: RecipeConfig) -> None:
        """Attach/load modules and set `requires_grad` on exactly the parameters that train."""

    def loss(self, model: nn.Module, batch: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """Loss of one micro-batch (mean over its tokens/positions) and terms to log (detached 0-d
        tensors: the trainer averages them over micro-batches and ranks, as the loss, and reads them on
        the host after the step, so that a captured step can produce them)."""

    def evaluate(self, model: nn.Module, batches: list[Tensor]) -> dict[str, Any]:
        """Metrics on held-out batches, identical on every rank (reduce across ranks inside)."""

    def report(self, run_dir: Path, metrics: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
        """Write the final report files (rank 0) and return a summary."""


@dataclass
class TrainResult:
    """What a finished run leaves behind."""

    run_dir: Path
    model: nn.Module | None = None
    losses: list[float] = field(default_factory=list)
    final_metrics: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)


def lr_lambda(config: RecipeConfig):
    """Linear warm-up, then cosine decay to `min_lr_ratio` (or constant)."""
    optim, steps = config.optim, config.train.steps

    def factor(step: int) -> float:
        if step < optim.warmup_steps:
            return (step + 1) / (optim.warmup_steps + 1)
        if optim.schedule == "constant":
            return 1.0
        progress = (step - optim.warmup_steps) / max(1, steps - optim.warmup_steps)
        return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def _dtypes(config: RecipeConfig, info: DistInfo) -> tuple[torch.dtype, torch.dtype | None]:
    """(dtype the base is loaded in, autocast dtype or None)."""
    on_gpu = info.device.type == "cuda"
    precision = config.distributed.mixed_precision
    compute = torch.bfloat16 if precision == "bf16" or (precision == "auto" and on_gpu) else None
    load = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(config.model.dtype)
    if load is None:  # auto: a frozen base can live in the compute dtype; a training base keeps fp32 masters
        load = compute if (compute is not None and config.train.base == "frozen") else torch.float32
    return load, compute


def _packed_rows(source: DataSourceConfig, tokenizer: Any, seq_len: int) -> Tensor:
    return pack_tokens(load_text_dataset(source.path, format=source.format, fields=source.fields), tokenizer, seq_len)


def _load_rows(config: RecipeConfig, tokenizer: Any) -> tuple[Tensor, Tensor]:
    """(train rows, eval rows): eval from `data.eval`, else held out of the training rows."""
    data = config.data
    rows = _packed_rows(data.train, tokenizer, data.seq_len)
    if data.eval is None:
        return split_eval(rows, data.eval_rows, data.seed)
    return rows, _packed_rows(data.eval, tokenizer, data.seq_len)


def _eval_batches(rows: Tensor, config: RecipeConfig, info: DistInfo) -> list[Tensor]:
    """This rank's share of the first `eval_batches` global batches of held-out rows."""
    per_rank = config.train.batch_size
    wanted = min(len(rows), config.logging.eval_batches * per_rank * info.world_size)
    usable = rows[: wanted - wanted % info.world_size][info.rank:: info.world_size]
    return [usable[i: i + per_rank].to(info.device) for i in range(0, len(usable), per_rank)]


def _param_groups(model: nn.Module, config: RecipeConfig) -> list[dict[str, Any]]:
    """Trainable parameters in two groups: GSM modules (at `optim.gsm_lr`, if set) and the rest."""
    gsm_ids = {id(param) for _, param in gsm_parameters(model)}
    gsm, rest = [], []
    for param in model.parameters():
        if param.requires_grad:
            (gsm if id(param) in gsm_ids else rest).append(param)
    gsm_lr = config.optim.gsm_lr or config.optim.lr
    return [group for group in ({"params": gsm, "lr": gsm_lr}, {"params": rest, "lr": config.optim.lr})
            if group["params"]]


def build_optimizer(model: nn.Module, config: RecipeConfig, fused: bool = True) -> torch.optim.AdamW:
    """The recipe's AdamW over the model's trainables; with `fused`, on CUDA, the fused kernel (one
    launch per step instead of several per tensor: the stage-1 step updates 60 small tensors). The
    DeepSpeed backend asks for the default one, which its ZeRO results were measured with."""
    optim = config.optim
    on_cuda = all(p.is_cuda for p in model.parameters() if p.requires_grad)
    return torch.optim.AdamW(_param_groups(model, config), lr=optim.lr, betas=optim.betas,
                             weight_decay=optim.weight_decay, fused=(fused and on_cuda) or None)


def run_training(config: RecipeConfig, stage: Stage, run_name: str | None = None,
                 options: StartOptions | None = None) -> TrainResult:
    """Run `stage` as the recipe says, resuming if asked; return losses, final metrics and summary.
    Bad input raises before the model loads (`preflight`), with nothing written; the run holds its
    folder's lock throughout (`run_folder`). `options`: --overwrite and --allow-recipe-change
    (default: neither)."""
    backend = select_backend(config)
    info = init_distributed()
    try:
        plan = _plan(config, backend, info, options or StartOptions())
        with hold_run_folder(plan.run_dir, info), \
                fp32_matmul_precision(config.train.fp32_matmul, info.device):
            return _run(config, stage, info, backend, run_name or config.stage, plan)
    finally:
        teardown()


def _plan(config: RecipeConfig, backend: Backend, info: DistInfo, options: StartOptions) -> RunPlan:
    """`plan_run` on every rank; a rank's refusal raised on all of them (collective)."""
    plan, error = None, None
    try:
        plan = plan_run(config, backend.name, info.world_size, options)
    except (ConfigError, ValueError) as err:  # ValueError: CheckpointError, RunFolderError
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


def export_options(config: RecipeConfig) -> dict[str, Any]:
    """What `export_adapter` needs to know about a run besides the model."""
    return {"base_name": config.model.name_or_path, "base_revision": config.model.revision,
            "recipe": config.model_dump(mode="json"), "include_base": config.output.export_base_weights,
            "lora": config.train.lora.model_dump() if config.train.base == "lora" else None}


def _autocast(info: DistInfo, compute_dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if compute_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(info.device.type, dtype=compute_dtype)


def _prepared_model(config: RecipeConfig, stage: Stage, info: DistInfo) -> tuple[nn.Module, Tensor, Tensor]:
    """The base model with the stage's modules attached, on the device, and the (train, eval) rows."""
    load_dtype, _ = _dtypes(config, info)
    model, tokenizer = load_model_and_tokenizer(config.model.name_or_path, config.model.gguf_file,
                                                config.model.revision, load_dtype)
    check_against_model(config, model.config.num_hidden_layers,
                        getattr(model.config, "max_position_embeddings", None))
    apply_kv_budget(config.gsm, config.tuning.kv_compression_ratio, model_dims(model), config.data.seq_len)
    stage.prepare(model, config)
    model.to(info.device)
    return model, *_load_rows(config, tokenizer)


def evaluate_recipe(config: RecipeConfig, stage: Stage) -> dict[str, Any]:
    """The stage's evaluation of the model the recipe prepares (no training step), in this process."""
    info = init_distributed()
    model, _, eval_rows = _prepared_model(config, stage, info)
    with _autocast(info, _dtypes(config, info)[1]):
        return stage.evaluate(model, _eval_batches(eval_rows, config, info))


def _graphed_loss(config: RecipeConfig, stage: Stage, model: nn.Module, backend: FSDP2Backend, info: DistInfo,
                  compute_dtype: torch.dtype | None, token_dtype: torch.dtype) -> GraphedLoss:
    """The stage's micro-step captured in a CUDA graph (after any resume, so the captured step reads the
    restored trainables)."""
    backend.grads_in_place = True
    model.train()  # the replays run as captured
    configure_gsm(model, captured_steps=True)  # paths that pay off only without per-call Python and launches
    example = torch.zeros(config.train.batch_size, config.data.seq_len, dtype=token_dtype, device=info.device)
    trainables = [p for p in model.parameters() if p.requires_grad]
    return GraphedLoss(lambda batch: stage.loss(model, batch), trainables, example, compute_dtype,
                       grad_scale=1 / config.train.grad_accum)


def _run(config: RecipeConfig, stage: Stage, info: DistInfo, backend: Backend, run_name: str,
         plan: RunPlan) -> TrainResult:
    capture_step = use_cuda_graph(config.train.cuda_graph,  # checked before anything loads or is written
                                  cuda_graph_blockers(info.device, info.world_size, backend.name, stage))
    torch.manual_seed(config.train.seed)
    run_dir = Path(config.output.dir)
    _, compute_dtype = _dtypes(config, info)
    model, train_rows, eval_rows = _prepared_model(config, stage, info)
    kv_ratio = kv_bytes_ratio(gsm_settings(model).config, model_dims(model), config.data.seq_len)  # as built
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    # counted before wrapping: ZeRO-3 leaves partitioned parameters empty
    counts = {"trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
              "frozen_params": sum(p.numel() for p in model.parameters() if not p.requires_grad)}
    model, optimizer = backend.prepare(model, lambda m: build_optimizer(m, config, fused=backend.name == "fsdp2"),
                                       info, compute_dtype)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))
    loader = PackedBatches(train_rows, config.train.batch_size, seed=config.data.seed, rank=info.rank,
                           world_size=info.world_size)
    start = 0
    resume = plan.resume
    if resume is not None:
        meta = load_checkpoint(resume, backend, model, optimizer, scheduler, info)
        loader.load_state_dict(meta["data"])
        start = meta["step"]
    if info.is_main:
        record_run(run_dir, plan.run_id, resolved_yaml(config), start, plan.overwrite)
    guard = NonFiniteGuard(config.train.max_skipped_steps)
    logger = RunLogger(run_dir, config.logging, config.train.steps, start, info.is_main, run_name,
                       config.model_dump(mode="json"))
    logger.log("setup", start, {
        "world_size": info.world_size, "device": str(info.device), **backend.describe(),
        "fsdp_sharded_params": sum(isinstance(p, DTensor) for p in model.parameters()), **counts,
        "train_rows": len(train_rows), "eval_rows": len(eval_rows), "kv_bytes_ratio": kv_ratio,
        "resumed_from": str(resume) if resume is not None else None,
        "cuda_graph": capture_step})
    eval_batches = _eval_batches(eval_rows, config, info)
    autocast = _autocast(info, compute_dtype)
    graphed = _graphed_loss(config, stage, model, backend, info, compute_dtype, train_rows.dtype) if capture_step else None
    result = TrainResult(run_dir=run_dir, model=backend.unwrap(model))
    history: list[dict[str, Any]] = []
    tokens_per_step = config.train.batch_size * config.train.grad_accum * config.data.seq_len * info.world_size
    for step in range(start, config.train.steps):
        tic = time.perf_counter()
        model.train()
        sums: dict[str, Tensor] = {}  # the loss and the stage's terms, averaged over the micro-batches
        for micro in range(config.train.grad_accum):
            batch = loader.next_batch().to(info.device)
            if graphed is not None:
                loss, terms = graphed(batch)
            else:
                with autocast:
                    loss, terms = stage.loss(model, batch)
                backend.backward(loss / config.train.grad_accum, boundary=micro == config.train.grad_accum - 1)
            for name, value in {"loss": loss, **terms}.items():  # added up before the next replay overwrites it
                sums[name] = sums.get(name, 0.0) + value.detach().float() / config.train.grad_accum
        means = all_reduce_sum(torch.stack(list(sums.values()))) / info.world_size  # one reduction, one read
        grad_norm = backend.step(optimizer, guard.update_check(means))
        scheduler.step()
        step_means = dict(zip(sums, means.tolist()))
        mean_loss = step_means.pop("loss")
        elapsed = time.perf_counter() - tic
        record = {"loss": mean_loss, "grad_norm": float(grad_norm), "lr": scheduler.get_last_lr()[0],
                  "tokens_per_s": tokens_per_step / elapsed, **step_means}
        done = step + 1
        try:
            skipped = guard.observe(done, record)
        except NonFiniteError:
            logger.log("stopped", done, record)  # the values that stopped it
            logger.close()
            raise
        if skipped:
            logger.log("skipped", done, record)
        else:
            result.losses.append(mean_loss)
            if done % config.logging.log_every == 0:
                logger.log("train", done, record)
        logger.progress(done, {"loss": mean_loss, "tok/s": record["tokens_per_s"]})
        if done % config.logging.eval_every == 0 or done == config.train.steps:
            with autocast:
                metrics = stage.evaluate(model, eval_batches)
            history.append({"step": done, **metrics})
            logger.log("eval", done, metrics)
            result.final_metrics = metrics
        if done % config.output.checkpoint_every == 0 or done == config.train.steps:
            save_checkpoint(run_dir, done, backend, model, optimizer, scheduler,
                            loader.state_dict(), trainable, info, config.output.keep_checkpoints,
                            {"run_id": plan.run_id, "recipe": plan.recipe})
    if not result.final_metrics:
        with autocast:
            result.final_metrics = stage.evaluate(model, eval_batches)
    scalars = {k: v for k, v in result.final_metrics.items() if isinstance(v, (int, float))}
    state = backend.full_state_dict(model)
    adapter_names = AdapterNames.of(backend.unwrap(model))
    refuse_non_finite({name: t for name, t in state.items() if name in adapter_names}, "export", info)
    export_dir = export_adapter(backend.unwrap(model), run_dir / "export", metrics=scalars, is_main=info.is_main,
                                state=state, **export_options(config))
    if info.is_main:
        result.summary = stage.report(run_dir, result.final_metrics, history) | {"export": str(export_dir)}
        logger.log("report", config.train.steps, {"summary": result.summary})
    logger.close()
    return result
