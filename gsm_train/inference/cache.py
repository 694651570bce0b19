"""A transformers `Cache` that stores what GSM inference needs, and nothing more, in buffers allocated
once for a capacity set at creation.

Per layer: K and V in a `KVStore` (compressed blocks plus the raw newest block, or raw without a
compressor), the gate keys (bf16, or int8 with an fp16 scale per key: `gate_key_bits`), and, for a
`share`-mode bridge target, only the KV heads it keeps (the shared heads are read from the source
layer's store through the bridge). Every layer shares one `CacheLengths` and the keys each row may
see (`key_valid`, from the attention mask: left padding).

    cache = GSMCache(model, capacity=4096)
    model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=64)

(`gsm_train.inference.engine` does this: after `enable_gsm_generation`, a plain `model.generate` uses a GSM
cache.) How a call's tokens are attended depends on what the cache holds when it starts
(`GSMCache.begin_forward`, called by GSM's per-forward hook): a prompt into an empty cache runs through
the training-time attention (so prefill equals the teacher-forced pass); one new token after earlier
ones runs `decode_attention`; a further prompt chunk runs `prefill.chunk_attention`. That is the
`sparse` prefill; in `dense` prefill (`GSMCache(prefill=...)`; default DEFAULT_PREFILL) a prompt attends as the base
model does (causal SDPA over raw K/V: `prefill.dense_chunk_attention`), and the cache is filled the
same way: the stores, the gate keys and the lengths hold what a sparse prefill of the same K/V holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import weakref
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache, CacheLayerMixin

from gsm_train.attention.adapter import GSMAttentionAdapter
from gsm_train.attention.cache_protocol import CachedStep, EarlySelection
from gsm_train.attention.kv_store import CacheLengths, DeferredEncodings, KVStore, append_pair, pack_tails
from gsm_train.attention.settings import GSMSettings, gsm_settings
from gsm_train.functional.gate_keys import GATE_KEY_DTYPE, encode_gate_keys
from gsm_train.functional.gate_rope import GateKeyRotation
from gsm_train.functional.top_k import scheduled_k
from gsm_train.inference.decode_attention import decode_attention, device_selection, selects_on_device
from gsm_train.inference.prefill import chunk_attention, dense_chunk_attention
from gsm_train.kernels import gate_token
from gsm_train.kernels.decode_topk import kernel_ready
from gsm_train.models.families import attention_modules, model_dims
from gsm_train.modules.errors import GSMError
from gsm_train.quant import zeroed_fields

PREFILL_MODES = ("dense", "sparse")
DEFAULT_PREFILL = "dense"  # chosen by benchmarks/prefill_quality.py (docs/design-decisions.md)


def check_prefill(prefill: str) -> str:
    """`prefill` if it names a prefill mode, else a GSMError naming the modes."""
    if prefill not in PREFILL_MODES:
        raise GSMError(
            f"prefill {prefill!r} is not a prefill mode; use 'dense' (the prompt attends as the base model, "
            "the cache is filled from its K/V) or 'sparse' (the prompt attends as the teacher-forced GSM pass)"
        )
    return prefill


class GSMCacheLayer(CacheLayerMixin):
    """One layer's GSM cache, the `attention.cache_protocol.LayerCache` (its members documented there): what
    the attention function calls, and what decode and prefill attention read (the K/V stores, the gate keys
    in buffers of the cache's capacity, the cache's lengths, ...). Its buffers are allocated at the first
    tokens (batch and dtype known)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, cache: GSMCache, adapter: GSMAttentionAdapter, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        # weakly: the cache owns its layers, and a layer holding it would make a cycle that only Python's
        # collector frees, keeping a finished generation's device buffers allocated until it runs
        self.cache, self.adapter, self.head_dim = weakref.proxy(cache), adapter, head_dim
        shared = adapter.bridge.out_heads if adapter.bridge is not None and cache.bridge_mode == "share" else 0
        self.store_heads = kv_heads - shared
        self.k_store: KVStore | None = None
        self.v_store: KVStore | None = None
        self.gate_keys: Tensor | None = None  # bf16, or int8 codes, [B, n, capacity, gate_head_dim]
        self.gate_key_scales: Tensor | None = None  # fp16 [B, n, capacity, 1] for int8 gate keys
        self.source: GSMCacheLayer | None = None  # the bridge source's cache, for a bridge target
        self.recent_raw: tuple[Tensor, Tensor] | None = None  # a prompt chunk's raw K/V since the last packed block
        self.early_selection: EarlySelection | None = None  # this token step's, started by `select_ahead`
        self.buffers: list[Tensor] = []  # every buffer of the layer (stores and gate keys), once allocated

    @property
    def lengths(self) -> CacheLengths:
        return self.cache.lengths

    @property
    def key_valid(self) -> Tensor | None:
        return self.cache.key_valid

    @property
    def kernels(self) -> ModuleType | None:
        return self.cache.kernels

    @property
    def dense_block_kernel(self) -> bool:
        return self.cache.dense_block_kernel

    @property
    def k_by_position(self) -> Tensor | None:
        return self.cache.k_by_position

    @property
    def positions(self) -> Tensor:
        return self.cache.positions

    def buffer_specs(self, batch: int, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The shapes and dtypes of the layer's buffers for `batch` rows of K/V in `dtype`: both stores' fields
        (`KVStore.buffer_specs`, named `k.*` and `v.*`) and the gate keys' (`gate.*`)."""
        capacity = self.cache.capacity
        compressors = {"k": self.adapter.asq_k, "v": self.adapter.asq_v}
        specs = {
            f"{side}.{name}": spec
            for side, compressor in compressors.items()
            for name, spec in KVStore.buffer_specs(
                compressor, batch, self.store_heads, self.head_dim, capacity, dtype
            ).items()
        }
        gate = self.adapter.gate
        if gate is not None:
            shape = (batch, gate.num_selectors, capacity, gate.gate_head_dim)
            int8 = gate.key_bits == 8
            specs |= {"gate.keys": (shape, torch.int8 if int8 else GATE_KEY_DTYPE)}
            specs |= {"gate.scales": ((*shape[:3], 1), torch.float16)} if int8 else {}
        return specs

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """The layer's buffers, made at its first call from the K/V's batch, dtype and device: its share of the
        cache's one zeroed buffer (`GSMCache.layer_buffers`: every layer's, one allocation and one fill)."""
        batch, device, dtype = key_states.shape[0], key_states.device, key_states.dtype
        buffers = self.cache.layer_buffers(self, batch, dtype, device)
        stores = {}
        for side, compressor in {"k": self.adapter.asq_k, "v": self.adapter.asq_v}.items():
            own = {name.removeprefix(f"{side}."): t for name, t in buffers.items() if name.startswith(f"{side}.")}
            stores[side] = KVStore(
                compressor, batch, self.store_heads, self.head_dim, self.cache.capacity, dtype, device,
                self.cache.lengths, own,
            )  # fmt: skip
        self.k_store, self.v_store = stores["k"], stores["v"]
        self.gate_keys, self.gate_key_scales = buffers.get("gate.keys"), buffers.get("gate.scales")
        self.buffers = list(buffers.values())
        self.device, self.dtype, self.is_initialized = device, dtype, True

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Store the new raw K/V [B, Hkv, n, D]; returns them unchanged (attention reads the stores)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.cache.token_step:
            self.k_store.write_newest(key_states)
            self.v_store.write_newest(value_states)
            return key_states, value_states
        deferred = self.cache.deferred_encodings
        store_pair = deferred.append_pair if deferred is not None else append_pair
        raw = store_pair(self.k_store, self.v_store, key_states, value_states)
        if self.cache.lengths.before > 0 and raw[0] is not None:  # a further prompt chunk: its own blocks raw
            self.recent_raw = raw  # the rows since the last block packed before the chunk, as the stores took them
        return key_states, value_states

    def keep_gate_keys(self, gate_keys: Tensor, bits: int, rotation: GateKeyRotation | None = None) -> None:
        """Store gate keys [B, n, t, gate_head_dim] of the call's new tokens as `encode_gate_keys` gives them at
        `bits`: one token at the slot the device lengths name (capture-safe), a chunk at host positions. With
        `rotation` the keys are the gate's projections, rotated here first (a dense prefill chunk's with every
        layer's after the forward). Called by the attention function's `run_gate` alone, before the call attends."""
        start, end = self.lengths.before, self.lengths.seq_len
        deferred = self.cache.deferred_encodings
        if deferred is not None:  # a dense prefill chunk: rotated and encoded with every layer's after the forward
            scales_at = self.gate_key_scales[:, :, start:end] if self.gate_key_scales is not None else None
            deferred.add_gate_keys(self.gate_keys[:, :, start:end], scales_at, gate_keys.detach(), bits, rotation)
            return
        if rotation is not None:
            gate_keys = rotation.apply(gate_keys)
        codes, scales = encode_gate_keys(gate_keys.detach(), bits)
        if self.cache.token_step:
            slot = self.lengths.slots[0:1]
            self.gate_keys.index_copy_(2, slot, codes)
            if scales is not None:
                self.gate_key_scales.index_copy_(2, slot, scales)
            return
        self.gate_keys[:, :, start:end] = codes
        if scales is not None:
            self.gate_key_scales[:, :, start:end] = scales

    def token_gate(self, gate: nn.Module, hidden: Tensor, cos: Tensor, sin: Tensor) -> Tensor | None:
        """A token step on the device path: the gate's query [B, n, 1, dg] (fp32) of the new token, its key
        written at the slot the device lengths name, by `kernels.gate_token` (projections split over d, then
        RoPE, encoding, write), or the query `select_ahead` computed so already (its stream joined to the current
        one). None elsewhere (the PyTorch path, a prompt chunk, a bridge target, a gate the kernel does not
        serve): then `run_gate` runs the gate module and `keep_gate_keys`."""
        runs = self._gate_kernel_runs(gate, hidden)
        early = self.early_selection
        if early is not None:
            early.joined()  # the query is read from here on, on the current stream: nothing is left to wait for
            # dropped where the attention runs under another context than its pre-hook (autocast)
            self.early_selection = dataclasses.replace(early, stream=None) if runs else None
            if runs:
                return early.gate_query
        return self._gate_kernel(gate, hidden, cos, sin) if runs else None

    def _gate_kernel_runs(self, gate: nn.Module, hidden: Tensor) -> bool:
        """Whether `kernels.gate_token` serves this call (a token step on the device path, no bridge target)."""
        return (
            self.cache.token_step
            and self.kernels is not None
            and self.source is None
            and gate_token.kernel_runs(hidden, gate.q_proj.weight, gate.k_proj.weight, gate.gate_head_dim)
        )

    def _gate_kernel(self, gate: nn.Module, hidden: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return gate_token.gate_token(
            hidden, gate.q_proj.weight, gate.k_proj.weight, cos, sin, gate.rope_freq_index,
            self.gate_keys, self.gate_key_scales, self.lengths.device,
        )  # fmt: skip

    def select_ahead(self, settings: GSMSettings, hidden: Tensor, cos: Tensor, sin: Tensor) -> None:
        """Start a token step's gate (`kernels.gate_token`) and key selection (`decode_attention.device_selection`)
        from the layer's input, before its q/k/v projections, where both run on the device path and the cache
        overlaps them (`GSMCache(overlap_selection=...)`): on CUDA on the cache's side stream, forked from the
        current one, so the selection's few latency-bound kernels run beside the projections' GEMMs; under
        Triton's interpreter in order. The decode attention takes it (`take_early_selection`); the gate and
        the selection compute what they compute in the layer's attention otherwise."""
        self.early_selection = None
        gate = self.adapter.gate
        if not (
            gate is not None
            and self.cache.overlap_selection
            and self._gate_kernel_runs(gate, hidden)
            and selects_on_device(self.adapter, settings, self)
        ):
            return
        side = self.cache.side_stream
        with _forked(side):
            gate_query = self._gate_kernel(gate, hidden, cos, sin)
            index, valid = device_selection(settings, gate_query, self)
        self.early_selection = EarlySelection(gate_query, index, valid, side)

    def take_early_selection(self) -> EarlySelection | None:
        """The selection `select_ahead` started for this step, once (None: none); `EarlySelection.joined` joins
        its stream."""
        early, self.early_selection = self.early_selection, None
        return early

    def attends_itself(self) -> bool:
        """Whether this call's attention runs over the cache (a token or a prompt chunk after earlier
        tokens); else the training-time attention runs over the call's own tokens."""
        return self.lengths.before > 0

    def prompt_attends_densely(self) -> bool:
        """Whether a prompt (a call that is not a token step) attends as the base model: dense prefill."""
        return self.cache.prefill == "dense" and not self.cache.token_step

    def cached_attention(self, step: CachedStep) -> Tensor:
        """Attention [B, T, Hq, D] of the call's new tokens over what the cache holds."""
        if self.cache.token_step:
            return decode_attention(step, self)
        if self.prompt_attends_densely():
            return dense_chunk_attention(step, self)
        return chunk_attention(step, self)

    def get_seq_length(self) -> int:
        """Tokens held before the forward in progress (transformers reads it to place the new ones)."""
        return self.lengths.seq_len - self.cache.pending

    def get_mask_sizes(self, query_length: int, *args: Any) -> tuple[int, int]:
        return self.lengths.before + query_length, 0

    def get_max_length(self) -> int:
        return self.cache.capacity

    def get_max_cache_shape(self) -> int:
        return self.cache.capacity

    def reset(self) -> None:
        """The layer's part of `GSMCache.reset`: no prompt rows kept (its buffers are zeroed there, every
        layer's in one op)."""
        self.recent_raw = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise GSMError("a GSM cache does not support beam search; generate with num_beams=1")

    def nbytes(self) -> int:
        """Bytes the tokens held occupy: K and V stores plus gate keys."""
        if not self.is_initialized:
            return 0
        held = self.lengths.seq_len
        gate = sum(
            t[:, :, :held].numel() * t.element_size() for t in (self.gate_keys, self.gate_key_scales) if t is not None
        )
        return self.k_store.nbytes() + self.v_store.nbytes() + gate


class GSMCache(Cache):
    """Generation cache of a GSM-injected model (one `GSMCacheLayer` per decoder layer) holding at most
    `capacity` tokens per row (default: the model's context length); more is a GSMError. `prefill`: how
    prompts attend, `dense` or `sparse` (module docstring; default: what `enable_gsm_generation` set on the
    model, else DEFAULT_PREFILL). `pack_after_forward`: a dense prefill chunk's blocks packed after its
    forward, every layer's in one encoding, bit for bit what packing each layer as it runs stores on the CPU
    (default: on a GPU, where it saves ~80 kernel launches a layer; on the CPU packing each layer while its
    rows are in cache is faster). `dense_block_kernel`: a layer that reads every key decodes over its packed
    store a block a tile (`kernels.dense_decode`; default: what `enable_gsm_generation` set, else on).
    `overlap_selection`: on the fused path a token step's gate and key selection of each layer start before
    the layer's projections, on a side stream on CUDA (`GSMCacheLayer.select_ahead`; default: what
    `enable_gsm_generation` set, else on)."""

    def __init__(
        self,
        model: nn.Module,
        capacity: int | None = None,
        fused: bool | None = None,
        prefill: str | None = None,
        pack_after_forward: bool | None = None,
        dense_block_kernel: bool | None = None,
        overlap_selection: bool | None = None,
    ) -> None:
        settings = gsm_settings(model)
        if not settings.enabled:
            raise GSMError("GSM is switched off on this model; generate with the default cache instead")
        generation = getattr(model, "gsm_generation", None) or {}
        self.prefill = check_prefill(prefill or generation.get("prefill", DEFAULT_PREFILL))
        config = settings.config
        self.capacity = _round_capacity(capacity or model_dims(model)["context"] or 4096, config)
        self.bridge_mode = config.cross_layer_sharing.mode
        self.kernels = fused_kernels(model, fused)
        self.built_with = settings  # the model's GSM settings it was made (and its steps captured) under
        # a layer reading every key decodes a compressor block a tile (`kernels.dense_decode`) where the kernels run
        block_kernel = generation.get("dense_block_kernel", True) if dense_block_kernel is None else dense_block_kernel
        self.dense_block_kernel = bool(block_kernel) and self.kernels is not None
        device = next(model.parameters()).device
        overlap = generation.get("overlap_selection", True) if overlap_selection is None else overlap_selection
        self.overlap_selection = bool(overlap) and self.kernels is not None
        # the stream a token step's selections run on beside the layers' projections (`select_ahead`)
        self.side_stream = torch.cuda.Stream(device) if self.overlap_selection and device.type == "cuda" else None
        self.lengths = CacheLengths(device)
        self.positions = torch.arange(self.capacity, device=device)  # every slot's position, made once
        sparse = config.sparse_attention
        # a schedule whose k varies: every position's k, once, for the fused steps to read on the device
        self.k_by_position = (
            scheduled_k(torch.arange(self.capacity), sparse).to(device)
            if self.kernels is not None and sparse.top_k_schedule != "constant"
            else None
        )
        self.key_valid: Tensor | None = None  # [B, capacity] bool, once a padded batch is seen
        self.step_graphs: Any = None  # its token steps captured (`inference.engine` makes them at the first step)
        self.buffers: list[dict[str, Tensor]] | None = None  # each layer's buffers by name (`layer_buffers`)
        self.token_step = False  # the call in progress adds one token after earlier ones
        self.pending = 0  # tokens of the forward in progress (held already, not yet for transformers)
        self.deferred_encodings: DeferredEncodings | None = None  # a dense prefill chunk's, made after its forward
        dims = model_dims(model)
        layers = [
            GSMCacheLayer(self, attn.gsm, attn.k_proj.out_features // dims["head_dim"], dims["head_dim"])
            for attn in attention_modules(model)
        ]
        for layer_cache, attn in zip(layers, attention_modules(model), strict=True):
            if attn.gsm.bridge is not None:
                layer_cache.source = layers[config.cross_layer_sharing.bridge_from]
        # a dense prefill chunk attends over its raw K/V and the prefix packed before it, so its blocks may be
        # packed after its forward, every layer's together (`DeferredEncodings`): on a GPU, where each of a layer's
        # ~80 packing ops is a kernel launch; not where a bridge target reads another layer's store
        together = device.type == "cuda" if pack_after_forward is None else pack_after_forward
        self.packs_after_forward = (
            together and self.prefill == "dense" and all(layer.source is None for layer in layers)
        )
        super().__init__(layers=layers)

    def layer_buffers(
        self, layer: GSMCacheLayer, batch: int, dtype: torch.dtype, device: torch.device
    ) -> dict[str, Tensor]:
        """`layer`'s zeroed buffers (`GSMCacheLayer.buffer_specs`), cut from one buffer made for every layer at
        the first layer's first call (`quant.zeroed_fields`: one allocation and one fill for the whole cache,
        where one a layer took 30 of each for SmolLM2)."""
        if self.buffers is None:
            specs = [each.buffer_specs(batch, dtype) for each in self.layers]
            named = {
                f"{index}/{name}": spec for index, layer_specs in enumerate(specs) for name, spec in layer_specs.items()
            }
            every = zeroed_fields(named, device)
            self.buffers = [
                {name: every[f"{index}/{name}"] for name in layer_specs} for index, layer_specs in enumerate(specs)
            ]
        return self.buffers[layer.adapter.layer_idx]  # `gsm_layer`: the cache's layers are in layer order

    def reset(self) -> None:
        """Empty again for a new sequence of the same batch, in place: lengths 0, every layer's buffers zeroed,
        the padding mask (if one was made) all valid. Its buffers and captured token steps stay, so a generation
        that reuses the cache replays those steps instead of capturing new ones; what it holds after a prompt
        is what a new cache would hold, bit for bit (tests/test_cache_reuse.py)."""
        self.join_early_selections()
        self.lengths.clear()
        self.token_step, self.pending, self.deferred_encodings = False, 0, None
        if self.key_valid is not None:  # kept, not dropped: the captured steps read it
            self.key_valid.fill_(True)
        if self.buffers is not None:
            torch._foreach_zero_([t for layer_buffers in self.buffers for t in layer_buffers.values()])  # one op
        for layer in self.layers:
            layer.reset()

    def serves(self, model: nn.Module, batch: int) -> bool:
        """Whether a reset of it serves `model`'s next sequence of `batch` rows as a new cache would (False
        before its first tokens): buffers made for as many rows on the model's device and in its dtype, the
        model's GSM settings and modules those it was made with (its captured steps baked them in). A model
        moved, cast, switched to another mode or given other GSM modules since gets a new cache."""
        like = next(model.parameters())
        layer = next((layer for layer in self.layers if layer.is_initialized), None)
        return (
            layer is not None
            and layer.k_store.tail.shape[0] == batch
            and layer.device == like.device
            and layer.dtype == like.dtype
            and gsm_settings(model) == self.built_with
            and all(
                layer.adapter is attn.gsm for layer, attn in zip(self.layers, attention_modules(model), strict=True)
            )
        )

    def gsm_layer(self, layer_idx: int) -> GSMCacheLayer:
        return self.layers[layer_idx]

    def begin_forward(self, new_tokens: int, attention_mask: Tensor | None) -> None:
        """A forward of `new_tokens` per row starts (GSM's per-forward hook calls this before any layer):
        advance the lengths, pack a full newest block before a token step, take padding from a 2-D
        `attention_mask` [B, tokens so far]. A token step changes the device lengths by device ops only,
        so it can be captured in a CUDA graph (`decode_graph`)."""
        self.join_early_selections()
        lengths = self.lengths
        end = lengths.seq_len + new_tokens
        if end > self.capacity:
            raise GSMError(
                f"the GSM cache holds {self.capacity} tokens per row and this call would make it "
                f"{end}; create it with a larger capacity (GSMCache(model, capacity=...)), or "
                "generate fewer tokens"
            )
        self.token_step = new_tokens == 1 and lengths.seq_len > 0
        self.pending = new_tokens
        self.deferred_encodings = None  # (what a forward that raised left is dropped)
        if self.token_step:  # the new token is always visible: padding was taken from the prompt
            self.pack_full_tail()
            lengths.add_token()
            return
        lengths.add_chunk(new_tokens, self.block_size())
        self.deferred_encodings = DeferredEncodings() if self.packs_after_forward else None
        if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
            self._mark_padding(attention_mask)

    def end_forward(self) -> None:
        """The forward in progress has run: a dense prefill chunk's deferred encodings are made (its blocks
        packed, its gate keys encoded), and its tokens count as held for transformers too."""
        if self.deferred_encodings is not None:
            self.deferred_encodings.flush()
            self.deferred_encodings = None
        self.pending = 0

    def join_early_selections(self) -> None:
        """Every layer's selection no attention took (a forward that raised between a layer's pre-hook and its
        attention, which skips `end_forward`), dropped, its stream joined first: the next forward, a reset
        and a capture find none."""
        for layer in self.layers:
            early = layer.take_early_selection()
            if early is not None:
                early.joined()

    def tail_full(self) -> bool:
        """Whether the newest block is full (a next token must start a new one; host lengths)."""
        block = self.block_size()
        return bool(block) and self.lengths.seq_len - self.lengths.packed_len >= block

    def pack_full_tail(self, pack: Callable[[], object] | None = None) -> bool:
        """Pack every layer's newest block if it is full, so a next token starts a new one (`pack`, default
        eagerly `pack_newest_block`; a captured token step's driver passes the replay of its own graph,
        `decode_graph.CapturedPack`), the host lengths following. Returns whether it did."""
        if not self.tail_full():
            return False
        (pack or self.pack_newest_block)()
        self.lengths.follow_packed(self.block_size())
        return True

    @torch.no_grad()
    def pack_newest_block(self) -> None:
        """Every layer's full newest block packed (`kv_store.pack_tails`) at the block the device lengths
        name, and their packed count advanced: device ops of fixed shapes only, whatever block it is, so one
        CUDA graph captures it for every block. The host lengths are left behind (`follow_packed`)."""
        block = self.block_size()
        tokens = self.lengths.device[1:2] + self.positions[:block]  # the block's positions, int64
        index = tokens[:1] // block
        for layer in self.layers:
            if layer.is_initialized:
                pack_tails(layer.k_store, layer.v_store, tokens, index)
        self.lengths.advance_packed(block)

    def block_size(self) -> int:
        """The compressors' block size (0: nothing is compressed)."""
        store = next((layer.k_store for layer in self.layers if layer.k_store is not None), None)
        if store is None:
            first = self.layers[0].adapter.asq_k
            return first.block_size if first is not None else 0
        return store.compressor.block_size if store.compressor is not None else 0

    def _mark_padding(self, attention_mask: Tensor) -> None:
        """key_valid from a 2-D attention mask covering the tokens so far (eager)."""
        if self.key_valid is None:
            self.key_valid = torch.ones(
                attention_mask.shape[0], self.capacity, dtype=torch.bool, device=attention_mask.device
            )
            self.step_graphs = None  # steps captured without a mask would not read it: capture again
        seen = attention_mask.shape[1]
        self.key_valid[:, :seen] = attention_mask.bool()

    def nbytes(self) -> int:
        """Bytes the tokens held occupy, all layers."""
        return sum(layer.nbytes() for layer in self.layers)

    def allocated_bytes(self) -> int:
        """Bytes the cache's buffers take on the device."""
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                total += layer.k_store.allocated_bytes() + layer.v_store.allocated_bytes()
                total += sum(
                    t.numel() * t.element_size() for t in (layer.gate_keys, layer.gate_key_scales) if t is not None
                )
        return total


@contextlib.contextmanager
def _forked(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Inside: work is issued on `stream`, which first waits for the current stream's work so far (None: on the
    current stream). Whoever reads what it computes joins it first (`EarlySelection.joined`); an error inside
    joins it before it propagates, so nothing issued there runs unseen."""
    if stream is None:
        yield
        return
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    try:
        with torch.cuda.stream(stream):
            yield
    except BaseException:
        current.wait_stream(stream)
        raise


def _round_capacity(capacity: int, config: Any) -> int:
    """`capacity` rounded up to whole compressor blocks (a store holds whole blocks)."""
    kv = config.kv_compression
    block = kv.block_size if kv.enabled else 1
    return -(-capacity // block) * block


def fused_kernels(model: nn.Module, fused: bool | None) -> ModuleType | None:
    """The fused Triton decode kernels when asked for (or, with `fused=None`, when on CUDA with Triton and
    not in fp64: the kernels compute in fp32, an fp64 model decodes on the PyTorch path)."""
    parameter = next(model.parameters())
    if parameter.dtype == torch.float64:
        if fused:
            raise GSMError(
                "the fused decode kernels compute in fp32, not fp64; pass fused=False (or None) for an fp64 model"
            )
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
    forward = getattr(model, "gsm_base_forward", model.forward)
    name = "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
    return {name: cache}
