"""The attention function registered with transformers: one dispatcher for every GSM layer.

Per call it takes one of these paths:
- the base path (transformers' SDPA): GSM switched off, or a dense layer with nothing to record;
- new tokens after earlier ones in a generation cache (a token step, a further prompt chunk): the cache
  computes it (`LayerCache.cached_attention`);
- a prompt into a generation cache in dense prefill: the base path, the cache keeping the gate keys;
- a teacher-forced pass (training, evaluation, a prompt): the K/V path (ASQ, bridge), main attention
  `dense`, `sparse` (the gate's top-k) or `oracle` (the true top-k), then the training-time records the
  forward was asked for (gate KL, captured mass).
With every GSM feature off, the output is the base SDPA's, bit for bit. Over a generation cache, every path
that runs a gate hands the cache the call's gate keys through `run_gate`, the one place they are written.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from gsm_train.attention.adapter import GSMAttentionAdapter
from gsm_train.attention.cache_protocol import CachedStep, LayerCache
from gsm_train.attention.forward_state import FORWARD_KWARG, ForwardState
from gsm_train.attention.layer_pass import LayerPass
from gsm_train.attention.layout import Layout, earlier_blocks, forward_layout, kl_candidates, sampled_rows
from gsm_train.attention.records import kl_from_hidden, record_captured_mass, record_gate_kl
from gsm_train.attention.selection import GateSelector, chunks, oracle_selection
from gsm_train.functional import own_block_attention as own_block
from gsm_train.modules.errors import GSMError

ATTN_IMPLEMENTATION = "gsm"
ATTENTION_CHUNK = 512  # queries per masked SDPA of a teacher-forced pass (`chunked_masked_attention`)


def gsm_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The registered attention function (signature of transformers' attention interface)."""
    state: ForwardState | None = kwargs.pop(FORWARD_KWARG, None)
    adapter: GSMAttentionAdapter | None = getattr(module, "gsm", None)
    if adapter is not None and state is None:
        raise GSMError(
            f"layer {module.layer_idx} of a GSM model was called outside the model's forward; "
            "call the model (or its decoder stack), not a layer"
        )
    inputs = state.layer_inputs.pop(module.layer_idx, None) if state is not None else None
    if adapter is None or not state.settings.enabled:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if inputs is None:
        raise GSMError(f"layer {module.layer_idx}: the gate's input was not kept; was the model injected?")
    scale = module.scaling if scaling is None else scaling
    layer_cache = state.layer_cache(module.layer_idx)
    if layer_cache is not None and layer_cache.attends_itself():
        gate_query = None
        if adapter.gate is not None:  # a dense prefill's chunk selects nothing: the keys alone
            gate_query, _ = run_gate(adapter, inputs, layer_cache, query=not layer_cache.prompt_attends_densely())
        step = CachedStep(module, adapter, query, *inputs, attention_mask, scale, state.settings, gate_query)
        return layer_cache.cached_attention(step), None
    if layer_cache is not None and layer_cache.prompt_attends_densely():  # dense prefill: the base's attention
        if adapter.gate is not None:  # the cache keeps the prompt's gate keys for the token steps
            run_gate(adapter, inputs, layer_cache, query=False)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    key, value, own = adapter.transform_kv(key, value, state)
    mode = adapter.attention_mode(state.settings)
    layer = LayerPass(module, adapter, state, query, key, value, own, inputs, scale, mode)
    if mode == "dense" and own is None and not _gate_runs_in_dense(layer):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    return teacher_forced_attention(layer, attention_mask, dropout, kwargs), None


def run_gate(
    adapter: GSMAttentionAdapter,
    inputs: tuple[Tensor, Tensor, Tensor],
    layer_cache: LayerCache | None,
    query: bool = True,
    detach: bool = False,
) -> tuple[Tensor | None, Tensor | None]:
    """The gate's queries and keys [B, n, T, dg] of the call's tokens from the layer input (hidden, cos, sin;
    `detach`: the hidden states detached). Without `query` (a dense prefill, which selects nothing) it only
    hands the cache the keys' projections and their RoPE to apply (`keep_gate_keys`, which rotates a chunk's
    keys of every layer in one call), and returns (None, None). A generation cache keeps the keys: the one
    place GSM writes gate keys into a cache but `gate_ahead_hook` (on a token step's device path the cache's
    `token_gate` runs the gate in one kernel, or hands over what `select_ahead` ran, and the keys come back
    None)."""
    gate = adapter.gate
    hidden, cos, sin = inputs
    hidden = hidden.detach() if detach else hidden
    if query and layer_cache is not None:
        token_query = layer_cache.token_gate(gate, hidden, cos, sin)  # a token step's one-kernel path
        if token_query is not None:
            return token_query, None
    if query:
        gate_q, gate_k = gate(hidden, cos, sin)
        kept, rotation = gate_k, None
    else:
        gate_q, gate_k = None, None
        kept, rotation = gate.projected_keys(hidden), gate.key_rotation(cos, sin)
    if layer_cache is not None:
        layer_cache.keep_gate_keys(kept, gate.key_bits, rotation)
    return gate_q, gate_k


def gate_ahead_hook(attention: nn.Module, args: tuple, kwargs: dict) -> None:
    """Pre-hook of a GSM attention module, after `forward_state`'s (which keeps the layer's input): over a
    generation cache, let the layer's cache start a token step's gate and key selection before the layer's
    projections run (`LayerCache.select_ahead`: where they take the device path; the gate's key is written
    then, and `run_gate` takes the gate's query from it)."""
    state: ForwardState | None = kwargs.get(FORWARD_KWARG)
    if state is None or state.cache is None or not state.settings.enabled:
        return
    hidden, cos, sin = state.layer_inputs[attention.layer_idx]
    state.layer_cache(attention.layer_idx).select_ahead(state.settings, hidden, cos, sin)


def _gate_runs_in_dense(layer: LayerPass) -> bool:
    """Whether a dense layer's gate must run: to record its KL or recall, or to fill a generation cache."""
    request = layer.state.request
    return layer.adapter.gate is not None and (
        request.distill or request.recall is not None or layer.state.cache is not None
    )


def teacher_forced_attention(
    layer: LayerPass, attention_mask: Tensor | None, dropout: float, sdpa_kwargs: dict[str, Any]
) -> Tensor:
    """Main attention of a whole-sequence pass [B, T, Hq, D], and the records asked for."""
    query, key, request = layer.query, layer.key, layer.state.request
    q_len, kv_len = query.shape[2], key.shape[2]
    if q_len != kv_len:
        raise GSMError(
            f"layer {layer.adapter.layer_idx}: {layer.mode} attention, distillation and recall need the "
            f"whole sequence (got {q_len} queries over {kv_len} cached keys); call the model with "
            "use_cache=False for teacher-forced passes, and generate over a GSM cache: "
            "GSMModel.from_pretrained, or enable_gsm_generation(model) (both: from gsm_train import ...)"
        )
    layout = forward_layout(layer.state, attention_mask, q_len, kv_len, query.device)
    gate = layer.adapter.gate
    index = (
        sampled_rows(layer.state, kl_candidates(layout, layer.state.settings.config.sparse_attention), query.device)
        if request.distill and gate is not None
        else None
    )
    selector = _gate_selector(layer, layout, index)
    if layer.mode == "dense" and layer.own is None:
        out = sdpa_attention_forward(
            layer.module, query, key, layer.value, attention_mask, dropout=dropout, scaling=layer.scaling, **sdpa_kwargs
        )[0]
        selection = layout.allowed
    else:
        selection = _selection(layer, layout, selector)
        out = attend_selected(layer, selection)
    if request.distill and gate is not None:
        record_gate_kl(layer, layout, index, selector, selection)
    if request.recall is not None:
        record_captured_mass(layer, layout, selector)
    return out


def _gate_selector(layer: LayerPass, layout: Layout, index: Tensor | None) -> GateSelector | None:
    """The gate's scores for this pass (None where nothing needs them: no gate, or stage 1's KL taken
    straight from the hidden states, `records.kl_from_hidden`). A prompt's gate keys go into the cache."""
    gate, state = layer.adapter.gate, layer.state
    if gate is None or kl_from_hidden(layer, index):
        return None
    if layer.mode != "sparse" and not _gate_runs_in_dense(layer):
        return None
    layer_cache = state.layer_cache(layer.adapter.layer_idx)  # a generation's prompt: the cache keeps its keys
    gate_q, gate_k = run_gate(layer.adapter, layer.inputs, layer_cache, detach=state.settings.detach_gate_input)
    stored_k = gate.stored_keys(gate_k) if layer.mode == "sparse" or state.request.recall is not None else None
    training_shapes = layer.query.is_cuda and layer.module.training
    return GateSelector(gate, gate_q, gate_k, stored_k, layout, state.settings.config.sparse_attention, training_shapes)


def _selection(layer: LayerPass, layout: Layout, selector: GateSelector | None) -> Tensor:
    """The keys each query keeps [B|1, n, T, S]: all allowed ones (dense), the gate's or the oracle's top-k."""
    if layer.mode == "dense":
        return layout.allowed
    config = layer.state.settings.config.sparse_attention
    num_selectors = layer.adapter.gate.num_selectors if layer.adapter.gate is not None else 1
    if layer.mode == "sparse":
        pick = selector.select
    else:

        def pick(start: int, stop: int) -> Tensor:
            return oracle_selection(
                layer.query,
                layer.key,
                layer.own,
                layout,
                config,
                layer.block_size,
                layer.scaling,
                num_selectors,
                start,
                stop,
            )

    with torch.no_grad():
        return torch.cat([pick(a, b) for a, b in chunks(layer.query.shape[2], config.query_chunk)], dim=2)


def attend_selected(layer: LayerPass, selection: Tensor) -> Tensor:
    """Attention [B, T, Hq, D] over the selected keys: earlier blocks as stored, the own block raw. In a
    training forward on CUDA that is captured or large enough (`own_block.serves`), FlexAttention over
    only the tiles queries see; else masked SDPAs of ATTENTION_CHUNK queries each (`chunked_masked_attention`)."""
    module, query, own = layer.module, layer.query, layer.own
    gqa = module.num_key_value_groups > 1
    if own is not None and module.training and own_block.serves(query, layer.state.settings.captured_steps):
        return own_block.own_block_attention(
            query, (layer.key, layer.value), own, selection, layer.block_size, layer.scaling, gqa
        )
    return chunked_masked_attention(
        query, (layer.key, layer.value), own, selection, layer.block_size, layer.scaling, gqa
    )


def chunked_masked_attention(
    query: Tensor,
    stored: tuple[Tensor, Tensor],
    own: tuple[Tensor, Tensor] | None,
    selection: Tensor,
    block_size: int,
    scaling: float,
    gqa: bool,
    chunk: int = ATTENTION_CHUNK,
) -> Tensor:
    """What one masked SDPA of every query over `block_causal_kv`'s 2S keys computes, [B, T, Hq, D], in
    query chunks that read only the keys they can select: for queries [a, b), the stored keys [0, b) (the
    selection is causal) and the raw keys of the blocks they own, [a rounded down to a block, b). For a
    prompt of T tokens that is about T^2 / 2 + T * chunk (query, key) pairs instead of 2 T^2. query
    [B, Hq, T, D] at positions 0..T-1; stored and own K/V [B, Hkv, T, D]; selection [B|1, n, T, T].

    The query chunks and the K/V spans are joined from pieces split once at every chunk and block edge
    (`_pieces`), not sliced per chunk: a slice's gradient is a zero-filled tensor of the whole sequence
    that the backward then adds up once per chunk, a piece's only the piece's rows.

    Exact across lengths: a query's row is bit for bit the same in a pass over any longer sequence (the
    short last chunk is padded to a whole one), as a causal SDPA's rows are, so a prefill's K/V and ASQ codes
    are those of teacher forcing over the longer text (benchmarks.step_kl)."""
    length = query.shape[2]
    starts = range(0, length, chunk)
    firsts = [start // block_size * block_size for start in starts] if own is not None else []
    edges = sorted({*starts, *firsts, length})
    stored_pieces = _pieces(stored, edges)
    own_pieces = _pieces(own, edges) if own is not None else None
    parts = []
    for start, queries in zip(starts, query.split(chunk, 2)):
        stop = min(start + chunk, length)
        stop_at = edges.index(stop)
        keys, values = (list(pieces[:stop_at]) for pieces in stored_pieces)
        rows = selection[..., start:stop, :stop]
        if own_pieces is not None:
            first = start // block_size * block_size
            earlier = earlier_blocks(torch.arange(start, stop, device=query.device), stop, block_size)
            own_keys, own_values = (pieces[edges.index(first) : stop_at] for pieces in own_pieces)
            rows, own_rows = rows & earlier, (rows & ~earlier)[..., first:]
        # a short last chunk is padded to a whole one (queries, stored and raw keys no real query sees), so a
        # query's keys sit where, and among as many as, in any longer pass: SDPA sums them in the same order
        # and the query's row comes out bit for bit as there
        padding = start + chunk - stop
        keys += _blanks(keys[0], padding)
        values += _blanks(values[0], padding)
        rows = torch.nn.functional.pad(rows, (0, padding))
        if own_pieces is not None:
            keys += [*own_keys, *_blanks(keys[0], padding)]
            values += [*own_values, *_blanks(values[0], padding)]
            rows = torch.cat((rows, torch.nn.functional.pad(own_rows, (0, padding))), -1)
        if padding:
            queries = torch.cat((queries, *_blanks(queries, padding)), 2)
            blank_rows = torch.zeros(*rows.shape[:2], padding, rows.shape[3], dtype=torch.bool, device=rows.device)
            blank_rows[..., stop] = True  # a padding query sees one blank key: a finite row, dropped below
            rows = torch.cat((rows, blank_rows), 2)
        parts.append(masked_sdpa(queries, _joined(keys), _joined(values), rows, scaling, gqa)[:, : stop - start])
    return torch.cat(parts, 1)


def _pieces(pair: tuple[Tensor, Tensor], edges: list[int]) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """Both tensors of `pair` [B, H, T, D] split along T at `edges` (0, the inner edges, T, ascending)."""
    sizes = [stop - start for start, stop in zip(edges, edges[1:])]
    return pair[0].split(sizes, 2), pair[1].split(sizes, 2)


def _blanks(like: Tensor, length: int) -> list[Tensor]:
    """[zeros [B, H, length, D]] of `like`'s kind [B, H, *, D] (none for 0): rows no real query reads."""
    return [like.new_zeros(*like.shape[:2], length, like.shape[3])] if length else []


def _joined(pieces: list[Tensor]) -> Tensor:
    """Consecutive pieces along T as one tensor (a lone piece as it is, without a copy)."""
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, 2)


def masked_sdpa(query: Tensor, key: Tensor, value: Tensor, selection: Tensor, scaling: float, gqa: bool) -> Tensor:
    """SDPA restricted to the selected keys -> [B, T, Hq, D]; selection [B|1, n, T, S] is shared by the n
    head groups. One selection for all heads (n = 1) goes in as a broadcast mask with the KV heads as they
    are (`enable_gqa`), which needs no copy of K/V per head; one per KV group needs the mask per head."""
    heads = query.shape[1]
    mask = selection if selection.shape[1] == 1 else selection.repeat_interleave(heads // selection.shape[1], dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa
    )
    return out.transpose(1, 2).contiguous()
