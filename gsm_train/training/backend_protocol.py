"""What the training loop asks of a distributed backend (FSDP2 in `backend`, DeepSpeed in
`deepspeed_backend`): the same calls for both."""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from gsm_train.training.distributed import DistInfo

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
# a checkpoint's trainables as full tensors, where a backend writes them so (DeepSpeed; and FSDP2
# before its checkpoints were sharded)
FULL_TRAINABLES_FILE = "trainable.safetensors"


class Backend(Protocol):
    """What the training loop asks of a distributed backend."""

    name: str
    # what its checkpoints hold: "dcp" (sharded; resumes on any number of processes), or its own
    checkpoint_format: str

    def prepare(
        self, model: nn.Module, make_optimizer: OptimizerFactory, info: DistInfo, compute_dtype: torch.dtype | None
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Wrap the model (the returned one runs forward) and build the AdamW the schedule drives."""

    def backward(self, loss: Tensor, boundary: bool) -> None:
        """Backward of one micro-batch; `boundary` marks the last one of the step."""

    def step(
        self, optimizer: torch.optim.Optimizer, update_if: Callable[[Tensor], bool] | None = None
    ) -> Tensor | float:
        """Clip the global gradient norm, update, zero the gradients; return the norm before clipping (a
        tensor stays on the device, so the host queues the update before it waits to read the norm).
        With `update_if`, the update runs only if it returns True for the norm (the gradients are
        dropped either way)."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The Hugging Face model inside the wrapper."""

    def describe(self) -> dict[str, Any]:
        """What the setup record says about the backend."""

    def full_tensors(self, model: nn.Module, names: Collection[str]) -> dict[str, Tensor]:
        """Full CPU tensors of the model's state-dict entries named in `names` on rank 0
        (trainables at their fp32 values), nothing on the others; collective. Only those are
        gathered."""

    def trainable_tensors(self, model: nn.Module, trainable: set[str]) -> dict[str, Tensor]:
        """What this rank holds of each trainable for a checkpoint (FSDP2: its shards, nothing
        gathered; DeepSpeed: full fp32 tensors on rank 0, nothing on the others); collective."""

    def save_state(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        folder: Path,
        tensors: dict[str, Tensor],
        info: DistInfo,
    ) -> None:
        """Write `tensors` (`trainable_tensors`) and the optimizer state into a checkpoint folder;
        collective."""

    def load_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path, trainable: set[str], info: DistInfo
    ) -> None:
        """Restore the trainables and the optimizer state from a checkpoint folder this backend
        wrote (at another number of processes only in the `dcp` format); collective."""
