"""benchmarks.int4_hybrid's plumbing on the CPU: the perplexity part (bf16 and 4-bit, dense and with GSM,
on the same windows) and the summary's keys from the 8B rows benchmarks.generate.run_row writes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from benchmarks import int4_hybrid
from benchmarks.int4_hybrid import int4_summary, perplexity
from gsm_train.attention import inject_gsm
from gsm_train.config.schema import GSMConfig
from gsm_train.export.save_load import export_adapter
from gsm_train.models.model_zoo import tiny_model

pytest.importorskip("torchao", reason="the int4 path needs torchao (pip install 'gsm-train[int4]')")


def test_the_perplexity_part_sets_4bit_against_bf16(tmp_path: Path) -> None:
    """Six perplexities of one tiny export's base on the same windows (full, 4-bit, 4-bit with AWQ
    scales from other text; dense and GSM); 4-bit weights move them and AWQ's scales move them again,
    and the ratios are those of the perplexities."""
    model = tiny_model("llama", num_layers=1)  # AWQ searches 20 scales per linear: few linears
    gsm = {"sparse_attention": {"top_k": 8, "k_min": 8}, "kv_compression": {"enabled": True, "block_size": 8}}
    inject_gsm(model, GSMConfig.model_validate(gsm), mode="sparse")
    export = export_adapter(model, tmp_path / "export", base_name="tiny-llama-1")
    text = tmp_path / "valid.txt"
    text.write_text("a held-out line of text, repeated for the windows. " * 30)

    calibration = tmp_path / "train.txt"
    calibration.write_text("other lines of text, for the scales AWQ chooses. " * 30)

    ppl = perplexity(str(export), str(text), 64, 2, "int4-g64", (str(calibration), 2, 32))

    assert ppl["windows_evaluated"] == 2 and ppl["settings"]["weights"] == "int4-g64"
    values = [ppl[f"ppl_{w}_{p}"] for w in ("bf16", "int4", "int4awq") for p in ("dense", "gsm")]
    assert all(math.isfinite(v) and v > 1 for v in values)
    assert ppl["ppl_int4_dense"] != ppl["ppl_bf16_dense"] and ppl["ppl_int4_gsm"] != ppl["ppl_bf16_gsm"]
    assert ppl["ppl_int4_gsm_over_bf16_gsm"] == ppl["ppl_int4_gsm"] / ppl["ppl_bf16_gsm"]
    assert ppl["ppl_int4_dense_over_bf16_dense"] == ppl["ppl_int4_dense"] / ppl["ppl_bf16_dense"]
    assert ppl["ppl_int4awq_gsm_over_bf16_gsm"] == ppl["ppl_int4awq_gsm"] / ppl["ppl_bf16_gsm"]
    assert ppl["ppl_int4awq_gsm"] != ppl["ppl_int4_gsm"]  # AWQ's scales change the 4-bit weights


def _method(tokens_per_s: float) -> dict:
    return {"decode_tokens_per_s": tokens_per_s, "bandwidth_share": 0.5, "time_to_first_token_s": None}


def test_the_summary_names_the_int4_rows() -> None:
    """GSM over the fastest 4-bit dense method, and GSM's bandwidth bound over the dense one, per row; a
    row cut short has no summary; the perplexity ratio comes from the perplexity part."""
    bounds = {"bound_tokens_per_s_dense": 100.0, "bound_tokens_per_s_gsm": 300.0}
    result = {
        "perplexity": {
            "ppl_int4_gsm_over_bf16_gsm": 1.02,
            "ppl_int4_dense_over_bf16_dense": 1.01,
            "ppl_int4_gsm_over_int4_dense": 1.05,
        },
        "rows": {
            "8b_128k_bs1": {
                "dense_engine": _method(40.0),
                "dense_static_compiled": _method(30.0),
                "gsm": _method(120.0),
            }
            | bounds,
            "8b_32k_bs16": {"dense_engine": _method(400.0)} | bounds,
        },
    }
    device_in_use = torch.cuda.is_initialized()  # another test of this process may have started CUDA
    summary = int4_summary(result)
    assert summary["e2e_speedup_int4_8b_128k_bs1"] == 3.0
    assert summary["bound_speedup_int4_8b_128k_bs1"] == 3.0
    assert summary["bandwidth_share_dense_static_compiled_int4_8b_128k_bs1"] == 0.5
    assert summary["ppl_int4_gsm_over_bf16_gsm"] == 1.02
    assert not any(key.endswith("8b_32k_bs16") for key in summary)
    assert torch.cuda.is_initialized() == device_in_use  # the summary needs no device


@pytest.mark.parametrize(
    ("bad", "named"),
    [(["--rows", "8b_32k_bs1,8b_64k_bs1"], "--rows: unknown 8b_64k_bs1"), (["--methods", "dense_eager"], "--methods")],
)
def test_bad_8b_arguments_are_refused_before_any_part_runs(
    bad: list[str], named: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A wrong row or method is refused by name before the perplexity part or any model: nothing is written."""
    result = tmp_path / "int4.json"
    argv = [
        "int4_hybrid",
        "--parts",
        "ppl,8b",
        "--eval-data",
        "x",
        "--smollm2-export",
        "y",
        *bad,
        "--result",
        str(result),
    ]
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(SystemExit):
        int4_hybrid.main()
    assert named in capsys.readouterr().err and not result.exists()
