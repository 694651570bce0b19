"""`gsm-train eval`: perplexity with GSM as inference runs it, against the base, plus KV bytes and recall."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from gsm_train.attention import gsm_settings, inject_gsm
from gsm_train.cli import main as cli_main
from gsm_train.commands.evaluate import evaluate_exports, perplexity_and_recall, position_buckets
from gsm_train.config.schema import GSMConfig
from gsm_train.data.text import load_text_dataset, pack_tokens
from gsm_train.export.save_load import export_adapter
from gsm_train.models.model_zoo import byte_tokenizer, tiny_model

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
    asq = _export(
        tmp_path,
        "asq",
        {
            "sparse_attention": {"enabled": False},
            "kv_compression": {"enabled": True, "quant_bits": 2, "block_size": 8, "cluster_num": 2},
        },
    )
    result = _evaluate({"asq": asq})["asq"]
    assert 0 < result["kv_bytes_ratio"] < 1
    assert result["kv_bytes_per_token"] == pytest.approx(result["kv_bytes_ratio"] * result["kv_bytes_per_token_bf16"])


def test_cli_writes_json_and_table(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    export = _export(tmp_path, "gate", {"sparse_attention": {"top_k": 4, "k_min": 4}})
    argv = _eval_argv(str(export), "--out", str(tmp_path / "eval"))
    assert cli_main(argv) == 0
    assert "| gsm |" in capsys.readouterr().out
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert set(report["results"]) == {"base", "gsm"}
    assert cli_main([*argv[:5], "--export", "no-equals-sign"]) == 2


@pytest.mark.parametrize("baseline", ["per_token", "kivi"])
def test_plain_quant_baselines_replace_asq(tmp_path: Path, baseline: str) -> None:
    asq = _export(
        tmp_path,
        "asq",
        {"sparse_attention": {"enabled": False}, "kv_compression": {"enabled": True, "quant_bits": 2, "block_size": 8}},
    )
    with_asq = _evaluate({"asq": asq})["asq"]["ppl"]
    plain = evaluate_exports(
        "tiny-llama", {"asq": asq}, "embedded:sample_prose", SEQ, WINDOWS, 2, "sparse", 8, kv_baseline=baseline
    )["results"]
    assert plain["asq"]["ppl"] != pytest.approx(with_asq, rel=1e-4)
    assert plain["base"]["ppl"] == pytest.approx(_evaluate({})["base"]["ppl"], rel=1e-6)


# --------------------------------------------------------------------------- per position bucket


def test_position_buckets_double_from_the_first_and_stop_at_the_window() -> None:
    assert position_buckets(8192) == [(0, 2048), (2048, 4096), (4096, 8192)]
    assert position_buckets(2048) == [(0, 2048)]
    assert position_buckets(6000) == [(0, 2048), (2048, 4096), (4096, 6000)]
    assert position_buckets(1000) == [(0, 1000)]
    assert position_buckets(32, first=8) == [(0, 8), (8, 16), (16, 32)]


def _fp64_gate_model() -> torch.nn.Module:
    model = tiny_model("llama").double()
    gsm = GSMConfig.model_validate({"sparse_attention": {"top_k": 4, "k_min": 4}})
    inject_gsm(model, gsm, mode="sparse")
    return model


def _prose_rows(count: int) -> torch.Tensor:
    return pack_tokens(load_text_dataset("embedded:sample_prose"), byte_tokenizer(), SEQ)[:count]


def test_bucket_nll_adds_up_to_the_window_and_each_is_the_tokens_predicted_there() -> None:
    """fp64: the token-weighted bucket NLLs sum to the window's NLL to 1e-9, each bucket's is the
    NLL of the tokens predicted from its positions (written by hand from the logits), and the mean
    agrees with the model's own loss (which transformers takes in fp32)."""
    model, rows = _fp64_gate_model(), _prose_rows(3)
    result = perplexity_and_recall(model, rows, 2, (4, 8), position_buckets(SEQ, first=8))
    with torch.no_grad():
        log_probs = model(input_ids=rows).logits.log_softmax(-1)  # fp64
        own_loss = float(model(input_ids=rows, labels=rows).loss)
    # [rows, T - 1]: position t predicts token t + 1
    by_hand = -log_probs[:, :-1].gather(-1, rows[:, 1:, None])[..., 0]
    parts = result["buckets"]
    assert [p["tokens"] for p in parts] == [3 * 8, 3 * 8, 3 * 15]  # the last position: no token
    assert sum(p["nll"] for p in parts) == result["nll"]  # the window's figure is the buckets' sum
    assert result["nll"] == pytest.approx(float(by_hand.sum()), rel=1e-9)
    assert result["tokens"] == 3 * (SEQ - 1)
    for part in parts:
        nll = float(by_hand[:, part["start"] : part["stop"]].sum())
        assert part["nll"] == pytest.approx(nll, rel=1e-9)
        assert part["ppl"] == pytest.approx(math.exp(nll / part["tokens"]), rel=1e-9)
    assert result["ppl"] == pytest.approx(math.exp(own_loss), rel=1e-6)


def test_bucket_captured_mass_adds_up_to_the_unbucketed_figures() -> None:
    model, rows = _fp64_gate_model(), _prose_rows(2)
    whole = perplexity_and_recall(model, rows, 2, (4, 8))
    parts = perplexity_and_recall(model, rows, 2, (4, 8), position_buckets(SEQ, first=8))["buckets"]
    gate_layers = len(gsm_settings(model).gate_layers)
    # queries with >= 8 keys: position 7 of the first bucket, all of the others'; 2 rows, every gate
    assert [p["queries"] for p in parts] == [2 * gate_layers * n for n in (1, 8, 16)]
    assert sum(p["queries"] for p in parts) == whole["queries"]
    for key in ("gate_mass", "oracle_mass"):
        added = sum(p[key] * p["queries"] for p in parts) / whole["queries"]
        assert added == pytest.approx(whole[key], rel=1e-12)
    assert all(0 < p["gate_mass"] <= p["oracle_mass"] <= 1 for p in parts)


def test_captured_mass_at_the_scheduled_k() -> None:
    """recall k None measures at each query's scheduled k: on a constant schedule that is top_k."""
    model, rows = _fp64_gate_model(), _prose_rows(2)
    buckets = position_buckets(SEQ, first=8)
    scheduled = perplexity_and_recall(model, rows, 2, (None, 8), buckets)
    constant = perplexity_and_recall(model, rows, 2, (4, 8), buckets)
    for key in ("gate_mass", "oracle_mass", "queries"):
        assert scheduled[key] == pytest.approx(constant[key], rel=1e-12)
    fraction = tiny_model("llama").double()
    sparse = {"top_k_schedule": "fraction", "top_k_fraction": 0.25, "k_min": 2, "top_k": 6}
    inject_gsm(fraction, GSMConfig.model_validate({"sparse_attention": sparse}), mode="sparse")
    parts = perplexity_and_recall(fraction, rows, 2, (None, 8), buckets)["buckets"]
    at_top_k = perplexity_and_recall(fraction, rows, 2, (6, 8), buckets)["buckets"]
    # k_t = ceil((t + 1) / 4) within [2, 6], at most top_k's 6: at most its mass, less below 6
    assert parts[0]["oracle_mass"] < at_top_k[0]["oracle_mass"]  # position 7: k_t = 2
    assert all(p["oracle_mass"] <= q["oracle_mass"] + 1e-12 for p, q in zip(parts, at_top_k))
    assert all(0 < p["gate_mass"] <= p["oracle_mass"] + 1e-12 for p in parts)


def _eval_argv(export: str, *more: str) -> list[str]:
    return [
        "eval",
        "--model",
        "tiny-llama",
        "--data",
        "embedded:sample_prose",
        "--export",
        f"gsm={export}",
        "--seq-len",
        str(SEQ),
        "--windows",
        "2",
        "--min-keys",
        "8",
        *more,
    ]


def test_cli_writes_the_bucket_table_and_runs_a_changed_selection(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    export = _export(tmp_path, "gate", {"sparse_attention": {"top_k": 4, "k_min": 4}})
    assert cli_main(_eval_argv(export, "--first-bucket", "8", "--out", str(tmp_path / "own"))) == 0
    header = "| model | PPL 0-8 | PPL 8-16 | PPL 16-32 | gate/oracle 0-8 |"
    assert header in capsys.readouterr().out
    own = json.loads((tmp_path / "own" / "eval.json").read_text())
    assert own["buckets"] == [[0, 8], [8, 16], [16, 32]]
    assert len(own["results"]["gsm"]["buckets"]) == 3
    wide = ["--select", "top_k_schedule=fraction", "--select", "top_k_fraction=1.0", "--select", "top_k=64"]
    assert cli_main(_eval_argv(export, *wide, "--out", str(tmp_path / "wide"))) == 0
    results = json.loads((tmp_path / "wide" / "eval.json").read_text())["results"]
    # every key kept: the base's perplexity, and not the export's own selection's
    assert results["gsm"]["ppl"] == pytest.approx(results["base"]["ppl"], rel=1e-5)
    assert own["results"]["gsm"]["ppl"] != pytest.approx(results["gsm"]["ppl"], rel=1e-4)


@pytest.mark.parametrize(
    ("select", "message"),
    [
        ("gate_head_dim=8", "gsm.sparse_attention.gate_head_dim = 8: evaluation can change only"),
        ("top_k_fraction=0.5", "top_k_schedule is 'constant'"),
        ("top_k=0", "gsm.sparse_attention.top_k = 0"),
        ("gsm.top_k=0", "gsm.sparse_attention.top_k = 0"),  # one export's change, checked as every export's
    ],
)
def test_a_bad_selection_change_is_one_clear_error_before_a_model_loads(
    tmp_path: Path, select: str, message: str, capsys: pytest.CaptureFixture
) -> None:
    export = _export(tmp_path, "gate", {"sparse_attention": {"top_k": 4, "k_min": 4}})
    argv = _eval_argv(export, "--select", select, "--out", str(tmp_path / "eval"))
    argv[argv.index("tiny-llama")] = "no-such-model"  # refused before any model would load
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "fix:" in err and "--export gsm" in err
    assert not (tmp_path / "eval").exists()
