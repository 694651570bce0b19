"""`gsm-train eval`: perplexity with GSM as inference runs it, against the base, plus KV bytes and recall."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from gsm_train.cli import main as cli_main
from gsm_train.config import GSMConfig
from gsm_train.data import load_text_dataset, pack_tokens
from gsm_train.evaluate import evaluate_exports
from gsm_train.export import export_adapter
from gsm_train.model_zoo import byte_tokenizer, tiny_model
from gsm_train.modules import inject_gsm

SEQ, WINDOWS = 32, 4


def _export(tmp_path: Path, name: str, gsm: dict) -> str:
    model = tiny_model("llama")
    inject_gsm(model, GSMConfig.model_validate(gsm))
    return str(export_adapter(model, tmp_path / name, base_name="tiny-llama"))


def _evaluate(exports: dict[str, str]) -> dict:
    return evaluate_exports("tiny-llama", exports, "embedded:sample_prose", SEQ, WINDOWS, 2, "sparse", 8)["results"]


def test_base_perplexity_is_exp_of_the_mean_token_loss() -> None:
    rows = pack_tokens(load_text_dataset("embedded:sample_prose"), byte_tokenizer(), SEQ)[:WINDOWS]
    with torch.no_grad():
        loss = tiny_model("llama")(input_ids=rows, labels=rows).loss
    assert _evaluate({})["base"]["ppl"] == pytest.approx(math.exp(float(loss)), rel=1e-5)


def test_sparse_with_k_above_the_window_matches_base_and_small_k_does_not(tmp_path: Path) -> None:
    wide = _export(tmp_path, "wide", {"sparse_attention": {"top_k": 64, "k_min": 32}})
    narrow = _export(tmp_path, "narrow", {"sparse_attention": {"top_k": 2, "k_min": 2}})
    results = _evaluate({"wide": wide, "narrow": narrow})
    assert results["wide"]["ppl"] == pytest.approx(results["base"]["ppl"], rel=1e-5)
    assert results["narrow"]["ppl"] != pytest.approx(results["base"]["ppl"], rel=1e-3)
    assert results["wide"]["recall_ratio"] == pytest.approx(1.0, abs=1e-6)
    assert 0 < results["narrow"]["gate_mass"] <= results["narrow"]["oracle_mass"] <= 1


def test_kv_bytes_reflect_asq(tmp_path: Path) -> None:
    asq = _export(tmp_path, "asq", {"sparse_attention": {"enabled": False},
                                    "kv_compression": {"enabled": True, "quant_bits": 2, "block_size": 8,
                                                       "cluster_num": 2}})
    result = _evaluate({"asq": asq})["asq"]
    assert 0 < result["kv_bytes_ratio"] < 1
    assert result["kv_bytes_per_token"] == pytest.approx(result["kv_bytes_ratio"] * result["kv_bytes_per_token_bf16"])


def test_cli_writes_json_and_table(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    export = _export(tmp_path, "gate", {"sparse_attention": {"top_k": 4, "k_min": 4}})
    argv = ["eval", "--model", "tiny-llama", "--data", "embedded:sample_prose", "--export", f"gsm={export}",
            "--seq-len", str(SEQ), "--windows", "2", "--min-keys", "8", "--out", str(tmp_path / "eval")]
    assert cli_main(argv) == 0
    assert "| gsm |" in capsys.readouterr().out
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert set(report["results"]) == {"base", "gsm"}
    assert cli_main([*argv[:5], "--export", "no-equals-sign"]) == 2


@pytest.mark.parametrize("baseline", ["per_token", "kivi"])
def test_plain_quant_baselines_replace_asq(tmp_path: Path, baseline: str) -> None:
    asq = _export(tmp_path, "asq", {"sparse_attention": {"enabled": False},
                                    "kv_compression": {"enabled": True, "quant_bits": 2, "block_size": 8}})
    with_asq = _evaluate({"asq": asq})["asq"]["ppl"]
    plain = evaluate_exports("tiny-llama", {"asq": asq}, "embedded:sample_prose", SEQ, WINDOWS, 2, "sparse", 8,
                             kv_baseline=baseline)["results"]
    assert plain["asq"]["ppl"] != pytest.approx(with_asq, rel=1e-4)
    assert plain["base"]["ppl"] == pytest.approx(_evaluate({})["base"]["ppl"], rel=1e-6)
