"""A training stage set up on this process: the public interface of one step, evaluation, saving and
exporting, shared by the training loop (`trainer`) and the benchmarks.

    session = TrainingSession.setup(config, JointStage())
    session.capture()             # optional: the micro-step replayed from a CUDA graph (one GPU)
    record = session.step()       # one optimizer step over `train.grad_accum` micro-batches
    metrics = session.evaluate()  # the stage's metrics on the held-out batches
    session.save(run_dir, step, run)
    session.export(run_dir / "export", metrics)

A stage (see `gsm_train/training/stages/`) says which parameters train, what the loss is, how to evaluate and
what to report; the session does everything else, the same way for every stage, through the
distributed backend (`backend.py`: FSDP2, or DeepSpeed ZeRO when the accelerate config asks for it).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from gsm_train.attention import configure_gsm, gsm_parameters
from gsm_train.config.schema import RecipeConfig
from gsm_train.export.save_load import AdapterNames, export_adapter
from gsm_train.models.model_zoo import load_model_and_tokenizer
from gsm_train.training.activation_checkpoint import checkpoint_decoder_layers
from gsm_train.training.backend import FSDP2Backend, select_backend
from gsm_train.training.backend_protocol import Backend
from gsm_train.training.checkpoint import load_checkpoint, save_checkpoint
from gsm_train.training.distributed import DistInfo, all_reduce_sum, init_distributed
from gsm_train.training.finite_guard import refuse_non_finite
from gsm_train.training.optim import AdamWBF16
from gsm_train.training.step_graph import GraphedLoss
from gsm_train.training.training_data import TrainingData, load_training_data
from gsm_train.tuning.resolved_recipe import resolve_for_base


class Stage(Protocol):
    """What a training stage supplies."""

    name: str
    # why the step cannot be captured in a CUDA graph (train.cuda_graph), or None if it can: a capturable
    # step reads no device values on the host and gives every trainable parameter a gradient
    graph_blocker: str | None

    def prepare(self, model: nn.Module, config: RecipeConfig) -> None:
        """Attach/load modules and set `requires_grad` on exactly the parameters that train."""

    def loss(self, model: nn.Module, batch: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """Loss of one micro-batch (mean over its tokens/positions) and terms to log (detached 0-d
        tensors: the session averages them over micro-batches and ranks, as the loss, and reads them on
        the host after the step, so that a captured step can produce them)."""

    def evaluate(self, model: nn.Module, batches: list[Tensor]) -> dict[str, Any]:
        """Metrics on held-out batches, identical on every rank (reduce across ranks inside)."""

    def report(self, run_dir: Path, metrics: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
        """Write the final report files (rank 0) and return a summary."""


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step: the loss and the stage's terms averaged over micro-batches and ranks (`means`,
    the loss first, one device tensor) and the global gradient norm before clipping (on the device)."""

    names: tuple[str, ...]
    means: Tensor
    grad_norm: Tensor | float


def lr_lambda(config: RecipeConfig) -> Callable[[int], float]:
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


def dtypes(config: RecipeConfig, device: torch.device) -> tuple[torch.dtype, torch.dtype | None]:
    """(dtype the base is loaded in, autocast dtype or None)."""
    precision = config.distributed.mixed_precision
    compute = torch.bfloat16 if precision == "bf16" or (precision == "auto" and device.type == "cuda") else None
    load = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(config.model.dtype)
    if load is None:  # auto: a frozen base can live in the compute dtype; a training base keeps fp32 masters
        load = compute if (compute is not None and config.train.base == "frozen") else torch.float32
    return load, compute


def eval_batches(rows: Tensor, config: RecipeConfig, info: DistInfo) -> list[Tensor]:
    """This rank's share of the first `eval_batches` global batches of held-out rows."""
    per_rank = config.train.batch_size
    wanted = min(len(rows), config.logging.eval_batches * per_rank * info.world_size)
    usable = rows[: wanted - wanted % info.world_size][info.rank :: info.world_size]
    return [usable[i : i + per_rank].to(info.device) for i in range(0, len(usable), per_rank)]


def param_groups(model: nn.Module, config: RecipeConfig) -> list[dict[str, Any]]:
    """Trainable parameters in two groups: GSM modules (at `optim.gsm_lr`, if set) and the rest."""
    gsm_ids = {id(param) for _, param in gsm_parameters(model)}
    gsm, rest = [], []
    for param in model.parameters():
        if param.requires_grad:
            (gsm if id(param) in gsm_ids else rest).append(param)
    gsm_lr = config.optim.gsm_lr or config.optim.lr
    return [
        group for group in ({"params": gsm, "lr": gsm_lr}, {"params": rest, "lr": config.optim.lr}) if group["params"]
    ]


def build_optimizer(model: nn.Module, config: RecipeConfig, fused: bool = True) -> torch.optim.Optimizer:
    """The recipe's AdamW over the model's trainables: torch's, with `fused` on CUDA the fused
    kernel (one launch per step instead of several per tensor; the DeepSpeed backend asks for the
    default one), or with `optim.state_dtype: bf16` gsm-train's with bf16 moments
    (`gsm_train/training/optim.py`)."""
    optim = config.optim
    if optim.state_dtype == "bf16":
        return AdamWBF16(
            param_groups(model, config),
            lr=optim.lr,
            betas=optim.betas,
            weight_decay=optim.weight_decay,
            seed=config.train.seed,
        )
    on_cuda = all(p.is_cuda for p in model.parameters() if p.requires_grad)
    return torch.optim.AdamW(
        param_groups(model, config),
        lr=optim.lr,
        betas=optim.betas,
        weight_decay=optim.weight_decay,
        fused=(fused and on_cuda) or None,
    )


def export_options(config: RecipeConfig) -> dict[str, Any]:
    """What `export_adapter` needs to know about a run besides the model."""
    return {
        "base_name": config.model.name_or_path,
        "base_revision": config.model.revision,
        "recipe": config.model_dump(mode="json"),
        "include_base": config.output.export_base_weights,
        "lora": config.train.lora.model_dump() if config.train.base == "lora" else None,
    }


def prepared_model(config: RecipeConfig, stage: Stage, device: torch.device) -> tuple[nn.Module, Any]:
    """The base model with the stage's modules attached, on `device`, and its tokenizer; `config`
    resolved against the base (`resolved_recipe.resolve_for_base`)."""
    load_dtype, _ = dtypes(config, device)
    model, tokenizer = load_model_and_tokenizer(
        config.model.name_or_path, config.model.gguf_file, config.model.revision, load_dtype, device
    )
    stage.prepare(model, config)
    checkpointing = config.train.activation_checkpointing
    if checkpointing:
        checkpoint_decoder_layers(model, "mlp" if checkpointing == "mlp" else "layer")
    return model.to(device), tokenizer


class TrainingSession:
    """One stage set up on this process: model (wrapped by the backend), optimizer, schedule, data."""

    def __init__(
        self, config: RecipeConfig, stage: Stage, info: DistInfo, backend: Backend, model: nn.Module, data: TrainingData
    ) -> None:
        self.config, self.stage, self.info, self.backend = config, stage, info, backend
        self.compute_dtype = dtypes(config, info.device)[1]
        self.trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        # counted before wrapping: ZeRO-3 leaves partitioned parameters empty
        self.counts = {
            "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "frozen_params": sum(p.numel() for p in model.parameters() if not p.requires_grad),
        }
        self.model, self.optimizer = backend.prepare(
            model, lambda m: build_optimizer(m, config, fused=backend.name == "fsdp2"), info, self.compute_dtype
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(config))
        self.data = data
        self.loader = data.batches
        self.eval_batches = eval_batches(data.eval_rows, config, info)
        self.graphed: GraphedLoss | None = None

    @classmethod
    def setup(
        cls, config: RecipeConfig, stage: Stage, info: DistInfo | None = None, backend: Backend | None = None
    ) -> TrainingSession:
        """Resolve the recipe against the base's config (its tuning knobs; before any weights load:
        `resolved_recipe`, which gives a resolved recipe back unchanged), load the base, attach the
        stage's modules, tokenize the data (once per node), wrap and build the optimizer. The session's
        `config` is the resolved recipe."""
        info = info or init_distributed()
        config, _ = resolve_for_base(config)
        torch.manual_seed(config.train.seed)
        model, tokenizer = prepared_model(config, stage, info.device)
        return cls(
            config, stage, info, backend or select_backend(config), model, load_training_data(config, tokenizer, info)
        )

    @property
    def unwrapped(self) -> nn.Module:
        """The Hugging Face model inside the backend's wrapper."""
        return self.backend.unwrap(self.model)

    @property
    def tokens_per_step(self) -> int:
        train = self.config.train
        return train.batch_size * train.grad_accum * self.config.data.seq_len * self.info.world_size

    def autocast(self) -> contextlib.AbstractContextManager:
        """The recipe's mixed precision (bf16 autocast on the GPU), or nothing."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.info.device.type, dtype=self.compute_dtype)

    def resume(self, checkpoint: Path) -> int:
        """Restore trainables, optimizer, schedule, RNG and data position; returns the step to continue at."""
        meta = load_checkpoint(
            checkpoint,
            self.backend,
            self.model,
            self.optimizer,
            self.scheduler,
            self.trainable,
            self.config.train.batch_size,
            self.info,
        )
        self.loader.load_state_dict(meta["data"])
        return meta["step"]

    def capture(self) -> None:
        """Capture the stage's micro-step in a CUDA graph and replay it from now on (one GPU, FSDP2; after any
        resume, so the captured step reads the restored trainables)."""
        assert isinstance(self.backend, FSDP2Backend), "captured steps run on the FSDP2 backend"
        self.backend.grads_in_place = True
        self.model.train()  # the replays run as captured
        configure_gsm(self.model, captured_steps=True)  # paths that pay off only without per-call Python
        example = torch.zeros(
            self.config.train.batch_size, self.config.data.seq_len, dtype=torch.long, device=self.info.device
        )
        trainables = [p for p in self.model.parameters() if p.requires_grad]
        self.graphed = GraphedLoss(
            lambda batch: self.stage.loss(self.model, batch),
            trainables,
            example,
            self.compute_dtype,
            grad_scale=1 / self.config.train.grad_accum,
        )

    def micro_step(self, batch: Tensor, boundary: bool) -> tuple[Tensor, dict[str, Tensor]]:
        """Loss and terms of one micro-batch, its gradients added into `.grad`."""
        if self.graphed is not None:
            return self.graphed(batch)
        with self.autocast():
            loss, terms = self.stage.loss(self.model, batch)
        self.backend.backward(loss / self.config.train.grad_accum, boundary=boundary)
        return loss, terms

    def step(self, update_check: Callable[[Tensor], Callable[[Tensor], bool] | None] | None = None) -> StepRecord:
        """One optimizer step over `train.grad_accum` micro-batches. `update_check(means)` may return a
        predicate on the gradient norm that decides whether the update runs (the NaN guard)."""
        self.model.train()
        accum = self.config.train.grad_accum
        sums: dict[str, Tensor] = {}  # the loss and the stage's terms, averaged over the micro-batches
        for micro in range(accum):
            loss, terms = self.micro_step(self.loader.next_batch().to(self.info.device), micro == accum - 1)
            for name, value in {"loss": loss, **terms}.items():  # added up before the next replay overwrites it
                sums[name] = sums.get(name, 0.0) + value.detach().float() / accum
        means = all_reduce_sum(torch.stack(list(sums.values()))) / self.info.world_size  # one reduction, one read
        grad_norm = self.backend.step(self.optimizer, update_check(means) if update_check is not None else None)
        self.scheduler.step()
        return StepRecord(tuple(sums), means, grad_norm)

    def evaluate(self) -> dict[str, Any]:
        """The stage's metrics on this rank's held-out batches (the same on every rank)."""
        with self.autocast():
            return self.stage.evaluate(self.model, self.eval_batches)

    def save(self, run_dir: Path, step: int, run: dict[str, Any]) -> Path:
        """A complete checkpoint of `step` in `run_dir/checkpoints` (collective); `run`: the run id and recipe."""
        return save_checkpoint(
            run_dir,
            step,
            self.backend,
            self.model,
            self.optimizer,
            self.scheduler,
            self.loader.state_dict(),
            self.trainable,
            self.info,
            self.config.output.keep_checkpoints,
            run,
        )

    def export(self, out_dir: Path, metrics: dict[str, Any]) -> Path:
        """The adapter export (collective; rank 0 writes), refused for non-finite tensors. Only the
        tensors it holds are gathered (the base's only with `output.export_base_weights`)."""
        names = AdapterNames.of(self.unwrapped)
        with_base = self.config.output.export_base_weights
        wanted = self.unwrapped.state_dict().keys() if with_base else names.gsm | names.lora
        state = self.backend.full_tensors(self.model, wanted)
        refuse_non_finite({name: t for name, t in state.items() if name in names}, "export", self.info)
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        return export_adapter(
            self.unwrapped,
            out_dir,
            metrics=scalars,
            is_main=self.info.is_main,
            state=state,
            **export_options(self.config),
        )
