"""benchmarks.prefill_profile on the CPU with the tiny model: per method a wall time, a per-op table and the ops
one prefill runs (by part for GSM), written as JSON; a second run with the same settings profiles nothing
again; bad arguments are refused before a model is built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import prefill_profile

# a prompt of 40 in chunks of 16 with blocks of 16 (the tiny overrides): three chunks, the later two read
# the blocks packed before them
ARGV = ["--model", "tiny", "--context", "40", "--chunk", "16", "--repeats", "1", "--warmup", "0"]
CPU_ARGV = [*ARGV, "--device", "cpu"]  # the smoke tests name their device: on a GPU machine the default is cuda


def test_profile_writes_each_method_and_resumes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "prefill.json"
    prefill_profile.main([*CPU_ARGV, "--result", str(path)])
    result = json.loads(path.read_text())
    assert result["settings"]["chunk"] == 16 and result["settings"]["device"] == "cpu"
    for method in prefill_profile.METHODS:
        figures = result[method]
        assert figures["wall_ms"] > 0 and len(figures["per_layer"]) == 4
        assert figures["us_per_op"] == figures["wall_ms"] * 1000 / figures["ops"]
        assert sum(figures["ops_by_part"].values()) == figures["ops"]  # every op counted in one part
        assert sum(row["share"] for row in figures["kernels"]) == pytest.approx(1.0)
    assert set(result["dense_eager"]["ops_by_part"]) == {"model"}  # no GSM module ran
    gsm_parts = result["gsm"]["ops_by_part"]
    assert gsm_parts["asq_pack"] > 0 and gsm_parts["earlier_chunks_dequantized"] > 0 and gsm_parts["gate_keys"] > 0
    assert result["ratios"]["ops_gsm_over_dense_eager"] == result["gsm"]["ops"] / result["dense_eager"]["ops"]
    assert any("ops by part:" in line and "asq_pack" in line for line in capsys.readouterr().out.splitlines())
    prefill_profile.main([*CPU_ARGV, "--result", str(path)])
    assert capsys.readouterr().out.count("profiled by an earlier run") == len(prefill_profile.METHODS)
    assert json.loads(path.read_text())["gsm"] == result["gsm"]


def test_methods_picks_what_runs(tmp_path: Path) -> None:
    """`--methods` runs only the named methods, and the ratios are over the dense ones among them."""
    path = tmp_path / "prefill.json"
    prefill_profile.main([*CPU_ARGV, "--methods", "dense_engine", "gsm", "--result", str(path)])
    result = json.loads(path.read_text())
    assert [m for m in prefill_profile.METHODS if m in result] == ["dense_engine", "gsm"]
    assert set(result["ratios"]) == {"wall_gsm_over_dense_engine", "ops_gsm_over_dense_engine"}


@pytest.mark.parametrize(
    "bad", [["--chunk", "0"], ["--repeats", "0"], ["--warmup", "-1"], ["--prefill", "oracle"], ["--methods", "hf"]]
)
def test_bad_arguments_are_refused(bad: list[str], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        prefill_profile.main([*CPU_ARGV, *bad, "--result", str(tmp_path / "x.json")])
    assert bad[0] in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="kernel and host times apart exist on a GPU only")
def test_a_gpu_run_says_where_the_host_spends(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "prefill.json"
    prefill_profile.main([*ARGV, "--device", "cuda", "--result", str(path)])
    for method in prefill_profile.METHODS:
        figures = json.loads(path.read_text())[method]
        assert 0 < figures["kernel_ms"] and 0 < figures["host_op_ms"]
        assert 0 < len(figures["host_ops"]) <= prefill_profile.HOST_TOP
        assert figures["host_op_ms"] * 1000 >= sum(row["total_us"] for row in figures["host_ops"])
        idle = figures["idle"]  # the tiny model's prefill is launch-bound: the GPU waits between kernels
        assert idle["gaps"] > 0 and idle["idle_us"] >= sum(row["gap_us"] for row in idle["largest"]) > 0
    out = capsys.readouterr().out
    assert out.count("host: the ops' own CPU time") == out.count("GPU idle") == len(prefill_profile.METHODS)
