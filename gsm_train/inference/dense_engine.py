"""The dense model through an engine of our own: what a serving engine gives a dense model, as the
baseline GSM's generation is measured against.

`DenseEngine(model).generate(ids, new_tokens)` runs greedy decoding of a plain (GSM-free) causal LM over
a `DenseCache`: K and V of every layer in buffers allocated once for the prompt plus the new tokens, in
the model's dtype, laid out [B, capacity, Hkv, D] (the layout flash attention streams). The prompt is fed
in chunks of `prefill_chunk` tokens with a causal SDPA (flash on CUDA); each token step runs the whole
model's forward, on CUDA captured once in a CUDA graph and replayed (as GSM's token steps are), and
attends over the valid prefix only: the query heads of one KV head go in as that head's queries, so no
K/V is repeated. Inside a captured step the prefix length is read on the device: flash attention's
`seqused_k` where this torch's flash kernel takes it (checked once per shape against SDPA), else SDPA
over the capacity with a mask of the valid prefix (the capacity exceeds the prefix by the new tokens
only). On the CPU every step runs eagerly over the host's prefix length.

Attention is routed here through transformers' attention interface (`ATTN_IMPLEMENTATION`, set for the
call and restored after), so every family whose attention goes through that interface runs unchanged.
Contract: full causal attention (no sliding window), no padding (every prompt position is a token), one
prompt length per batch, greedy decoding.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from gsm_train.attention import gsm_adapters
from gsm_train.compiled import captured
from gsm_train.inference.cache import cache_kwargs
from gsm_train.inference.decode_fusion import fused_decode
from gsm_train.inference.prefill import causal_chunk_sdpa
from gsm_train.models.families import attention_modules, model_dims
from gsm_train.modules.errors import GSMError

ATTN_IMPLEMENTATION = "gsm_dense_engine"
PREFILL_CHUNK = 8192  # prompt tokens per row and forward
_ACTIVE: contextvars.ContextVar[DenseCache | None] = contextvars.ContextVar("gsm_dense_cache", default=None)


class DenseLayer(CacheLayerMixin):
    """One layer's K and V [B, capacity, Hkv, D] of a `DenseCache`."""

    is_sliding = False

    def __init__(self, cache: DenseCache, batch: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        shape = (batch, cache.capacity, kv_heads, head_dim)
        self.cache = weakref.proxy(cache)  # weakly, as GSMCacheLayer holds its cache: no cycle to wait for
        self.keys = torch.empty(shape, dtype=cache.dtype, device=cache.device)
        self.values = torch.empty(shape, dtype=cache.dtype, device=cache.device)
        self.device, self.dtype, self.is_initialized = cache.device, cache.dtype, True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Nothing to do: the buffers are allocated at creation."""

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Store the call's K/V [B, Hkv, T, D]: a token step at the slot the device length names (capture-
        safe), a prompt chunk at the host's positions. Returns them unchanged (attention reads the buffers)."""
        cache = self.cache
        for buffer, states in ((self.keys, key_states), (self.values, value_states)):
            rows = states.transpose(1, 2).to(buffer.dtype)
            if cache.token_step:
                buffer.index_copy_(1, (cache.device_length[:1] - 1).long(), rows)
            else:
                buffer[:, cache.before : cache.length] = rows
        return key_states, value_states

    def attend(self, query: Tensor, scaling: float) -> Tensor:
        """Attention [B, T, Hq, D] of the call's queries [B, Hq, T, D] over the keys held (its own included)."""
        cache = self.cache
        if not cache.token_step:
            return _prefill_attention(query, self.keys, self.values, cache.length, scaling)
        if cache.decode_path == "flash":
            return _flash_decode(query, self.keys, self.values, cache.device_length, scaling)
        if cache.decode_path == "masked":
            valid = torch.arange(cache.capacity, device=query.device) < cache.device_length[:1]
            return _grouped_decode(query, self.keys, self.values, scaling, valid)
        end = cache.length
        return _grouped_decode(query, self.keys[:, :end], self.values[:, :end], scaling, None)

    def get_mask_sizes(self, query_length: int, *args: Any) -> tuple[int, int]:
        return self.cache.before + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.before

    def get_max_length(self) -> int:
        return self.cache.capacity


class DenseCache(Cache):
    """Preallocated K/V of `batch` rows and `capacity` tokens for a dense `model` (see the module
    docstring). `length` / `before` on the host (tokens held after / before the call in progress),
    `device_length` int32 [B] on the device (what a captured step reads and advances). `decode_path`:
    how a token step finds the prefix: "host" (eager, host length), "masked" or "flash" (device length)."""

    def __init__(self, model: nn.Module, batch: int, capacity: int, decode_path: str = "host") -> None:
        parameter = next(model.parameters())
        self.device, self.dtype, self.capacity = parameter.device, parameter.dtype, capacity
        self.decode_path = decode_path
        self.length = self.before = 0
        self.token_step = False
        self.device_length = torch.zeros(batch, dtype=torch.int32, device=self.device)
        dims = model_dims(model)
        layers = [
            DenseLayer(self, batch, attn.k_proj.out_features // dims["head_dim"], dims["head_dim"])
            for attn in attention_modules(model)
        ]
        super().__init__(layers=layers)

    def begin(self, new_tokens: int) -> None:
        """A forward of `new_tokens` per row starts: advance both lengths (the device's by a device op)."""
        if self.length + new_tokens > self.capacity:
            raise GSMError(
                f"the dense cache holds {self.capacity} tokens per row and this call would make it "
                f"{self.length + new_tokens}; create it with a larger capacity"
            )
        self.token_step = new_tokens == 1 and self.length > 0
        self.before, self.length = self.length, self.length + new_tokens
        self.device_length.add_(new_tokens)

    def follow_replayed_token(self) -> None:
        """A captured token step was replayed: its `begin` advanced the device length; the host's follows."""
        self.before, self.length = self.length, self.length + 1

    def snapshot(self) -> tuple[int, int, Tensor]:
        """The lengths as they are (`restore` puts them back), the device length cloned."""
        return self.length, self.before, self.device_length.clone()

    def restore(self, saved: tuple[int, int, Tensor]) -> None:
        """The lengths as `snapshot` took them."""
        self.length, self.before = saved[0], saved[1]
        self.device_length.copy_(saved[2])

    def clear_unwritten(self) -> None:
        """Zero every slot past the tokens held: the masked decode path weighs them by 0, and 0 times an
        uninitialised NaN would still be NaN."""
        for layer in self.layers:
            layer.keys[:, self.length :].zero_()
            layer.values[:, self.length :].zero_()

    def nbytes(self) -> int:
        """Bytes the tokens held occupy (K and V of every layer)."""
        return sum(2 * layer.keys[:, : self.length].numel() * layer.keys.element_size() for layer in self.layers)


def _prefill_attention(query: Tensor, keys: Tensor, values: Tensor, end: int, scaling: float) -> Tensor:
    """Causal SDPA [B, T, Hq, D] of a chunk's T queries (the positions before `end`) over keys [0, end), with
    torch's lower-right causal bias (`causal_chunk_sdpa`; it runs plain `is_causal` where the chunk starts at 0)."""
    return causal_chunk_sdpa(
        query, keys[:, :end].transpose(1, 2), values[:, :end].transpose(1, 2), scaling, True, bias=True
    )


def _grouped_decode(query: Tensor, keys: Tensor, values: Tensor, scaling: float, valid: Tensor | None) -> Tensor:
    """One token's attention [B, 1, Hq, D]: the G query heads of each KV head as that head's G queries
    over keys [B, S, Hkv, D] (`valid` [S] or None: every key)."""
    batch, heads, _, dim = query.shape
    kv_heads = keys.shape[2]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    mask = None if valid is None else valid[None, None, None, :]
    out = F.scaled_dot_product_attention(
        grouped, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scaling
    )
    return out.reshape(batch, 1, heads, dim)


def _flash_decode(query: Tensor, keys: Tensor, values: Tensor, lengths: Tensor, scaling: float) -> Tensor:
    """One token's attention [B, 1, Hq, D] by flash attention's variable-length form over each row's first
    `lengths` [B] keys of the buffers [B, C, Hkv, D] (`seqused_k`: read on the device)."""
    batch, heads, _, dim = query.shape
    capacity, kv_heads = keys.shape[1], keys.shape[2]
    rows = torch.arange(batch + 1, dtype=torch.int32, device=query.device)
    out = torch.ops.aten._flash_attention_forward(
        query.reshape(batch, heads, dim),
        keys.view(batch * capacity, kv_heads, dim),
        values.view(batch * capacity, kv_heads, dim),
        rows,
        rows * capacity,
        1,
        capacity,
        0.0,
        False,
        False,
        scale=scaling,
        seqused_k=lengths,
    )[0]
    return out.view(batch, 1, heads, dim)


@functools.cache
def flash_decode_works(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> bool:
    """Whether this torch's flash kernel decodes with `seqused_k` as SDPA over the prefix does (a small
    probe per shape; any error or a mismatch: no)."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    generator = torch.Generator(device=device).manual_seed(0)
    query = torch.randn(2, heads, 1, dim, device=device, dtype=dtype, generator=generator)
    keys = torch.randn(2, 256, kv_heads, dim, device=device, dtype=dtype, generator=generator)
    values = torch.randn_like(keys)
    lengths = torch.tensor([100, 100], dtype=torch.int32, device=device)
    try:
        got = _flash_decode(query, keys, values, lengths, dim**-0.5)
    except (RuntimeError, NotImplementedError):
        return False
    expected = _grouped_decode(query, keys[:, :100], values[:, :100], dim**-0.5, None)
    return bool(torch.allclose(got.float(), expected.float(), atol=2e-2, rtol=2e-2))


def _dense_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The attention function registered as `ATTN_IMPLEMENTATION`: the active `DenseCache`'s layer attends."""
    cache = _ACTIVE.get()
    if cache is None:
        raise GSMError(f"the attention implementation {ATTN_IMPLEMENTATION!r} runs inside DenseEngine calls only")
    scale = module.scaling if scaling is None else scaling
    return cache.layers[module.layer_idx].attend(query, scale), None


@contextlib.contextmanager
def _routed(model: nn.Module, cache: DenseCache) -> Iterator[None]:
    """Attention of `model` through `cache` for the block; the model's own implementation after. Inside a
    block that routes it already (a captured step's warm-up and capture), nothing changes."""
    if _ACTIVE.get() is cache and model.config._attn_implementation == ATTN_IMPLEMENTATION:
        yield
        return
    previous = model.config._attn_implementation
    token = _ACTIVE.set(cache)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
        _ACTIVE.reset(token)


class DenseEngine:
    """Greedy generation of a dense causal LM as the module docstring says. `cuda_graphs`: capture the token
    step on CUDA (the CPU always runs eagerly); `decode_path` "auto" (flash where it works, else masked
    SDPA, on CUDA; the host path elsewhere), or "host" / "masked" / "flash"; `fused_decode`: token steps
    run inside `inference.decode_fusion.fused_decode`, as GSM's engine's do with the same option."""

    def __init__(
        self,
        model: nn.Module,
        cuda_graphs: bool = True,
        prefill_chunk: int = PREFILL_CHUNK,
        decode_path: str = "auto",
        fused_decode: bool = False,
    ) -> None:
        if any(True for _ in gsm_adapters(model)):
            raise GSMError("DenseEngine runs a model without GSM modules; use it before inject_gsm or load_gsm")
        if any(kind != "full_attention" for kind in getattr(model.config, "layer_types", None) or ()):
            raise GSMError("DenseEngine runs full causal attention only; this model has sliding-window layers")
        if decode_path not in ("auto", "host", "masked", "flash"):
            raise GSMError(f"decode_path={decode_path!r} is not one of auto, host, masked, flash")
        AttentionInterface.register(ATTN_IMPLEMENTATION, _dense_attention)
        self.model, self.prefill_chunk, self.fused_decode = model, prefill_chunk, fused_decode
        parameter = next(model.parameters())
        on_cuda = parameter.device.type == "cuda"
        self.cuda_graphs = cuda_graphs and on_cuda
        if decode_path == "auto":
            dims = model_dims(model)
            shape = (dims["heads"], dims["kv_heads"], dims["head_dim"])
            flash = flash_decode_works(parameter.device, parameter.dtype, *shape)
            decode_path = "flash" if flash else "masked" if on_cuda else "host"
        if self.cuda_graphs and decode_path == "host":
            raise GSMError("a captured token step reads the prefix length on the device: decode_path masked or flash")
        self.decode_path = decode_path

    def new_cache(self, batch: int, capacity: int) -> DenseCache:
        return DenseCache(self.model, batch, capacity, self.decode_path)

    def forward(self, cache: DenseCache, ids: Tensor, positions: Tensor) -> Tensor:
        """Logits [B, 1, V] of the last of `ids` [B, T] at `positions` [B, T], their K/V joining `cache`."""
        cache.begin(ids.shape[1])
        with torch.no_grad(), _routed(self.model, cache):
            out = self.model(
                input_ids=ids,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **cache_kwargs(self.model, cache),
            )
        return out.logits

    def prefill(self, cache: DenseCache, ids: Tensor) -> Tensor:
        """Feed the prompt `ids` [B, T] in chunks; the last position's logits [B, 1, V]."""
        positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        logits = None
        for start in range(0, ids.shape[1], self.prefill_chunk):
            end = start + self.prefill_chunk
            logits = self.forward(cache, ids[:, start:end], positions[:, start:end])
        return logits

    def token_step(self, cache: DenseCache) -> Callable[[Tensor], Tensor]:
        """The step `step(token [B, 1]) -> logits [B, 1, V]` that feeds one token per row after what `cache`
        holds: captured in a CUDA graph (with `cuda_graphs` on CUDA), else eager."""
        cache.clear_unwritten()
        if not self.cuda_graphs:
            return functools.partial(self._eager_step, cache)
        return CapturedDenseStep(self, cache)

    def _eager_step(self, cache: DenseCache, token: Tensor) -> Tensor:
        """One token step run as it comes (no graph), inside `fused_decode` where asked for."""
        with fused_decode(self.model, self.fused_decode):
            return self.forward(cache, token, torch.full_like(token, cache.length))

    def generate(self, ids: Tensor, new_tokens: int, on_token: Callable[[], None] | None = None) -> Tensor:
        """`ids` [B, T] followed by `new_tokens` greedy tokens [B, T + new_tokens]; `on_token()` after each
        new token is chosen (a timer's hook)."""
        notify = on_token or (lambda: None)
        cache = self.new_cache(ids.shape[0], ids.shape[1] + new_tokens)
        tokens = [self.prefill(cache, ids)[:, -1:].argmax(-1)]
        notify()
        step = None
        for _ in range(new_tokens - 1):
            if step is None:
                step = self.token_step(cache)
            tokens.append(step(tokens[-1])[:, -1:].argmax(-1))
            notify()
        return torch.cat([ids, *tokens], 1)


class CapturedDenseStep:
    """A dense token step captured once in a CUDA graph for `cache` and replayed: the K/V slot and the
    prefix length come from `cache.device_length` (advanced inside the graph), the token and its position
    are copied into static inputs before each replay."""

    def __init__(self, engine: DenseEngine, cache: DenseCache) -> None:
        self.engine, self.cache = engine, cache
        batch = cache.device_length.shape[0]
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=cache.device)
        self.position = torch.zeros(batch, 1, dtype=torch.long, device=cache.device)
        saved = cache.snapshot()
        with _routed(engine.model, cache), fused_decode(engine.model, engine.fused_decode):  # outside the capture
            self.graph, self.logits = captured(
                lambda: engine.forward(cache, self.token, self.position), lambda: cache.restore(saved)
            )

    def __call__(self, token: Tensor) -> Tensor:
        cache = self.cache
        if cache.length >= cache.capacity:
            raise GSMError(f"the dense cache holds {cache.capacity} tokens per row and is full")
        self.position.fill_(cache.length)
        self.token.copy_(token)
        self.graph.replay()
        cache.follow_replayed_token()
        return self.logits
