"""The view of one layer's cached K or V that the fused decode kernel reads (no Triton needed to build it)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class PackedRows:
    """One layer's cached K or V as the fused kernel reads them (`inference.kv_store.KVStore.packed_rows`).

    The first `packed_len` tokens are ASQ-packed: `ids` uint8 [B, H, F], `residual` uint8
    [B, H, F, D * bits / 8], `scales` fp16 [B, H, F], `prototypes` fp16 [B, H, F / block_size, C, D]
    (None, all four, when nothing is packed yet); the newest tokens are raw in `tail` [B, H, S - F, D].
    With `rotation_signs` (fp32 [D], `quant.hadamard_signs`) prototypes and residuals are of rotated rows."""

    tail: Tensor
    ids: Tensor | None = None
    residual: Tensor | None = None
    scales: Tensor | None = None
    prototypes: Tensor | None = None
    bits: int = 8
    cluster_num: int = 1
    block_size: int = 1
    rotation_signs: Tensor | None = None

    @property
    def packed_len(self) -> int:
        return 0 if self.ids is None else self.ids.shape[-1]
