"""The generation cache as GSM's attention sees it: the protocols `inference.cache` implements, declared
here so that `attention/` never imports `inference/`.

Two objects, one protocol each (as transformers has a `Cache` and its layers):
- `GenerationCache`, the whole cache: the per-forward hooks (`forward_state`) tell it a forward starts
  and ends, and hand each layer its `LayerCache`;
- `LayerCache`, one layer's cache, its data and its methods: the attention function (`dispatch`) asks it
  which path the call takes, gives it the call's gate keys (the one place they are written:
  `dispatch.run_gate`), and lets it attend over what it holds (`cached_attention`, with what the layer
  hands it in a `CachedStep`); decode and prefill attention (`inference.decode_attention`,
  `inference.prefill`), which it runs, read its buffers (the K/V stores of `attention.kv_store`, the gate
  keys, the lengths).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from gsm_train.attention.kv_store import CacheLengths, KVStore
from gsm_train.attention.settings import GSMSettings
from gsm_train.functional.gate_rope import GateKeyRotation


@runtime_checkable
class GenerationCache(Protocol):
    """What a generation cache gives GSM's attention (implemented by `gsm_train.inference.GSMCache`)."""

    def gsm_layer(self, layer_idx: int) -> LayerCache:
        """The cache of one decoder layer."""

    def begin_forward(self, new_tokens: int, attention_mask: Tensor | None) -> None:
        """A forward adding `new_tokens` per row starts (before any layer runs)."""

    def end_forward(self) -> None:
        """The forward has run through every layer."""


class LayerCache(Protocol):
    """One layer's generation cache (implemented by `gsm_train.inference.GSMCacheLayer`).

    What it holds, as decode and prefill attention read it: the K and V stores, the gate keys in buffers of the
    cache's capacity C (codes [B, n, C, dg] and, for int8, fp16 scales [B, n, C, 1]), the keys each row may see
    (`key_valid` [B, C], None: all), the cache's lengths, every slot's position (`positions`, int64 [C]: 0 to C -
    1), the fused kernels' module (None: the PyTorch path) and whether a layer reading every key takes the block
    kernel there (`dense_block_kernel`, `kernels.dense_decode`), on that path the k of every position [C] (int64) of a
    schedule whose k varies (None: constant), for a bridge target the source layer's cache, and during a further
    prompt chunk the raw K/V [B, Hkv, n, D] from the last block packed before it to its end (None without a
    compressor; the chunk's attention takes it). The methods are what the attention function calls."""

    k_store: KVStore
    v_store: KVStore
    gate_keys: Tensor | None
    gate_key_scales: Tensor | None
    key_valid: Tensor | None
    lengths: CacheLengths
    kernels: ModuleType | None
    dense_block_kernel: bool
    k_by_position: Tensor | None
    positions: Tensor
    source: LayerCache | None
    recent_raw: tuple[Tensor, Tensor] | None

    def attends_itself(self) -> bool:
        """Whether this call's attention runs over the cache (new tokens after earlier ones); else the
        training-time attention runs over the call's own tokens (a prompt into an empty cache)."""

    def prompt_attends_densely(self) -> bool:
        """Whether this call is a prompt (not a token step) that attends as the base model (dense prefill:
        the base's SDPA over its raw K/V), the cache being filled as in any mode."""

    def keep_gate_keys(self, gate_keys: Tensor, bits: int, rotation: GateKeyRotation | None = None) -> None:
        """Store the call's gate keys [B, n, T, dg] at `bits`; with `rotation` they are the gate's projections,
        which the cache rotates before it stores them."""

    def token_gate(self, gate: nn.Module, hidden: Tensor, cos: Tensor, sin: Tensor) -> Tensor | None:
        """A token step where the cache runs the gate itself: the new token's gate query [B, n, 1, dg], its
        key kept; None where the gate module and `keep_gate_keys` run instead."""

    def select_ahead(self, settings: GSMSettings, hidden: Tensor, cos: Tensor, sin: Tensor) -> None:
        """Called with the attention module's input (hidden [B, 1, d], cos, sin) before its projections run:
        on a token step whose selection runs on the device, start the gate and the key selection now (on a
        side stream on CUDA), for `token_gate` and the decode attention to take (`take_early_selection`)."""

    def take_early_selection(self) -> EarlySelection | None:
        """The selection `select_ahead` started for this step (None: none), the stream that computes it joined
        to the current one; it is handed out once."""

    def cached_attention(self, step: CachedStep) -> Tensor:
        """The new tokens' attention output [B, T, Hq, D] over this layer's cache."""


@dataclass(frozen=True)
class CachedStep:
    """What one layer hands its cache when the cache attends (`LayerCache.cached_attention`): the attention
    module and its GSM adapter, the new tokens' queries [B, Hq, T, D] (post-RoPE) and their layer input
    (hidden [B, T, d], cos, sin), the model's attention mask as transformers built it, the softmax scale,
    the settings, and the gate's queries [B, n, T, dg] of the new tokens (None: the layer has no gate, or
    a dense prefill, which selects nothing; their keys are in the cache already)."""

    module: nn.Module
    adapter: nn.Module
    query: Tensor
    hidden: Tensor
    cos: Tensor
    sin: Tensor
    attention_mask: Tensor | None
    scaling: float
    settings: GSMSettings
    gate_query: Tensor | None = None


@dataclass(frozen=True)
class EarlySelection:
    """A token step's gate query [B, n, 1, dg] (fp32; its key is in the cache) and the cached positions the
    token attends to [B, n, k] with which are valid ([B, n, k] or None), computed ahead of the layer's
    projections (`LayerCache.select_ahead`) on `stream` (a CUDA side stream; None: on the current stream).
    Until `joined`, the current stream must not read them."""

    gate_query: Tensor
    index: Tensor
    valid: Tensor | None
    stream: torch.cuda.Stream | None

    def joined(self) -> tuple[Tensor, Tensor | None]:
        """(index, valid), the current stream made to wait for the side stream's work so far."""
        if self.stream is not None:
            torch.cuda.current_stream(self.index.device).wait_stream(self.stream)
        return self.index, self.valid
