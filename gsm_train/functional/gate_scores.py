"""The gate's score of a key for a query: the one definition every selection and the gate's KL use.

A gate query row [..., Q] goes with keys [..., S, dg] (`dg` = gate_head_dim, the key the cache stores):
- one query head (`gate_query_heads: 1`, Q = dg): `s(t, j) = q(t) . k(j) / sqrt(dg)`;
- H > 1 query heads (Q = H * dg + H: the H rotated query vectors, then their H weights, as
  `SparseGateHead` lays them out): `s(t, j) = sum_h w_h(t) * relu(q_h(t) . k(j) / sqrt(dg))`, DSA's
  lightning indexer over one shared key per token.

The query row's width says which (`query_heads`), so a caller slices rows of it (a query chunk, sampled
rows) like any [B, n, T, Q] tensor and needs no second argument. The fast paths that assume one head (the
by-hand gradient of `attention_targets.chunk_kl`, `gate_distill`, the Triton gate-score kernel) are taken
only for it.
"""

from __future__ import annotations

import torch
from torch import Tensor


def query_heads(query_width: int, gate_head_dim: int) -> int:
    """The query heads H of gate queries [..., query_width] for keys of `gate_head_dim`: 1 for a width of
    `gate_head_dim`, else the H with `query_width = H * (gate_head_dim + 1)` (ValueError if none)."""
    if query_width == gate_head_dim:
        return 1
    heads, rest = divmod(query_width, gate_head_dim + 1)
    if rest or heads < 2:
        raise ValueError(
            f"gate queries of width {query_width} fit no query-head count for gate keys of {gate_head_dim} "
            f"dimensions (width {gate_head_dim} for one head, H * {gate_head_dim + 1} for H heads)"
        )
    return heads


def pack_queries(queries: Tensor, weights: Tensor) -> Tensor:
    """Query rows [..., H * dg + H] of H rotated query vectors [..., H, dg] and their weights [..., H]."""
    return torch.cat((queries.flatten(-2), weights.to(queries.dtype)), -1)


def gate_logits(gate_q: Tensor, keys: Tensor) -> Tensor:
    """Gate scores [B, n, c, S] of query rows gate_q [B, n, c, Q] over keys [B, n, S, dg] (module
    docstring), in the inputs' dtype. The 1/sqrt(dg) scale goes on the queries, not on the c x S logits
    (exact where sqrt(dg) is a power of two: dg 16, 64, 256). Differentiable in both inputs; with H heads it
    holds one [B, n, c * H, S] product at a time."""
    dim = keys.shape[-1]
    heads = query_heads(gate_q.shape[-1], dim)
    if heads == 1:
        return torch.matmul(gate_q * dim**-0.5, keys.transpose(-1, -2))
    batch, selectors, rows, _ = gate_q.shape
    queries = gate_q[..., : heads * dim].reshape(batch, selectors, rows * heads, dim)
    weights = gate_q[..., heads * dim :]  # [B, n, c, H]
    per_head = torch.relu(torch.matmul(queries * dim**-0.5, keys.transpose(-1, -2)))  # [B, n, c * H, S]
    per_head = per_head.view(batch, selectors, rows, heads, -1)
    return torch.matmul(weights.unsqueeze(-2), per_head).squeeze(-2)
