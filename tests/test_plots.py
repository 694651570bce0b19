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
