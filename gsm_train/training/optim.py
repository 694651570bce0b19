"""AdamW with its two moments stored in bf16 (`optim.state_dtype: bf16`).

torch.optim.AdamW keeps both moments in the parameter's dtype: 8 bytes per fp32 trainable. Here they
take 4 (2 + 2), which is what lets `train.base: full` of an 8B model fit one 141 GB GPU with fp32
weights (docs/design-decisions.md, 'An 8B base in full on one H200'). Per parameter and step:

    m = b1 m + (1 - b1) g          v = b2 v + (1 - b2) g^2          (in fp32, from the bf16 moments)
    p = p (1 - lr wd) - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

exactly torch's AdamW (not amsgrad, not maximize) computed in fp32 with fp32 weights; only storing
m and v rounds them to bf16. The rounding is stochastic (unbiased): with round-to-nearest, a
moment whose step is below half a bf16 unit (8 significant bits) never moves, e.g. v's decay by
b2 = 0.999 per step (a relative change of 0.001 against bf16's 0.0039 per unit), which would leave
v at its largest value and shrink the updates. The random bits come from a generator seeded by the
step, the parameter's position and the rank, so a resumed run draws what the uninterrupted one drew
(at the same number of processes).

On CUDA the per-parameter update is one fused kernel (`torch.compile`); on the CPU it runs eagerly,
the same operations. Parameters may be FSDP2's DTensors: each rank updates its own shard.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

# elements updated at once (eagerly: bounds the fp32 temporaries to a few hundred MB)
CHUNK = 1 << 26


def stochastic_round_bf16(values: Tensor, noise: Tensor) -> Tensor:
    """fp32 `values` rounded to bf16 by adding `noise` (int32, uniform in [0, 2^16)) below the 16
    bits bf16 keeps and truncating: up with probability equal to the fraction dropped. Returns fp32
    tensors whose values are bf16 numbers (the conversion that follows is exact)."""
    bits = values.view(torch.int32)
    return ((bits + noise) & -65536).view(torch.float32)


def _update(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, noise: Tensor, scalars: Tensor) -> None:
    """One AdamW update of flat views, in place. `scalars`: fp32 [lr, beta1, beta2, eps, weight
    decay, 1 - beta1^t, sqrt(1 - beta2^t)] on the parameter's device (tensors, so that a compiled
    update is not recompiled when the learning rate changes)."""
    lr, beta1, beta2, eps, weight_decay, bias1, bias2_sqrt = scalars.unbind()
    g = grad.float()
    m = exp_avg.float() * beta1 + g * (1 - beta1)
    v = exp_avg_sq.float() * beta2 + g * g * (1 - beta2)
    exp_avg.copy_(stochastic_round_bf16(m, noise & 0xFFFF))
    exp_avg_sq.copy_(stochastic_round_bf16(v, (noise >> 16) & 0xFFFF))
    p = param.float() * (1 - lr * weight_decay)
    param.copy_(p - (lr / bias1) * m / (v.sqrt() / bias2_sqrt + eps))


_compiled_update = None


def _device_update(device: torch.device):
    """The update for tensors on `device`: compiled once (dynamic shapes) on CUDA, else eager."""
    global _compiled_update
    if device.type != "cuda":
        return _update
    if _compiled_update is None:
        _compiled_update = torch.compile(_update, dynamic=True, fullgraph=True)
    return _compiled_update


def _local(tensor: Tensor) -> Tensor:
    """This rank's part of a DTensor, flat (a view: updates in place reach the DTensor)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if not local.is_contiguous():
        raise ValueError("AdamWBF16 updates parameters through flat views; this one is not contiguous")
    return local.view(-1)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class AdamWBF16(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected) whose moments `exp_avg` and `exp_avg_sq` are
    bf16; state and state dict as torch.optim.AdamW's (`step` a CPU fp32 tensor), so that
    torch.distributed.checkpoint saves and reshards it the same way. `seed` varies the rounding
    bits."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        seed: int = 0,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _noise(self, like: Tensor, step: int, index: int, start: int) -> Tensor:
        """int32 random bits shaped like `like`, fixed by (seed, step, parameter index, rank,
        offset)."""
        generator = self._generators.get(like.device)
        if generator is None:
            generator = self._generators[like.device] = torch.Generator(like.device)
        generator.manual_seed(hash((self.seed, step, index, _rank(), start)) & (2**63 - 1))
        return torch.randint(-(2**31), 2**31, like.shape, dtype=torch.int32, device=like.device, generator=generator)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = -1
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                index += 1
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.bfloat16)
                state["step"] += 1
                step = int(state["step"].item())
                flat = [_local(t) for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"])]
                scalars = torch.tensor(
                    [
                        group["lr"],
                        beta1,
                        beta2,
                        group["eps"],
                        group["weight_decay"],
                        1 - beta1**step,
                        math.sqrt(1 - beta2**step),
                    ],
                    dtype=torch.float32,
                ).to(flat[0].device, non_blocking=True)
                update = _device_update(flat[0].device)
                for start in range(0, flat[0].numel(), CHUNK):
                    part = [t[start : start + CHUNK] for t in flat]
                    update(*part, self._noise(part[0], step, index, start), scalars)
        return loss
