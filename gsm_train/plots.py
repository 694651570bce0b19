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


def plot_decode_speedup(rows: list[dict], path: Path) -> Path:
    """Dense / GSM decode-attention time per step against context, one panel per layer shape."""
    shapes = sorted({row["shape"] for row in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.2 * len(shapes), 3.8), sharey=True, squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for batch in sorted({row["batch"] for row in rows}):
            for k in sorted({row["k"] for row in rows}):
                points = sorted((r["context"], r["speedup"]) for r in rows
                                if (r["shape"], r["batch"], r["k"]) == (shape, batch, k))
                ax.plot([c for c, _ in points], [s for _, s in points], "o-", label=f"batch {batch}, k={k}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axhline(3.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_title(shape)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("speed-up over dense SDPA (x)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle("decode attention per step, GSM (top-k + fused ASQ kernel) vs dense bf16 SDPA")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
