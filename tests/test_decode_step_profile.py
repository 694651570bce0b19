"""benchmarks.decode_step_profile on the CPU with the tiny model: a per-op table for the dense engine's and
GSM's token steps, written as JSON, and a second run with the same settings profiles nothing again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import decode_step_profile


def test_profile_writes_a_table_per_method_and_resumes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "profile.json"
    argv = ["--model", "tiny", "--context", "37", "--steps", "2", "--result", str(path)]
    decode_step_profile.main(argv)
    result = json.loads(path.read_text())
    assert result["settings"] == {"model": "tiny", "context": 37, "batch": 1, "steps": 2}
    for method in ("dense_engine", "gsm"):
        kernels = result[method]["kernels"]
        assert result[method]["step_us"] > 0 and {"name", "calls", "total_us", "share"} <= set(kernels[0])
        assert sum(row["share"] for row in kernels) == pytest.approx(1.0)
        assert [row["total_us"] for row in kernels] == sorted((row["total_us"] for row in kernels), reverse=True)
    assert any("topk" in row["name"] for row in result["gsm"]["kernels"])  # GSM's step selects its keys
    assert "dense_engine:" in capsys.readouterr().out
    decode_step_profile.main(argv)
    assert capsys.readouterr().out.count("profiled by an earlier run") == 2
    assert json.loads(path.read_text())["gsm"] == result["gsm"]
