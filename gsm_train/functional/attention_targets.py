"""What stage 1 learns from and how gates are measured, computed per layer in query chunks.

The target `p[t, :]` is the main attention's probabilities averaged over the heads that share one
selection (all heads of the layer, or one KV group), without gradient. On CUDA two Triton kernels form
it from the base's queries and keys with fp32 logits that never leave registers
(`gsm_train/kernels/attention_target.py`); elsewhere PyTorch forms the logits (under autocast as bf16
products with fp32 accumulation). Softmax, KL and their gradients are fp32. Only a `[B, n, chunk, S]`
slice exists at any time, so memory grows with the chunk, not with T x S. The gate's KL gradient is
formed in the same pass (softmax(gate) - target), so nothing is recomputed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from gsm_train.compiled import compiled
from gsm_train.functional.gate_scores import gate_logits
from gsm_train.kernels import attention_target


def _product_dtype(query: Tensor) -> torch.dtype:
    """The dtype the target's products take: autocast's where it is on (as main attention's SDPA and the
    PyTorch path below compute them; an fp32 base under autocast gives fp32 queries after RoPE, whose
    exact fp32 products would make the kernels many times slower: docs/design-decisions.md, 'The
    gate KL's target multiplies in autocast's dtype'), else the query's own."""
    device = query.device.type
    if query.dtype == torch.float32 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return query.dtype


def head_averaged_probs(
    query: Tensor, key: Tensor, allowed: Tensor, scaling: float, num_selectors: int, key_limit: Tensor | None = None
) -> Tensor:
    """Attention probabilities [B, n, c, S] averaged within each selector's heads (fp32 tensors).

    query: [B, Hq, c, D] (a chunk of queries), key: [B, Hkv, S, D], allowed: [B|1, 1, c, S]. On CUDA with
    Triton, two fused kernels that never hold the per-head logits (`gsm_train/kernels/attention_target.py`;
    `key_limit` [c], if given, bounds the keys each row sees, so they skip the rest); elsewhere PyTorch.
    """
    if query.is_cuda and attention_target.kernel_runs(query, key):
        dtype = _product_dtype(query)
        return attention_target.head_averaged_probs(
            query.to(dtype), key.to(dtype), allowed, scaling, num_selectors, key_limit
        )
    batch, num_heads, length, _ = query.shape
    num_kv = key.shape[1]
    q = query.float().view(batch, num_kv, num_heads // num_kv, length, -1)
    logits = torch.matmul(q, key.float()[:, :, None].transpose(-1, -2)) * scaling  # [B, Hkv, g, c, S]
    logits = logits.view(batch, num_heads, length, -1).masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row that sees no key: zeros, as the kernels give
    return probs.view(batch, num_selectors, num_heads // num_selectors, length, -1).mean(dim=2)


def _kl_sum(logits: Tensor, target: Tensor, mask: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
    """The sum of KL(target || softmax(logits)) over the counted `rows`, and the gate's log-probabilities."""
    log_gate = torch.log_softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
    log_target = torch.log(target.clamp_min(1e-30))
    kl = torch.where(target > 0, target * (log_target - log_gate), torch.zeros_like(target)).sum(-1)
    return (kl * rows).sum(), log_gate


def chunk_kl(
    gate_q: Tensor, gate_k: Tensor, target: Tensor, mask: Tensor, rows: Tensor, want_grad: bool
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """One query chunk: the sum of KL(target || softmax(gate logits)) over its counted `rows`, and (if
    `want_grad`) its gradients for the chunk's gate queries and for the gate keys it sees. `target` is
    `head_averaged_probs` of the chunk. One query head (gate_q as wide as gate_k): the logits and their
    gradient by hand (the logits scaled after the product); several (`gate_scores`): `_chunk_kl_by_autograd`."""
    if gate_q.shape[-1] != gate_k.shape[-1]:
        return _chunk_kl_by_autograd(gate_q, gate_k, target, mask, rows, want_grad)
    scale = gate_q.shape[-1] ** -0.5
    logits = torch.matmul(gate_q, gate_k.transpose(-1, -2)) * scale
    total, log_gate = _kl_sum(logits, target, mask, rows)
    if not want_grad:
        return total, None, None
    grad_logits = (log_gate.exp() - target).masked_fill(~mask, 0.0) * (rows[..., None] * scale)
    return total, torch.matmul(grad_logits, gate_k), torch.matmul(grad_logits.transpose(-1, -2), gate_q)


def _chunk_kl_by_autograd(
    gate_q: Tensor, gate_k: Tensor, target: Tensor, mask: Tensor, rows: Tensor, want_grad: bool
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """`chunk_kl` of query rows with several heads: the logits of `gate_scores.gate_logits` and the
    gradients through it by autograd, taken within the chunk (so memory stays that of one chunk)."""
    with torch.enable_grad():
        gq, gk = gate_q.detach().requires_grad_(want_grad), gate_k.detach().requires_grad_(want_grad)
        total, _ = _kl_sum(gate_logits(gq, gk), target, mask, rows)
        if not want_grad:
            return total.detach(), None, None
        grad_q, grad_k = torch.autograd.grad(total, (gq, gk))
    return total.detach(), grad_q, grad_k


def full_batch(allowed: Tensor, counted_rows: Tensor, batch: int) -> tuple[Tensor, Tensor]:
    """Mask [B, 1, c, S] and counted rows [B, 1, c] (fp32) at the full batch, contiguous: one shape whether
    the model passed a mask or not, so a compiled chunk never recompiles inside a CUDA graph capture."""
    return allowed.expand(batch, -1, -1, -1).contiguous(), counted_rows.expand(batch, -1, -1).float().contiguous()


class GradientsFromForward(torch.autograd.Function):
    """A scalar whose gradients for its first two inputs are formed in the forward pass (`keep_gradients`);
    the backward only scales them and hands them back in those inputs' dtypes."""

    @staticmethod
    def keep_gradients(ctx, first: Tensor, second: Tensor, dtypes: tuple[torch.dtype, torch.dtype]) -> None:
        ctx.save_for_backward(first, second)
        ctx.dtypes = dtypes

    @staticmethod
    def backward(ctx, grad_total: Tensor):
        first, second = ctx.saved_tensors
        dtype_first, dtype_second = ctx.dtypes
        others = [None] * (len(ctx.needs_input_grad) - 2)  # the inputs after the first two get no gradient
        return (first * grad_total).to(dtype_first), (second * grad_total).to(dtype_second), *others


class _GateKL(GradientsFromForward):
    """Sum of KL(target || softmax(gate logits)) over counted rows, with its gradient computed chunk by chunk
    in the forward pass: d KL / d logits = softmax(logits) - target, so the backward needs neither the
    target nor the logits again, and memory stays O(chunk x S)."""

    @staticmethod
    def forward(
        ctx,
        gate_q: Tensor,
        gate_k: Tensor,
        query: Tensor,
        key: Tensor,
        allowed: Tensor,
        counted_rows: Tensor,
        visible: Tensor,
        scaling: float,
        chunk: int,
    ) -> Tensor:
        want_grad = any(ctx.needs_input_grad[:2])
        gq, gk = gate_q.float(), gate_k.float()
        length = query.shape[2]
        one_chunk = length <= chunk  # several chunks see different key counts: shapes a compile would chase
        one_head = gq.shape[-1] == gk.shape[-1]  # several query heads take autograd, not compiled
        kl_of_chunk = compiled(chunk_kl) if gq.is_cuda and want_grad and one_chunk and one_head else chunk_kl
        total = grad_q = grad_k = None
        for start in range(0, length, chunk):
            stop = min(start + chunk, length)
            keys = int(visible[stop - 1])
            mask, rows = full_batch(allowed[..., start:stop, :keys], counted_rows[..., start:stop], query.shape[0])
            target = head_averaged_probs(query[:, :, start:stop], key[:, :, :keys], mask, scaling, gq.shape[1])
            part, part_q, part_k = kl_of_chunk(gq[:, :, start:stop], gk[:, :, :keys], target, mask, rows, want_grad)
            total = part if total is None else total + part
            if not want_grad:
                continue
            if stop - start == length and keys == gk.shape[2]:  # one chunk over every key (a step's sampled
                grad_q, grad_k = part_q, part_k  # rows): its gradients are the whole ones, no fill and copy
                continue
            if grad_q is None:
                grad_q, grad_k = torch.zeros_like(gq), torch.zeros_like(gk)
            grad_q[:, :, start:stop] = part_q
            grad_k[:, :, :keys] += part_k
        total = gq.new_zeros(()) if total is None else total  # no rows (nothing counted): zero
        if grad_q is None:
            grad_q, grad_k = torch.zeros_like(gq), torch.zeros_like(gk)
        _GateKL.keep_gradients(ctx, grad_q, grad_k, (gate_q.dtype, gate_k.dtype))
        return total


def causal_visible(q_len: int, kv_len: int) -> Tensor:
    """Host tensor: the most keys each of the last `q_len` queries can see under the causal mask."""
    return torch.arange(kv_len - q_len + 1, kv_len + 1)


def gate_distill_loss(
    query: Tensor,
    key: Tensor,
    gate_q: Tensor,
    gate_k: Tensor,
    allowed: Tensor,
    counted_rows: Tensor,
    scaling: float,
    chunk: int,
    visible: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Sum of KL(target || gate) over counted query rows, and the number of rows counted.

    `counted_rows` [B|1, 1, T] marks the queries that have at least k keys; `visible` (on the host,
    non-decreasing, one per query row; default: the causal bound) says how many leading keys a row
    may see at most, so that a chunk only touches the keys its queries can see without asking the device. The
    target and the gradient are computed per query chunk in one pass (see `_GateKL`).
    """
    if visible is None:
        visible = causal_visible(query.shape[2], key.shape[2])
    total = _GateKL.apply(gate_q, gate_k, query, key, allowed, counted_rows, visible, scaling, chunk)
    count = counted_rows.expand(query.shape[0], gate_q.shape[1], -1).sum()
    return total, count


MASS_SUMS = ("gate", "oracle", "queries")


def _top_mass(target: Tensor, k: int | Tensor) -> Tensor:
    """Each row's mass in its k largest entries [B, n, c] of `target` [B, n, c, S]; `k` one for all
    rows or one per row (host int64 [c])."""
    if isinstance(k, int):
        return target.topk(min(k, target.shape[-1]), dim=-1).values.sum(-1)
    values = target.topk(min(int(k.max()), target.shape[-1]), dim=-1).values
    ranks = torch.arange(values.shape[-1])[None, :] < k[:, None]
    return (values * ranks.to(values.device)).sum(-1)


@torch.no_grad()
def captured_mass(
    query: Tensor,
    key: Tensor,
    allowed: Tensor,
    scaling: float,
    k: int | Tensor,
    min_keys: int,
    chunk: int,
    num_selectors: int,
    gate_selection: Callable[[int, int], Tensor] | None,
    visible: Tensor | None = None,
    bucket_starts: Tensor | None = None,
) -> dict[str, Tensor]:
    """Target mass captured by the gate's selection and by the true top-k, over queries with >= min_keys keys.

    `k`: one k for every query, or each query row's k (host int64 [T], e.g. a top-k schedule's).
    `visible` as for `gate_distill_loss`; `gate_selection(start, stop)` returns the gate's boolean
    selection [B, n, c, S] for a chunk. The query rows are the last T of the S key positions.
    Returns fp64 sums `gate`, `oracle` and `queries` (rows counted, times batch and selectors). With
    `bucket_starts` (host int64 [m], ascending, the first 0: the query positions where position
    buckets start), also `gate_by_bucket`, `oracle_by_bucket` and `queries_by_bucket` (fp64 [m]),
    the same sums over each bucket's queries; they add up to the whole-window sums (`queries`
    exactly, the masses up to fp64 rounding).
    """
    length, kv_len = query.shape[2], key.shape[2]
    visible = causal_visible(length, kv_len) if visible is None else visible
    key_count = allowed.sum(-1)  # [B|1, 1, T]
    sums = {name: torch.zeros((), dtype=torch.float64, device=query.device) for name in MASS_SUMS}
    if bucket_starts is not None:
        sums |= {f"{name}_by_bucket": query.new_zeros(len(bucket_starts), dtype=torch.float64) for name in MASS_SUMS}
        row_positions = torch.arange(kv_len - length, kv_len)
        bucket_of_row = torch.searchsorted(bucket_starts, row_positions, right=True) - 1
        bucket_of_row = bucket_of_row.to(query.device)
    for start in range(0, length, chunk):
        stop = min(start + chunk, length)
        keys = int(visible[stop - 1])
        if keys < min_keys:
            continue
        rows = (key_count[..., start:stop] >= min_keys).double()  # [B|1, 1, c]
        target = head_averaged_probs(
            query[:, :, start:stop], key[:, :, :keys], allowed[..., start:stop, :keys], scaling, num_selectors
        )
        rows = rows.expand(target.shape[0], target.shape[1], -1)
        oracle = _top_mass(target, k if isinstance(k, int) else k[start:stop])
        per_row = {"oracle": oracle.double() * rows, "queries": rows}
        if gate_selection is not None:
            picked = gate_selection(start, stop)[..., :keys]
            per_row["gate"] = (target * picked).sum(-1).double() * rows
        for name, values in per_row.items():
            sums[name] += values.sum()
            if bucket_starts is not None:
                by_row = values.sum((0, 1))
                sums[f"{name}_by_bucket"].index_add_(0, bucket_of_row[start:stop], by_row)
    return sums
