"""What the training loop asks of a distributed backend (FSDP2 in `backend`, DeepSpeed in
`deepspeed_backend`): five calls, the same for both."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from gsm_train.distributed import DistInfo

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]


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
