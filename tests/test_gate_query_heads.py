"""Several gate query heads (`sparse_attention.gate_query_heads`, DSA's lightning indexer) over the one
cached gate key per token: one head is the gate as it was, several score by the indexer's formula, learn
in stage 1, export and load exactly, and leave the KV account as it was (CPU, tiny models)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from run_helpers import TINY_MODEL
from torch import Tensor

from gsm_train.attention import gsm_collect, gsm_parameters, gsm_state_dict, inject_gsm
from gsm_train.cli import main as cli_main
from gsm_train.commands.inspect_model import layer_reports
from gsm_train.config.schema import ConfigError, GSMConfig, load_recipe
from gsm_train.export.adapter_format import CONFIG_FILE, GSM_FILE, ExportError
from gsm_train.export.save_load import export_adapter, load_gsm
from gsm_train.functional.attention_targets import gate_distill_loss
from gsm_train.models.families import config_dims
from gsm_train.models.model_zoo import tiny_model
from gsm_train.modules import SparseGateHead, sparse_gate
from gsm_train.train import train_recipe
from gsm_train.tuning.kv_budget import kv_bytes_ratio

REPO = Path(__file__).resolve().parents[1]
HIDDEN, DIM, BASE_HEAD_DIM, T = 32, 8, 16, 24
SPARSE = {"top_k": 4, "k_min": 2, "gate_head_dim": 16, "dense_layers": [0]}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rope(length: int, head_dim: int) -> tuple[Tensor, Tensor]:
    """cos/sin [1, T, head_dim] (rotate-half layout, base 10000)."""
    inv_freq = 10000.0 ** (-torch.arange(0, head_dim, 2).double() / head_dim)
    angles = torch.arange(length).double()[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)[None]
    return emb.cos().float(), emb.sin().float()


def _random_gate(heads: int, selectors: int = 1, seed: int = 0) -> SparseGateHead:
    gate = SparseGateHead(HIDDEN, DIM, BASE_HEAD_DIM, selectors, query_heads=heads)
    for param in gate.parameters():
        torch.nn.init.normal_(param, generator=_gen(seed))
        seed += 1
    return gate


def _model(sections: dict, mode: str = "sparse", family: str = "llama") -> torch.nn.Module:
    model = tiny_model(family)
    inject_gsm(model, GSMConfig.model_validate(sections), mode=mode)
    return model


def test_one_query_head_is_the_gate_built_without_the_option() -> None:
    """`gate_query_heads: 1` builds the same tensors under the same names, and scores bit for bit as the
    gate did (`q . k / sqrt(dg)`, the scale on the queries)."""
    torch.manual_seed(0)
    before = SparseGateHead(HIDDEN, 16, BASE_HEAD_DIM, 2, 8)
    torch.manual_seed(0)
    now = SparseGateHead(HIDDEN, 16, BASE_HEAD_DIM, 2, 8, query_heads=1)
    assert (
        before.state_dict().keys() == now.state_dict().keys() == {"rope_freq_index", "q_proj.weight", "k_proj.weight"}
    )
    assert all(torch.equal(before.state_dict()[n], now.state_dict()[n]) for n in before.state_dict())
    hidden, (cos, sin) = torch.randn(2, T, HIDDEN, generator=_gen(1)), _rope(T, BASE_HEAD_DIM)
    gate_q, gate_k = now(hidden, cos, sin)
    assert gate_q.shape == gate_k.shape == (2, 2, T, 16)
    keys = now.stored_keys(gate_k)
    expected = torch.matmul(gate_q.float() * 16**-0.5, keys.transpose(-1, -2))
    assert torch.equal(now.score_stored(gate_q, keys), expected)

    config = {"sparse_attention": SPARSE, "kv_compression": {"enabled": True, "block_size": 8, "cluster_num": 4}}
    torch.manual_seed(0)
    plain = _model(config)
    torch.manual_seed(0)
    explicit = _model({**config, "sparse_attention": {**SPARSE, "gate_query_heads": 1}})
    plain_state, explicit_state = gsm_state_dict(plain), gsm_state_dict(explicit)
    assert plain_state.keys() == explicit_state.keys()
    assert all(torch.equal(plain_state[n], explicit_state[n]) for n in plain_state)
    ids = torch.randint(0, 256, (2, 37), generator=_gen(2))
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, explicit(ids).logits)


def _rotated(x: Tensor, angles: Tensor) -> Tensor:
    """x [..., T, dg] rotated pair by pair (pair i: (x_i, x_{i + dg/2}) by angles [T, dg/2]), as complex numbers."""
    half = x.shape[-1] // 2
    turned = torch.complex(x[..., :half].double(), x[..., half:].double()) * torch.polar(
        torch.ones_like(angles), angles
    )
    return torch.cat((turned.real, turned.imag), -1)


def test_several_query_heads_score_by_the_indexer_formula() -> None:
    """s(t, j) = sum_h w_h(t) relu(q_h(t) . k(j) / sqrt(dg)), written out by hand from the projections (selector,
    then head, then dimension), RoPE on every head with its selector's pairs, and `weights_proj` with its bias."""
    heads, selectors = 3, 2
    gate = _random_gate(heads, selectors)
    gate.rope_freq_index.copy_(torch.tensor([[0, 2, 5, 7], [1, 3, 4, 6]]))
    hidden, (cos, sin) = torch.randn(2, T, HIDDEN, generator=_gen(9)), _rope(T, BASE_HEAD_DIM)
    gate_q, gate_k = gate(hidden, cos, sin)
    assert gate_q.shape == (2, selectors, T, heads * DIM + heads) and gate_k.shape == (2, selectors, T, DIM)
    keys = gate.stored_keys(gate_k)

    inv_freq = 10000.0 ** (-torch.arange(0, BASE_HEAD_DIM, 2).double() / BASE_HEAD_DIM)
    q_weight = gate.q_proj.weight.double().view(selectors, heads, DIM, HIDDEN)
    weights = (hidden.double() @ gate.weights_proj.weight.double().t() + gate.weights_proj.bias.double()).view(
        2, T, selectors, heads
    )
    for sel in range(selectors):
        angles = torch.arange(T).double()[:, None] * inv_freq[gate.rope_freq_index[sel]][None, :]
        expected = torch.zeros(2, T, T, dtype=torch.float64)
        for head in range(heads):
            q = _rotated(hidden.double() @ q_weight[sel, head].t(), angles)
            expected += weights[:, :, sel, head, None] * torch.relu(
                q @ keys[:, sel].double().transpose(-1, -2) / 8**0.5
            )
        # fp32 projections against fp64 ones: scores of up to ~1, within fp32's rounding of 576-wide sums
        torch.testing.assert_close(gate.score_stored(gate_q, keys)[:, sel].double(), expected, atol=1e-4, rtol=1e-4)
    k_alone = gate.keys(hidden, cos, sin)
    assert torch.equal(k_alone, gate_k), "`keys` gives the keys the forward gives"


def _qk_weights(seed: int = 4) -> tuple[Tensor, Tensor]:
    gen = _gen(seed)
    return torch.randn(4 * BASE_HEAD_DIM, HIDDEN, generator=gen), torch.randn(2 * BASE_HEAD_DIM, HIDDEN, generator=gen)


@pytest.mark.parametrize("heads", [2, 3, 4])
def test_qk_svd_init_scores_as_one_query_head_at_step_zero(heads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Heads in pairs (u, -u) with weights (+1/P, -1/P) score u's logit (relu(x) - relu(-x) = x): without the
    init noise the scores equal the one-head gate's; with it they stay within a few percent, and the heads
    of different pairs differ."""
    q_weight, k_weight = _qk_weights()
    noise = sparse_gate.INIT_QUERY_NOISE
    hidden, (cos, sin) = torch.randn(2, T, HIDDEN, generator=_gen(5)), _rope(T, BASE_HEAD_DIM)
    one = SparseGateHead(HIDDEN, DIM, BASE_HEAD_DIM)
    one.init_from_attention(q_weight, k_weight, 4, 2, BASE_HEAD_DIM)
    reference_q, reference_k = one(hidden, cos, sin)
    reference = one.score_stored(reference_q, one.stored_keys(reference_k)).detach()
    scale = float(reference.abs().mean())

    def scores(relative: float) -> tuple[Tensor, SparseGateHead]:
        monkeypatch.setattr(sparse_gate, "INIT_QUERY_NOISE", relative)
        torch.manual_seed(0)
        gate = SparseGateHead(HIDDEN, DIM, BASE_HEAD_DIM, query_heads=heads)
        gate.init_from_attention(q_weight, k_weight, 4, 2, BASE_HEAD_DIM)
        assert torch.equal(gate.k_proj.weight, one.k_proj.weight) and torch.equal(
            gate.rope_freq_index, one.rope_freq_index
        )
        gate_q, gate_k = gate(hidden, cos, sin)
        return gate.score_stored(gate_q, gate.stored_keys(gate_k)).detach(), gate

    exact, _ = scores(0.0)
    torch.testing.assert_close(exact, reference, atol=1e-5 * scale, rtol=1e-5)
    noisy, gate = scores(noise)
    assert 0 < (noisy - reference).abs().mean() < 0.05 * scale
    rows = gate.q_proj.weight.view(heads, DIM, HIDDEN)
    assert not torch.equal(rows[0], -rows[1])
    if heads == 4:
        assert not torch.equal(rows[0], rows[2]), "the noise tells the pairs apart"
    expected_bias = [(-1.0) ** h / (heads // 2) for h in range(heads)]
    expected_bias[-1] = 0.0 if heads % 2 else expected_bias[-1]
    assert gate.weights_proj.bias.tolist() == pytest.approx(expected_bias)
    assert not gate.weights_proj.weight.any()


def _causal(length: int = T) -> Tensor:
    return torch.ones(length, length, dtype=torch.bool).tril()[None, None]


def test_the_chunked_kl_and_its_gradients_equal_a_dense_kl_with_several_heads() -> None:
    """With several query heads the chunked KL (`_chunk_kl_by_autograd`) equals a dense KL of the indexer
    formula differentiated by autograd, for the queries, their weights and the keys."""
    heads, selectors, chunk = 3, 2, 7
    gen = _gen(6)
    query, key = torch.randn(2, 4, T, 8, generator=gen), torch.randn(2, 2, T, 8, generator=gen)
    gate_q = torch.randn(2, selectors, T, heads * DIM + heads, generator=gen).requires_grad_()
    gate_k = torch.randn(2, selectors, T, DIM, generator=gen).requires_grad_()
    allowed = _causal()
    counted = allowed.sum(-1) >= 4
    total, count = gate_distill_loss(query, key, gate_q, gate_k, allowed, counted, 0.3, chunk)
    assert int(count) == 2 * selectors * (T - 3)

    target = (query @ key.repeat_interleave(2, 1).transpose(-1, -2) * 0.3).masked_fill(~allowed, -math.inf).softmax(-1)
    target = target.unflatten(1, (selectors, -1)).mean(2)
    per_head = gate_q[..., : heads * DIM].unflatten(-1, (heads, DIM))
    logits = torch.einsum(
        "bntw,bntws->bnts",
        gate_q[..., heads * DIM :],
        torch.relu(torch.einsum("bntwd,bnsd->bntws", per_head, gate_k) / DIM**0.5),
    )
    log_gate = logits.masked_fill(~allowed, -math.inf).log_softmax(-1)
    kl = torch.where(allowed, target * (target.log() - log_gate), torch.zeros(())).sum(-1)
    expected = kl[counted.expand_as(kl)].sum()
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(torch.autograd.grad(total, (gate_q, gate_k)), torch.autograd.grad(expected, (gate_q, gate_k))):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


GATE_RECIPE = str(REPO / "recipes" / "gate_only.yaml")
TINY_GATE_RUN = [
    *TINY_MODEL,
    "logging.progress_bar=false",
    "optim.warmup_steps=1",
    "optim.lr=0.01",
    "gsm.sparse_attention.gate_init=random",
]


def test_stage_1_learns_with_several_query_heads_and_exports_their_tensors(tmp_path: Path) -> None:
    """The gate stage with 4 query heads (KL on 16 sampled rows a step, taken through autograd): the loss
    falls, and the export holds the query heads and their weights."""
    overrides = ["gsm.sparse_attention.gate_query_heads=4", "train.distill_queries=16", "train.steps=12"]
    result = train_recipe(GATE_RECIPE, [*TINY_GATE_RUN, *overrides, "logging.eval_every=12", f"output.dir={tmp_path}"])
    losses = result.losses
    assert sum(losses[-4:]) / 4 < 0.5 * sum(losses[:4]) / 4, losses
    tensors = json.loads((tmp_path / "export" / CONFIG_FILE).read_text())["files"][GSM_FILE]["tensors"]
    dims = config_dims(tiny_model("llama").config)
    gate = "model.layers.1.self_attn.gsm.gate."
    assert tensors[gate + "q_proj.weight"] == [4 * 16, dims["hidden"]]
    assert tensors[gate + "k_proj.weight"] == [16, dims["hidden"]]
    assert tensors[gate + "weights_proj.weight"] == [4, dims["hidden"]] and tensors[gate + "weights_proj.bias"] == [4]


def test_the_joint_stage_gate_kl_takes_several_query_heads() -> None:
    """Sparse main attention, the KL on the selected keys (as the joint stage takes it): finite, and its
    gradient reaches every gate tensor, the query heads' weights included."""
    model = _model({"sparse_attention": {**SPARSE, "gate_query_heads": 3, "heads": "kv"}})
    ids = torch.randint(0, 256, (2, 33), generator=_gen(3))
    with gsm_collect(model, distill=True, distill_on_selection=True, distill_queries=12) as records:
        model(ids)
    kl = torch.stack(records.gate_kl_means()).mean()
    assert torch.isfinite(kl) and kl > 0
    kl.backward()
    gates = [(n, p) for n, p in gsm_parameters(model) if ".gate." in n]
    assert gates and all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in gates), [n for n, _ in gates]


SEVERAL_HEADS = {
    "sparse_attention": {**SPARSE, "gate_query_heads": 3, "heads": "kv", "gate_key_bits": 8},
    "kv_compression": {"enabled": True, "block_size": 8, "cluster_num": 4, "hidden_dim": 8},
}


def _exported(tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    model = _model(SEVERAL_HEADS)
    with torch.no_grad():
        for name, tensor in gsm_state_dict(model).items():
            if tensor.is_floating_point():
                tensor.add_(0.01 * torch.randn(tensor.shape, generator=_gen(len(name))))
    return model, export_adapter(model, tmp_path / "export", base_name="tiny-llama")


def test_an_export_with_several_query_heads_loads_exactly(tmp_path: Path) -> None:
    model, folder = _exported(tmp_path)
    assert json.loads((folder / CONFIG_FILE).read_text())["sparse_attention"]["gate_query_heads"] == 3
    loaded = tiny_model("llama")
    load_gsm(loaded, folder, mode="sparse")
    original, restored = gsm_state_dict(model), gsm_state_dict(loaded)
    assert original.keys() == restored.keys() and any("weights_proj" in n for n in original)
    assert all(torch.equal(original[n], restored[n]) for n in original)
    ids = torch.randint(0, 256, (2, 40), generator=_gen(4))
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, loaded.eval()(ids).logits)


def test_an_export_whose_query_heads_disagree_with_its_tensors_is_refused(tmp_path: Path) -> None:
    _, folder = _exported(tmp_path)
    config = json.loads((folder / CONFIG_FILE).read_text())
    config["sparse_attention"]["gate_query_heads"] = 2
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(ExportError, match="gate.q_proj.weight"):
        load_gsm(tiny_model("llama"), folder, mode="sparse")


@pytest.mark.parametrize("heads", ["layer", "kv"])
def test_query_heads_leave_the_kv_account_as_it_was(heads: str) -> None:
    """The cache stores one gate key per token (and selector) whatever the query heads: the same bytes."""
    sections = {**SEVERAL_HEADS, "sparse_attention": {**SEVERAL_HEADS["sparse_attention"], "heads": heads}}
    one_head = {**sections, "sparse_attention": {**sections["sparse_attention"], "gate_query_heads": 1}}
    configs = [GSMConfig.model_validate(s) for s in (one_head, sections)]
    dims = config_dims(tiny_model("llama").config)
    assert kv_bytes_ratio(configs[0], dims, 64) == kv_bytes_ratio(configs[1], dims, 64)
    reports = [layer_reports(_model(s), c, 64) for s, c in zip((one_head, sections), configs, strict=True)]
    assert [r.gsm_bytes for r in reports[0]] == [r.gsm_bytes for r in reports[1]]


def test_query_heads_are_validated(capsys: pytest.CaptureFixture) -> None:
    """A count below 1 is one clear error naming the field; the GPU run's override validates."""
    long_gate = str(REPO / "recipes" / "gate_only_long.yaml")
    assert (
        load_recipe(long_gate, ["gsm.sparse_attention.gate_query_heads=4"]).gsm.sparse_attention.gate_query_heads == 4
    )
    assert cli_main(["validate", long_gate, "gsm.sparse_attention.gate_query_heads=4"]) == 0
    assert "gate_query_heads: 4" in capsys.readouterr().out
    with pytest.raises(ConfigError) as info:
        load_recipe(long_gate, ["gsm.sparse_attention.gate_query_heads=0"])
    assert [p.path for p in info.value.problems] == ["gsm.sparse_attention.gate_query_heads"]
    assert cli_main(["validate", long_gate, "gsm.sparse_attention.gate_query_heads=0"]) == 2
    err = capsys.readouterr().err
    assert "gsm.sparse_attention.gate_query_heads" in err and "greater than or equal to 1" in err
    with pytest.raises(ValueError, match="query_heads must be at least 1, got 0"):
        SparseGateHead(HIDDEN, DIM, BASE_HEAD_DIM, query_heads=0)
