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
import torch.nn.functional as F
from torch import Tensor

from gsm_train.attention.layout import Layout, block_causal_kv
from gsm_train.compiled import compiled
from gsm_train.config.schema import SparseAttentionConfig
from gsm_train.functional.attention_targets import head_averaged_probs
from gsm_train.functional.top_k import select_top_k, ties_fall_by_row_length
from gsm_train.modules.sparse_gate import SparseGateHead
from gsm_train.quant import compute_dtype


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
        if k_max is None:  # compiled, every chunk takes the layer's largest k (each query keeps its own k)
            k_max = int((layout.k_host if self.training_shapes else layout.k_host[start:stop]).max())
        if uniform is None:
            uniform = bool((layout.k_host[start:stop] == k_max).all())
        length = layout.positions.shape[0]
        ties_by_length = ties_fall_by_row_length(self.gate_q.device, compute_dtype(self.gate_q), length, uniform)
        whole_chunk = stop - start <= cfg.query_chunk and layout.allowed.shape[-2] == length
        if ties_by_length and whole_chunk and not self.training_shapes:
            return self._select_whole_chunk(start, stop, k, k_max, uniform)
        with torch.no_grad():
            scores = self.gate.score_stored(self.gate_q[:, :, start:stop], self.stored_k)
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

    def _select_whole_chunk(self, start: int, stop: int, k: Tensor, k_max: int, uniform: bool) -> Tensor:
        """`select` of queries [start, stop) of a pass whose queries are its keys, where `torch.topk` ranks them
        (`ties_fall_by_row_length`): over the keys [0, start + query_chunk) only (later ones are never allowed
        to them), a short chunk padded with queries and keys that nothing may select, so every query's row has
        the same length and contents in a pass of any length and ties at the k-th score fall the same way (a
        prompt's prefill selects as teacher forcing over a longer text does)."""
        layout, cfg = self.layout, self.config
        length, width = layout.positions.shape[0], start + cfg.query_chunk
        missing_rows, missing_keys = start + cfg.query_chunk - stop, max(width - length, 0)
        gate_q = F.pad(self.gate_q[:, :, start:stop], (0, 0, 0, missing_rows))
        keys = F.pad(self.stored_k[:, :, :width], (0, 0, 0, missing_keys))
        with torch.no_grad():
            scores = self.gate.score_stored(gate_q, keys)
        positions = torch.arange(width, device=layout.positions.device)
        selected = select_top_k(
            scores,
            F.pad(layout.allowed[..., start:stop, :width], (0, missing_keys, 0, missing_rows)),
            F.pad(k[start:stop], (0, missing_rows), value=k_max),
            positions[start : start + cfg.query_chunk],
            positions,
            cfg.sink_tokens,
            cfg.recent_tokens,
            k_max,
            uniform,
        )[..., : stop - start, : min(width, length)]
        return F.pad(selected, (0, length - selected.shape[-1]))


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
