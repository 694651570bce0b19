"""PNG plots for reports (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_recall_per_layer(layers: list[int], gate: list[float], oracle: list[float], k: int, path: Path) -> Path:
    """Captured attention mass per layer at k: the gate's selection against the true top-k."""
    fig, ax = plt.subplots(figsize=(max(6.0, 0.3 * len(layers) + 2), 3.6))
    ax.plot(layers, oracle, "o-", label=f"oracle top-{k}")
    ax.plot(layers, gate, "s-", label=f"gate top-{k}")
    ax.set_xlabel("layer")
    ax.set_ylabel(f"captured attention mass @ k={k}")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    mean_ratio = sum(g / max(o, 1e-12) for g, o in zip(gate, oracle)) / max(1, len(layers))
    ax.set_title(f"gate / oracle captured mass, mean ratio {mean_ratio:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
