"""A GSM model's settings: frozen, held by its decoder stack, replaced whole, never edited in place.

`inject_gsm` puts a `GSMSettings` on the model's decoder stack; every forward hands it to the layers
(`forward_state.ForwardState`). Changing a switch replaces the object: `set_gsm_mode`,
`configure_gsm`, and the `gsm_disabled` / `gsm_settings_changed` blocks, which restore the settings on
leaving, also on an exception. Nothing else writes them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from gsm_train.config.schema import GSMConfig
from gsm_train.models.families import UnsupportedModel, decoder_stack
from gsm_train.modules.errors import GSMError

MODES = ("dense", "sparse", "oracle")
KV_BASELINES = ("per_token", "kivi")
SETTINGS_ATTRIBUTE = "gsm_settings"


@dataclass(frozen=True)
class GSMSettings:
    """How the GSM layers of one model run.

    config: the GSM block the modules were built from (and exports carry).
    base_fingerprint: the base weights' fingerprint, taken before any module was attached.
    gate_layers: the layers with a Sparse Gate Head, ascending.
    mode: main attention of the sparse layers, `dense`, `sparse` (gate top-k) or `oracle` (true top-k).
    enabled: False runs the model exactly as the base.
    detach_gate_input: the gate reads detached hidden states (the joint stage: the base learns only from
        the LM loss).
    captured_steps: training forwards are captured in a CUDA graph, so ASQ layers may take the
        block-sparse FlexAttention path at any size (eager steps take it only where a layer's attention
        is large enough to pay for its host time: `own_block_attention.pays_off_eagerly`).
    kv_baseline: replace ASQ by plain quantization at ASQ's widths (`per_token` or `kivi`), for evaluation.
    """

    config: GSMConfig
    base_fingerprint: str
    gate_layers: tuple[int, ...]
    mode: str = "dense"
    enabled: bool = True
    detach_gate_input: bool = False
    captured_steps: bool = False
    kv_baseline: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise GSMError(f"unknown GSM mode {self.mode!r}; use one of {', '.join(MODES)}")
        if self.kv_baseline is not None and self.kv_baseline not in KV_BASELINES:
            raise GSMError(f"unknown kv_baseline {self.kv_baseline!r}; use one of {', '.join(KV_BASELINES)}")
        sparse = self.config.sparse_attention
        gateless = sorted(set(sparse.retrieval_layers) - set(self.gate_layers))
        if sparse.enabled and gateless:
            raise GSMError(
                f"sparse_attention.retrieval_layers names layer {gateless[0]}, which has no gate (the gate layers: "
                f"{list(self.gate_layers)}); name gate layers only (a layer without a gate reads every key anyway)"
            )


def has_gsm(model: nn.Module) -> bool:
    """Whether GSM modules were injected into this model."""
    try:
        return isinstance(getattr(decoder_stack(model), SETTINGS_ATTRIBUTE, None), GSMSettings)
    except UnsupportedModel:
        return False


def gsm_settings(model: nn.Module) -> GSMSettings:
    """The settings of an injected model (through FSDP, DeepSpeed and PEFT wrappers)."""
    try:
        settings = getattr(decoder_stack(model), SETTINGS_ATTRIBUTE, None)
    except UnsupportedModel:
        settings = None
    if not isinstance(settings, GSMSettings):
        raise GSMError("this model has no GSM modules; call inject_gsm(model, config) first")
    return settings


def put_settings(model: nn.Module, settings: GSMSettings) -> None:
    """Make `settings` the model's (the one place they are written)."""
    setattr(decoder_stack(model), SETTINGS_ATTRIBUTE, settings)


def configure_gsm(model: nn.Module, **changes: Any) -> GSMSettings:
    """Replace the named fields of the model's settings (e.g. `mode="sparse"`); returns the new settings."""
    settings = replace(gsm_settings(model), **changes)
    put_settings(model, settings)
    return settings


def set_gsm_mode(model: nn.Module, mode: str) -> None:
    """Main attention of the sparse layers: `dense`, `sparse` (gate top-k) or `oracle` (true top-k)."""
    configure_gsm(model, mode=mode)


@contextmanager
def gsm_settings_changed(model: nn.Module, **changes: Any) -> Iterator[GSMSettings]:
    """Within: the settings with `changes`; on leaving (also on an exception) the settings as they were."""
    before = gsm_settings(model)
    try:
        yield configure_gsm(model, **changes)
    finally:
        put_settings(model, before)


@contextmanager
def gsm_disabled(model: nn.Module) -> Iterator[None]:
    """Run the model exactly as the base model inside this block."""
    with gsm_settings_changed(model, enabled=False):
        yield
