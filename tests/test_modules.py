"""Unit tests of the Sparse Gate Head, the stage-1 attention targets and the cache bridge (CPU)."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F
from run_helpers import KERNEL_DEVICE, KERNELS_RUN_HERE, triton_kernel_test
from torch import Tensor
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from gsm_train.functional.attention_targets import (
    captured_mass,
    gate_distill_loss,
    head_averaged_probs,
)
from gsm_train.functional.gate_keys import decode_gate_keys, encode_gate_keys, gate_key_bytes
from gsm_train.functional.top_k import k_per_query, select_top_k
from gsm_train.modules import CacheBridge, SparseGateHead

T = 24


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _causal(length: int = T) -> Tensor:
    """[1, 1, T, T] causal visibility."""
    return torch.ones(length, length, dtype=torch.bool).tril()[None, None]


def _rope(length: int, head_dim: int, base: float = 10000.0) -> tuple[Tensor, Tensor]:
    """cos/sin [1, T, head_dim] in the rotate-half layout of Llama-style models."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2).double() / head_dim)
    angles = torch.arange(length).double()[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)[None]
    return emb.cos().float(), emb.sin().float()


def _reference_target(query: Tensor, key: Tensor, allowed: Tensor, scaling: float, num_selectors: int) -> Tensor:
    """Head-averaged attention probabilities [B, n, T, S], written densely by hand."""
    groups = query.shape[1] // key.shape[1]
    logits = query @ key.repeat_interleave(groups, dim=1).transpose(-1, -2) * scaling
    probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
    return probs.unflatten(1, (num_selectors, -1)).mean(2)


# --------------------------------------------------------------------------- k_per_query


@pytest.mark.parametrize(
    ("schedule", "rate", "expected"),
    [
        ("constant", 0.5, lambda t: torch.full_like(t, 16.0)),
        ("exp_decay", 0.05, lambda t: torch.floor(16 * torch.exp(-0.05 * t))),
        ("linear_decay", 0.5, lambda t: torch.floor(16 - 0.5 * t)),
    ],
)
def test_k_per_query_schedules(schedule: str, rate: float, expected) -> None:
    t = torch.arange(200)
    k = k_per_query(t, schedule, top_k=16, k_min=4, decay_rate=rate)
    assert k.dtype == torch.long
    assert torch.equal(k, expected(t.double()).clamp(4, 16).long())
    assert bool((k[1:] <= k[:-1]).all())
    assert int(k[0]) == 16
    if schedule != "constant":
        assert int(k[-1]) == 4  # floored at k_min


@pytest.mark.parametrize(("fraction", "k_min", "top_k"), [(0.25, 4, 16), (0.1, 2, 100), (1.0, 1, 7), (0.3, 5, 5)])
def test_fraction_schedule_keeps_a_share_of_the_visible_keys_within_floor_and_ceiling(
    fraction: float, k_min: int, top_k: int
) -> None:
    t = torch.arange(400)
    k = k_per_query(t, "fraction", top_k=top_k, k_min=k_min, decay_rate=0.0, fraction=fraction)
    expected = [min(max(math.ceil(round(fraction * (p + 1), 6)), k_min), top_k) for p in range(400)]
    assert k.dtype == torch.long and k.tolist() == expected
    assert bool(((k >= k_min) & (k <= top_k)).all()) and bool((k[1:] >= k[:-1]).all())
    # never more keys than the query sees once it sees k_min: the counted positions form a suffix
    assert bool((k[k_min - 1 :] <= t[k_min - 1 :] + 1).all())


def test_fraction_schedule_rounds_the_share_as_decimals_do() -> None:
    """0.1 x 30 is 3.0000000000000004 in binary: the schedule keeps 3 keys, as its formula reads."""
    k = k_per_query(torch.tensor([29, 9]), "fraction", top_k=64, k_min=1, decay_rate=0.0, fraction=0.1)
    assert k.tolist() == [3, 1]


def test_fraction_schedule_needs_its_fraction() -> None:
    with pytest.raises(ValueError, match="fraction in"):
        k_per_query(torch.arange(4), "fraction", 8, 4, 0.0)


def test_k_per_query_never_above_top_k() -> None:
    k = k_per_query(torch.arange(50), "exp_decay", top_k=8, k_min=32, decay_rate=0.1)
    assert torch.equal(k, torch.full((50,), 8))


def test_k_per_query_rejects_unknown_schedule() -> None:
    with pytest.raises(ValueError, match="exp_decay"):
        k_per_query(torch.arange(4), "cosine", 8, 4, 0.1)


# --------------------------------------------------------------------------- select_top_k


def _select(
    k: int | Tensor, allowed: Tensor | None = None, sinks: int = 0, recent: int = 0, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """(selection, allowed, scores) for random scores over T queries and T keys, 2 batch rows, 2 selectors."""
    allowed = _causal() if allowed is None else allowed
    scores = torch.randn(2, 2, T, T, generator=_gen(seed))
    positions = torch.arange(T)
    k = torch.full((T,), k) if isinstance(k, int) else k
    return select_top_k(scores, allowed, k, positions, positions, sinks, recent), allowed.expand_as(scores), scores


def test_select_top_k_counts_and_own_position() -> None:
    k = 5
    selection, allowed, _ = _select(k)
    own = torch.eye(T, dtype=torch.bool).expand_as(selection)
    assert bool(selection[own].all())
    assert not bool((selection & ~allowed).any())
    assert torch.equal(selection[..., :k, :], allowed[..., :k, :])  # <= k keys: dense
    assert bool((selection[..., k:, :].sum(-1) == k).all())


def test_select_top_k_keeps_best_scores() -> None:
    """Besides the own position, the k - 1 best-scored earlier keys are kept."""
    k = 4
    selection, _, scores = _select(k)
    for t in range(k, T):
        earlier = scores[..., t, :t]
        best = earlier.topk(k - 1, dim=-1).indices
        expected = torch.zeros_like(earlier, dtype=torch.bool).scatter(-1, best, True)
        assert torch.equal(selection[..., t, :t], expected)


def test_a_larger_top_k_bound_selects_the_same_keys() -> None:
    """What lets the compiled selection take one `k_max` for all query chunks of a decaying schedule."""
    scores, positions = torch.randn(2, 2, T, T, generator=_gen(3)), torch.arange(T)
    k = k_per_query(positions, "linear_decay", 9, 2, 0.5)
    for sinks, recent in ((0, 0), (1, 2)):
        for start, stop in ((0, T // 2), (T // 2, T)):
            args = (
                scores[..., start:stop, :],
                _causal()[..., start:stop, :],
                k[start:stop],
                positions[start:stop],
                positions,
                sinks,
                recent,
            )
            assert torch.equal(select_top_k(*args, int(k.max())), select_top_k(*args))


@pytest.mark.parametrize(("sinks", "recent"), [(0, 0), (1, 2)])
def test_one_k_for_every_query_selects_the_same_keys_unsorted(sinks: int, recent: int) -> None:
    """`uniform_k` (top-k unsorted, no ranks) keeps exactly the ranked path's keys when every query has k_max."""
    scores, positions, k = torch.randn(2, 2, T, T, generator=_gen(4)), torch.arange(T), torch.full((T,), 5)
    args = (scores, _causal(), k, positions, positions, sinks, recent, 5)
    assert torch.equal(select_top_k(*args, uniform_k=True), select_top_k(*args))


def test_fraction_schedule_selects_k_t_keys_at_every_position() -> None:
    """The selection keeps exactly k_t keys per query (all of them while it sees fewer), with k_t
    within the schedule's floor and ceiling."""
    positions = torch.arange(T)
    k = k_per_query(positions, "fraction", top_k=9, k_min=3, decay_rate=0.0, fraction=0.5)
    selection, allowed, _ = _select(k)
    counts = selection.sum(-1)
    assert torch.equal(counts, torch.minimum(k, positions + 1).expand_as(counts))
    assert int(k.min()) == 3 and int(k.max()) == 9 and bool((k >= 3).all() & (k <= 9).all())


def test_select_top_k_per_query_k() -> None:
    k = torch.tensor([3, 6] * (T // 2))
    selection, _, _ = _select(k)
    assert torch.equal(selection.sum(-1), torch.minimum(k, torch.arange(T) + 1).expand(2, 2, T))


def test_select_top_k_forces_sinks_and_recent() -> None:
    sinks, recent = 2, 3
    selection, allowed, _ = _select(k=6, sinks=sinks, recent=recent)
    t = torch.arange(T)
    distance = t[:, None] - t[None, :]
    forced = ((t[None, :] < sinks) | ((distance >= 0) & (distance < recent))) & allowed
    assert bool(selection[forced].all())
    assert not bool((selection & ~allowed).any())
    assert bool((selection[..., 6:, :].sum(-1) == 6).all())  # forced keys fit inside k here


def test_select_top_k_never_selects_disallowed_keys() -> None:
    padding = torch.rand(2, 1, 1, T, generator=_gen(1)) > 0.3
    allowed = _causal() & padding
    for k in (1, 4, T):
        selection, full_allowed, _ = _select(k, allowed=allowed, sinks=2, recent=2)
        assert not bool((selection & ~full_allowed).any())


# --------------------------------------------------------------------------- SparseGateHead


def _head_averaged_logits(
    hidden: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
    num_selectors: int,
    cos: Tensor,
    sin: Tensor,
) -> Tensor:
    """`(1/H_sel) sum_h q_h . k_g(h) / sqrt(head_dim)` after RoPE, per selector: [1, n, T, T]."""
    q = (hidden @ q_weight.T).view(1, -1, heads, head_dim).transpose(1, 2)
    k = (hidden @ k_weight.T).view(1, -1, kv_heads, head_dim).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    logits = q @ k.repeat_interleave(heads // kv_heads, dim=1).transpose(-1, -2) / math.sqrt(head_dim)
    return logits.unflatten(1, (num_selectors, -1)).mean(2)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "num_selectors", "gate_dim"),
    [
        (1, 1, 1, 16),
        (4, 2, 2, 16),
        (4, 2, 1, 16),
        (1, 1, 1, 32),
    ],
)
def test_gate_init_reproduces_rank_one_attention(heads: int, kv_heads: int, num_selectors: int, gate_dim: int) -> None:
    """Each frequency's matrix is rank 1 (query heads of a selector are scaled copies, one KV head per
    selector), so the SVD init reproduces the head-averaged attention logits exactly."""
    hidden_size, head_dim, length = 32, 16, 20
    g = _gen(2)
    k_weight = torch.randn(kv_heads, head_dim, hidden_size, generator=g) / math.sqrt(hidden_size)
    if num_selectors < kv_heads:  # one selector over several KV heads is rank 1 only if they are equal
        k_weight = k_weight[:1].expand(kv_heads, -1, -1)
    per_selector = torch.randn(num_selectors, 1, head_dim, hidden_size, generator=g) / math.sqrt(hidden_size)
    scales = torch.rand(num_selectors, heads // num_selectors, 1, 1, generator=g) + 0.5
    q_weight = (per_selector * scales).reshape(heads * head_dim, hidden_size)
    k_weight = k_weight.reshape(kv_heads * head_dim, hidden_size)
    gate = SparseGateHead(hidden_size, gate_dim, head_dim, num_selectors)
    gate.init_from_attention(q_weight, k_weight, heads, kv_heads, head_dim)
    hidden = torch.randn(1, length, hidden_size, generator=g)
    cos, sin = _rope(length, head_dim)
    expected = _head_averaged_logits(hidden, q_weight, k_weight, heads, kv_heads, head_dim, num_selectors, cos, sin)
    gate_q, gate_k = gate(hidden, cos, sin)  # the products themselves (scores() rounds keys to bf16 as cached)
    assert torch.allclose(gate_q @ gate_k.transpose(-1, -2) / math.sqrt(gate_dim), expected, atol=1e-4, rtol=1e-4)


def test_gate_init_keeps_strongest_frequencies() -> None:
    """With fewer gate pairs than base frequencies, the gate keeps the frequencies of largest sigma."""
    hidden_size, head_dim = 32, 16
    q_weight = torch.randn(head_dim, hidden_size, generator=_gen(3))
    k_weight = torch.randn(head_dim, hidden_size, generator=_gen(4))
    strength = (2.0 ** torch.arange(head_dim // 2)).repeat(2)[:, None]
    gate = SparseGateHead(hidden_size, 4, head_dim)
    gate.init_from_attention(q_weight * strength, k_weight, 1, 1, head_dim)
    assert set(gate.rope_freq_index[0].tolist()) == {7, 6}


def test_gate_rejects_odd_dim() -> None:
    with pytest.raises(ValueError, match="even"):
        SparseGateHead(16, 7, 16)


def test_int8_gate_keys_round_to_half_a_step() -> None:
    """8-bit gate keys: int8 codes and an fp16 scale max|k|/127 per key (at least fp16's smallest normal),
    error at most half a stored step at any magnitude, 66 bytes for 64 dims; selection scores the keys as stored."""
    torch.manual_seed(0)
    magnitude = torch.logspace(-6, 1, 50).view(1, 1, 50, 1)  # down to keys whose scale max|k|/127 is below
    # fp16's smallest normal (it is stored as that, and divides by what is stored)
    gate_k = torch.randn(2, 1, 50, 64) * magnitude
    gate_k[0, 0, 3] = 0.0  # an all-zero key stays zero
    codes, scales = encode_gate_keys(gate_k, 8)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float16 and scales.shape == (2, 1, 50, 1)
    assert int(codes.abs().max()) == 127 and bool((scales > 0).all())
    error = (decode_gate_keys(codes, scales) - gate_k).abs()
    assert bool((error <= scales.float() * 0.5 + gate_k.abs() * 2e-3).all())
    assert torch.equal(decode_gate_keys(codes, scales)[0, 0, 3], torch.zeros(64))
    assert (gate_key_bytes(64, 8), gate_key_bytes(64, 16)) == (66, 128)
    gate = SparseGateHead(16, 64, 8, key_bits=8)
    gate_q = torch.randn(2, 1, 50, 64)
    # the keys selection scores are the stored ones bit for bit (one expression, compiled in training), and the
    # 1/sqrt(64) on the queries gives the logits' bits
    assert torch.equal(gate.stored_keys(gate_k), decode_gate_keys(codes, scales))
    assert torch.equal(
        gate.score_stored(gate_q, gate.stored_keys(gate_k)),
        torch.matmul(gate_q, decode_gate_keys(codes, scales).transpose(-1, -2)) / 8.0,
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled rounding serves CUDA training steps")
def test_compiled_int8_gate_key_rounding_keeps_the_fp16_scales() -> None:
    """In training on the GPU the 8-bit round trip runs compiled; the keys equal the stored ones on this data
    (Inductor would drop a plain fp16 cast of the scales; its division may still round a rare key apart)."""
    torch.manual_seed(0)
    gate_k = torch.randn(4, 1, 2048, 16, device="cuda") * torch.logspace(-6, 1, 2048, device="cuda")[:, None]
    gate = SparseGateHead(16, 16, 8, key_bits=8).cuda().train()
    assert torch.equal(gate.stored_keys(gate_k), decode_gate_keys(*encode_gate_keys(gate_k, 8)))


# --------------------------------------------------------------------------- gate_distill_loss


def _attention_inputs(
    heads: int = 4, kv_heads: int = 2, head_dim: int = 8, batch: int = 2, seed: int = 5
) -> tuple[Tensor, Tensor]:
    g = _gen(seed)
    return (torch.randn(batch, heads, T, head_dim, generator=g), torch.randn(batch, kv_heads, T, head_dim, generator=g))


def _distill(chunk: int, num_selectors: int = 2) -> tuple[Tensor, Tensor, SparseGateHead]:
    """Gate KL through a real SparseGateHead, so gradients reach its projections."""
    query, key = _attention_inputs()
    torch.manual_seed(0)
    gate = SparseGateHead(16, 6, 8, num_selectors)
    gate_q, gate_k = gate(torch.randn(2, T, 16, generator=_gen(6)), *_rope(T, 8))
    allowed = _causal()
    counted = allowed.sum(-1) >= 3
    total, count = gate_distill_loss(query, key, gate_q, gate_k, allowed, counted, 8**-0.5, chunk)
    total.backward()
    return total, count, gate


def test_distill_loss_positive_with_gradients() -> None:
    total, count, gate = _distill(chunk=5)
    assert torch.isfinite(total) and total.item() > 0
    assert int(count) == 2 * 2 * (T - 2)  # batch x selectors x rows with >= 3 keys
    for weight in (gate.q_proj.weight, gate.k_proj.weight):
        assert weight.grad is not None and torch.isfinite(weight.grad).all() and weight.grad.abs().sum() > 0


def test_distill_loss_independent_of_chunk() -> None:
    small, _, gate_small = _distill(chunk=3)
    large, _, gate_large = _distill(chunk=1000)
    assert torch.allclose(small, large, rtol=1e-5, atol=1e-5)
    for a, b in ((gate_small.q_proj, gate_large.q_proj), (gate_small.k_proj, gate_large.k_proj)):
        assert torch.allclose(a.weight.grad, b.weight.grad, rtol=1e-4, atol=1e-6)


def test_distill_loss_and_gradients_match_dense_kl() -> None:
    """The chunked loss and its gradients equal a dense KL differentiated by autograd."""
    query, key = _attention_inputs()
    gate_q, gate_k = (torch.randn(2, 2, T, 6, generator=_gen(seed)).requires_grad_() for seed in (7, 8))
    allowed = _causal()
    counted = allowed.sum(-1) >= 4
    total, _ = gate_distill_loss(query, key, gate_q, gate_k, allowed, counted, 0.3, chunk=7)
    target = _reference_target(query, key, allowed, 0.3, 2)
    log_gate = (gate_q @ gate_k.transpose(-1, -2) / math.sqrt(6)).masked_fill(~allowed, float("-inf")).log_softmax(-1)
    kl = torch.where(allowed, target * (target.log() - log_gate), torch.zeros(())).sum(-1)
    expected = kl[counted.expand_as(kl)].sum()
    assert torch.allclose(total, expected, rtol=1e-5)
    got_grads = torch.autograd.grad(total, (gate_q, gate_k))
    for got, want in zip(got_grads, torch.autograd.grad(expected, (gate_q, gate_k)), strict=True):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6)


def test_distill_gradients_finite_with_left_padding() -> None:
    query, key = _attention_inputs()
    gate_q, gate_k = (torch.randn(2, 2, T, 6, generator=_gen(seed)).requires_grad_() for seed in (10, 11))
    allowed = _causal() & (torch.arange(T) >= torch.tensor([[3], [0]]))[:, None, None, :]  # row 0: 3 pads
    counted = allowed.sum(-1) >= 2
    total, _ = gate_distill_loss(query, key, gate_q, gate_k, allowed, counted, 0.3, chunk=5)
    total.backward()
    assert torch.isfinite(total)
    assert torch.isfinite(gate_q.grad).all() and torch.isfinite(gate_k.grad).all()


def test_distill_loss_zero_when_gate_is_the_attention() -> None:
    """One head and a gate equal to its q/k at the same temperature: KL(target || gate) = 0."""
    query, key = _attention_inputs(heads=1, kv_heads=1)
    allowed = _causal()
    total, _ = gate_distill_loss(query, key, query, key, allowed, allowed.sum(-1) >= 1, 8**-0.5, chunk=5)
    assert abs(float(total)) < 1e-6


# --------------------------------------------------------------------------- captured_mass


def _mass(k: int, min_keys: int, chunk: int, pick_oracle: bool) -> tuple[dict[str, Tensor], Tensor]:
    query, key = _attention_inputs()
    allowed = _causal()
    target = _reference_target(query, key, allowed, 0.4, 2)
    top = target.topk(k, dim=-1).indices
    oracle_pick = torch.zeros_like(target, dtype=torch.bool).scatter(-1, top, True)

    def gate_selection(start: int, stop: int) -> Tensor:
        return oracle_pick[:, :, start:stop]

    sums = captured_mass(query, key, allowed, 0.4, k, min_keys, chunk, 2, gate_selection if pick_oracle else None)
    return sums, target


def test_captured_mass_oracle_is_dense_top_k() -> None:
    k, min_keys = 4, 6
    sums, target = _mass(k, min_keys, chunk=5, pick_oracle=False)
    rows = torch.arange(T) + 1 >= min_keys
    expected = target.topk(k, dim=-1).values.sum(-1)[..., rows]
    assert torch.allclose(sums["oracle"], expected.double().sum(), rtol=1e-6)
    assert int(sums["queries"]) == expected.numel()
    assert float(sums["gate"]) == 0.0
    assert 0 < float(sums["oracle"]) <= float(sums["queries"])


def test_captured_mass_gate_equal_to_oracle_selection() -> None:
    sums, _ = _mass(k=4, min_keys=4, chunk=7, pick_oracle=True)
    assert torch.allclose(sums["gate"], sums["oracle"], rtol=1e-6)


def test_captured_mass_by_bucket_is_the_mass_of_each_buckets_queries() -> None:
    """Per position bucket, the sums are those of a pass over only that bucket's query rows (the
    last rows of the keys) up to fp32 rounding (the passes chunk the keys differently), and they add
    up to the window's to fp64 rounding."""
    query, key = _attention_inputs()
    allowed = _causal()
    target = _reference_target(query, key, allowed, 0.4, 2)
    random_top = torch.randn_like(target).topk(4).indices
    gate_pick = torch.zeros_like(target, dtype=torch.bool).scatter(-1, random_top, True) & allowed

    def mass(first: int, stop: int, buckets: Tensor | None = None) -> dict[str, Tensor]:
        """captured_mass of the queries [first, stop) over the keys [0, stop)."""

        def pick(a: int, b: int) -> Tensor:
            return gate_pick[:, :, first + a : first + b, :stop]

        return captured_mass(
            query[:, :, first:stop],
            key[:, :, :stop],
            allowed[..., first:stop, :stop],
            0.4,
            4,
            3,
            5,
            2,
            pick,
            bucket_starts=buckets,
        )

    sums = mass(0, T, torch.tensor([0, 6, 13]))
    for index, (start, stop) in enumerate(((0, 6), (6, 13), (13, T))):
        part = mass(start, stop)
        for name in ("gate", "oracle", "queries"):
            assert torch.allclose(sums[f"{name}_by_bucket"][index], part[name], rtol=1e-6, atol=0)
    for name in ("gate", "oracle", "queries"):
        assert torch.allclose(sums[f"{name}_by_bucket"].sum(), sums[name], rtol=1e-12, atol=0)
    # rows with >= 3 keys, times 2 batch rows and 2 selectors
    assert sums["queries_by_bucket"].tolist() == [2 * 2 * 4, 2 * 2 * 7, 2 * 2 * 11]


def test_captured_mass_at_each_querys_own_k() -> None:
    """Per-row k (a schedule's): the oracle's mass is each row's own top-k_t, as written by hand."""
    query, key = _attention_inputs()
    allowed = _causal()
    k_rows = torch.arange(T) % 5 + 1
    sums = captured_mass(query, key, allowed, 0.4, k_rows, 3, 7, 2, None)
    target = _reference_target(query, key, allowed, 0.4, 2)
    by_hand = sum(
        float(target[:, :, t].topk(int(k_rows[t]), dim=-1).values.sum()) for t in range(2, T)
    )  # rows with at least 3 keys
    assert float(sums["oracle"]) == pytest.approx(by_hand, rel=1e-5)
    constant = captured_mass(query, key, allowed, 0.4, torch.full((T,), 4), 3, 7, 2, None)
    assert torch.allclose(
        constant["oracle"], captured_mass(query, key, allowed, 0.4, 4, 3, 7, 2, None)["oracle"], rtol=1e-12, atol=0
    )


def test_captured_mass_independent_of_chunk() -> None:
    small, _ = _mass(k=4, min_keys=4, chunk=3, pick_oracle=True)
    large, _ = _mass(k=4, min_keys=4, chunk=1000, pick_oracle=True)
    for name in small:
        assert torch.allclose(small[name], large[name], rtol=1e-6)


def test_head_averaged_probs_matches_reference() -> None:
    query, key = _attention_inputs()
    for selectors in (1, 2, 4):
        got = head_averaged_probs(query, key, _causal(), 0.5, selectors)
        assert torch.allclose(got, _reference_target(query, key, _causal(), 0.5, selectors), atol=1e-6)


def test_target_products_take_autocasts_dtype_as_main_attention_does() -> None:
    """An fp32 base under autocast gives fp32 queries after RoPE; SDPA (main attention) and the PyTorch
    target multiply them in bf16, and so must the Triton target (its exact fp32 path is 30x slower)."""
    from gsm_train.functional.attention_targets import _product_dtype

    fp32, bf16 = torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16)
    assert _product_dtype(fp32) == torch.float32 and _product_dtype(bf16) == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _product_dtype(fp32) == torch.bfloat16 and _product_dtype(fp32.double()) == torch.float64
    if torch.cuda.is_available() and KERNELS_RUN_HERE:  # the kernels then get bf16 queries and keys
        from gsm_train.kernels import attention_target

        query, key = (t.cuda() for t in _attention_inputs(head_dim=16))
        allowed = _causal().cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got = head_averaged_probs(query.float(), key.float(), allowed, 0.5, 1)
        assert torch.equal(got, attention_target.head_averaged_probs(query.bfloat16(), key.bfloat16(), allowed, 0.5, 1))


@triton_kernel_test
@pytest.mark.parametrize("window", [None, (3, 40)])  # (sinks, recent) left out, as gate_target beyond_forced does
@pytest.mark.parametrize("selectors", [1, 2, 4])
def test_attention_target_kernel_matches_the_dense_softmax(selectors: int, window: tuple[int, int] | None) -> None:
    from gsm_train.kernels import attention_target

    device = torch.device(KERNEL_DEVICE)
    g = _gen(11)
    length, rows = 150, 70  # neither a multiple of the kernels' 64-wide tiles
    index = torch.randperm(length, generator=g)[:rows].sort().values
    query, key = torch.randn(2, 4, rows, 16, generator=g), torch.randn(2, 2, length, 16, generator=g)
    allowed = (torch.arange(length)[None, :] <= index[:, None])[None, None].repeat(2, 1, 1, 1)
    allowed[1, ..., :5] = False  # padding: rows before it see no key at all
    if window is not None:  # gate_target beyond_forced: rows in the window see no key either
        allowed = _beyond_forced(allowed, *window, index)
    sees_keys = allowed.any(-1, keepdim=True)  # [2, 1, R, 1]: the kernel gives such rows zeros, not NaN
    expected = _reference_target(query, key, allowed, 0.3, selectors).nan_to_num(0.0) * sees_keys
    for limit in (None, index + 1):
        got = attention_target.head_averaged_probs(
            query.to(device),
            key.to(device),
            allowed.to(device),
            0.3,
            selectors,
            None if limit is None else limit.to(device),
        ).cpu()
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_attention_target_kernel_leaves_what_needs_64_bit_offsets_to_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    from gsm_train.kernels import attention_target

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # so that CPU tensors qualify; nothing is launched
    row = torch.zeros(1, 1, 1, 64)
    query, key = row.expand(2, 8, 1024, 64), row.expand(2, 2, 4096, 64)
    assert attention_target.kernel_runs(query, key)
    assert not attention_target.kernel_runs(row.expand(2, 8, 2**18, 64), key)  # output [2, 8, 2**18, 4096]
    assert not attention_target.kernel_runs(query, row.expand(2, 2, 2**25, 64))
    odd = torch.zeros(1, 1, 1, 96)  # a head dim tl.dot does not take
    assert not attention_target.kernel_runs(odd.expand(2, 8, 1024, 96), odd.expand(2, 2, 4096, 96))


# --------------------------------------------------------------------------- CacheBridge


def _bridge_inputs() -> tuple[Tensor, ...]:
    g = _gen(9)
    return tuple(torch.randn(2, 3, T, 8, generator=g) for _ in range(4))


def test_bridge_alpha_zero_mix_is_identity() -> None:
    key, value, src_k, src_v = _bridge_inputs()
    out_k, out_v = CacheBridge(3, 8, 3, alpha_init=0.0)(key, value, src_k, src_v, "mix")
    assert torch.equal(out_k, key) and torch.equal(out_v, value)


@pytest.mark.parametrize(("mode", "out_heads"), [("mix", 3), ("share", 1), ("share", 2)])
def test_bridge_initial_mapping(mode: str, out_heads: int) -> None:
    """Identity-initialised maps: the bridge adds (mix) or substitutes (share, last heads) alpha * LN(source)."""
    key, value, src_k, src_v = _bridge_inputs()
    bridge = CacheBridge(3, 8, out_heads, alpha_init=0.3)
    for out, own, src in zip(bridge(key, value, src_k, src_v, mode), (key, value), (src_k, src_v), strict=True):
        bridged = 0.3 * F.layer_norm(src[:, :out_heads], (8,))
        if mode == "mix":
            assert torch.allclose(out, own + bridged, atol=1e-6)
        else:
            keep = 3 - out_heads
            assert torch.equal(out[:, :keep], own[:, :keep])
            assert torch.allclose(out[:, keep:], bridged, atol=1e-6)


def test_bridge_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="mix or share"):
        CacheBridge(3, 8, 3, 0.3)(*_bridge_inputs(), "swap")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled training paths run on the GPU only")
def test_compiled_gate_paths_match_the_written_ones() -> None:
    from gsm_train.compiled import compiled
    from gsm_train.functional.attention_targets import chunk_kl
    from gsm_train.functional.gate_distill import _gate_kl_from_hidden
    from gsm_train.functional.gate_rope import rope_pair

    gen = torch.Generator().manual_seed(0)
    cuda = torch.device("cuda")
    gq, gk = torch.randn(2, 1, 16, 8, generator=gen).to(cuda), torch.randn(2, 1, 32, 8, generator=gen).to(cuda)
    query, key = torch.randn(2, 4, 16, 8, generator=gen).to(cuda), torch.randn(2, 2, 32, 8, generator=gen).to(cuda)
    mask = (torch.arange(32)[None, :] <= torch.arange(16, 32)[:, None])[None, None].to(cuda)
    rows = torch.ones(1, 1, 16, device=cuda)
    target = head_averaged_probs(query, key, mask, 0.3, 1)
    for written, fused in zip(
        chunk_kl(gq, gk, target, mask, rows, True), compiled(chunk_kl)(gq, gk, target, mask, rows, True)
    ):
        torch.testing.assert_close(fused, written, atol=1e-5, rtol=1e-5)
    cos, sin = torch.randn(2, 16, 8, generator=gen).to(cuda), torch.randn(2, 16, 8, generator=gen).to(cuda)
    index = torch.tensor([[0, 3, 1, 2]], device=cuda)
    q = torch.randn(2, 1, 16, 8, generator=gen).to(cuda).requires_grad_()
    k = torch.randn(2, 1, 16, 8, generator=gen).to(cuda).requires_grad_()
    hidden, weights = torch.randn(2, 32, 16, generator=gen).to(cuda), torch.randn(2, 8, 16, generator=gen).to(cuda)
    rows_index = torch.tensor([1, 5, 9, 15], device=cuda)
    cos32, sin32 = torch.randn(2, 32, 8, generator=gen).to(cuda), torch.randn(2, 32, 8, generator=gen).to(cuda)
    fused_args = (
        weights[0],
        weights[1],
        hidden,
        cos32,
        sin32,
        index,
        target[:, :, :4],
        mask[..., :4, :],
        rows[..., :4],
        rows_index,
        True,
    )
    for written, fused in zip(_gate_kl_from_hidden(*fused_args), compiled(_gate_kl_from_hidden)(*fused_args)):
        torch.testing.assert_close(fused, written, atol=1e-4, rtol=1e-4)
    outs = [fn(q, k, cos, sin, index) for fn in (rope_pair, compiled(rope_pair))]
    grads = [torch.autograd.grad(a.sum() + 2 * b.sum(), (q, k)) for a, b in outs]
    for written, fused in zip((*outs[0], *grads[0]), (*outs[1], *grads[1])):
        torch.testing.assert_close(fused, written, atol=1e-5, rtol=1e-5)
    scores, positions = torch.randn(2, 2, T, T, generator=gen).to(cuda), torch.arange(T, device=cuda)
    for sinks, recent in ((0, 0), (2, 3)):
        args = (scores, _causal().to(cuda), torch.full((T,), 5, device=cuda), positions, positions, sinks, recent, 5)
        assert torch.equal(compiled(select_top_k)(*args), select_top_k(*args))  # exact operations: the same set


def _beyond_forced(allowed: Tensor, sinks: int, recent: int, positions: Tensor | None = None) -> Tensor:
    """`allowed` [.., T, S] less the keys a selection forces (`gate_target: beyond_forced`): key j of query t
    stays if j >= sinks, t - j >= recent and j != t (t: `positions`, default those of the last T of S keys)."""
    length, keys = allowed.shape[-2:]
    t = torch.arange(keys - length, keys)[:, None] if positions is None else positions[:, None]
    j = torch.arange(keys)[None, :]
    return allowed & (j >= sinks) & (t - j >= recent) & (j != t)


@pytest.mark.parametrize("window", [None, (2, 5)])  # (sinks, recent): the KL over the keys beyond the forced ones
@pytest.mark.parametrize("rotated_pairs", [None, 1])  # 1: three of the four pairs unrotated (content only)
@pytest.mark.parametrize("selectors", [1, 2])
def test_gate_loss_from_hidden_equals_the_gate_head_and_autograd(
    selectors: int, rotated_pairs: int | None, window: tuple[int, int] | None
) -> None:
    from gsm_train.functional.attention_targets import gate_distill_loss
    from gsm_train.functional.gate_distill import DistillTarget

    gen = torch.Generator().manual_seed(3)
    gate = SparseGateHead(32, 8, 16, num_selectors=selectors, rotated_pairs=rotated_pairs)
    torch.nn.init.normal_(gate.q_proj.weight, generator=gen)
    torch.nn.init.normal_(gate.k_proj.weight, generator=gen)
    hidden = torch.randn(2, 24, 32, generator=gen)
    angles = torch.arange(24.0)[:, None] * torch.rand(8, generator=gen)[None, :]
    cos, sin = (torch.cat((f(angles), f(angles)), -1)[None].expand(2, -1, -1) for f in (torch.cos, torch.sin))
    query, key = torch.randn(2, 4, 24, 16, generator=gen), torch.randn(2, 2, 24, 16, generator=gen)
    allowed = (torch.arange(24)[None, :] <= torch.arange(24)[:, None])[None, None]
    counted = allowed.sum(-1) >= 6
    if window is not None:
        allowed = _beyond_forced(allowed, *window)
        counted = counted & allowed.any(-1)
    index = torch.tensor([3, 9, 17, 23])
    gate_q, gate_k = gate(hidden, cos, sin)
    expected, expected_count = gate_distill_loss(
        query[:, :, index],
        key,
        gate_q[:, :, index],
        gate_k,
        allowed[..., index, :],
        counted[..., index],
        0.25,
        64,
        torch.full((len(index),), 24),
    )
    expected_grads = torch.autograd.grad(expected, (gate.q_proj.weight, gate.k_proj.weight))
    total, count = gate(
        hidden,
        cos,
        sin,
        DistillTarget(query[:, :, index], key, allowed[..., index, :], counted[..., index], index, 0.25),
    )
    grads = torch.autograd.grad(total, (gate.q_proj.weight, gate.k_proj.weight))
    assert int(count) == int(expected_count) == 2 * selectors * 3
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=1e-6)
    for grad, want in zip(grads, expected_grads):
        assert want.abs().max() > 0
        torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)


def test_gate_loss_from_hidden_hands_bf16_weights_bf16_gradients() -> None:
    from gsm_train.functional.attention_targets import gate_distill_loss
    from gsm_train.functional.gate_distill import DistillTarget

    gen = torch.Generator().manual_seed(4)
    gate = SparseGateHead(32, 8, 16).to(torch.bfloat16)
    hidden = torch.randn(1, 16, 32, generator=gen, dtype=torch.bfloat16)
    cos, sin = torch.ones(1, 16, 16), torch.zeros(1, 16, 16)
    query, key = torch.randn(1, 2, 16, 16, generator=gen), torch.randn(1, 1, 16, 16, generator=gen)
    allowed = (torch.arange(16)[None, :] <= torch.arange(16)[:, None])[None, None]
    counted = allowed.sum(-1) >= 1
    gate_q, gate_k = gate(hidden, cos, sin)
    expected, _ = gate_distill_loss(query, key, gate_q, gate_k, allowed, counted, 0.25, 64)
    expected_grads = torch.autograd.grad(expected, (gate.q_proj.weight, gate.k_proj.weight))
    total, _ = gate(hidden, cos, sin, DistillTarget(query, key, allowed, counted, torch.arange(16), 0.25))
    grads = torch.autograd.grad(total, (gate.q_proj.weight, gate.k_proj.weight))
    torch.testing.assert_close(total, expected, rtol=1e-2, atol=1e-3)
    for grad, want in zip(grads, expected_grads):
        assert grad.dtype == torch.bfloat16
        assert F.cosine_similarity(grad.float().flatten(), want.float().flatten(), dim=0) > 0.99
