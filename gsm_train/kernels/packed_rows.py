"""The view of one layer's cached K or V that the fused decode kernel reads (no Triton needed to build it)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class PackedRows:
    """One layer's cached K or V in preallocated buffers of `capacity` tokens
    (`attention.kv_store.KVStore.packed_rows`).

    `lengths` int32 [2] on the device, shared by every layer of the cache: (tokens held, tokens packed);
    the kernels read them when they run, so a launch captured in a CUDA graph serves every step.
    With a compressor (`ids` not None) the first `lengths[1]` tokens are ASQ-packed: `ids` uint8
    [B, H, capacity], `residual` uint8 [B, H, capacity, D * bits / 8], `scales` fp16 [B, H, capacity],
    `prototypes` fp16 [B, H, capacity / block_size, C, D], and `tail` [B, H, block_size, D] holds the newest
    block raw (token p at slot p - lengths[1]); without one, `tail` [B, H, capacity, D] holds every token
    raw (token p at slot p). With `rotation_signs` (fp32 [D], `quant.hadamard_signs`) prototypes and
    residuals are of rotated rows."""

    tail: Tensor
    lengths: Tensor
    ids: Tensor | None = None
    residual: Tensor | None = None
    scales: Tensor | None = None
    prototypes: Tensor | None = None
    bits: int = 8
    cluster_num: int = 1
    block_size: int = 1
    rotation_signs: Tensor | None = None

    @property
    def packed(self) -> bool:
        """Whether a compressor packs this store's earlier blocks."""
        return self.ids is not None
