"""The distributed backend of the training loop: FSDP2 (the default) or DeepSpeed ZeRO.

`accelerate launch` with a DeepSpeed config (e.g. `launch/deepspeed_zero2.yaml`) exports
`ACCELERATE_USE_DEEPSPEED=true` plus its settings (zero stage, clipping, precision); the loop then
hands model and optimizer to accelerate's DeepSpeed integration (`gsm_train/deepspeed_backend.py`).
Every other launch (one process, `torchrun`, `launch/multi_gpu.yaml`) runs gsm-train's own FSDP2.
Both backends do the same things through the same five calls: prepare, backward, step (global
clipping over the trainables, the pre-clip norm returned for logging), full state dict (for
checkpoints and exports) and the optimizer's part of a checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from accelerate.utils import DeepSpeedPlugin, parse_flag_from_env
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from gsm_train.config import ConfigError, Problem, RecipeConfig
from gsm_train.distributed import DistInfo, shard_model

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
_SOURCE = "accelerate config (ACCELERATE_USE_DEEPSPEED=true)"


class Backend(Protocol):
    """What the training loop asks of a distributed backend."""

    name: str

    def prepare(self, model: nn.Module, make_optimizer: OptimizerFactory, info: DistInfo,
                compute_dtype: torch.dtype | None) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Wrap the model (the returned one runs forward) and build the AdamW the schedule drives."""

    def backward(self, loss: Tensor, boundary: bool) -> None:
        """Backward of one micro-batch; `boundary` marks the last one of the step."""

    def step(self, optimizer: torch.optim.Optimizer,
             update_if: Callable[[Tensor], bool] | None = None) -> Tensor | float:
        """Clip the global gradient norm, update, zero the gradients; return the norm before clipping (a
        tensor stays on the device, so the host queues the update before it waits to read the norm).
        With `update_if`, the update runs only if it returns True for the norm (the gradients are
        dropped either way)."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The Hugging Face model inside the wrapper."""

    def describe(self) -> dict[str, Any]:
        """What the setup record says about the backend."""

    def full_state_dict(self, model: nn.Module) -> dict[str, Tensor]:
        """Full CPU tensors of the whole model on rank 0 (trainables at their fp32 values); collective."""

    def save_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path, info: DistInfo) -> None:
        """Write the optimizer state into a checkpoint folder; collective."""

    def load_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path,
                   weights: dict[str, Tensor]) -> None:
        """Restore the trainables (`weights`, full tensors) and the optimizer from a checkpoint folder."""


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> Tensor:
    """Global gradient norm over the trainable parameters (DTensor-aware), clipped to max_norm; the norm
    before clipping stays on the device."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    full = getattr(norm, "full_tensor", None)
    return full() if full else norm


class FSDP2Backend:
    """gsm-train's own `fully_shard` (see `shard_model`) above one process; plain PyTorch in one."""

    name = "fsdp2"

    def __init__(self, config: RecipeConfig):
        self.config = config
        self.params: list[nn.Parameter] = []
        self.grads_in_place = False  # a captured step adds into fixed .grad buffers: zero them, never drop them

    def prepare(self, model: nn.Module, make_optimizer: OptimizerFactory, info: DistInfo,
                compute_dtype: torch.dtype | None) -> tuple[nn.Module, torch.optim.Optimizer]:
        if info.distributed and self.config.distributed.fsdp == "auto":
            shard_model(model, compute_dtype)
        self.params = [p for p in model.parameters() if p.requires_grad]
        return model, make_optimizer(model)

    def backward(self, loss: Tensor, boundary: bool) -> None:
        loss.backward()

    def step(self, optimizer: torch.optim.Optimizer,
             update_if: Callable[[Tensor], bool] | None = None) -> Tensor:
        norm = clip_grad_norm(self.params, self.config.optim.max_grad_norm)
        if update_if is None or update_if(norm):
            optimizer.step()
        optimizer.zero_grad(set_to_none=not self.grads_in_place)
        return norm

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name}

    def full_state_dict(self, model: nn.Module) -> dict[str, Tensor]:
        return get_model_state_dict(model, options=_FULL)

    def save_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path, info: DistInfo) -> None:
        state = get_optimizer_state_dict(model, optimizer, options=_FULL)
        if info.is_main:
            torch.save(state, folder / "optimizer.pt")

    def load_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path,
                   weights: dict[str, Tensor]) -> None:
        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
        set_optimizer_state_dict(model, optimizer, torch.load(folder / "optimizer.pt", weights_only=True),
                                 options=StateDictOptions(full_state_dict=True))


def uses_deepspeed() -> bool:
    """Whether `accelerate launch` started this process with a DeepSpeed config."""
    return parse_flag_from_env("ACCELERATE_USE_DEEPSPEED")


def _plugin_problems(plugin: DeepSpeedPlugin, config: RecipeConfig) -> list[Problem]:
    """Settings of the accelerate config that contradict the recipe."""
    pairs = (("gradient_clipping", plugin.gradient_clipping, "optim.max_grad_norm", config.optim.max_grad_norm),
             ("gradient_accumulation_steps", plugin.gradient_accumulation_steps, "train.grad_accum",
              config.train.grad_accum))
    problems = [Problem(f"deepspeed_config.{key}", value, f"differs from the recipe's {field} ({wanted})",
                        f"set {key}: {wanted} in the accelerate config (or 'auto'), or change {field}")
                for key, value, field, wanted in pairs if value not in ("auto", None) and float(value) != float(wanted)]
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if precision != "no" and config.distributed.mixed_precision == "no":
        problems.append(Problem("mixed_precision", precision, "DeepSpeed would store every parameter in "
                                f"{precision}, but the recipe's distributed.mixed_precision is 'no'",
                                "set mixed_precision: 'no' in the accelerate config, or distributed.mixed_precision: "
                                "bf16 in the recipe"))
    return problems


def select_backend(config: RecipeConfig) -> Backend:
    """FSDP2, or DeepSpeed when the accelerate config asks for it. Checked before anything is written:
    a missing `deepspeed` package or settings that contradict the recipe raise one ConfigError."""
    if not uses_deepspeed():
        return FSDP2Backend(config)
    plugin = DeepSpeedPlugin()  # reads the settings `accelerate launch` exported
    problems = _plugin_problems(plugin, config)
    try:
        import deepspeed  # noqa: F401
    except ImportError as err:
        problems.insert(0, Problem("distributed_type", "DEEPSPEED",
                                   f"the accelerate config asks for DeepSpeed, but `import deepspeed` failed ({err})",
                                   "pip install 'gsm-train[deepspeed]', or launch with an FSDP2 config such as "
                                   "launch/multi_gpu.yaml"))
    if config.train.max_skipped_steps:
        problems.append(Problem("train.max_skipped_steps", config.train.max_skipped_steps,
                                "skipping a step needs its gradient norm before the update, which "
                                "the DeepSpeed engine does not give",
                                "set train.max_skipped_steps: 0 (a non-finite step stops the run), "
                                "or launch with an FSDP2 config"))
    if problems:
        raise ConfigError(_SOURCE, problems)
    from gsm_train.deepspeed_backend import DeepSpeedBackend

    return DeepSpeedBackend(config, plugin)

