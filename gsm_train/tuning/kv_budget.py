"""The KV cache's byte account from a GSM config and the model's shape, and the
`tuning.kv_compression_ratio` knob, which picks the storage that fits a budget.

The account is exactly what `GSMCache` holds (tests/test_decode.py checks it byte for byte): per
layer and token, ASQ's packed K and V per KV head (ids, residual codes at K's and V's bits, scales,
amortised prototypes, the raw newest block), bf16 K/V where ASQ is off, minus the heads a `share`-mode
bridge target does not cache, plus the gate keys.

The knob sets two fields: `kv_compression.quant_bits` (ASQ's residual bits: 8, 4 or 2) and
`sparse_attention.gate_key_bits` (16 or 8). It takes the most precise pair whose ratio at
`data.seq_len` is within the budget, giving up gate key precision before residual bits: from
(8, 16) through (8, 8), (4, 16), (4, 8), (2, 16) to (2, 8). Per-layer widths (`kv_compression.layer_bits`)
are counted layer by layer; the knob is an error together with them. Everything else
(bridge sharing, gate dimension, clusters, block size) stays as the recipe says.
"""

from __future__ import annotations

import math

from gsm_train.config.schema import ConfigError, GSMConfig, Problem
from gsm_train.functional.gate_keys import gate_key_bytes
from gsm_train.modules.kv_registry import kv_bytes_per_token

BF16_BYTES = 2
BUDGET_LADDER = ((8, 16), (8, 8), (4, 16), (4, 8), (2, 16), (2, 8))  # (quant_bits, gate_key_bits), most precise first


def bf16_layer_kv_bytes(dims: dict[str, int]) -> int:
    """Bytes one layer of a plain bf16 cache holds per token: K and V of every KV head."""
    return 2 * BF16_BYTES * dims["kv_heads"] * dims["head_dim"]


def layer_kv_bytes(config: GSMConfig, dims: dict[str, int], layer: int, seq_len: int) -> tuple[float, float]:
    """(bf16 bytes without GSM, bytes with GSM) one layer caches per token at `seq_len`."""
    head_dim, kv_heads = dims["head_dim"], dims["kv_heads"]
    base = bf16_layer_kv_bytes(dims)
    kv = config.kv_compression
    per_head = kv_bytes_per_token(kv, layer, seq_len, head_dim) if kv.enabled else 2 * BF16_BYTES * head_dim
    sharing = config.cross_layer_sharing
    shared = (
        min(sharing.shared_kv_heads, kv_heads)
        if sharing.enabled and sharing.mode == "share" and layer >= sharing.bridge_to_start
        else 0
    )
    sparse = config.sparse_attention
    selectors = 1 if sparse.heads == "layer" else kv_heads
    gate = (
        gate_key_bytes(sparse.gate_head_dim, sparse.gate_key_bits) * selectors
        if sparse.enabled and layer not in sparse.dense_layers
        else 0
    )
    return base, per_head * (kv_heads - shared) + gate


def kv_bytes_ratio(config: GSMConfig, dims: dict[str, int], seq_len: int) -> float:
    """KV bytes with GSM over bf16 without, whole model, at `seq_len`."""
    rows = [layer_kv_bytes(config, dims, layer, seq_len) for layer in range(dims["layers"])]
    return sum(gsm for _, gsm in rows) / sum(base for base, _ in rows)


def fit_kv_budget(config: GSMConfig, budget: float, dims: dict[str, int], seq_len: int) -> GSMConfig:
    """`config` with ASQ's bits and the gate keys' bits the `tuning.kv_compression_ratio` budget picks
    (a new config: `config` is not changed). Raises ConfigError when no pair fits, naming the smallest
    ratio reachable."""
    tried = []
    for quant_bits, key_bits in BUDGET_LADDER:
        fitted = config.model_copy(
            update={
                "kv_compression": config.kv_compression.model_copy(update={"quant_bits": quant_bits}, deep=True),
                "sparse_attention": config.sparse_attention.model_copy(update={"gate_key_bits": key_bits}, deep=True),
            },
            deep=True,
        )
        ratio = kv_bytes_ratio(fitted, dims, seq_len)
        if ratio <= budget:
            return fitted
        tried.append(ratio)
    raise ConfigError(
        "recipe vs model",
        [
            Problem(
                "tuning.kv_compression_ratio",
                budget,
                f"the smallest ratio ASQ and gate key bits reach on this model at seq_len {seq_len} is "
                f"{min(tried):.4f}",
                f"use at least {math.ceil(min(tried) * 100) / 100:.2f}, or cache less elsewhere "
                "(cross_layer_sharing.mode share with more shared_kv_heads or a lower bridge_to_start, "
                "a smaller sparse_attention.gate_head_dim)",
            )
        ],
    )


def budget_choice(config: GSMConfig, budget: float, dims: dict[str, int], seq_len: int) -> str:
    """What the budget chose in `config` (`fit_kv_budget`'s result), in words."""
    quant_bits, key_bits = config.kv_compression.quant_bits, config.sparse_attention.gate_key_bits
    return (
        f"kv_compression_ratio {budget}: ASQ {quant_bits}-bit residuals, {key_bits}-bit gate keys, "
        f"{kv_bytes_ratio(config, dims, seq_len):.4f} of bf16 at seq_len {seq_len}"
    )
