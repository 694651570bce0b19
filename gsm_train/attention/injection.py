"""Attach GSM modules to a Hugging Face causal LM, and find them again.

`inject_gsm` gives every attention layer a `GSMAttentionAdapter` (`self_attn.gsm`), installs the
per-forward hooks (`forward_state`), registers the `gsm` attention and mask functions with transformers,
and puts the model's frozen `GSMSettings` on its decoder stack. The GSM modules are found by type
(`gsm_adapters`), never by parameter names.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel, masking_utils
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function, sdpa_mask

from gsm_train.attention.adapter import GSMAttentionAdapter
from gsm_train.attention.dispatch import ATTN_IMPLEMENTATION, gate_ahead_hook, gsm_attention_forward
from gsm_train.attention.forward_state import install_forward_hooks
from gsm_train.attention.settings import GSMSettings, has_gsm, put_settings
from gsm_train.config.schema import GSMConfig
from gsm_train.models.families import UnsupportedModel, attention_modules, family_of, model_dims
from gsm_train.models.fingerprint import base_fingerprint
from gsm_train.modules.cache_bridge import CacheBridge
from gsm_train.modules.errors import GSMError
from gsm_train.modules.kv_registry import build_compressors
from gsm_train.modules.sparse_gate import SparseGateHead

_SDPA_MASK_PARAMETERS = inspect.signature(sdpa_mask)


def gsm_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """transformers' `sdpa_mask`, except that an unpadded causal pass over the whole sequence gets no mask
    (None: attention is causal by construction, and SDPA keeps its flash path) even while a CUDA graph
    captures, where transformers materialises the [B, 1, T, T] mask."""
    bound = _SDPA_MASK_PARAMETERS.bind(*args, **kwargs)
    bound.apply_defaults()
    given = bound.arguments
    if "q_length" in given:
        q_length = given["q_length"]
    else:
        position = given.get("cache_position")
        q_length = None if position is None else position.shape[0]
    causal_full = (
        given.get("attention_mask") is None
        and given.get("mask_function") is causal_mask_function
        and given.get("local_size") is None
        and given.get("allow_is_causal_skip", False)
        and q_length is not None
        and q_length == given.get("kv_length")
        and not given.get("kv_offset")
    )
    return None if causal_full else sdpa_mask(*args, **kwargs)


@contextmanager
def rows_not_packed() -> Iterator[None]:
    """Within: transformers takes each row's position ids as one sequence, without looking.

    Without a padding mask transformers reads the position ids on the host to detect several sequences
    packed into one row. While a CUDA graph captures it cannot read them, so it assumes packing and builds
    a full [B, 1, T, T] mask. gsm-train's rows are never packed that way (documents are joined with
    separators, positions run 0..T-1), so a captured training step runs inside this block."""
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:  # a transformers version without the check: nothing to skip
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def _register_attention() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, gsm_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, gsm_mask)


def _check_against(model: PreTrainedModel, config: GSMConfig, dims: dict[str, int]) -> None:
    """Refuse a config that names layers or shapes this model does not have."""
    try:
        family_of(model)
    except UnsupportedModel as err:
        raise GSMError(str(err)) from None
    if has_gsm(model):
        raise GSMError("this model already has GSM modules; load a fresh base model to inject again")
    bridge = config.cross_layer_sharing
    if config.gsm_enabled and bridge.enabled and bridge.bridge_to_start >= dims["layers"]:
        raise GSMError(
            f"cross_layer_sharing.bridge_to_start={bridge.bridge_to_start} but the model has "
            f"{dims['layers']} layers; use a value below {dims['layers']}"
        )
    beyond = [layer for layer in getattr(config.kv_compression, "layer_bits", {}) if layer >= dims["layers"]]
    if config.kv_compression.enabled and beyond:
        raise GSMError(
            f"kv_compression.layer_bits names layer {beyond[0]}, but the model has {dims['layers']} layers "
            f"(0 to {dims['layers'] - 1}); drop it or name a layer below {dims['layers']}"
        )
    head_dim = dims["head_dim"]
    rotates = getattr(config.kv_compression, "rotate_residuals", False)
    if config.kv_compression.enabled and rotates and head_dim & (head_dim - 1):
        raise GSMError(
            f"kv_compression.rotate_residuals=true needs a power-of-two head_dim (a Hadamard rotation), "
            f"but this model's is {head_dim}; set kv_compression.rotate_residuals=false"
        )


def _build_adapter(layer_idx: int, attn: nn.Module, config: GSMConfig, dims: dict[str, int]) -> GSMAttentionAdapter:
    sparse, asq_cfg, bridge_cfg = config.sparse_attention, config.kv_compression, config.cross_layer_sharing
    gate = asq_k = asq_v = bridge = None
    if sparse.enabled and layer_idx not in sparse.dense_layers:
        selectors = 1 if sparse.heads == "layer" else dims["kv_heads"]
        gate = SparseGateHead(
            dims["hidden"],
            sparse.gate_head_dim,
            dims["head_dim"],
            selectors,
            sparse.gate_key_bits,
            sparse.gate_query_heads,
            sparse.gate_rotated_pairs,
        )
        if sparse.gate_init == "qk_svd":
            gate.init_from_attention(
                attn.q_proj.weight, attn.k_proj.weight, dims["heads"], dims["kv_heads"], dims["head_dim"]
            )
    if asq_cfg.enabled:
        asq_k, asq_v = build_compressors(asq_cfg, layer_idx, dims["kv_heads"], dims["head_dim"])
    if bridge_cfg.enabled and layer_idx >= bridge_cfg.bridge_to_start:
        out_heads = dims["kv_heads"] if bridge_cfg.mode == "mix" else min(bridge_cfg.shared_kv_heads, dims["kv_heads"])
        bridge = CacheBridge(dims["kv_heads"], dims["head_dim"], out_heads, bridge_cfg.alpha_init)
    adapter = GSMAttentionAdapter(
        layer_idx,
        gate,
        asq_k,
        asq_v,
        bridge,
        is_bridge_source=bridge_cfg.enabled and layer_idx == bridge_cfg.bridge_from,
        dense_layer=layer_idx in sparse.dense_layers,
    )
    return adapter.to(device=attn.q_proj.weight.device, dtype=torch.float32)


def inject_gsm(model: PreTrainedModel, config: GSMConfig, mode: str = "dense") -> GSMSettings:
    """Attach a `gsm` adapter (gate, ASQ, bridge as configured) to every attention layer; returns the
    model's settings.

    Modules are created in fp32 on the model's device, each in its attention module's mode (a model put in
    eval mode before the call, as loaded models are, gets GSM modules in eval mode: training-only paths,
    such as the gate keys' compiled int8 rounding on CUDA, never run in its inference). The model then runs
    attention through the registered `gsm` function; with `config.gsm_enabled` false it behaves exactly
    like the base.
    """
    dims = model_dims(model)
    _check_against(model, config, dims)
    fingerprint = base_fingerprint(model.state_dict())
    _register_attention()
    gate_layers = []
    for layer_idx, attn in enumerate(attention_modules(model)):
        attn.gsm = _build_adapter(layer_idx, attn, config, dims).train(attn.training)
        if attn.gsm.gate is not None:
            gate_layers.append(layer_idx)
    install_forward_hooks(model)
    for attn in attention_modules(model):  # after forward_state's, which keeps the input it reads
        attn.register_forward_pre_hook(gate_ahead_hook, with_kwargs=True)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    settings = GSMSettings(
        config=config,
        base_fingerprint=fingerprint,
        gate_layers=tuple(gate_layers),
        mode=mode,
        enabled=config.gsm_enabled,
    )
    put_settings(model, settings)
    return settings


def gsm_adapters(model: nn.Module) -> list[tuple[str, GSMAttentionAdapter]]:
    """The model's GSM adapters with their qualified module names, in layer order."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, GSMAttentionAdapter)]


def gsm_parameters(
    model: nn.Module, parts: tuple[str, ...] = ("gate", "compressor", "bridge")
) -> Iterator[tuple[str, nn.Parameter]]:
    """Named GSM parameters of the given parts (`gate`, `compressor`, `bridge`), as the model names them."""
    wanted = {
        id(p) for _, adapter in gsm_adapters(model) for part in parts for p in getattr(adapter, f"{part}_parameters")()
    }
    return ((name, p) for name, p in model.named_parameters() if id(p) in wanted)


def gsm_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The GSM tensors (parameters and persistent buffers) by the model's names for them."""
    return {
        f"{prefix}.{name}": tensor
        for prefix, adapter in gsm_adapters(model)
        for name, tensor in adapter.state_dict().items()
    }


def inject_only(model: PreTrainedModel, section: str, values: dict[str, Any]) -> GSMSettings:
    """Inject with one GSM section enabled (with `values`) and the others off."""
    blocks: dict[str, dict[str, Any]] = {"sparse_attention": {"enabled": False}}
    blocks[section] = {"enabled": True, **values}
    return inject_gsm(model, GSMConfig.model_validate(blocks))


def inject_sparse_gate(
    model: PreTrainedModel, top_k_schedule: str = "constant", k_max: int = 64, **options: Any
) -> GSMSettings:
    """Attach only Sparse Gate Heads (seed API); `options` are `sparse_attention` fields."""
    return inject_only(model, "sparse_attention", {"top_k_schedule": top_k_schedule, "top_k": k_max, **options})


def inject_kv_compressor(
    model: PreTrainedModel, cluster_num: int = 32, quant_bits: int = 8, **options: Any
) -> GSMSettings:
    """Attach only ASQ compressors (seed API); `options` are `kv_compression` fields."""
    return inject_only(model, "kv_compression", {"cluster_num": cluster_num, "quant_bits": quant_bits, **options})


def inject_cache_bridge(
    model: PreTrainedModel, bridge_layers: tuple[int, int] = (8, 24), alpha_init: float = 0.3, **options: Any
) -> GSMSettings:
    """Attach only the cache bridge from `bridge_layers[0]` to layers `bridge_layers[1]`.. (seed API)."""
    return inject_only(
        model,
        "cross_layer_sharing",
        {"bridge_from": bridge_layers[0], "bridge_to_start": bridge_layers[1], "alpha_init": alpha_init, **options},
    )
