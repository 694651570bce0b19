"""Report plots (`gsm_train.plots`) that benchmarks draw from their results."""

from __future__ import annotations

from pathlib import Path

import pytest

from gsm_train.plots import plot_layer_sensitivity


def test_layer_sensitivity_plot_is_written(tmp_path: Path) -> None:
    path = plot_layer_sensitivity({"K": [0.1, 0.0, 0.2], "V": [0.3, 0.05, 0.0]}, 2, tmp_path / "s.png")
    assert path.stat().st_size > 1000


def test_layer_sensitivity_plot_refuses_nothing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_layer_sensitivity({}, 2, tmp_path / "s.png")


def test_quality_vs_kv_plot_is_written_with_runs_near_the_goal_and_far_from_it(tmp_path: Path) -> None:
    from gsm_train.plots import plot_quality_vs_kv

    points = [
        {"label": "far", "kv_bytes_ratio": 0.59, "ppl_over_control": 1.02},
        {"label": "near a", "kv_bytes_ratio": 0.2999, "ppl_over_control": 1.048},
        {"label": "near b", "kv_bytes_ratio": 0.2999, "ppl_over_control": 1.051},
    ]
    assert plot_quality_vs_kv(points, 1.05, 0.30, tmp_path / "q.png").stat().st_size > 1000
    assert plot_quality_vs_kv(points[:1], 1.05, 0.30, tmp_path / "one.png").stat().st_size > 1000  # none near


def test_quality_vs_kv_plot_refuses_nothing(tmp_path: Path) -> None:
    from gsm_train.plots import plot_quality_vs_kv

    with pytest.raises(ValueError, match="no runs to plot"):
        plot_quality_vs_kv([], 1.05, 0.30, tmp_path / "q.png")
