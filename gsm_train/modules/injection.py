"""Attach GSM modules to a Hugging Face causal LM and switch them on and off."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel, masking_utils
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function, sdpa_mask

from gsm_train.config import GSMConfig
from gsm_train.fingerprint import base_fingerprint
from gsm_train.modules.cache_bridge import CacheBridge
from gsm_train.modules.gsm_attention import (
    ATTN_IMPLEMENTATION, MODES, GSMAttentionAdapter, GSMError, GSMRuntime, gsm_attention_forward,
)
from gsm_train.modules.kv_compressor import ASQCompressor
from gsm_train.modules.sparse_gate import SparseGateHead

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
GSM_PARAM_MARKER = ".gsm."


_SDPA_MASK_PARAMETERS = inspect.signature(sdpa_mask)


def gsm_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """transformers' `sdpa_mask`, except that an unpadded causal pass over the whole sequence gets no mask
    (None: attention is causal by construction, and SDPA keeps its flash path) even while a CUDA graph
    captures, where transformers 5.x materialises the [B, 1, T, T] mask. (Under capture transformers also
    takes the rows for packed sequences, which no mask function can undo: see `rows_not_packed`.)"""
    bound = _SDPA_MASK_PARAMETERS.bind(*args, **kwargs)
    bound.apply_defaults()
    given = bound.arguments
    if "q_length" in given:
        q_length = given["q_length"]
    else:
        position = given.get("cache_position")
        q_length = None if position is None else position.shape[0]
    causal_full = (given.get("attention_mask") is None and given.get("mask_function") is causal_mask_function
                   and given.get("local_size") is None and given.get("allow_is_causal_skip", False)
                   and q_length is not None and q_length == given.get("kv_length") and not given.get("kv_offset"))
    return None if causal_full else sdpa_mask(*args, **kwargs)


@contextmanager
def rows_not_packed() -> Iterator[None]:
    """Within: transformers takes each row's position ids as one sequence, without looking.

    Without a padding mask, transformers reads the position ids on the host to detect several sequences
    packed into one row with restarting positions. While a CUDA graph captures it cannot read them, so
    it assumes packing and builds a full [B, 1, T, T] mask: SDPA then loses its causal path (masked
    attention, GQA heads copied, the mask converted in every layer) and GSM its shared layout. gsm-train's
    rows are never packed that way (documents are joined with separators, positions run 0..T-1), so a
    captured training step runs inside this context and gets the causal pass an eager step gets."""
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


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a supported causal LM (or of its base model)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise GSMError(f"{type(model).__name__} has no decoder layers at .model.layers; supported families: "
                       f"{', '.join(SUPPORTED_FAMILIES)}")
    return layers


def _check_family(model: PreTrainedModel) -> None:
    family = getattr(model.config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise GSMError(f"model family {family!r} is not supported: GSM needs attention through transformers' "
                       f"attention interface with q/k/v projections and RoPE ({', '.join(SUPPORTED_FAMILIES)}); "
                       "use a model of one of these families")


def _capture_inputs(module: nn.Module, args: tuple, kwargs: dict) -> None:
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    cos, sin = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
    module.gsm.capture_inputs(hidden, cos, sin)


def model_dims(model: PreTrainedModel) -> dict[str, int]:
    """hidden size, query heads, KV heads, head_dim and layers of a supported causal LM."""
    cfg = model.config
    heads = cfg.num_attention_heads
    return {
        "hidden": cfg.hidden_size,
        "heads": heads,
        "kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "layers": cfg.num_hidden_layers,
    }


def _build_adapter(layer_idx: int, attn: nn.Module, config: GSMConfig, dims: dict[str, int],
                   runtime: GSMRuntime) -> GSMAttentionAdapter:
    sparse, asq_cfg, bridge_cfg = config.sparse_attention, config.kv_compression, config.cross_layer_sharing
    gate = asq_k = asq_v = bridge = None
    if sparse.enabled and layer_idx not in sparse.dense_layers:
        selectors = 1 if sparse.heads == "layer" else dims["kv_heads"]
        gate = SparseGateHead(dims["hidden"], sparse.gate_head_dim, dims["head_dim"], selectors,
                              sparse.gate_key_bits)
        if sparse.gate_init == "qk_svd":
            gate.init_from_attention(attn.q_proj.weight, attn.k_proj.weight, dims["heads"], dims["kv_heads"],
                                     dims["head_dim"])
    if asq_cfg.enabled:
        asq_k, asq_v = (ASQCompressor(dims["kv_heads"], dims["head_dim"], asq_cfg.cluster_num, asq_cfg.hidden_dim,
                                      bits, asq_cfg.block_size, asq_cfg.tau, asq_cfg.rotate_residuals)
                        for bits in asq_cfg.bits(layer_idx))
    is_target = bridge_cfg.enabled and layer_idx >= bridge_cfg.bridge_to_start
    if is_target:
        out_heads = dims["kv_heads"] if bridge_cfg.mode == "mix" else min(bridge_cfg.shared_kv_heads, dims["kv_heads"])
        bridge = CacheBridge(dims["kv_heads"], dims["head_dim"], out_heads, bridge_cfg.alpha_init)
    adapter = GSMAttentionAdapter(layer_idx, runtime, gate, asq_k, asq_v, bridge,
                                  is_bridge_source=bridge_cfg.enabled and layer_idx == bridge_cfg.bridge_from,
                                  dense_layer=layer_idx in sparse.dense_layers)
    weight = attn.q_proj.weight
    return adapter.to(device=weight.device, dtype=torch.float32)


def inject_gsm(model: PreTrainedModel, config: GSMConfig, mode: str = "dense") -> GSMRuntime:
    """Attach a `gsm` adapter (gate, ASQ, bridge as configured) to every attention layer.

    Modules are created in fp32 on the model's device. The model then runs attention through the
    registered `gsm` function; with `config.gsm_enabled` false it behaves exactly like the base.
    """
    _check_family(model)
    if getattr(model, "gsm_runtime", None) is not None:
        raise GSMError("this model already has GSM modules; load a fresh base model to inject again")
    dims = model_dims(model)
    bridge = config.cross_layer_sharing
    if config.gsm_enabled and bridge.enabled and bridge.bridge_to_start >= dims["layers"]:
        raise GSMError(f"cross_layer_sharing.bridge_to_start={bridge.bridge_to_start} but the model has "
                       f"{dims['layers']} layers; use a value below {dims['layers']}")
    beyond = [layer for layer in config.kv_compression.layer_bits if layer >= dims["layers"]]
    if config.kv_compression.enabled and beyond:
        raise GSMError(f"kv_compression.layer_bits names layer {beyond[0]}, but the model has {dims['layers']} layers "
                       f"(0 to {dims['layers'] - 1}); drop it or name a layer below {dims['layers']}")
    head_dim = dims["head_dim"]
    if config.kv_compression.enabled and config.kv_compression.rotate_residuals and head_dim & (head_dim - 1):
        raise GSMError(f"kv_compression.rotate_residuals=true needs a power-of-two head_dim (a Hadamard rotation), "
                       f"but this model's is {head_dim}; set kv_compression.rotate_residuals=false")
    _register_attention()
    runtime = GSMRuntime(config=config, enabled=config.gsm_enabled, base_fingerprint=base_fingerprint(model.state_dict()))
    for layer_idx, layer in enumerate(decoder_layers(model)):
        attn = layer.self_attn
        attn.gsm = _build_adapter(layer_idx, attn, config, dims, runtime)
        if attn.gsm.gate is not None:
            runtime.layers_with_gate.append(layer_idx)
        attn.register_forward_pre_hook(_capture_inputs, with_kwargs=True)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    object.__setattr__(model, "gsm_runtime", runtime)
    set_gsm_mode(model, mode)
    return runtime


def gsm_runtime(model: nn.Module) -> GSMRuntime:
    """The runtime of an injected model (unwrapping FSDP/DDP/PEFT wrappers)."""
    for candidate in (model, getattr(model, "module", None), getattr(model, "base_model", None)):
        runtime = getattr(candidate, "gsm_runtime", None)
        if runtime is not None:
            return runtime
    raise GSMError("this model has no GSM modules; call inject_gsm(model, config) first")


def set_gsm_mode(model: nn.Module, mode: str) -> None:
    """Main attention of the sparse layers: `dense`, `sparse` (gate top-k) or `oracle` (true top-k)."""
    if mode not in MODES:
        raise GSMError(f"unknown GSM mode {mode!r}; use one of {', '.join(MODES)}")
    gsm_runtime(model).mode = mode


@contextmanager
def gsm_disabled(model: nn.Module) -> Iterator[None]:
    """Run the model exactly as the base model inside this block."""
    runtime = gsm_runtime(model)
    previous = runtime.enabled
    runtime.enabled = False
    try:
        yield
    finally:
        runtime.enabled = previous


def gsm_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The GSM tensors (parameters and buffers) by name."""
    return {name: tensor for name, tensor in model.state_dict().items() if GSM_PARAM_MARKER in f".{name}"}


def gsm_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Named GSM parameters."""
    return ((n, p) for n, p in model.named_parameters() if GSM_PARAM_MARKER in f".{n}")


def _inject_only(model: PreTrainedModel, section: str, values: dict[str, Any]) -> GSMRuntime:
    """Inject with one GSM section enabled (with `values`) and the others off."""
    blocks: dict[str, dict[str, Any]] = {"sparse_attention": {"enabled": False}}
    blocks[section] = {"enabled": True, **values}
    return inject_gsm(model, GSMConfig.model_validate(blocks))


def inject_sparse_gate(model: PreTrainedModel, top_k_schedule: str = "constant", k_max: int = 64,
                       **options: Any) -> GSMRuntime:
    """Attach only Sparse Gate Heads (seed API); `options` are `sparse_attention` fields."""
    return _inject_only(model, "sparse_attention", {"top_k_schedule": top_k_schedule, "top_k": k_max, **options})


def inject_kv_compressor(model: PreTrainedModel, cluster_num: int = 32, quant_bits: int = 8,
                         **options: Any) -> GSMRuntime:
    """Attach only ASQ compressors (seed API); `options` are `kv_compression` fields."""
    return _inject_only(model, "kv_compression", {"cluster_num": cluster_num, "quant_bits": quant_bits, **options})


def inject_cache_bridge(model: PreTrainedModel, bridge_layers: tuple[int, int] = (8, 24), alpha_init: float = 0.3,
                        **options: Any) -> GSMRuntime:
    """Attach only the cache bridge from `bridge_layers[0]` to layers `bridge_layers[1]`.. (seed API)."""
    return _inject_only(model, "cross_layer_sharing", {"bridge_from": bridge_layers[0],
                                                       "bridge_to_start": bridge_layers[1],
                                                       "alpha_init": alpha_init, **options})
