"""Stage 1's gate loss straight from the layer's hidden states, with the gate weights' gradients
formed in the same pass.

When the gate only feeds its KL (the gate warm-up: main attention dense, no selection, no recall),
nothing else needs the gate's queries and keys, so one function computes the projections (queries
only for the sampled rows), RoPE, the KL against the head-averaged attention, and the gradients of
the two projection weights, by hand: RoPE's transpose (rotation by -theta) takes the KL's gradient
back to the projections' outputs. On the GPU the function is compiled once per shape, so a layer
costs a few fused kernels instead of some thirty small ones and needs no backward pass of its own.
The result equals `SparseGateHead` + `gate_distill_loss` + autograd (a test checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

from gsm_train.compiled import compiled
from gsm_train.functional.attention_targets import GradientsFromForward, chunk_kl, full_batch, head_averaged_probs
from gsm_train.functional.gate_rope import rope_tables, rotate


def _gate_kl_from_hidden(
    q_weight: Tensor,
    k_weight: Tensor,
    hidden: Tensor,
    cos: Tensor,
    sin: Tensor,
    freq_index: Tensor,
    target: Tensor,
    mask: Tensor,
    rows: Tensor,
    index: Tensor,
    want_grad: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """KL sum over the sampled query rows `index` against their `target` (`head_averaged_probs`), and the
    gradients of the q/k projection weights."""
    batch, length, _ = hidden.shape
    selectors, dim = freq_index.shape[0], 2 * freq_index.shape[1]
    hidden_rows = hidden[:, index]
    k = F.linear(hidden, k_weight).view(batch, length, selectors, dim).transpose(1, 2)
    q = F.linear(hidden_rows, q_weight).view(batch, len(index), selectors, dim).transpose(1, 2)
    c, s = rope_tables(cos, sin, freq_index, k.dtype)
    c_rows, s_rows = c[:, :, index], s[:, :, index]
    total, grad_q, grad_k = chunk_kl(
        rotate(q, c_rows, s_rows).float(), rotate(k, c, s).float(), target, mask, rows, want_grad
    )
    if not want_grad:
        return total, None, None
    grad_q = rotate(grad_q, c_rows.float(), -s_rows.float()).transpose(1, 2).reshape(-1, selectors * dim)
    grad_k = rotate(grad_k, c.float(), -s.float()).transpose(1, 2).reshape(-1, selectors * dim)
    return (
        total,
        grad_q.t() @ hidden_rows.reshape(len(grad_q), -1).float(),
        grad_k.t() @ hidden.reshape(len(grad_k), -1).float(),
    )


class _GateKLFromHidden(GradientsFromForward):
    """The KL sum as a function of the two projection weights; their gradients come from the forward."""

    @staticmethod
    def forward(
        ctx,
        q_weight: Tensor,
        k_weight: Tensor,
        hidden: Tensor,
        cos: Tensor,
        sin: Tensor,
        freq_index: Tensor,
        target: Tensor,
        mask: Tensor,
        rows: Tensor,
        index: Tensor,
    ) -> Tensor:
        want_grad = any(ctx.needs_input_grad[:2])
        kl = compiled(_gate_kl_from_hidden) if hidden.is_cuda and want_grad else _gate_kl_from_hidden
        total, grad_q_weight, grad_k_weight = kl(
            q_weight, k_weight, hidden, cos, sin, freq_index, target, mask, rows, index, want_grad
        )
        if want_grad:  # handed back in the weights' own dtype
            _GateKLFromHidden.keep_gradients(ctx, grad_q_weight, grad_k_weight, (q_weight.dtype, k_weight.dtype))
        return total


@dataclass(frozen=True)
class DistillTarget:
    """What the gate's KL compares against, for the sampled query rows `index` (all in one chunk; their
    positions in a full-length pass, so no row sees a key after its own position): query [B, Hq, R, D]
    (those rows), key [B, Hkv, S, D], allowed_rows [B|1, 1, R, S] and counted_rows [B|1, 1, R] (rows
    with at least k keys), and the attention's scaling."""

    query: Tensor
    key: Tensor
    allowed_rows: Tensor
    counted_rows: Tensor
    index: Tensor
    scaling: float


def reads_weights_directly(module: torch.nn.Module) -> bool:
    """Whether the fused path may read the gate's projection weights without calling the Linear layers:
    not under ZeRO-3, which partitions each Linear's weight (`ds_id`) and gathers it only when that
    Linear itself is called (FSDP2 gathers a whole gate when the gate is called, which the path does)."""
    return not any(hasattr(p, "ds_id") for p in module.parameters())


def gate_kl_from_hidden(
    q_weight: Tensor,
    k_weight: Tensor,
    freq_index: Tensor,
    hidden: Tensor,
    cos: Tensor,
    sin: Tensor,
    target: DistillTarget,
) -> tuple[Tensor, Tensor]:
    """Sum of KL(target || gate) over the target's rows, and the number of rows counted, as
    `gate_distill_loss` gives for the gate's own queries and keys. `hidden` [B, S, d], the gate's input
    in the dtype its projections take, gets no gradient (stage 1's base is frozen)."""
    mask, rows = full_batch(target.allowed_rows, target.counted_rows, target.query.shape[0])
    # each row sees no key after its own position: the target skips the keys past its tile's last row
    probs = head_averaged_probs(
        target.query, target.key, mask, target.scaling, freq_index.shape[0], key_limit=target.index + 1
    )
    total = _GateKLFromHidden.apply(q_weight, k_weight, hidden, cos, sin, freq_index, probs, mask, rows, target.index)
    return total, rows.expand(-1, freq_index.shape[0], -1).sum()
