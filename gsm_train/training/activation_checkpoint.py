"""Activation checkpointing per decoder layer (`train.activation_checkpointing`).

Each decoder layer's `forward` (scope `layer`) or its MLP's alone (scope `mlp`) runs under PyTorch's
non-reentrant `torch.utils.checkpoint`: the forward keeps only the checkpointed part's inputs, and
the backward runs it again to rebuild what its gradients need. With `layer`, memory for activations
drops from every layer's intermediates to one layer's plus each layer's input, for one more forward
of the layers per step. With `mlp`, only the MLPs' intermediates (their [T, intermediate] products,
the largest activations) are rebuilt: the attention keeps its activations, so neither it nor GSM's
gate, selection and ASQ run twice, for the memory of one attention's activations per layer.

How it composes with the rest:
- FSDP2: the checkpoint wraps the layer's `forward`, inside the layer's `__call__`, so FSDP2's
  hooks (unshard before, reshard after) stay outside it, as torchtitan applies it; module and
  parameter names do not change (no wrapper module), so checkpoints and exports are unaffected.
- GSM: a layer records the gate's KL and ASQ's loss into the forward's records
  (`gsm_collect`) while it runs. Run again in the backward, it would record them a second time;
  during that recomputation the forward's records are swapped for a throwaway, so the records
  hold what the forward recorded, once. Gradients through those records flow as without
  checkpointing (non-reentrant checkpointing keeps the forward's graph and rebuilds only the
  tensors it saved). What a forward computes once and shares across layers (`ForwardState.scratch`:
  the layout, the sampled query rows) is reused as computed, not drawn again.
- RNG: the state at each layer's forward is restored for its recomputation (`preserve_rng_state`),
  so anything random in a layer draws the same values again.
- Without gradients (evaluation, generation) layers run as they are.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gsm_train.attention.forward_state import FORWARD_KWARG, ForwardState, GSMRecords
from gsm_train.models.families import decoder_layers

_MARK = "_gsm_activation_checkpointed"  # on a checkpointed decoder layer: its scope


@contextlib.contextmanager
def _records_discarded(state: ForwardState | None) -> Iterator[None]:
    """Within: what `state`'s layers record goes to a throwaway (a recomputation records none)."""
    if state is None or state.records is None:
        yield
        return
    kept, state.records = state.records, GSMRecords()
    try:
        yield
    finally:
        state.records = kept


def _checkpointed_forward(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    state = kwargs.get(FORWARD_KWARG)

    def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return contextlib.nullcontext(), _records_discarded(state)  # (forward, recomputation)

    return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)


SCOPES = ("layer", "mlp")  # what `checkpoint_decoder_layers` runs again in the backward


def checkpoint_decoder_layers(model: nn.Module, scope: str = "layer") -> int:
    """Run each decoder layer of `model` (`scope` "layer") or each layer's MLP (`scope` "mlp", the layer's
    `mlp` module) under activation checkpointing from now on (before the backend wraps it); returns the
    number of layers. Calling it again in the same scope changes nothing; in the other scope it is refused
    (a layer is checkpointed in one scope), as is the `mlp` scope on a model whose layers have no `mlp`
    module (before any layer is changed)."""
    if scope not in SCOPES:
        raise ValueError(f"activation checkpointing scope {scope!r} is not one of {SCOPES}")
    layers = decoder_layers(model)
    parts = []
    for index, layer in enumerate(layers):
        done = getattr(layer, _MARK, None)
        if done is not None and done != scope:
            raise ValueError(f"decoder layer {index} is checkpointed in scope {done!r} already, not {scope!r}")
        part = layer if scope == "layer" else getattr(layer, "mlp", None)
        if not isinstance(part, nn.Module):
            raise ValueError(
                f"decoder layer {index} ({type(layer).__name__}) has no `mlp` module to checkpoint; set "
                "train.activation_checkpointing: true to checkpoint whole layers"
            )
        parts.append((layer, part, done is None))
    for layer, part, new in parts:
        if new:
            part.forward = functools.partial(_checkpointed_forward, part.forward)
            setattr(layer, _MARK, scope)
    return len(layers)
