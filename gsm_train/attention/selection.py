"""Which keys main attention keeps in a teacher-forced pass: the gate's top-k, or the oracle's.

Both select per query chunk (`sparse_attention.query_chunk` rows at a time) with the rule of
`functional.top_k.select_top_k`: the k best allowed keys, the query's own position, sinks and recent tokens.
The gate scores the keys as the cache stores them (rounded once per layer), so teacher-forced and
cached selections agree; the oracle ranks the true head-averaged attention of the keys each query sees
(earlier blocks as stored, its own block raw).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gsm_train.attention.layout import Layout, block_causal_kv
from gsm_train.compiled import compiled
from gsm_train.config.schema import SparseAttentionConfig
from gsm_train.functional.attention_targets import head_averaged_probs
from gsm_train.functional.top_k import select_top_k
from gsm_train.modules.sparse_gate import SparseGateHead


def chunks(length: int, chunk: int) -> list[tuple[int, int]]:
    """[start, stop) spans of `chunk` rows covering `length`."""
    return [(start, min(start + chunk, length)) for start in range(0, length, chunk)]


@dataclass(frozen=True)
class GateSelector:
    """The gate's queries and keys [B, n, T, dg] and its keys as stored (fp32 [B, n, S, dg], None where no
    selection is made) for one layer's pass.

    `training_shapes`: the pass has a training step's fixed shapes on CUDA, so the masking around the
    top-k runs compiled and every chunk takes the layer's largest k (one compile for all chunks)."""

    gate: SparseGateHead
    gate_q: Tensor
    gate_k: Tensor
    stored_k: Tensor | None
    layout: Layout
    config: SparseAttentionConfig
    training_shapes: bool

    def select(
        self, start: int, stop: int, k: Tensor | None = None, k_max: int | None = None, uniform: bool | None = None
    ) -> Tensor:
        """Boolean selection [B, n, stop - start, S] of queries [start, stop): each keeps its `k` (default:
        the schedule's) best-scored keys; `k_max` the largest k on the host, `uniform` whether all equal it."""
        layout, cfg = self.layout, self.config
        k = layout.k if k is None else k
        with torch.no_grad():
            scores = self.gate.score_stored(self.gate_q[:, :, start:stop], self.stored_k)
        if k_max is None:  # compiled, every chunk takes the layer's largest k (each query keeps its own k)
            k_max = int((layout.k_host if self.training_shapes else layout.k_host[start:stop]).max())
        if uniform is None:
            uniform = bool((layout.k_host[start:stop] == k_max).all())
        select = compiled(select_top_k) if self.training_shapes else select_top_k
        return select(
            scores,
            layout.allowed[..., start:stop, :],
            k[start:stop],
            layout.positions[start:stop],
            layout.positions,
            cfg.sink_tokens,
            cfg.recent_tokens,
            k_max,
            uniform,
        )


@torch.no_grad()
def oracle_selection(
    query: Tensor,
    key: Tensor,
    own: tuple[Tensor, Tensor] | None,
    layout: Layout,
    config: SparseAttentionConfig,
    block_size: int,
    scaling: float,
    num_selectors: int,
    start: int,
    stop: int,
) -> Tensor:
    """Boolean selection [B, n, stop - start, S]: the true top-k of the head-averaged attention of queries
    [start, stop) (query [B, Hq, T, D], keys [B, Hkv, S, D] as stored, `own` the raw pair or None)."""
    kv_len = key.shape[2]
    keys, _, mask = block_causal_kv(
        key, None, own, layout.allowed[..., start:stop, :], layout.positions[start:stop], block_size
    )
    probs = head_averaged_probs(query[:, :, start:stop], keys, mask, scaling, num_selectors)
    probs = probs[..., :kv_len] + probs[..., kv_len:] if own is not None else probs  # fold the two versions
    return select_top_k(
        probs,
        layout.allowed[..., start:stop, :],
        layout.k[start:stop],
        layout.positions[start:stop],
        layout.positions,
        config.sink_tokens,
        config.recent_tokens,
        int(layout.k_host[start:stop].max()),
    )
