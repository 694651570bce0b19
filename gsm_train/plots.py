"""PNG plots for reports (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def plot_needle_per_layer(layers: list[int], figures: dict[str, list[float]], path: Path) -> Path:
    """The passkey needle probe per layer (benchmarks/passkey_probe.py): above, the attention mass on the
    needle's digits (head-averaged and the top head's) and what the gate's and the oracle's selections keep
    of it; below, the share of the digit tokens each selection keeps."""
    fig, (mass, kept) = plt.subplots(2, 1, figsize=(max(6.0, 0.3 * len(layers) + 2), 6.0), sharex=True)
    mass.plot(layers, figures["needle_mass"], "o-", label="dense, head-averaged")
    mass.plot(layers, figures["needle_mass_top_head"], "^:", label="dense, top head")
    mass.plot(layers, figures["oracle_needle_mass"], "s-", label="kept by the oracle's top-k")
    mass.plot(layers, figures["gate_needle_mass"], "x-", label="kept by the gate's top-k")
    mass.set_ylabel("attention on the needle's digits")
    mass.set_title("answer queries of the passkey cases, per layer")
    kept.plot(layers, figures["oracle_kept"], "s-", label="oracle")
    kept.plot(layers, figures["gate_kept"], "x-", label="gate")
    kept.set_ylabel("share of digit tokens kept")
    kept.set_xlabel("layer")
    kept.set_ylim(0, 1.02)
    for ax in (mass, kept):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _saved(fig, path)


def _saved(fig: plt.Figure, path: Path) -> Path:
    """Write `fig` to `path` (laid out, 120 dpi) and close it."""
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
                points = sorted(
                    (r["context"], r["speedup"]) for r in rows if (r["shape"], r["batch"], r["k"]) == (shape, batch, k)
                )
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


def plot_quality_vs_kv(points: list[dict[str, Any]], goal_ppl: float, goal_kv: float, path: Path) -> Path:
    """Perplexity over the dense control's against KV bytes over bf16 for one or more runs, each a dict with
    `label`, `kv_bytes_ratio` and `ppl_over_control`: numbered points (labels in the legend below), the
    goal region (both at most their goals) shaded; beside it, enlarged, the runs within 0.01 of the KV goal
    and 0.1 of the perplexity goal, which crowd there."""
    if not points:
        raise ValueError("plot_quality_vs_kv: no runs to plot")
    low = min(0.9, min(p["ppl_over_control"] for p in points) - 0.05)
    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(11, 4.2 + 0.22 * len(points)), width_ratios=(2, 1))
    near = [p for p in points if abs(p["kv_bytes_ratio"] - goal_kv) <= 0.01 and p["ppl_over_control"] <= goal_ppl + 0.1]
    colours = plt.get_cmap("tab20").colors
    for panel in (ax, zoom):
        panel.fill_between([0, goal_kv], low, goal_ppl, color="tab:green", alpha=0.12, label="goal")
        panel.axhline(1.0, color="grey", lw=0.8)
        panel.grid(alpha=0.3)
        panel.set_xlabel("KV bytes per token / bf16")
    for number, point in enumerate(sorted(points, key=lambda p: p["kv_bytes_ratio"]), start=1):
        x, y = point["kv_bytes_ratio"], point["ppl_over_control"]
        style = {"color": colours[(number - 1) % len(colours)]}
        ax.plot(x, y, "o", label=f"{number}: {point['label']}", **style)
        ax.annotate(str(number), (x, y), fontsize=8, xytext=(5, 5), textcoords="offset points")
        if point in near:  # numbers alternate sides: runs at the same budget sit in one column
            zoom.plot(x, y, "o", **style)
            zoom.annotate(
                str(number), (x, y), fontsize=8, xytext=(6 if number % 2 else -14, -3), textcoords="offset points"
            )
    ax.set_xlim(0, max(1.2, max(p["kv_bytes_ratio"] for p in points) + 0.1))
    ax.set_ylim(low, max(p["ppl_over_control"] for p in points) + 0.1)
    ax.set_ylabel("perplexity / dense control")
    ax.set_title("stage 2, SmolLM2-135M: quality against KV bytes (WikiText-2, context 2048)", fontsize=10)
    zoom.set_xlim(goal_kv - 0.01, goal_kv + 0.01)
    zoom.set_ylim(
        min([goal_ppl - 0.02] + [p["ppl_over_control"] - 0.01 for p in near]),
        max([goal_ppl + 0.02] + [p["ppl_over_control"] + 0.01 for p in near]),
    )
    zoom.set_title(f"enlarged: within 0.01 of the KV goal, {len(near)} runs", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.14), ncol=1, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_step_breakdown(steps: dict[str, dict[str, float]], title: str, path: Path) -> Path:
    """One horizontal bar per setting (`steps`: setting -> {part: ms}, parts in the order to stack), the
    same part in the same colour in every bar, milliseconds on the x axis."""
    if not steps:
        raise ValueError("plot_step_breakdown: no settings to plot")
    parts = list(dict.fromkeys(part for split in steps.values() for part in split))
    colours = plt.get_cmap("tab20").colors
    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.55 * len(steps) + 0.18 * len(parts)))
    names = list(steps)
    for index, part in enumerate(parts):
        widths = [steps[name].get(part, 0.0) for name in names]
        starts = [sum(steps[name].get(p, 0.0) for p in parts[:index]) for name in names]
        ax.barh(names, widths, left=starts, color=colours[index % len(colours)], label=part)
    for row, name in enumerate(names):
        total = sum(steps[name].values())
        ax.annotate(f"{total:.1f} ms", (total, row), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per step")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_layer_sensitivity(increase: dict[str, list[float]], bits: int, path: Path) -> Path:
    """Loss increase per layer when one layer's K or V (the keys of `increase`) is quantized at `bits`:
    grouped bars, one group per layer."""
    if not increase:
        raise ValueError("plot_layer_sensitivity: nothing to plot")
    layers = len(next(iter(increase.values())))
    width = 0.8 / len(increase)
    fig, ax = plt.subplots(figsize=(10, 3.8))
    for index, (side, values) in enumerate(increase.items()):
        ax.bar(
            [layer + (index - (len(increase) - 1) / 2) * width for layer in range(layers)], values, width, label=side
        )
    ax.set_xlabel("layer")
    ax.set_ylabel("loss increase (nats)")
    ax.set_xticks(range(layers))
    ax.set_title(f"SmolLM2-135M, training-free: one layer's K or V residuals at {bits} bits", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_pareto(points: list[dict[str, Any]], path: Path) -> Path:
    """Perplexity against end-to-end tokens/s of a tuning sweep: one series per knob (each point a dict with
    `knob`, `value`, `tokens_per_s` and `ppl`; knob None: the export as trained), values annotated."""
    if not points:
        raise ValueError("plot_pareto: no points to plot")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    knobs = sorted({str(p["knob"]) for p in points})
    for knob in knobs:
        series = sorted((p for p in points if str(p["knob"]) == knob), key=lambda p: p["tokens_per_s"])
        marker = "*" if knob == "None" else "o-"
        label = "as exported" if knob == "None" else knob
        ax.plot([p["tokens_per_s"] for p in series], [p["ppl"] for p in series], marker, label=label, ms=7)
        for p in series:
            if p["value"] is not None:
                ax.annotate(
                    f"{p['value']:g}",
                    (p["tokens_per_s"], p["ppl"]),
                    fontsize=7,
                    xytext=(4, 4),
                    textcoords="offset points",
                )
    ax.set_xlabel("end-to-end tokens/s (generation)")
    ax.set_ylabel("perplexity (held-out text)")
    ax.set_title("tuning knobs one at a time: quality against speed", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
