"""An opt-in fusion of a token step's small elementwise work, the same for GSM's engine and the dense one.

Inside `fused_decode(model)` the decoder layers' RMSNorms (Qwen3's per-head q/k norms included), their
SwiGLU MLPs' SiLU(gate) * up and their attention's RoPE run as one Triton launch each
(`gsm_train.kernels.decode_fusion`) instead of the handful of eager kernels each is in transformers. The
engines enter it around their token steps only (`enable_gsm_generation(..., fused_decode=True)`,
`DenseEngine(..., fused_decode=True)`): for a captured step around its warm-up and capture, so the graph
holds the fused launches and every replay runs them; for an eager step around the step. Prompts and
training never run inside it.

What is swapped, and only for a model of a family in `FUSED_CLASSES` whose modules are exactly that
family's transformers classes (a subclass, or a module whose forward was already replaced on the
instance, e.g. by an autocast wrapper, stays eager):
- each `<Family>RMSNorm`'s forward, on the instance, for the time of the block;
- each `<Family>MLP`'s forward whose `act_fn` is SiLU (hidden_act silu or swish), likewise;
- `apply_rotary_pos_emb` of the family's modeling module (a module global: `<Family>Attention.forward`
  reads it by name), where that forward does read it.
Each fused forward checks its inputs and runs the original where the kernel does not take them (a prompt's
RoPE, another dtype, autocast, the CPU without Triton's interpreter), so the module global, which other
models of the family see during the block, stays correct for them. How close the results are to the
eager ones: the kernels' module docstring (bf16: equal but for rare one-step roundings).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from transformers.activations import SiLUActivation

from gsm_train.kernels.decode_fusion import (
    kernels_run,
    rms_norm,
    rms_norm_fits,
    rope,
    rope_fits,
    silu_mul,
    silu_mul_fits,
)
from gsm_train.models.families import family_of

# config.model_type -> the prefix of its transformers classes (`<prefix>RMSNorm`, `<prefix>MLP`,
# `<prefix>Attention`, in transformers.models.<model_type>.modeling_<model_type>)
FUSED_CLASSES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}
ROPE_FUNCTION = "apply_rotary_pos_emb"


@dataclass
class Fused:
    """What a `fused_decode` block swapped in: RMSNorm and MLP modules, and whether RoPE."""

    norms: int = 0
    mlps: int = 0
    rope: bool = False


def _fused_norm(module: nn.Module, hidden_states: Tensor) -> Tensor:
    """An RMSNorm's forward by `rms_norm` where it fits, else the class's own."""
    if rms_norm_fits(hidden_states, module.weight):
        return rms_norm(hidden_states, module.weight, module.variance_epsilon)
    return type(module).forward(module, hidden_states)


def _fused_mlp(module: nn.Module, x: Tensor) -> Tensor:
    """A SwiGLU MLP's forward with SiLU(gate) * up by `silu_mul` where it fits."""
    gate, up = module.gate_proj(x), module.up_proj(x)
    hidden = silu_mul(gate, up) if silu_mul_fits(gate, up) else module.act_fn(gate) * up
    return module.down_proj(hidden)


def _fused_rope(original: Callable, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1) -> Any:
    """`apply_rotary_pos_emb` by `rope` where it fits (one token's q and k, unsqueeze_dim 1), else `original`."""
    if unsqueeze_dim == 1 and rope_fits(q, k, cos, sin):
        return rope(q, k, cos, sin)
    return original(q, k, cos, sin, unsqueeze_dim)


def _swap_forward(module: nn.Module, forward: Callable, undo: list[Callable[[], None]]) -> None:
    module.forward = types.MethodType(forward, module)
    undo.append(lambda: delattr(module, "forward"))


def _swap_rope(modeling: types.ModuleType, undo: list[Callable[[], None]]) -> bool:
    """`modeling.apply_rotary_pos_emb` replaced by `_fused_rope` of it (False: it is already)."""
    original = getattr(modeling, ROPE_FUNCTION)
    if isinstance(original, functools.partial) and original.func is _fused_rope:  # an enclosing block's
        return False
    setattr(modeling, ROPE_FUNCTION, functools.partial(_fused_rope, original))
    undo.append(lambda: setattr(modeling, ROPE_FUNCTION, original))
    return True


def _swap_in(model: nn.Module, undo: list[Callable[[], None]]) -> Fused:
    """Swap the fused forwards into `model`'s known modules (module docstring), each swap's undo appended."""
    fused = Fused()
    family = family_of(model).model_type
    prefix = FUSED_CLASSES.get(family)
    if prefix is None or not kernels_run(next(model.parameters())):
        return fused
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    # a class this transformers does not have (None) matches no module
    norm, mlp, attention = (getattr(modeling, prefix + name, None) for name in ("RMSNorm", "MLP", "Attention"))
    rope_read = False
    for module in model.modules():
        if "forward" in vars(module):  # replaced on the instance already (a wrapper, or an enclosing block)
            continue
        if type(module) is norm:
            _swap_forward(module, _fused_norm, undo)
            fused.norms += 1
        elif type(module) is mlp and isinstance(module.act_fn, (SiLUActivation, nn.SiLU)):
            _swap_forward(module, _fused_mlp, undo)
            fused.mlps += 1
        elif type(module) is attention:
            rope_read = ROPE_FUNCTION in attention.forward.__code__.co_names
    fused.rope = rope_read and hasattr(modeling, ROPE_FUNCTION) and _swap_rope(modeling, undo)
    return fused


@contextlib.contextmanager
def fused_decode(model: nn.Module, enabled: bool = True) -> Iterator[Fused]:
    """Inside: `model`'s token steps run the fused kernels as the module docstring says (nothing changes
    with `enabled` False, for a family not in `FUSED_CLASSES`, or where the kernels do not run: no Triton,
    or the CPU without Triton's interpreter). Yields what was swapped; everything is restored on exit.
    A block inside another for the same model swaps nothing more (the outer one restores)."""
    undo: list[Callable[[], None]] = []
    try:
        yield _swap_in(model, undo) if enabled else Fused()
    finally:
        for step in reversed(undo):
            step()
