"""What the gate's KL learns from (`gsm.sparse_attention.gate_target`): with `beyond_forced` the target and
the gate renormalise over the visible keys the selection does not force (sinks, the recent window, the
query's own key), on every path that computes the KL (CPU, tiny models)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from run_helpers import GATE_RECIPE, TINY_MODEL
from torch import Tensor

from gsm_train.attention import gsm_collect, inject_gsm
from gsm_train.attention.forward_state import CollectRequest, ForwardState
from gsm_train.attention.layout import Layout, kl_rows
from gsm_train.attention.settings import GSMSettings
from gsm_train.config.schema import ConfigError, GSMConfig, load_recipe
from gsm_train.export.adapter_format import CONFIG_FILE
from gsm_train.export.save_load import export_adapter, load_gsm
from gsm_train.functional.attention_targets import gate_distill_loss
from gsm_train.functional.gate_distill import DistillTarget
from gsm_train.models.model_zoo import tiny_model
from gsm_train.modules import SparseGateHead
from gsm_train.train import train_recipe

T, HIDDEN, HEAD_DIM, GATE_DIM, SCALING = 24, 32, 16, 8, 0.25


def _inputs(selectors: int, seed: int = 3) -> tuple[SparseGateHead, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """A random gate of `selectors` selectors, its input (hidden, cos, sin) and a layer's queries
    [2, 4, T, 16] and keys [2, 2, T, 16]."""
    gen = torch.Generator().manual_seed(seed)
    gate = SparseGateHead(HIDDEN, GATE_DIM, HEAD_DIM, num_selectors=selectors)
    torch.nn.init.normal_(gate.q_proj.weight, generator=gen)
    torch.nn.init.normal_(gate.k_proj.weight, generator=gen)
    hidden = torch.randn(2, T, HIDDEN, generator=gen)
    angles = torch.arange(float(T))[:, None] * torch.rand(HEAD_DIM // 2, generator=gen)[None, :]
    cos, sin = (torch.cat((f(angles), f(angles)), -1)[None].expand(2, -1, -1) for f in (torch.cos, torch.sin))
    query, key = torch.randn(2, 4, T, HEAD_DIM, generator=gen), torch.randn(2, 2, T, HEAD_DIM, generator=gen)
    return gate, hidden, cos, sin, query, key


def _rows(target: str, sinks: int, recent: int, index: Tensor | None, min_keys: int = 1) -> tuple[Tensor, Tensor]:
    """The KL's keys and counted rows as a forward's `kl_rows` gives them for a causal pass of T tokens."""
    sparse = {"gate_target": target, "sink_tokens": sinks, "recent_tokens": recent}
    settings = GSMSettings(GSMConfig.model_validate({"sparse_attention": sparse}), "", ())
    state = ForwardState(settings, CollectRequest(distill=True))
    positions = torch.arange(T)
    allowed = (positions[None, :] <= positions[:, None])[None, None]
    k = torch.full((T,), min_keys)
    return kl_rows(state, Layout(allowed, positions, k, positions + 1, k), index, 2)


def _hand_kl(
    query: Tensor, key: Tensor, gate_q: Tensor, gate_k: Tensor, rows: list[int], sinks: int, recent: int
) -> tuple[float, int]:
    """KL(target || gate) summed over the query rows at positions `rows` (query, gate_q: those rows) and
    the rows counted, by loops in fp64 over the keys j <= t that no rule forces: j >= sinks, t - j >=
    recent, j != t; a row without such a key is not counted."""
    total, count = 0.0, 0
    batch, heads = query.shape[:2]
    selectors = gate_q.shape[1]
    per_selector, groups = heads // selectors, heads // key.shape[1]
    for b in range(batch):
        for s in range(selectors):
            for r, t in enumerate(rows):
                keys = [j for j in range(t + 1) if j >= sinks and t - j >= recent and j != t]
                if not keys:
                    continue
                j = torch.tensor(keys)
                probs = [
                    (query[b, h, r].double() @ key[b, h // groups, j].double().T * SCALING).softmax(-1)
                    for h in range(s * per_selector, (s + 1) * per_selector)
                ]
                target = torch.stack(probs).mean(0)
                logits = gate_q[b, s, r].double() @ gate_k[b, s, j].double().T / math.sqrt(GATE_DIM)
                total += float((target * (target.log() - logits.log_softmax(-1))).sum().detach())
                count += 1
    return total, count


WINDOWS = [(2, 5), (0, 5), (3, 0)]  # (sink_tokens, recent_tokens)


@pytest.mark.parametrize(("sinks", "recent"), WINDOWS)
@pytest.mark.parametrize("selectors", [1, 2])
def test_the_kl_over_the_keys_beyond_the_forced_ones_is_the_hand_computed_one(
    selectors: int, sinks: int, recent: int
) -> None:
    """Stage 1's fused KL (sampled rows, `gate_kl_from_hidden`), the same rows through `gate_distill_loss`
    and autograd, and every row in chunks of 5 (the joint stage's path) equal the hand-computed KL over
    the unforced keys, rows with none (row 1, and row 5 where sinks + recent cover it) left uncounted."""
    gate, hidden, cos, sin, query, key = _inputs(selectors)
    gate_q, gate_k = gate(hidden, cos, sin)
    index = torch.tensor([1, 5, 9, 17, 23])
    rows_allowed, counted = _rows("beyond_forced", sinks, recent, index)
    want, want_count = _hand_kl(query[:, :, index], key, gate_q[:, :, index], gate_k, index.tolist(), sinks, recent)
    assert want_count == 2 * selectors * sum(1 for t in index.tolist() if t >= sinks + max(recent, 1))
    fused, fused_count = gate(
        hidden, cos, sin, DistillTarget(query[:, :, index], key, rows_allowed, counted, index, 0.25)
    )
    autograd, autograd_count = gate_distill_loss(
        query[:, :, index],
        key,
        gate_q[:, :, index],
        gate_k,
        rows_allowed,
        counted,
        SCALING,
        64,
        torch.full((len(index),), T),
    )
    every_allowed, every_counted = _rows("beyond_forced", sinks, recent, None)
    every, every_count = gate_distill_loss(query, key, gate_q, gate_k, every_allowed, every_counted, SCALING, 5)
    want_every, want_every_count = _hand_kl(query, key, gate_q, gate_k, list(range(T)), sinks, recent)
    assert int(fused_count) == int(autograd_count) == want_count and int(every_count) == want_every_count
    for got, expected in ((fused, want), (autograd, want), (every, want_every)):
        torch.testing.assert_close(got.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(fused, (gate.q_proj.weight, gate.k_proj.weight))
    expected_grads = torch.autograd.grad(autograd, (gate.q_proj.weight, gate.k_proj.weight))
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        largest = expected_grad.abs().max()
        assert largest > 0 and torch.isfinite(grad).all()
        # the two sum in other orders: an entry may differ by a few fp32 steps of the gradient's largest ones
        # (steps of 1.9e-6 at its 14-34; 3.8e-6 seen on an AMD EPYC), so small entries are bounded absolutely
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6 * float(largest))


@pytest.mark.parametrize("target", ["all", "beyond_forced"])
def test_attention_inside_the_window_moves_only_the_kl_over_all_keys(target: str) -> None:
    """Rows 18 to 23 with sink_tokens 2 and recent_tokens 6: keys 0, 1 and 18 onwards are forced (or in
    the future) for every one of them, so scaling those keys moves the target's mass only among forced
    keys. With beyond_forced the loss and the gate's gradients stay as they were; with all they move."""
    gate, hidden, cos, sin, query, key = _inputs(1, seed=5)
    index = torch.arange(18, 24)
    rows_allowed, counted = _rows(target, 2, 6, index)
    moved = key.clone()
    moved[:, :, :2] *= 3.0
    moved[:, :, 18:] *= 3.0
    results = []
    for keys in (key, moved):
        total, count = gate(
            hidden, cos, sin, DistillTarget(query[:, :, index], keys, rows_allowed, counted, index, 0.25)
        )
        grads = torch.autograd.grad(total, (gate.q_proj.weight, gate.k_proj.weight))
        results.append((total, *grads))
        assert int(count) == 2 * len(index)
    if target == "beyond_forced":
        for before, after in zip(*results, strict=True):
            torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-7)
    else:
        assert (results[0][0] - results[1][0]).abs() > 1e-3 * results[0][0]  # a thousand times the bound above


def test_all_is_the_kl_over_every_visible_key() -> None:
    """`all` (the default) hands the KL the causal mask and every row with at least k keys, untouched."""
    rows_allowed, counted = _rows("all", 2, 5, None, min_keys=4)
    assert torch.equal(rows_allowed, torch.ones(T, T, dtype=torch.bool).tril()[None, None])
    assert torch.equal(counted, (torch.arange(T) >= 3)[None, None])
    assert GSMConfig().sparse_attention.gate_target == "all"


def _collected(
    sections: dict, mode: str, distill_queries: int, on_selection: bool = False
) -> list[tuple[Tensor, Tensor]]:
    """Each gate layer's (KL sum, rows counted) of one teacher-forced pass of a tiny Llama over 2 x 40 tokens."""
    torch.manual_seed(0)
    model = tiny_model("llama")
    inject_gsm(model, GSMConfig.model_validate(sections), mode=mode)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with gsm_collect(model, distill=True, distill_on_selection=on_selection, distill_queries=distill_queries) as got:
        model(ids)
    return [got.layers[layer].gate_kl for layer in sorted(got.layers)]


BEYOND = {"top_k": 4, "k_min": 4, "gate_head_dim": 8, "recent_tokens": 8, "sink_tokens": 2}


def test_sampled_rows_are_drawn_among_the_rows_with_unforced_keys() -> None:
    """Through the model: sampling as many rows as there are candidates (positions 10 to 39) takes them
    all, so stage 1's fused KL equals the all-rows KL layer by layer; the rows counted are those, and
    the KL is not the one over all keys."""
    beyond = {"sparse_attention": {**BEYOND, "gate_target": "beyond_forced"}}
    sampled = _collected(beyond, "dense", distill_queries=30)
    every = _collected(beyond, "dense", distill_queries=0)
    over_all = _collected({"sparse_attention": BEYOND}, "dense", distill_queries=0)
    assert len(sampled) == len(every) > 0
    for (total, count), (every_total, every_count), (all_total, _) in zip(sampled, every, over_all, strict=True):
        assert int(count) == int(every_count) == 2 * 30
        torch.testing.assert_close(total, every_total, rtol=1e-5, atol=1e-6)
        assert (total - all_total).abs() > 0.05 * all_total


def test_the_joint_stage_kl_on_the_selection_leaves_the_forced_keys_out() -> None:
    """Sparse attention, the KL on the selected keys (the joint stage's): with top_k 4 and recent_tokens 4
    (no sinks) each row's forced keys fill its top-k, so the selection beyond them is empty and no row is
    counted; with top_k 8 rows count and the KL is finite and positive."""
    forced_only = {"sparse_attention": {**BEYOND, "sink_tokens": 0, "recent_tokens": 4, "gate_target": "beyond_forced"}}
    assert all(
        int(count) == 0 and float(total.detach()) == 0 for total, count in _collected(forced_only, "sparse", 16, True)
    )
    wider = {"sparse_attention": {**forced_only["sparse_attention"], "top_k": 8}}
    records = _collected(wider, "sparse", 16, True)
    assert records and all(int(count) > 0 and torch.isfinite(total) and total > 0 for total, count in records)


def test_beyond_forced_without_a_window_is_one_clear_error() -> None:
    """sink_tokens = recent_tokens = 0 would leave out only the own key: one problem naming the field, its
    value and the fix; a window as long as data.seq_len leaves nothing to learn: one problem too."""
    with pytest.raises(ConfigError) as info:
        load_recipe(GATE_RECIPE, ["gsm.sparse_attention.gate_target=beyond_forced"])
    [problem] = info.value.problems
    assert problem.path == "gsm.sparse_attention.gate_target" and problem.value == "beyond_forced"
    assert "recent_tokens" in problem.message and problem.fix.startswith("set recent_tokens, e.g. 512")
    with pytest.raises(ConfigError) as info:
        load_recipe(
            GATE_RECIPE,
            [*TINY_MODEL, "gsm.sparse_attention.gate_target=beyond_forced", "gsm.sparse_attention.recent_tokens=64"],
        )
    [problem] = info.value.problems
    assert "gate_target beyond_forced" in problem.message and "data.seq_len (64)" in problem.message
    config = load_recipe(
        GATE_RECIPE, ["gsm.sparse_attention.gate_target=beyond_forced", "gsm.sparse_attention.recent_tokens=512"]
    )
    assert config.gsm.sparse_attention.gate_target == "beyond_forced"


def test_an_export_carries_the_field_and_older_ones_load_as_all(tmp_path: Path) -> None:
    sections = {"sparse_attention": {**BEYOND, "gate_target": "beyond_forced"}}
    model = tiny_model("llama")
    inject_gsm(model, GSMConfig.model_validate(sections), mode="dense")
    folder = export_adapter(model, tmp_path / "export", base_name="tiny-llama")
    config = json.loads((folder / CONFIG_FILE).read_text())
    assert config["sparse_attention"]["gate_target"] == "beyond_forced"
    assert load_gsm(tiny_model("llama"), folder).config.sparse_attention.gate_target == "beyond_forced"
    del config["sparse_attention"]["gate_target"]
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    assert load_gsm(tiny_model("llama"), folder).config.sparse_attention.gate_target == "all"


def test_stage_one_trains_on_the_keys_beyond_the_window(tmp_path: Path) -> None:
    """A few steps of the gate warm-up (fused KL on sampled rows) with the field set: finite losses, not
    those of the same run over all keys, and an export that says beyond_forced."""
    common = [
        *TINY_MODEL,
        "logging.progress_bar=false",
        "optim.warmup_steps=1",
        "gsm.sparse_attention.gate_init=random",
        "gsm.sparse_attention.recent_tokens=16",
        "train.steps=3",
        "train.batch_size=2",
        "logging.eval_every=3",
        "logging.eval_batches=1",
    ]
    beyond = train_recipe(
        GATE_RECIPE, [*common, "gsm.sparse_attention.gate_target=beyond_forced", f"output.dir={tmp_path / 'b'}"]
    )
    over_all = train_recipe(GATE_RECIPE, [*common, f"output.dir={tmp_path / 'a'}"])
    assert len(beyond.losses) == 3 and all(math.isfinite(loss) and loss > 0 for loss in beyond.losses)
    assert beyond.losses[0] != pytest.approx(over_all.losses[0], rel=1e-3)
    exported = json.loads((tmp_path / "b" / "export" / CONFIG_FILE).read_text())
    assert exported["sparse_attention"]["gate_target"] == "beyond_forced"
