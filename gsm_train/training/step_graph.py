"""A training micro-step (loss, then backward) captured once in a CUDA graph and replayed.

On one GPU the stage-1 step is bound by the host, not the GPU: Python issues thousands of small
kernels (gate projections, RoPE, the KL per layer, their backward) more slowly than the GPU runs
them. A replay issues the whole micro-step at once. What a captured step must not do, and the gate and
joint stages do not: read device values on the host, copy from the host, or change shapes between steps
(packed batches have one shape; the gate KL draws its query rows on the device).

Gradients accumulate in place into buffers that exist before the capture, so gradient accumulation,
clipping and the eager optimizer step work unchanged, provided gradients are zeroed in place
(`zero_grad(set_to_none=False)`) instead of dropped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Literal, Protocol

import torch
from torch import Tensor, nn

from gsm_train.attention.injection import rows_not_packed
from gsm_train.compiled import captured
from gsm_train.config.schema import ConfigError, Problem

WARMUP_PASSES = 3  # eager passes on a side stream before capture (library handles, autotuning, layout caches)
CudaGraphSetting = Literal["auto"] | bool


class CapturableStage(Protocol):
    name: str
    graph_blocker: str | None


def cuda_graph_blockers(
    device: torch.device,
    world_size: int,
    backend_name: str,
    stage: CapturableStage,
    activation_checkpointing: bool | str = False,
) -> list[str]:
    """Why this run's step cannot be captured (empty: it can)."""
    blockers = []
    if activation_checkpointing:
        blockers.append(
            "train.activation_checkpointing runs each layer (or its MLP) again in the backward, "
            "with the random state of its forward restored, which a captured step "
            "cannot do"
        )
    if device.type != "cuda":
        blockers.append(f"the run is on {device.type}, and CUDA graphs need a CUDA GPU")
    if world_size > 1:
        blockers.append(f"the run has {world_size} processes; sharded steps (FSDP2, DeepSpeed) run eagerly")
    if backend_name != "fsdp2":
        blockers.append(f"the {backend_name} backend runs its own step")
    if stage.graph_blocker is not None:
        blockers.append(f"stage {stage.name}: {stage.graph_blocker}")
    return blockers


def use_cuda_graph(setting: CudaGraphSetting, blockers: list[str]) -> bool:
    """`auto`: capture when nothing blocks it; `true`: capture, or one ConfigError saying what blocks it."""
    if setting is True and blockers:
        raise ConfigError(
            "recipe vs run",
            [
                Problem(
                    "train.cuda_graph",
                    True,
                    "; ".join(blockers),
                    "set train.cuda_graph: auto (capture where possible) or false",
                )
            ],
        )
    return setting is True or (setting == "auto" and not blockers)


class GraphedLoss:
    """`loss_fn(batch)` -> (loss, scalars to log) and the loss's backward, captured for batches shaped
    like `example`.

    Calling it copies the batch into the captured input, replays, and returns the loss and the scalars
    (tensors that the next call overwrites). Gradients of `params` are added into their `.grad`
    buffers, scaled by `grad_scale` (1 / gradient accumulation steps). The warm-up passes and the capture leave the
    parameters, their gradients (zero) and the CPU and CUDA random states as they found them.
    """

    def __init__(
        self,
        loss_fn: Callable[[Tensor], tuple[Tensor, dict[str, Tensor]]],
        params: list[nn.Parameter],
        example: Tensor,
        autocast_dtype: torch.dtype | None,
        grad_scale: float = 1.0,
    ):
        self.loss_fn, self.grad_scale = loss_fn, grad_scale
        self.autocast_dtype = autocast_dtype
        self.batch = torch.zeros_like(example)
        for param in params:
            param.grad = torch.zeros_like(param) if param.grad is None else param.grad.zero_()
        cpu_rng, cuda_rng = torch.get_rng_state(), torch.cuda.get_rng_state()
        self.graph, (self.loss, self.scalars) = captured(self._loss_and_backward, warmups=WARMUP_PASSES)
        for param in params:
            param.grad.zero_()
        torch.set_rng_state(cpu_rng)
        torch.cuda.set_rng_state(cuda_rng)

    def _loss_and_backward(self) -> tuple[Tensor, dict[str, Tensor]]:
        autocast = (
            torch.autocast("cuda", dtype=self.autocast_dtype, cache_enabled=False)  # no cached casts in a graph
            if self.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with autocast, rows_not_packed():  # what transformers cannot check while capturing (see there)
            loss, scalars = self.loss_fn(self.batch)
        (loss * self.grad_scale).backward()
        return loss.detach(), {name: value.detach() for name, value in scalars.items()}

    def __call__(self, batch: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        self.batch.copy_(batch, non_blocking=True)
        self.graph.replay()
        return self.loss, self.scalars
