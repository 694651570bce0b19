"""The distributed backend of the training loop: FSDP2 (the default) or DeepSpeed ZeRO.

`accelerate launch` with a DeepSpeed config (e.g. `launch/deepspeed_zero2.yaml`) exports
`ACCELERATE_USE_DEEPSPEED=true` plus its settings (zero stage, clipping, precision); the loop then
hands model and optimizer to accelerate's DeepSpeed integration (`gsm_train/training/deepspeed_backend.py`).
Every other launch (one process, `torchrun`, `launch/multi_gpu.yaml`) runs gsm-train's own FSDP2.
Both backends do the same things through the same calls (`backend_protocol.Backend`): prepare,
backward, step (global clipping over the trainables, the pre-clip norm returned for logging), full
tensors for exports, and a checkpoint's trainables and optimizer state (FSDP2: sharded, written by
every rank, `sharded_checkpoint`; DeepSpeed: its own format).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DeepSpeedPlugin, parse_flag_from_env
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from gsm_train.config.schema import ConfigError, Problem, RecipeConfig
from gsm_train.training.backend_protocol import Backend, OptimizerFactory
from gsm_train.training.distributed import DistInfo, shard_model
from gsm_train.training.sharded_checkpoint import DCP_FORMAT, load_sharded, save_sharded, trainable_state

_SOURCE = "accelerate config (ACCELERATE_USE_DEEPSPEED=true)"
_LAUNCH_SOURCE = "accelerate config (as accelerate launch exported it)"


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> Tensor:
    """Global gradient norm over the trainable parameters (DTensor-aware), clipped to max_norm; the norm
    before clipping stays on the device."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    full = getattr(norm, "full_tensor", None)
    return full() if full else norm


class FSDP2Backend:
    """gsm-train's own `fully_shard` (see `shard_model`) above one process; plain PyTorch in one."""

    name = "fsdp2"
    checkpoint_format = DCP_FORMAT  # torch.distributed.checkpoint: resumes on any number of ranks

    def __init__(self, config: RecipeConfig):
        self.config = config
        self.is_main = True
        self.params: list[nn.Parameter] = []
        self.grads_in_place = False  # a captured step adds into fixed .grad buffers: zero them, never drop them

    def prepare(
        self, model: nn.Module, make_optimizer: OptimizerFactory, info: DistInfo, compute_dtype: torch.dtype | None
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        self.is_main = info.is_main
        if info.distributed and self.config.distributed.fsdp == "auto":
            shard_model(model, compute_dtype)
        self.params = [p for p in model.parameters() if p.requires_grad]
        return model, make_optimizer(model)

    def backward(self, loss: Tensor, boundary: bool) -> None:
        loss.backward()

    def step(self, optimizer: torch.optim.Optimizer, update_if: Callable[[Tensor], bool] | None = None) -> Tensor:
        norm = clip_grad_norm(self.params, self.config.optim.max_grad_norm)
        if update_if is None or update_if(norm):
            optimizer.step()
        optimizer.zero_grad(set_to_none=not self.grads_in_place)
        return norm

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name}

    def full_tensors(self, model: nn.Module, names: Collection[str]) -> dict[str, Tensor]:
        state = {}
        for name, tensor in get_model_state_dict(model).items():  # FSDP2: DTensor shards
            if name in names:
                full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # collective
                if self.is_main:
                    state[name] = full.detach().to("cpu", copy=True)
        return state

    def trainable_tensors(self, model: nn.Module, trainable: set[str]) -> dict[str, Tensor]:
        return trainable_state(model, trainable)

    def save_state(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        folder: Path,
        tensors: dict[str, Tensor],
        info: DistInfo,
    ) -> None:
        save_sharded(folder, tensors, model, optimizer)

    def load_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path, trainable: set[str], info: DistInfo
    ) -> None:
        load_sharded(folder, model, optimizer, trainable)


def uses_deepspeed() -> bool:
    """Whether `accelerate launch` started this process with a DeepSpeed config."""
    return parse_flag_from_env("ACCELERATE_USE_DEEPSPEED")


def _plugin_problems(plugin: DeepSpeedPlugin, config: RecipeConfig) -> list[Problem]:
    """Settings of the accelerate config that contradict the recipe."""
    pairs = (
        ("gradient_clipping", plugin.gradient_clipping, "optim.max_grad_norm", config.optim.max_grad_norm),
        (
            "gradient_accumulation_steps",
            plugin.gradient_accumulation_steps,
            "train.grad_accum",
            config.train.grad_accum,
        ),
    )
    problems = [
        Problem(
            f"deepspeed_config.{key}",
            value,
            f"differs from the recipe's {field} ({wanted})",
            f"set {key}: {wanted} in the accelerate config (or 'auto'), or change {field}",
        )
        for key, value, field, wanted in pairs
        if value not in ("auto", None) and float(value) != float(wanted)
    ]
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if precision != "no" and config.distributed.mixed_precision == "no":
        problems.append(
            Problem(
                "mixed_precision",
                precision,
                "DeepSpeed would store every parameter in "
                f"{precision}, but the recipe's distributed.mixed_precision is 'no'",
                "set mixed_precision: 'no' in the accelerate config, or distributed.mixed_precision: "
                "bf16 in the recipe",
            )
        )
    return problems


def _fsdp2_launch_problems(config: RecipeConfig) -> list[Problem]:
    """Settings of the accelerate config (as `accelerate launch` exports them) that gsm-train's own
    FSDP2 would not follow: accelerate's FSDP plugin (`distributed_type: FSDP`, whose `fsdp_config`
    then arrives as FSDP_* variables) and a mixed precision other than the recipe's."""
    problems = []
    if parse_flag_from_env("ACCELERATE_USE_FSDP"):
        problems.append(
            Problem(
                "distributed_type",
                "FSDP",
                "gsm-train shards with its own FSDP2 (fully_shard per GSM "
                "module, per decoder layer, then the root) whenever several processes run, so "
                "accelerate's FSDP plugin and its fsdp_config would be ignored",
                "launch with launch/multi_gpu.yaml (distributed_type: MULTI_GPU, no fsdp_config); the "
                "recipe's distributed.fsdp switches sharding",
            )
        )
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    recipe_precision = config.distributed.mixed_precision
    if precision not in ("no", "bf16") or (precision == "bf16" and recipe_precision == "no"):
        problems.append(
            Problem(
                "mixed_precision",
                precision,
                "gsm-train applies mixed precision itself, as the "
                f"recipe's distributed.mixed_precision ({recipe_precision!r}) says: bf16 compute, fp32 "
                "trainables",
                "set mixed_precision: 'no' in the accelerate config, and distributed.mixed_precision: "
                "bf16 (or auto: bf16 on GPUs) in the recipe for bf16",
            )
        )
    return problems


def select_backend(config: RecipeConfig) -> Backend:
    """FSDP2, or DeepSpeed when the accelerate config asks for it. Checked before anything is written:
    a missing `deepspeed` package, or accelerate settings that contradict the recipe or that the
    backend would ignore (an FSDP plugin config, a mixed precision the recipe does not ask for),
    raise one ConfigError."""
    if not uses_deepspeed():
        problems = _fsdp2_launch_problems(config)
        if problems:
            raise ConfigError(_LAUNCH_SOURCE, problems)
        return FSDP2Backend(config)
    plugin = DeepSpeedPlugin()  # reads the settings `accelerate launch` exported
    problems = _plugin_problems(plugin, config)
    try:
        import deepspeed  # noqa: F401
    except ImportError as err:
        problems.insert(
            0,
            Problem(
                "distributed_type",
                "DEEPSPEED",
                f"the accelerate config asks for DeepSpeed, but `import deepspeed` failed ({err})",
                "pip install 'gsm-train[deepspeed]', or launch with an FSDP2 config such as launch/multi_gpu.yaml",
            ),
        )
    if config.optim.state_dtype != "fp32":
        problems.append(
            Problem(
                "optim.state_dtype",
                config.optim.state_dtype,
                "DeepSpeed keeps its optimizer's state itself, in fp32",
                "set optim.state_dtype: fp32, or launch with an FSDP2 config",
            )
        )
    if config.train.max_skipped_steps:
        problems.append(
            Problem(
                "train.max_skipped_steps",
                config.train.max_skipped_steps,
                "skipping a step needs its gradient norm before the update, which the DeepSpeed engine does not give",
                "set train.max_skipped_steps: 0 (a non-finite step stops the run), or launch with an FSDP2 config",
            )
        )
    if problems:
        raise ConfigError(_SOURCE, problems)
    from gsm_train.training.deepspeed_backend import DeepSpeedBackend

    return DeepSpeedBackend(config, plugin)
