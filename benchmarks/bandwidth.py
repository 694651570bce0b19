"""The memory-bandwidth bound of a decode step: the bytes one token step must read (the weights and the
KV cache it reads) and the peak they are read at, so that a measured step time says how near its bound a
method runs (`share`: 1.0 is the bound).

- Dense: the weights (as stored: 4-bit ones at their packed size with their scales) and the bf16 K/V
  of every token held.
- GSM (`gsm_kv_read_bytes`, from the cache's own buffers): per layer that selects, the gate keys of every
  token held (codes and scales) and, per KV head, the packed rows of the k selected keys (every packed
  field of a row: cluster id, residual codes, scale, and the row of its block's prototype table) plus the
  raw newest block; a layer that does not select reads every packed row and the raw block.
- The peak: a device-to-device copy measured in the run (bytes read plus written over its time), or,
  without CUDA, the H200's stated 4.8e12 B/s.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gsm_train.attention import gsm_settings
from gsm_train.attention.kv_store import KVStore
from gsm_train.export.int4 import stored_bytes
from gsm_train.inference.cache import GSMCache
from gsm_train.inference.decode_attention import decode_k, static_k
from gsm_train.models.families import model_dims

STATED_PEAK_BYTES_PER_S = 4.8e12  # the H200's HBM3e (spec)
COPY_BYTES = 2**30  # the measured copy's size: far past the L2


def peak_bandwidth() -> tuple[float, str]:
    """The peak bytes/s a step's reads are set against, and where it comes from."""
    if not torch.cuda.is_available():
        return STATED_PEAK_BYTES_PER_S, "stated: H200 HBM3e 4.8e12 B/s (no CUDA device in this run)"
    source = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    repeats = 20
    start.record()
    for _ in range(repeats):
        target.copy_(source)
    stop.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(stop) / 1e3 / repeats
    del source, target
    torch.cuda.empty_cache()
    return 2 * COPY_BYTES / seconds, f"measured: device-to-device copy of {COPY_BYTES} bytes, read + written"


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters as stored (a 4-bit weight: its packed values, scales and zero
    points: `gsm_train.export.int4.stored_bytes`)."""
    return stored_bytes(model)


def dense_kv_bytes(model: nn.Module, tokens: int, batch: int, element_size: int = 2) -> int:
    """K and V of `tokens` per row and `batch` rows, every layer (bf16 by default)."""
    dims = model_dims(model)
    return 2 * element_size * dims["kv_heads"] * dims["head_dim"] * dims["layers"] * tokens * batch


def _packed_row_bytes(store: KVStore) -> int:
    """Bytes one packed token of one head reads, every row of the batch: per-token fields in full, and one
    row of a per-block field (its prototype)."""
    batch = store.tail.shape[0]
    total = 0
    for field in store.fields.values():
        if field.shape[2] == store.capacity:
            total += math.prod(field.shape[3:]) * field.element_size()
        else:
            total += field.shape[-1] * field.element_size()
    return total * batch


def _store_read_bytes(store: KVStore, held: int, packed: int, rows: int) -> int:
    """Bytes a step reads of one store: `rows` of the tokens held (packed ones when a compressor packs),
    and the raw newest block."""
    batch, heads, _, dim = store.tail.shape
    raw_row = batch * dim * store.tail.element_size()
    if store.compressor is None:
        return heads * rows * raw_row
    return heads * (rows * _packed_row_bytes(store) + (held - packed) * raw_row)


def gsm_kv_read_bytes(model: nn.Module, cache: GSMCache) -> int:
    """Bytes the next token step over `cache` reads besides the weights (see the module docstring)."""
    settings = gsm_settings(model)
    cfg = settings.config.sparse_attention
    held, packed = cache.lengths.seq_len, cache.lengths.packed_len
    k = static_k(decode_k(settings.config, held), cfg.most_forced_keys(), cache.capacity)
    total = 0
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        adapter = layer.adapter
        selects = cfg.enabled and settings.mode == "sparse" and adapter.gate is not None and not adapter.dense_layer
        packed_here = packed if layer.k_store.compressor is not None else held
        rows = min(k, packed_here) if selects else packed_here
        if selects:
            for codes in (layer.gate_keys, layer.gate_key_scales):
                if codes is not None:
                    total += codes[:, :, :held].numel() * codes.element_size()
        total += sum(_store_read_bytes(store, held, packed_here, rows) for store in (layer.k_store, layer.v_store))
    return total


def share(tokens_per_s: float, batch: int, step_bytes: int, peak: float) -> float:
    """The fraction of the bound a method's decode runs at: step bytes over the step's time, over the peak."""
    return tokens_per_s / batch * step_bytes / peak
