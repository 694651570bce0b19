"""benchmarks.pareto on the CPU with a tiny export and small sizes: every sweep point and scenario in the
JSON with its keys, a knob the export cannot take recorded with its reason, the knobs applied as the
recipe would set them, pareto.png written, and a second run with the same settings measuring nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import pareto
from gsm_train.attention import gsm_adapters, gsm_settings, inject_gsm
from gsm_train.config.schema import GSMConfig
from gsm_train.export.save_load import export_adapter, load_gsm
from gsm_train.models.model_zoo import tiny_model

GSM = {
    "sparse_attention": {"top_k": 6, "k_min": 2, "gate_head_dim": 8, "dense_layers": [0], "mode": "sparse"},
    "kv_compression": {"enabled": True, "block_size": 16, "cluster_num": 2, "hidden_dim": 8},
}


def _export(folder: Path, gsm: dict) -> Path:
    model = tiny_model("llama")
    torch.manual_seed(1)
    inject_gsm(model, GSMConfig.model_validate(gsm), mode="sparse")
    return export_adapter(model, folder / "export", base_name="tiny-llama")


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _export(tmp_path_factory.mktemp("gsm"), GSM)


def test_knobs_set_the_fields_the_recipe_names(export: Path) -> None:
    model = tiny_model("llama")
    load_gsm(model, export)
    assert pareto.apply_knob(model, "top_k_base", 32, 64) == "sparse_attention.top_k=32"
    assert gsm_settings(model).config.sparse_attention.top_k == 32
    assert "2-bit residuals, 8-bit gate keys" in pareto.apply_knob(model, "kv_compression_ratio", 0.6, 64)
    assert gsm_settings(model).config.kv_compression.quant_bits == 2
    adapters = [adapter for _, adapter in gsm_adapters(model)]
    assert all(a.asq_k.quant_bits == a.asq_v.quant_bits == 2 for a in adapters if a.asq_k is not None)
    assert all(a.gate.key_bits == 8 for a in adapters if a.gate is not None)
    with pytest.raises(pareto.NotApplicable, match="no cache bridge"):
        pareto.apply_knob(model, "bridge_alpha", 0.3, 64)


def test_a_top_k_below_the_export_s_floor_lowers_the_floor(tmp_path: Path) -> None:
    """A long-context export's k_min is above the knob's values: k_min follows top_k down, and says so."""
    floor = {**GSM, "sparse_attention": {**GSM["sparse_attention"], "top_k": 6, "k_min": 6}}
    model = tiny_model("llama")
    load_gsm(model, _export(tmp_path, floor))
    assert (
        pareto.apply_knob(model, "top_k_base", 4, 64)
        == "sparse_attention.top_k=4, k_min=4 (the export's 6 is above it)"
    )
    sparse = gsm_settings(model).config.sparse_attention
    assert (sparse.top_k, sparse.k_min) == (4, 4)
    with pytest.raises(pareto.NotApplicable, match="top_k"):
        pareto.apply_knob(model, "top_k_base", 0, 64)


def test_sweep_writes_points_scenarios_and_the_plot(tmp_path: Path, capsys) -> None:
    export = _export(tmp_path, {**GSM, "kv_compression": {"enabled": False}})  # the gate alone: fast on the CPU
    text = tmp_path / "held_out.txt"
    text.write_text("\n\n".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog." * 3 for i in range(30)))
    result_path = tmp_path / "pareto.json"
    argv = [
        "--export", str(export), "--eval-data", str(text), "--result", str(result_path),
        "--seq-len", "64", "--ppl-windows", "1", "--batch-size", "1", "--sweep-prompts", "1",
        "--sweep-prompt-tokens", "20", "--new-tokens", "2", "--scenario-prompts", "2",
        "--scenarios", "general:24:2,long_text_over_4k:40:2,low_latency:12:2",
        "--values", "top_k_base=32,kv_compression_ratio=0.6,bridge_alpha=0.3", "--device", "cpu",
    ]  # fmt: skip
    pareto.main(argv)
    result = json.loads(result_path.read_text())
    assert set(result["points"]) == {"as_exported", "top_k_base=32", "kv_compression_ratio=0.6", "bridge_alpha=0.3"}
    for key in ("as_exported", "top_k_base=32"):
        point = result["points"][key]
        assert point["ppl"] > 1 and point["tokens_per_s"] > 0 and point["p95_token_latency_ms"] > 0
    assert "no cache bridge" in result["points"]["bridge_alpha=0.3"]["not_applicable"]
    assert "no KV compression" in result["points"]["kv_compression_ratio=0.6"]["not_applicable"]
    assert set(result["scenarios"]) == {"general", "long_text_over_4k", "low_latency"}
    long_text = result["scenarios"]["long_text_over_4k"]
    assert (long_text["prompt_tokens"], long_text["new_tokens"], long_text["prompts"]) == (40, 2, 2)
    assert (tmp_path / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    pareto.main(argv)
    assert capsys.readouterr().out.count("measured by an earlier run") == 7
