"""A transformers `Cache` that stores what GSM inference needs, and nothing more.

Per layer: K and V in a `KVStore` (ASQ-packed blocks plus the raw newest block, or raw without ASQ),
the gate keys (bf16, or int8 with an fp16 scale per key: `gate_key_bits`), and, for a `share`-mode
bridge target, only the KV heads it keeps (the shared heads are read from the source layer's store
through the bridge). Works with `generate()`:

    cache = GSMCache(model)
    model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=64)

(`cache_kwargs` names the argument as the installed transformers does: `cache`, or `past_key_values`
before it was renamed.) The prompt runs through the training-time attention (so prefill equals the
teacher-forced pass); each new token attends over the cache (`decode_attention`). GSM's attention
reaches a layer's cache through `GSMCache.gsm_layer` (the protocol in `modules.forward_state`).
"""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache, CacheLayerMixin

from gsm_train.families import attention_modules
from gsm_train.inference.decode_attention import decode_attention
from gsm_train.inference.kv_store import KVStore
from gsm_train.kernels.decode_topk import kernel_ready
from gsm_train.modules.adapter import GSMAttentionAdapter
from gsm_train.modules.errors import GSMError
from gsm_train.modules.forward_state import DecodeStep
from gsm_train.modules.settings import gsm_settings
from gsm_train.modules.sparse_gate import encode_gate_keys


class GSMLayerCache(CacheLayerMixin):
    """One layer's GSM cache."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, adapter: GSMAttentionAdapter, kv_heads: int, bridge_mode: str,
                 kernels: ModuleType | None) -> None:
        super().__init__()
        shared = adapter.bridge.out_heads if adapter.bridge is not None and bridge_mode == "share" else 0
        self.k_store = KVStore(adapter.asq_k, kv_heads - shared)
        self.v_store = KVStore(adapter.asq_v, kv_heads - shared)
        self.gate_keys: Tensor | None = None  # bf16, or int8 codes, [B, n, S, gate_head_dim]
        self.gate_key_scales: Tensor | None = None  # fp16 [B, n, S, 1] for int8 gate keys
        self.source: GSMLayerCache | None = None  # the bridge source's cache, for a bridge target
        self.kernels = kernels  # gsm_train.kernels.sparse_decode where the fused kernels run, else None
        self.cached_before_update = 0

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Store the new raw K/V [B, Hkv, n, D]; returns them unchanged (attention reads the stores)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cached_before_update = self.get_seq_length()
        self.k_store.append(key_states)
        self.v_store.append(value_states)
        return key_states, value_states

    def decoding(self) -> bool:
        return self.cached_before_update > 0

    def keep_gate_keys(self, gate_keys: Tensor, bits: int) -> None:
        """Add gate keys [B, n, t, gate_head_dim], stored as `encode_gate_keys` gives them at `bits`."""
        codes, scales = encode_gate_keys(gate_keys.detach(), bits)
        if self.gate_keys is None:
            self.gate_keys, self.gate_key_scales = codes, scales
            return
        self.gate_keys = torch.cat((self.gate_keys, codes), dim=2)
        if scales is not None:
            self.gate_key_scales = torch.cat((self.gate_key_scales, scales), dim=2)

    def decode_attention(self, step: DecodeStep) -> Tensor:
        return decode_attention(step, self)

    def get_seq_length(self) -> int:
        return self.k_store.seq_len

    def get_mask_sizes(self, query_length: int, *args: Any) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self) -> None:
        raise GSMError("a GSM cache cannot be reset; create a new GSMCache(model) for a new sequence")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise GSMError("a GSM cache does not support beam search; generate with num_beams=1")

    def nbytes(self) -> int:
        """Bytes held: K and V stores plus gate keys."""
        gate = sum(t.numel() * t.element_size() for t in (self.gate_keys, self.gate_key_scales) if t is not None)
        return self.k_store.nbytes() + self.v_store.nbytes() + gate


class GSMCache(Cache):
    """Generation cache of a GSM-injected model (one `GSMLayerCache` per decoder layer)."""

    def __init__(self, model: nn.Module, fused: bool | None = None) -> None:
        settings = gsm_settings(model)
        if not settings.enabled:
            raise GSMError("GSM is switched off on this model; generate with the default cache instead")
        config = settings.config
        kernels = fused_kernels(model, fused)
        layers = [GSMLayerCache(attn.gsm, attn.k_proj.out_features // attn.head_dim, config.cross_layer_sharing.mode,
                                kernels) for attn in attention_modules(model)]
        for layer_cache, attn in zip(layers, attention_modules(model), strict=True):
            if attn.gsm.bridge is not None:
                layer_cache.source = layers[config.cross_layer_sharing.bridge_from]
        super().__init__(layers=layers)

    def gsm_layer(self, layer_idx: int) -> GSMLayerCache:
        return self.layers[layer_idx]

    def nbytes(self) -> int:
        """Bytes held by all layers."""
        return sum(layer.nbytes() for layer in self.layers)


def fused_kernels(model: nn.Module, fused: bool | None) -> ModuleType | None:
    """The fused Triton decode kernels when asked for (or, with `fused=None`, when on CUDA with Triton and
    not in fp64: the kernels compute in fp32, an fp64 model decodes on the PyTorch path)."""
    parameter = next(model.parameters())
    if parameter.dtype == torch.float64:
        if fused:
            raise GSMError("the fused decode kernels compute in fp32, not fp64; pass fused=False (or None) for "
                           "an fp64 model")
        return None
    if fused is False or (fused is None and parameter.device.type != "cuda"):
        return None
    from gsm_train.kernels import sparse_decode

    if not sparse_decode.triton_available():
        if fused:
            raise GSMError("fused=True needs Triton and a CUDA device; install triton or pass fused=False")
        return None
    if parameter.device.type == "cuda":  # the top-k kernel built now, before any CUDA graph captures a step
        kernel_ready(parameter.device)
    return sparse_decode


def cache_kwargs(model: nn.Module, cache: Cache | None) -> dict[str, Cache | None]:
    """`cache` as the keyword argument this model's `forward` and `generate` take: `cache` where the
    installed transformers names it so (5.24 does, deprecating `past_key_values`), else `past_key_values`."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}
