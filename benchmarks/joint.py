"""Stage 2 as shipped on SmolLM2-135M: gate_only, then joint (GSM) and the dense control (same recipe,
gsm_enabled=false) on the Gutenberg prose; perplexity on WikiText-2 validation windows for the base,
the control and the GSM model as inference runs it; plain quantization at ASQ's bits with the same
sparsity and bridge; KV bytes; tokens/s of a joint step against a dense fine-tune step.

python -m benchmarks.joint --train-data PATH/prose --eval-data PATH/wikitext-2/valid.txt --out DIR

Run again with the same arguments after an interruption (e.g. a per-call time limit) and it goes on
where it stopped: a stage whose export exists is not trained again, a stage with checkpoints resumes
from its latest one, and the measurements already in the result file are kept if it records the
same overrides and recipes (it holds their hash and the commit; so keep `--result` where it
survives between runs, e.g. its default under `--out`, and copy it out afterwards).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
from pathlib import Path

from benchmarks.common import add_gsm_argument, git_commit, train_unless_exported, write_result
from gsm_train.commands.evaluate import evaluate_exports

REPO = Path(__file__).resolve().parents[1]


RECIPES = ("gate_only.yaml", "joint.yaml")
LAST_EVAL_KEYS = (
    "ppl",
    "recall_ratio_k64",
    "asq_recon_rel_error",
    "asq_cluster_usage",
    "asq_dead_clusters",
    "bridge_alpha_mean",
)


def _identity(overrides: list[str], gate_only_overrides: list[str], joint_overrides: list[str]) -> dict:
    """What makes two runs the same: the overrides and the recipes' text (hashed); plus the commit, for the record."""
    digest = hashlib.sha256(b"".join((REPO / "recipes" / name).read_bytes() for name in RECIPES)).hexdigest()
    return {
        "gsm_overrides": overrides,
        "gate_only_overrides": gate_only_overrides,
        "joint_overrides": joint_overrides,
        "recipes_sha256": digest,
        "commit": git_commit(REPO),
    }


def _earlier_result(path: Path, identity: dict) -> dict:
    """The measurements an interrupted run of the same overrides and recipes already wrote (none otherwise)."""
    if not path.exists():
        return {}
    earlier = json.loads(path.read_text())
    same = all(
        earlier.get(key, []) == identity[key]
        for key in ("gsm_overrides", "gate_only_overrides", "joint_overrides", "recipes_sha256")
    )
    return earlier if same else {}


def _records(run_dir: Path, kind: str) -> list[dict]:
    """The run's metrics.jsonl records of one kind (train, eval, ...)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == kind]


def _last_eval(run_dir: Path) -> dict:
    """The joint run's last in-training evaluation (ASQ error and cluster use, recall, bridge alphas)."""
    last = _records(run_dir, "eval")[-1:]
    return {key: last[0][key] for key in LAST_EVAL_KEYS if last and key in last[0]}


def _tokens_per_s(run_dir: Path) -> float:
    rates = [r["tokens_per_s"] for r in _records(run_dir, "train")]
    return statistics.median(rates[5:] or rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--train-data", required=True)
    parser.add_argument("--eval-data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--result", default=None)
    parser.add_argument("--windows", type=int, default=40)
    add_gsm_argument(
        parser,
        "GSM settings for all three runs on top of the shipped recipes, e.g. a KV budget: "
        "gsm.sparse_attention.gate_key_bits=8 gsm.kv_compression.quant_bits=2",
    )
    parser.add_argument(
        "--gate-only",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="recipe settings for stage 1 (gate warm-up) alone, e.g. optim.lr=4e-3 for a smaller gate",
    )
    parser.add_argument(
        "--joint",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="recipe settings for the joint run and its dense control, e.g. train.fp32_matmul=tf32",
    )
    args = parser.parse_args()
    out = Path(args.out)
    result_path = Path(args.result) if args.result else out / "joint.json"
    data = [
        f"data.train.path={args.train_data}",
        f"data.eval.path={args.eval_data}",
        "logging.progress_bar=false",
        "logging.eval_every=1000",
        *args.gsm,
    ]
    identity = _identity(args.gsm, args.gate_only, args.joint)
    earlier = _earlier_result(result_path, identity)
    result: dict = dict(identity)
    recipes = REPO / "recipes"
    train_unless_exported(recipes / "gate_only.yaml", [*data, *args.gate_only], out / "gate_only")
    gate_export = out / "gate_only" / "export"
    joint = [*data, *args.joint, f"init_from={gate_export}"]
    train_unless_exported(recipes / "joint.yaml", joint, out / "joint")
    train_unless_exported(recipes / "joint.yaml", [*joint, "gsm.gsm_enabled=false"], out / "control")
    result["joint_over_dense_tokens_per_s"] = _tokens_per_s(out / "joint") / _tokens_per_s(out / "control")
    result["joint_last_eval"] = _last_eval(out / "joint")
    write_result(result_path, result)
    exports = {"dense_control": str(out / "control" / "export"), "gsm": str(out / "joint" / "export")}
    if "eval" in earlier:
        result |= {
            key: earlier[key]
            for key in (
                "ppl_base",
                "ppl_dense_control",
                "ppl_gsm",
                "ppl_gsm_over_control",
                "kv_bytes_ratio",
                "kv_bytes_per_token",
                "gsm_recall_ratio",
                "eval",
            )
        }
    else:
        report = evaluate_exports("smollm2-135m", exports, args.eval_data, 2048, args.windows, 1, "sparse", 512)
        rows = report["results"]
        result |= {
            "ppl_base": rows["base"]["ppl"],
            "ppl_dense_control": rows["dense_control"]["ppl"],
            "ppl_gsm": rows["gsm"]["ppl"],
            "ppl_gsm_over_control": rows["gsm"]["ppl"] / rows["dense_control"]["ppl"],
            "kv_bytes_ratio": rows["gsm"]["kv_bytes_ratio"],
            "kv_bytes_per_token": rows["gsm"]["kv_bytes_per_token"],
            "gsm_recall_ratio": rows["gsm"].get("recall_ratio"),
            "eval": report,
        }
    write_result(result_path, result)
    for baseline in ("per_token", "kivi"):
        if f"ppl_plain_quant_{baseline}" in earlier:
            result[f"ppl_plain_quant_{baseline}"] = earlier[f"ppl_plain_quant_{baseline}"]
            continue
        plain = evaluate_exports(
            "smollm2-135m",
            {"gsm": exports["gsm"]},
            args.eval_data,
            2048,
            args.windows,
            1,
            "sparse",
            512,
            kv_baseline=baseline,
        )
        result[f"ppl_plain_quant_{baseline}"] = plain["results"]["gsm"]["ppl"]
        write_result(result_path, result)
    result["ppl_plain_quant_same_bits"] = min(result["ppl_plain_quant_per_token"], result["ppl_plain_quant_kivi"])
    write_result(result_path, result)
    print(
        f"PPL base {result['ppl_base']:.3f}  dense control {result['ppl_dense_control']:.3f}  "
        f"GSM {result['ppl_gsm']:.3f} ({result['ppl_gsm_over_control']:.3f}x control)  "
        f"plain quant same bits {result['ppl_plain_quant_same_bits']:.3f}  KV bytes ratio "
        f"{result['kv_bytes_ratio']:.3f}  joint/dense tokens/s {result['joint_over_dense_tokens_per_s']:.3f}"
    )


if __name__ == "__main__":
    main()
