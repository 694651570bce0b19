"""The training-time records of a teacher-forced pass: the gate's KL and the captured attention mass.

Both are recorded only when the forward was asked for them (`forward_state.gsm_collect`) and go into
its records, per layer. The KL's target is the head-averaged main attention (`attention_targets`),
over all allowed keys, or in sparse training over the keys selected (as DSA trains its indexer); with
`gate_target: beyond_forced` less the keys the selection forces (`layout.without_forced`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gsm_train.attention.layer_pass import LayerPass
from gsm_train.attention.layout import Layout, kl_rows, without_forced
from gsm_train.attention.selection import GateSelector
from gsm_train.functional.attention_targets import captured_mass, gate_distill_loss
from gsm_train.functional.gate_distill import DistillTarget, reads_weights_directly


def kl_from_hidden(layer: LayerPass, index: Tensor | None) -> bool:
    """Whether the gate's KL is taken straight from the hidden states (`gate_distill`): stage 1, where the
    gate only feeds its KL (dense, no ASQ, no recall, no cache) on sampled rows that fit one chunk, and
    the hidden states need no gradient from it."""
    state, gate = layer.state, layer.adapter.gate
    hidden = layer.inputs[0]
    return (
        layer.mode == "dense"
        and layer.own is None
        and state.request.recall is None
        and state.cache is None
        and index is not None
        and len(index) <= state.settings.config.sparse_attention.query_chunk
        and reads_weights_directly(gate)
        and (state.settings.detach_gate_input or not hidden.requires_grad)
    )


def record_gate_kl(
    layer: LayerPass, layout: Layout, index: Tensor | None, selector: GateSelector | None, selection: Tensor
) -> None:
    """Record the layer's KL(main attention || gate) sum over its counted query rows and the rows counted
    (`index`: the sampled rows, or None for all)."""
    state, gate, query, key = layer.state, layer.adapter.gate, layer.query, layer.key
    rows_allowed, rows_counted = kl_rows(state, layout, index, query.shape[0])
    if state.request.distill_on_selection and layer.mode == "sparse" and gate.num_selectors == 1:
        rows_allowed = selection if index is None else selection[..., index, :]
        rows_allowed, rows_counted = without_forced(
            rows_allowed, rows_counted, layout, index, state.settings.config.sparse_attention
        )
    rows_q = query if index is None else query[:, :, index]
    if selector is None:  # kl_from_hidden
        hidden, cos, sin = layer.inputs
        target = DistillTarget(rows_q.detach(), key.detach(), rows_allowed, rows_counted, index, layer.scaling)
        total, count = gate(hidden, cos, sin, target)
    else:  # sampled rows were drawn on the device: every key is in bounds (the mask holds each row to its own)
        rows_gq, rows_visible = (
            (selector.gate_q, layout.visible)
            if index is None
            else (selector.gate_q[:, :, index], torch.full((len(index),), key.shape[2]))
        )
        total, count = gate_distill_loss(
            rows_q.detach(),
            key.detach(),
            rows_gq,
            selector.gate_k,
            rows_allowed,
            rows_counted,
            layer.scaling,
            state.settings.config.sparse_attention.query_chunk,
            rows_visible,
        )
    state.records.add_gate_kl(layer.adapter.layer_idx, total, count)


def record_captured_mass(layer: LayerPass, layout: Layout, selector: GateSelector | None) -> None:
    """Record the gate's and the oracle's captured target mass at the requested k
    (`CollectRequest.recall`; None: each query's scheduled k, the gate selecting as the model does),
    per position bucket too where `recall_buckets` asks."""
    request = layer.state.request
    k, min_keys = request.recall
    gate = layer.adapter.gate
    if k is None:
        pick = None if selector is None else selector.select
        k = layout.k_host
    else:
        constant_k = torch.full_like(layout.k, k)
        pick = None if selector is None else (lambda a, b: selector.select(a, b, constant_k, k, uniform=True))
    buckets = torch.tensor(request.recall_buckets) if request.recall_buckets else None
    sums = captured_mass(
        layer.query.detach(),
        layer.key.detach(),
        layout.allowed,
        layer.scaling,
        k,
        min_keys,
        layer.state.settings.config.sparse_attention.query_chunk,
        gate.num_selectors if gate is not None else 1,
        pick,
        layout.visible,
        buckets,
    )
    layer.state.records.add_captured_mass(layer.adapter.layer_idx, sums)
