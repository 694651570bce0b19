"""Where a training step's GPU time goes: reads a `benchmarks/joint_step.py --profile N` result, groups each
setting's N largest kernels by name pattern into parts (attention, selection, matmuls, ...), counts the
rest of the step's time as "kernels outside the profile's N largest" (step time minus their sum), prints
the table and draws one stacked bar per setting. No GPU: it only reads the result. The grouping is by
kernel name (the patterns are in PARTS), so a kernel lands in the first part whose pattern it matches.

python -m benchmarks.step_breakdown benchmarks/results/joint_step.json --plot OUT.png [--result OUT.json]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from benchmarks.common import write_result
from gsm_train.plots import plot_step_breakdown

PARTS = (  # (part, kernel name pattern), first match wins
    ("FlexAttention (ASQ layers)", r"flex_attention"),
    ("cuDNN / SDPA attention", r"sdpa|fmha|flash|cudnn"),
    ("top-k selection", r"_top_k|topk|radix|[Ss]ort"),
    ("gate KL target", r"_row_log_normaliser|_averaged_probs"),
    ("fp32 matmuls (ASQ's MLP)", r"gemm_f32f32"),
    ("bf16 matmuls", r"nvjet|gemm|splitKreduce|cutlass"),
    ("LM head softmax", r"SoftMax"),
    ("optimizer", r"multi_tensor_apply"),
    ("Inductor-fused kernels", r"^triton_"),
    ("elementwise, copies, casts, reductions", r"elementwise|copy|[Mm]emcpy|Memset|Fill|CatArray|reduce|index"),
)
OTHER = "other named kernels"
OUTSIDE = "kernels outside the profile's largest"


def split_step(row: dict) -> dict[str, float]:
    """ms per step of one setting's profiled kernels grouped into PARTS, plus the time outside them."""
    split = {part: 0.0 for part, _ in PARTS}
    split[OTHER] = 0.0
    for kernel in row["kernels"]:
        part = next((name for name, pattern in PARTS if re.search(pattern, kernel["kernel"])), OTHER)
        split[part] += kernel["ms_per_step"]
    split[OUTSIDE] = max(row["step_ms"] - sum(split.values()), 0.0)
    return {part: ms for part, ms in split.items() if ms > 0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", help="a result file of benchmarks/joint_step.py written with --profile N")
    parser.add_argument("--plot", required=True, help="where to write the PNG")
    parser.add_argument("--result", default=None, help="also write the table and this command line as JSON")
    args = parser.parse_args(argv)
    rows = json.loads(Path(args.profile).read_text())["rows"]
    profiled = {name: row for name, row in rows.items() if row.get("kernels")}
    if not profiled:
        parser.error(f"{args.profile} has no kernel profile; run benchmarks/joint_step.py with --profile N")
    steps = {name: split_step(row) for name, row in profiled.items()}
    order = [part for part, _ in PARTS] + [OTHER, OUTSIDE]
    parts = [part for part in order if any(part in split for split in steps.values())]
    steps = {name: {part: split.get(part, 0.0) for part in parts} for name, split in steps.items()}  # one order
    print(f"{'part':42s}" + "".join(f"{name:>16s}" for name in steps))
    for part in parts:
        print(f"{part:42s}" + "".join(f"{steps[name][part]:13.2f} ms" for name in steps))
    print(f"{'step':42s}" + "".join(f"{profiled[name]['step_ms']:13.2f} ms" for name in steps))
    top = len(next(iter(profiled.values()))["kernels"])
    title = f"SmolLM2-135M training step, batch 4 x 2048, one H200: the {top} largest kernels grouped by name"
    plot_step_breakdown(steps, title, Path(args.plot))
    print(f"plot: {args.plot}")
    if args.result:
        write_result(Path(args.result), {"profile": args.profile, "plot": args.plot, "parts_ms": steps})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
