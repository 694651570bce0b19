"""Per-call state of a GSM forward: what it should collect, and what it collected.

Every forward of an injected model gets a fresh `ForwardState`: a pre-hook on the decoder stack builds
it from the model's frozen settings, the innermost active `gsm_collect` block for that model (what to
collect) and the generation cache the call was given, and passes it down as the keyword argument
`gsm_forward`, which transformers hands through each decoder layer to the attention function. Within
one forward the layers use it to share what a forward computes once (the selection layout, the sampled
query rows, the bridge source's K/V); nothing of it outlives the call.

What a caller wants back is asked for explicitly:

    with gsm_collect(model, distill=True) as records:
        model(input_ids=batch, use_cache=False)
    kl_per_layer = records.gate_kl_means()

`records` holds typed per-layer sums over the forwards run inside the block. Leaving the block restores
what was active before, also on an exception.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from gsm_train.attention.cache_protocol import GenerationCache, LayerCache
from gsm_train.attention.settings import GSMSettings, gsm_settings
from gsm_train.models.families import attention_modules, decoder_stack
from gsm_train.modules.errors import GSMError

FORWARD_KWARG = "gsm_forward"
CACHE_KWARGS = ("cache", "past_key_values")  # the cache's name in transformers 5.24+ and before


@dataclass(frozen=True)
class CollectRequest:
    """What a forward should record.

    distill: each gate layer's KL(main attention || gate) sum and rows counted (stage-1 / joint loss).
    distill_on_selection: in sparse mode the KL's target is the main attention over the selected keys.
    distill_queries: the KL uses this many query positions drawn per forward (0: all of them).
    recall: (k, min_keys): the gate's and the oracle's captured attention mass at k over queries with at
        least min_keys keys; k None: at each query's k of the top-k schedule.
    recall_buckets: with `recall`, the query positions where position buckets start (ascending, the
        first 0): the captured mass is also summed per bucket (`LayerRecords.captured_mass`).
    """

    distill: bool = False
    distill_on_selection: bool = False
    distill_queries: int = 0
    recall: tuple[int | None, int] | None = None
    recall_buckets: tuple[int, ...] = ()


@dataclass
class LayerRecords:
    """One layer's records, summed over the forwards of a `gsm_collect` block.

    gate_kl: (KL sum over the counted query rows, rows counted), 0-d tensors.
    captured_mass: fp64 0-d sums `gate`, `oracle` (target mass captured at k) and `queries` (rows
        counted); with `recall_buckets` also `gate_by_bucket`, `oracle_by_bucket` and
        `queries_by_bucket` (fp64 [m]).
    asq_loss: ASQ's reconstruction loss (mean of K's and V's), a 0-d tensor (training forwards only).
    """

    gate_kl: tuple[Tensor, Tensor] | None = None
    captured_mass: dict[str, Tensor] | None = None
    asq_loss: Tensor | None = None


@dataclass
class GSMRecords:
    """What the forwards inside one `gsm_collect` block recorded, per layer index."""

    forwards: int = 0
    layers: dict[int, LayerRecords] = field(default_factory=dict)

    def add_gate_kl(self, layer: int, total: Tensor, count: Tensor) -> None:
        record = self.layers.setdefault(layer, LayerRecords())
        previous = record.gate_kl
        record.gate_kl = (total, count) if previous is None else (previous[0] + total, previous[1] + count)

    def add_captured_mass(self, layer: int, sums: dict[str, Tensor]) -> None:
        record = self.layers.setdefault(layer, LayerRecords())
        previous = record.captured_mass
        record.captured_mass = sums if previous is None else {k: previous[k] + v for k, v in sums.items()}

    def add_asq_loss(self, layer: int, loss: Tensor) -> None:
        record = self.layers.setdefault(layer, LayerRecords())
        record.asq_loss = loss if record.asq_loss is None else record.asq_loss + loss

    def gate_kl_means(self) -> list[Tensor]:
        """Per gate layer (ascending), the KL per counted row."""
        return [r.gate_kl[0] / r.gate_kl[1].clamp_min(1) for _, r in sorted(self.layers.items()) if r.gate_kl]

    def asq_losses(self) -> list[Tensor]:
        """Per ASQ layer (ascending), its reconstruction loss summed over the block's forwards."""
        return [r.asq_loss for _, r in sorted(self.layers.items()) if r.asq_loss is not None]

    def captured_mass_total(self) -> dict[str, Tensor] | None:
        """Each captured-mass sum (`gate`, `oracle`, `queries`, and per bucket where asked) summed
        over the layers, or None where nothing was recorded."""
        sums = [r.captured_mass for _, r in sorted(self.layers.items()) if r.captured_mass]
        if not sums:
            return None
        return {key: torch.stack([s[key] for s in sums]).sum(0) for key in sums[0]}


class ForwardState:
    """One forward's GSM state (see the module docstring). `scratch` holds what the layers compute once
    per forward and share (`layout.forward_layout`, sampled rows), keyed by what they depend on.

    A plain class, not a dataclass: wrappers that walk a call's arguments (FSDP2 casting its inputs,
    for one) rebuild dataclasses field by field, which would give each layer a copy instead of the one
    state of the forward."""

    def __init__(
        self,
        settings: GSMSettings,
        request: CollectRequest | None = None,
        records: GSMRecords | None = None,
        cache: GenerationCache | None = None,
    ) -> None:
        self.settings = settings
        self.request = request or CollectRequest()
        self.records = records
        self.cache = cache
        self.layer_inputs: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
        self.bridge_source: tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None] | None = None
        self.scratch: dict[Any, Any] = {}

    def layer_cache(self, layer_idx: int) -> LayerCache | None:
        return None if self.cache is None else self.cache.gsm_layer(layer_idx)

    def pop_layer_input(self, layer_idx: int) -> tuple[Tensor, Tensor, Tensor]:
        """The attention module's input (hidden, cos, sin), kept by its pre-hook for the gate."""
        inputs = self.layer_inputs.pop(layer_idx, None)
        if inputs is None:
            raise GSMError(f"layer {layer_idx}: the gate's input was not kept; was the model injected?")
        return inputs


_ACTIVE: ContextVar[tuple[tuple[nn.Module, CollectRequest, GSMRecords], ...]] = ContextVar("gsm_collect", default=())


@contextmanager
def gsm_collect(
    model: nn.Module,
    *,
    distill: bool = False,
    distill_on_selection: bool = False,
    distill_queries: int = 0,
    recall: tuple[int | None, int] | None = None,
    recall_buckets: Sequence[int] = (),
) -> Iterator[GSMRecords]:
    """Within: the model's forwards record what is asked (`CollectRequest`) into the yielded records."""
    stack = decoder_stack(model)
    gsm_settings(model)  # refuses a model without GSM modules
    buckets = tuple(int(start) for start in recall_buckets)
    ascending = all(b > a for a, b in zip(buckets, buckets[1:]))
    if buckets and (recall is None or buckets[0] != 0 or not ascending):
        raise GSMError(
            f"recall_buckets {buckets}: give them with recall, as the ascending query "
            "positions where buckets start, the first 0, e.g. (0, 2048, 4096)"
        )
    request = CollectRequest(distill, distill_on_selection, distill_queries, recall, buckets)
    records = GSMRecords()
    token = _ACTIVE.set((*_ACTIVE.get(), (stack, request, records)))
    try:
        yield records
    finally:
        _ACTIVE.reset(token)


def _active_for(stack: nn.Module) -> tuple[CollectRequest, GSMRecords | None]:
    for owner, request, records in reversed(_ACTIVE.get()):
        if owner is stack:
            return request, records
    return CollectRequest(), None


def _start_forward(stack: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Pre-hook of the decoder stack: a fresh ForwardState for this call, passed down as `gsm_forward`."""
    request, records = _active_for(stack)
    if records is not None:
        records.forwards += 1
    cache = next((kwargs[name] for name in CACHE_KWARGS if kwargs.get(name) is not None), None)
    cache = cache if isinstance(cache, GenerationCache) else None
    if cache is not None and stack.gsm_settings.enabled:
        tokens = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
        tokens = tokens if tokens is not None else args[0]
        cache.begin_forward(tokens.shape[1], kwargs.get("attention_mask"))
    state = ForwardState(stack.gsm_settings, request, records, cache)
    return args, {**kwargs, FORWARD_KWARG: state}


def _keep_layer_input(attention: nn.Module, args: tuple, kwargs: dict) -> None:
    """Pre-hook of an attention module: keep its input (hidden, cos, sin) in the forward's state."""
    state = kwargs.get(FORWARD_KWARG)
    if state is None:
        return
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    cos, sin = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
    state.layer_inputs[attention.layer_idx] = (hidden, cos, sin)


def _end_forward(stack: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
    """Post-hook of the decoder stack: tell the generation cache its forward is over."""
    state = kwargs.get(FORWARD_KWARG)
    if state is not None and state.cache is not None:
        state.cache.end_forward()


def install_forward_hooks(model: nn.Module) -> None:
    """Give each forward of `model` its ForwardState (call once, at injection)."""
    stack = decoder_stack(model)
    stack.register_forward_pre_hook(_start_forward, with_kwargs=True)
    stack.register_forward_hook(_end_forward, with_kwargs=True)
    for attention in attention_modules(model):
        attention.register_forward_pre_hook(_keep_layer_input, with_kwargs=True)
