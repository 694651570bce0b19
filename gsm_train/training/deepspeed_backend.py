"""DeepSpeed ZeRO-2/3 through accelerate's integration (chosen by `backend.select_backend`).

accelerate builds the engine (`Accelerator.prepare(model, optimizer)`) from the DeepSpeed plugin that
`accelerate launch` configured, completed here with the recipe's clipping, accumulation and micro-batch.
The loop stays gsm-train's: the same AdamW parameter groups (trainables only), LR schedule, logging,
checkpoint and export formats. Where it differs from FSDP2:

- bf16 (`mixed_precision: bf16`): DeepSpeed stores every parameter in bf16 and keeps fp32 masters of
  the trainables in its optimizer; checkpoints and exports take the trainables from those masters.
  DeepSpeed builds those masters from the parameters it has already cast to bf16; they are set back to
  the trainables' own fp32 values (as FSDP2's fp32 sharded parameters keep them). Masters rounded to bf16
  make every update smaller than half a bf16 step vanish from the bf16 weights, where fp32 masters move
  them by that update on average: early in warm-up DeepSpeed's base barely learned.
  Frozen GSM/LoRA tensors are kept aside on CPU before that cast, so exports carry them unchanged; a
  frozen base loaded in bf16 (the recipes' default on GPU) is untouched.
- Gradients are reduced in fp32 (`communication_data_type`), as FSDP2's `reduce_dtype`.
- The loop's autocast reaches the model: the engine's forward switches off an autocast active around it
  on CUDA (`deepspeed.runtime.torch_autocast.autocast_if_enabled`, unless DeepSpeed's own `torch_autocast`
  is configured), which would run the forward in plain bf16, unlike FSDP2's bf16 parameters under
  autocast (e.g. the GSM modules' fp32 einsums and matmuls, and autocast's fp32 softmax/log/exp/sums).
  The model's own forward therefore enters the same autocast inside the engine.
- Checkpoints keep DeepSpeed's own format, not FSDP2's sharded one (`sharded_checkpoint`): the
  engine's `save_checkpoint` (fp32 master partitions and Adam moments, one file per rank) in
  `deepspeed/`, and the full trainables, gathered to rank 0, in `trainable.safetensors` (which
  `gsm-train export CHECKPOINT` reads); resuming restores it exactly and needs the same number of
  processes.
- ZeRO-3 partitions every parameter. GSM parameters read outside their module's forward (ASQ's loss)
  are gathered by ZeRO-3's external-parameter discovery during the engine's forward; full tensors for
  checkpoints and exports are gathered one parameter at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import deepspeed
import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin
from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param
from safetensors.torch import save_file
from torch import Tensor, nn

from gsm_train.config.schema import RecipeConfig
from gsm_train.export.lora import adapter_tensor_names
from gsm_train.training.backend_protocol import FULL_TRAINABLES_FILE, OptimizerFactory
from gsm_train.training.distributed import DistInfo

CHECKPOINT_TAG = "deepspeed"


def _set_fp32_master(param: nn.Parameter, value: Tensor) -> None:
    """Set the fp32 master of a trainable to `value`. ZeRO-3 partitions are padded at the end, which
    DeepSpeed 0.19's `set_full_hp_param` does not allow for (a rank whose partition lies in the padding
    fails, leaving the others waiting in the next collective), so its local partition is set here."""
    if not hasattr(param, "ds_id"):
        safe_set_full_fp32_param(param, value)
        return
    optimizer = param._z3_optimizer
    partition, group = optimizer._get_fp32_opt_state_partition(param, release_swap_buffers=False)
    size = partition.numel()
    start = size * optimizer._get_param_partition_rank(param)
    local = value.flatten()[start : start + size]
    partition.data.zero_()
    partition.data[: local.numel()].copy_(local)
    if optimizer._swappable_optimizer_subgroup(group):  # NVMe offload: write it back, as DeepSpeed's own setter does
        optimizer._optimizer_states_and_gradient_swap_out(group)


class DeepSpeedBackend:
    """Model and optimizer in a DeepSpeed engine; clipping, reduction and partitioning are the engine's."""

    name = "deepspeed"
    checkpoint_format = "deepspeed"  # ZeRO's partitions: resumes on as many processes as wrote it

    def __init__(self, config: RecipeConfig, plugin: DeepSpeedPlugin):
        self.config = config
        self.plugin = plugin
        self.engine: Any = None
        self.is_main = True
        self.kept: dict[str, Tensor] = {}

    def prepare(
        self, model: nn.Module, make_optimizer: OptimizerFactory, info: DistInfo, compute_dtype: torch.dtype | None
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        self.is_main = info.is_main
        adapter_names = adapter_tensor_names(model)
        self.kept = {
            name: p.detach().to("cpu", copy=True)
            for name, p in model.named_parameters()
            if not p.requires_grad and name in adapter_names
        }
        masters = {
            name: p.detach().to("cpu", copy=True)
            for name, p in model.named_parameters()
            if p.requires_grad and p.dtype == torch.float32
        }
        optimizer = make_optimizer(model)
        train = self.config.train
        self.plugin.deepspeed_config.update(
            {
                "gradient_clipping": self.config.optim.max_grad_norm,
                "gradient_accumulation_steps": train.grad_accum,
                "train_micro_batch_size_per_gpu": train.batch_size,
                "train_batch_size": train.batch_size * train.grad_accum * info.world_size,
            }
        )
        self.plugin.deepspeed_config.setdefault("communication_data_type", "fp32")
        accelerator = Accelerator(deepspeed_plugin=self.plugin, gradient_accumulation_steps=train.grad_accum)
        self.engine, _ = accelerator.prepare(model, optimizer)
        for name, param in self.engine.module.named_parameters():
            if name in masters and param.dtype != torch.float32:  # the engine cast it: restore the fp32 master
                _set_fp32_master(param, masters[name].to(param.device))
        if compute_dtype is not None:
            module = self.engine.module
            module.forward = torch.autocast(info.device.type, dtype=compute_dtype)(module.forward)
        return self.engine, optimizer

    def backward(self, loss: Tensor, boundary: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(loss, scale_wrt_gas=False)  # the loop already divides by train.grad_accum

    def step(self, optimizer: torch.optim.Optimizer, update_if: Callable[[Tensor], bool] | None = None) -> float:
        if update_if is not None:  # select_backend refuses train.max_skipped_steps with DeepSpeed
            raise ValueError("the DeepSpeed backend cannot skip an update")
        self.engine.step()  # clips to gradient_clipping, updates and zeroes the gradients
        norm = self.engine.get_global_grad_norm()
        return float("nan") if norm is None else float(norm)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self.engine.module

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "zero_stage": self.engine.zero_optimization_stage(),
            "bf16": self.engine.bfloat16_enabled(),
        }

    def _full(self, name: str, tensor: Tensor) -> Tensor:
        """One full tensor (collective): fp32 master of a trainable, the kept copy of a frozen adapter
        tensor, else the (under ZeRO-3 gathered) module tensor."""
        if isinstance(tensor, nn.Parameter) and tensor.requires_grad:
            return safe_get_full_fp32_param(tensor).cpu()
        if name in self.kept:
            return self.kept[name]
        with deepspeed.zero.GatheredParameters(tensor):  # a no-op unless ZeRO-3 partitioned it
            return tensor.detach().to("cpu", copy=True)

    def full_tensors(self, model: nn.Module, names: Collection[str]) -> dict[str, Tensor]:
        state = {}
        for name, tensor in self.unwrap(model).state_dict(keep_vars=True).items():
            if name in names:
                full = self._full(name, tensor)
                if self.is_main:
                    state[name] = full
        return state

    def trainable_tensors(self, model: nn.Module, trainable: set[str]) -> dict[str, Tensor]:
        return {name: t.contiguous() for name, t in self.full_tensors(model, trainable).items()}

    def save_state(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        folder: Path,
        tensors: dict[str, Tensor],
        info: DistInfo,
    ) -> None:
        """rank 0: the full trainables in `trainable.safetensors` (what `gsm-train export
        CHECKPOINT` reads); every rank: its part of the engine's checkpoint in `deepspeed/`."""
        if info.is_main:
            save_file(tensors, str(folder / FULL_TRAINABLES_FILE))
        self.engine.save_checkpoint(
            str(folder), tag=CHECKPOINT_TAG, client_state={}, save_latest=False, exclude_frozen_parameters=True
        )

    def load_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path, trainable: set[str], info: DistInfo
    ) -> None:
        """The engine's checkpoint restores the fp32 masters (the values `trainable.safetensors`
        holds) and Adam's moments."""
        loaded, _ = self.engine.load_checkpoint(
            str(folder),
            tag=CHECKPOINT_TAG,
            load_module_strict=False,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
        )
        if loaded is None:
            raise RuntimeError(
                f"{folder}: no DeepSpeed state in {CHECKPOINT_TAG}/; resume with the backend that wrote the checkpoint"
            )
