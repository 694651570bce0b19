"""A gate whose pairs need not all rotate (`gsm.sparse_attention.gate_rotated_pairs`): pairs past the first r
hold `gate_rope.unrotated_index` in `rope_freq_index` and score the content alone, in the module, through
the recipe and its overrides, and through an export."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import Tensor

from gsm_train.attention import inject_gsm
from gsm_train.config.schema import ConfigError, GSMConfig, load_recipe
from gsm_train.export.adapter_format import CONFIG_FILE
from gsm_train.export.save_load import export_adapter, load_gsm
from gsm_train.models.model_zoo import tiny_model
from gsm_train.modules.sparse_gate import SparseGateHead

REPO = Path(__file__).resolve().parents[1]
HIDDEN, HEAD_DIM, GATE_DIM, LENGTH = 32, 16, 8, 24  # 8 base frequencies, 4 gate pairs
UNROTATED = HEAD_DIM // 2


def _rope(positions: Tensor) -> tuple[Tensor, Tensor]:
    """The model's cos/sin [1, T, HEAD_DIM] at `positions` (Llama's rotate-half layout)."""
    inv_freq = 10000.0 ** (-torch.arange(0, HEAD_DIM, 2).double() / HEAD_DIM)
    angles = positions.double()[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)[None]
    return emb.cos().float(), emb.sin().float()


def _attention_weights(selectors: int = 2) -> tuple[Tensor, Tensor]:
    """Random q/k projections of a layer of 4 query heads over `selectors` KV heads."""
    generator = torch.Generator().manual_seed(1)
    q_weight = torch.randn(4 * HEAD_DIM, HIDDEN, generator=generator) / math.sqrt(HIDDEN)
    k_weight = torch.randn(selectors * HEAD_DIM, HIDDEN, generator=generator) / math.sqrt(HIDDEN)
    return q_weight, k_weight


def _gate(rotated_pairs: int | None, query_heads: int = 1) -> SparseGateHead:
    """A gate of 2 selectors initialised from `_attention_weights` (qk_svd)."""
    torch.manual_seed(0)  # the noise of several query heads' init
    gate = SparseGateHead(HIDDEN, GATE_DIM, HEAD_DIM, 2, query_heads=query_heads, rotated_pairs=rotated_pairs)
    gate.init_from_attention(*_attention_weights(), 4, 2, HEAD_DIM)
    return gate


def _logits(gate: SparseGateHead, hidden: Tensor, positions: Tensor) -> Tensor:
    with torch.no_grad():
        return gate.score_stored(*gate(hidden, *_rope(positions)))


@pytest.mark.parametrize("query_heads", [1, 3])
def test_an_unrotated_gate_scores_content_alone(query_heads: int) -> None:
    """r = 0: the logits do not depend on the positions (queries and keys moved apart, by different
    distances, give the same logits to the bit: cos 1, sin 0 leave each value as projected); with every pair
    rotated they do."""
    hidden = torch.randn(1, LENGTH, HIDDEN, generator=torch.Generator().manual_seed(2))
    near, spread = torch.arange(LENGTH), torch.arange(LENGTH) * 7 + 100
    content = _gate(0, query_heads)
    assert torch.equal(_logits(content, hidden, near), _logits(content, hidden, spread))
    rotated = _gate(None, query_heads)
    assert (_logits(rotated, hidden, near) - _logits(rotated, hidden, spread)).abs().max() > 0.1


@pytest.mark.parametrize("query_heads", [1, 3])
def test_init_keeps_the_strongest_frequencies_rotated_and_the_others_as_initialised(query_heads: int) -> None:
    """With r = 2 the qk_svd init gives the same projections as with every pair rotated, the first two
    indices (largest singular values) as there and the others unrotated; r = gate_head_dim / 2 is r = None."""
    every, two = _gate(None, query_heads), _gate(2, query_heads)
    assert torch.equal(two.rope_freq_index[:, :2], every.rope_freq_index[:, :2])
    assert (two.rope_freq_index[:, 2:] == UNROTATED).all() and (every.rope_freq_index < UNROTATED).all()
    for name, tensor in every.state_dict().items():
        if name != "rope_freq_index":
            assert torch.equal(two.state_dict()[name], tensor), name
    assert all(torch.equal(a, b) for a, b in zip(_gate(4).state_dict().values(), _gate(None).state_dict().values()))


def test_random_init_rotates_the_first_pairs_by_the_default_frequencies() -> None:
    assert (
        SparseGateHead(HIDDEN, GATE_DIM, HEAD_DIM, 2, rotated_pairs=3).rope_freq_index.tolist()
        == [[0, 1, 2, UNROTATED]] * 2
    )
    with pytest.raises(ValueError, match="rotated_pairs must be between 0 and gate_head_dim / 2 = 4, got 5"):
        SparseGateHead(HIDDEN, GATE_DIM, HEAD_DIM, rotated_pairs=5)


def test_the_recipe_field_and_its_overrides() -> None:
    """Set by an override (as `benchmarks/long_context.py --long-override` passes it); above
    gate_head_dim / 2 one problem naming the field, the value and the fix."""
    recipe = REPO / "recipes" / "gate_only.yaml"
    assert load_recipe(recipe).gsm.sparse_attention.gate_rotated_pairs is None
    config = load_recipe(recipe, ["gsm.sparse_attention.gate_rotated_pairs=0"])
    assert config.gsm.sparse_attention.gate_rotated_pairs == 0
    with pytest.raises(ConfigError) as info:
        load_recipe(recipe, ["gsm.sparse_attention.gate_head_dim=16", "gsm.sparse_attention.gate_rotated_pairs=9"])
    [problem] = info.value.problems
    assert problem.path == "gsm.sparse_attention.gate_rotated_pairs" and problem.value == 9
    assert "8 RoPE pairs" in problem.message and problem.fix == "use a value from 0 to 8, or null to rotate them all"


def test_an_export_keeps_the_field_and_the_indices(tmp_path: Path) -> None:
    """The export's gsm_config.json carries gate_rotated_pairs and its tensors the unrotated indices; an
    export written before the field (none in its config) loads as every pair rotated."""
    sections = {"sparse_attention": {"top_k": 4, "k_min": 2, "gate_head_dim": 16, "gate_rotated_pairs": 2}}
    model = tiny_model("llama")
    inject_gsm(model, GSMConfig.model_validate(sections), mode="sparse")
    folder = export_adapter(model, tmp_path / "export", base_name="tiny-llama")
    config = json.loads((folder / CONFIG_FILE).read_text())
    assert config["sparse_attention"]["gate_rotated_pairs"] == 2
    loaded = tiny_model("llama")
    load_gsm(loaded, folder, mode="sparse")
    gates = [(a.self_attn.gsm.gate, b.self_attn.gsm.gate) for a, b in zip(model.model.layers, loaded.model.layers)]
    assert all(torch.equal(trained.rope_freq_index, restored.rope_freq_index) for trained, restored in gates)
    assert all((trained.rope_freq_index[:, 2:] == UNROTATED).all() for trained, _ in gates)
    assert load_gsm(tiny_model("llama"), folder).config.sparse_attention.gate_rotated_pairs == 2
    del config["sparse_attention"]["gate_rotated_pairs"]
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    assert load_gsm(tiny_model("llama"), folder).config.sparse_attention.gate_rotated_pairs is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the gate compiles its RoPE only on CUDA")
def test_only_a_training_gate_compiles_its_rope(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gate in eval mode rotates its queries and keys eagerly even where gradients flow (a scoring script
    without no_grad): only a training step, whose shapes are fixed, takes the compiled RoPE (each new length
    would compile again). The same values either way."""
    from gsm_train.modules import sparse_gate

    calls = []

    def spy(fn: object, mode: str | None = None) -> object:
        calls.append(fn)
        return fn

    monkeypatch.setattr(sparse_gate, "compiled", spy)
    gate = _gate(None).cuda()
    hidden = torch.randn(1, LENGTH, HIDDEN, device="cuda")
    cos, sin = (table.cuda() for table in _rope(torch.arange(LENGTH)))
    evaluated = gate.eval()(hidden, cos, sin)
    assert calls == []
    trained = gate.train()(hidden, cos, sin)
    assert calls == [sparse_gate.rope_pair]
    assert all(torch.equal(a, b) for a, b in zip(evaluated, trained, strict=True))
