"""The step-breakdown report (`benchmarks/step_breakdown.py`): kernels grouped by name, the rest of the step
counted outside them, one stacked bar per setting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import step_breakdown

PROFILE = {
    "rows": {
        "dense_graphed": {
            "step_ms": 10.0,
            "kernels": [
                {"kernel": "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "ms_per_step": 2.0},
                {"kernel": "nvjet_sm90_tst_192x192_64x3", "ms_per_step": 3.0},
            ],
        },
        "joint_graphed": {
            "step_ms": 20.0,
            "kernels": [
                {"kernel": "triton_tem_fused_flex_attention_2", "ms_per_step": 5.0},
                {"kernel": "_top_k_selection_kernel", "ms_per_step": 1.5},
                {"kernel": "sm80_xmma_gemm_f32f32_f32f32_f32_nt_n", "ms_per_step": 1.0},
                {"kernel": "some_new_kernel", "ms_per_step": 0.5},
            ],
        },
    }
}


def test_kernels_land_in_their_part_and_the_rest_is_outside() -> None:
    split = step_breakdown.split_step(PROFILE["rows"]["joint_graphed"])
    assert split == {
        "FlexAttention (ASQ layers)": 5.0,
        "top-k selection": 1.5,
        "fp32 matmuls (ASQ's MLP)": 1.0,
        step_breakdown.OTHER: 0.5,
        step_breakdown.OUTSIDE: 12.0,
    }
    assert sum(step_breakdown.split_step(PROFILE["rows"]["dense_graphed"]).values()) == 10.0


def test_report_draws_one_bar_per_setting(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    profile = tmp_path / "joint_step.json"
    profile.write_text(json.dumps(PROFILE))
    assert (
        step_breakdown.main([str(profile), "--plot", str(tmp_path / "b.png"), "--result", str(tmp_path / "b.json")])
        == 0
    )
    assert (tmp_path / "b.png").stat().st_size > 1000
    parts = json.loads((tmp_path / "b.json").read_text())["parts_ms"]
    assert list(parts["dense_graphed"]) == list(parts["joint_graphed"]), "every bar stacks the parts in one order"
    assert "20.00 ms" in capsys.readouterr().out


def test_a_result_without_a_profile_is_one_clear_error(tmp_path: Path) -> None:
    profile = tmp_path / "joint_step.json"
    profile.write_text(json.dumps({"rows": {"dense_graphed": {"step_ms": 10.0}}}))
    with pytest.raises(SystemExit):
        step_breakdown.main([str(profile), "--plot", str(tmp_path / "b.png")])
