"""Quality against KV bytes across `benchmarks/joint.py` runs: reads their result files, prints one row
per run (its label, perplexity over the dense control, KV bytes over bf16, joint over dense tokens/s)
and plots perplexity against KV bytes with the stage-2 goal region. No GPU: it only reads results.
A run is labelled with its `--gsm` overrides, or with the text after the first `=` in `FILE=LABEL`
(for runs whose recipe differed from today's; an argument naming an existing file is a file).

python -m benchmarks.joint_tradeoff RESULT.json[=LABEL] ... --plot OUT.png [--result OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.common import write_result
from gsm_train.plots import plot_quality_vs_kv

GOAL_PPL, GOAL_KV = 1.05, 0.30
SHORT = {"gsm.sparse_attention.": "", "gsm.kv_compression.": "asq.", "gsm.cross_layer_sharing.": "bridge."}


def _label(overrides: list[str]) -> str:
    """The run's overrides, shortened for a plot label."""
    text = " ".join(overrides) or "recipe as is"
    for long, short in SHORT.items():
        text = text.replace(long, short)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "results", nargs="+", metavar="FILE[=LABEL]", help="result files written by benchmarks/joint.py"
    )
    parser.add_argument("--plot", required=True, help="where to write the PNG")
    parser.add_argument("--result", default=None, help="also write the rows and this command line as JSON")
    args = parser.parse_args(argv)
    points = []
    for argument in args.results:
        name, _, label = ("", "", "") if Path(argument).is_file() else argument.partition("=")
        path = Path(name or argument)
        if not path.is_file():
            print(f"{path}: no such file. Fix: pass result files written by benchmarks/joint.py", file=sys.stderr)
            return 2
        try:
            result = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            print(f"{path}: not JSON ({error}). Fix: pass result files written by benchmarks/joint.py", file=sys.stderr)
            return 2
        missing = [key for key in ("ppl_gsm_over_control", "kv_bytes_ratio") if key not in result]
        if missing:
            print(f"{path}: no {', '.join(missing)}. Fix: pass a finished benchmarks/joint.py result", file=sys.stderr)
            return 2
        points.append(
            {
                "label": label or _label(result.get("gsm_overrides", [])),
                "result_file": str(path),
                "ppl_over_control": result["ppl_gsm_over_control"],
                "kv_bytes_ratio": result["kv_bytes_ratio"],
                "tokens_per_s_ratio": result.get("joint_over_dense_tokens_per_s"),
            }
        )
    print(f"{'ppl/control':>11} {'KV/bf16':>8} {'tok/s':>6}  run")
    for point in sorted(points, key=lambda p: p["kv_bytes_ratio"]):
        speed = point["tokens_per_s_ratio"]
        print(
            f"{point['ppl_over_control']:>11.3f} {point['kv_bytes_ratio']:>8.3f} "
            f"{'-' if speed is None else format(speed, '.3f'):>6}  {point['label']}"
        )
    plot = Path(args.plot)
    plot.parent.mkdir(parents=True, exist_ok=True)
    print(f"plot: {plot_quality_vs_kv(points, GOAL_PPL, GOAL_KV, plot)}")
    if args.result:
        write_result(
            Path(args.result),
            {"goal_ppl_over_control": GOAL_PPL, "goal_kv_bytes_ratio": GOAL_KV, "plot": str(plot), "runs": points},
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
