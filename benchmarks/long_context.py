"""Long context: GSM trained at 2048 and at the model's full context, measured at both
lengths per query-position bucket, with a passkey test at the full context.

python -m benchmarks.long_context --train --train-data PATH/prose \\
    --eval-data PATH/wikitext-2/valid.txt --out DIR --result OUT.json

Runs: `gate_only`, `joint`, `control` (recipes/gate_only.yaml, recipes/joint.yaml, and the joint
recipe with gsm_enabled false: the dense control), and `gate_only_long`, `joint_long`,
`control_long` (the same from recipes/*_long.yaml, 8192-token windows). A run is measured when it
is given (--export NAME=FOLDER), exported under --out, or trained: `--train` trains every run
missing, `--train NAME ...` those named and the runs they start from. Each joint export is also
evaluated on the other top-k schedule, a change of selection only: a constant k as the fraction
schedule that keeps the same share of the keys at any length (`joint_fraction`), a fraction
schedule as its floor held constant (`joint_long_constant`). A GSM model is measured against the
dense control trained at its length.

Measured, on held-out text: at every --lengths (2048 and 8192), perplexity for the window and per
position bucket (0-2k, 2-4k, 4-8k) of the base, every export and variant, their gate/oracle
captured mass per bucket, KV bytes against bf16; at the last length, the passkey test (100 seeded
cases) for the base, the controls and the GSM models; the peak GPU memory of each training run;
optionally (--probe NAME ...) benchmarks/long_context_probe.py on gate exports. The result JSON
holds the command, commit and device, every report, and the issue's targets checked per GSM model
against its control.

Resumable: every stage writes its output under --out (runs/, stages/) and is skipped when its
output is there with the same settings, so a run cut by a time limit goes on where it stopped when
started again with the same arguments (a training run resumes from its latest checkpoint). Use a
new --out after changing recipes or training settings.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import git_commit, train_unless_exported, write_result
from benchmarks.long_context_probe import print_tables, run_probe, trained_length
from gsm_train.commands.evaluate import bucket_label, evaluate_exports
from gsm_train.commands.passkey import evaluate_passkey
from gsm_train.export.adapter_format import read_config, read_training_args

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
# run name -> (recipe, the run whose export it starts from, extra settings)
RUNS: dict[str, tuple[str, str | None, tuple[str, ...]]] = {
    "gate_only": ("gate_only.yaml", None, ()),
    "joint": ("joint.yaml", "gate_only", ()),
    "control": ("joint.yaml", "gate_only", ("gsm.gsm_enabled=false",)),
    "gate_only_long": ("gate_only_long.yaml", None, ()),
    "joint_long": ("joint_long.yaml", "gate_only_long", ()),
    "control_long": ("joint_long.yaml", "gate_only_long", ("gsm.gsm_enabled=false",)),
}
LONG = ("gate_only_long", "joint_long", "control_long")
# the targets for a GSM model against its dense control (trained at the same length)
TARGETS = {
    "ppl_over_control": 1.05,  # perplexity over the whole window
    "ppl_over_control_per_bucket": 1.06,  # the same, in every position bucket (0-2k, 2-4k, 4-8k)
    "kv_bytes_ratio": 0.30,
    "passkey_points_below_control": 2.0,
}
# the recipes the README reports, under their result keys: the shipped long recipe and the 2k one
HEADLINE = {"joint_long": "", "joint": "_2k_recipe"}


def other_schedule(export: str, short: int, long: int) -> dict[str, Any]:
    """The selection change that runs a joint export on the other top-k schedule: a constant k
    becomes the fraction k / short of the visible keys, floor k, ceiling k x long / short (the same
    share at any length); a fraction schedule becomes its floor as a constant k."""
    sparse = read_config(export)["sparse_attention"]
    if sparse["top_k_schedule"] == "fraction":
        return {"top_k_schedule": "constant", "top_k_fraction": None, "top_k": sparse["k_min"]}
    k = sparse["top_k"]
    return {
        "top_k_schedule": "fraction",
        "top_k_fraction": k / short,
        "k_min": k,
        "top_k": max(k, round(k * long / short)),
    }


class Stages:
    """Stage outputs under `out/stages`: a stage runs unless its JSON is there with the same
    settings; its output is written whole or not at all."""

    def __init__(self, out: Path) -> None:
        self.folder = out / "stages"
        self.folder.mkdir(parents=True, exist_ok=True)

    def run(self, name: str, settings: dict[str, Any], work: Callable[[], dict[str, Any]]) -> dict:
        path = self.folder / f"{name}.json"
        settings = json.loads(json.dumps(settings))  # as stored: lists, string keys
        if path.is_file():
            stored = json.loads(path.read_text())
            if stored.get("settings") == settings:
                print(f"stage {name}: done before ({path})", flush=True)
                return stored["output"]
            print(f"stage {name}: its settings changed, running it again", flush=True)
        else:
            print(f"stage {name}: running", flush=True)
        output = json.loads(json.dumps(work()))  # as a later run will read it back
        temporary = path.with_suffix(".part")
        temporary.write_text(json.dumps({"settings": settings, "output": output}, indent=2))
        temporary.replace(path)
        return output


def train_run(name: str, args: argparse.Namespace, exports: dict[str, str]) -> dict[str, Any]:
    """Train run `name` (its recipe, from its start run's export) unless it is exported; record
    its settings, time and peak GPU memory. Fills `exports[name]`."""
    recipe, start, extra = RUNS[name]
    overrides = [
        f"model.name_or_path={args.model}",
        f"data.train.path={args.train_data}",
        f"data.eval.path={args.eval_data}",
        "logging.progress_bar=false",
        "logging.eval_every=1000",
        *args.override,
        *(args.long_override if name in LONG else []),
        *extra,
    ]
    if start is not None:
        overrides.append(f"init_from={exports[start]}")
    run_dir = Path(args.out) / "runs" / name
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    tic = time.perf_counter()
    train_unless_exported(RECIPES / recipe, overrides, run_dir)
    seconds = time.perf_counter() - tic
    exports[name] = str(run_dir / "export")
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    return {"recipe": recipe, "overrides": overrides, "seconds": seconds, "peak_gib": peak}


def find_exports(args: argparse.Namespace) -> dict[str, str]:
    """The exports given (--export), then those already trained under --out/runs."""
    exports = {}
    for item in args.export:
        name, _, folder = item.partition("=")
        if name not in RUNS or not folder:
            raise SystemExit(f"--export {item!r}: give NAME=FOLDER, NAME one of {', '.join(RUNS)}")
        exports[name] = folder
    for name in RUNS:
        exported = Path(args.out) / "runs" / name / "export"
        if name not in exports and exported.is_dir():
            exports[name] = str(exported)
    return exports


def to_train(asked: list[str] | None) -> set[str]:
    """The runs `--train` asks for: none (not given), all (given alone), or those named and the
    runs they start from."""
    if asked is None:
        return set()
    wanted, pending = set(), list(asked or RUNS)
    while pending:
        name = pending.pop()
        wanted.add(name)
        start = RUNS[name][1]
        if start is not None and start not in wanted:
            pending.append(start)
    return wanted


def train_missing(args: argparse.Namespace, exports: dict[str, str]) -> dict[str, Any]:
    """Train the runs `--train` asks for that are not exported, in order (each after the run it
    starts from); the training records of this and earlier calls."""
    records = {}
    wanted = to_train(args.train)
    for name in RUNS:
        record = Path(args.out) / "stages" / f"train_{name}.json"
        if name in wanted and name not in exports:
            records[name] = train_run(name, args, exports)
            record.write_text(json.dumps(records[name], indent=2))
        elif record.is_file():
            records[name] = json.loads(record.read_text())
    return records


def variants(exports: dict[str, str], lengths: list[int]) -> tuple[dict[str, str], dict[str, dict]]:
    """Every export under its name, plus each joint export on the other top-k schedule
    (`other_schedule`, named `joint_fraction`, `joint_long_constant`, ...): names -> folders, and
    the selection changes by name."""
    names, selections = dict(exports), {}
    for name in ("joint", "joint_long"):
        if name in exports:
            change = other_schedule(exports[name], lengths[0], lengths[-1])
            variant = f"{name}_{change['top_k_schedule']}"
            names[variant], selections[variant] = exports[name], change
    return names, selections


def _control_of(name: str) -> str | None:
    """The dense control a GSM model (a joint export or variant) is measured against: the one
    trained at the same length."""
    if not name.startswith("joint"):
        return None
    return "control_long" if name.startswith("joint_long") else "control"


def summary(evals: dict[int, dict], passkey: dict | None) -> dict[str, Any]:
    """Per model and length: PPL (window, per bucket), over its control, KV bytes ratio,
    gate/oracle mass (window, per bucket); passkey accuracies; the targets per GSM model."""
    models: dict[str, Any] = {}
    for length, report in evals.items():
        results = report["results"]
        for name, r in results.items():
            row = {
                "ppl": r["ppl"],
                "ppl_by_bucket": [p["ppl"] for p in r["buckets"]],
                "bucket_labels": [bucket_label(p["start"], p["stop"]) for p in r["buckets"]],
            }
            control = _control_of(name)
            if control in results:
                row["ppl_over_control"] = r["ppl"] / results[control]["ppl"]
                row["ppl_over_control_by_bucket"] = [
                    mine["ppl"] / theirs["ppl"]
                    for mine, theirs in zip(r["buckets"], results[control]["buckets"], strict=True)
                ]
            if "recall_ratio" in r:
                row |= {
                    "kv_bytes_ratio": r["kv_bytes_ratio"],
                    "gate_over_oracle": r["recall_ratio"],
                    "gate_over_oracle_by_bucket": [p.get("recall_ratio") for p in r["buckets"]],
                }
            models.setdefault(name, {})[str(length)] = row
    for name, r in (passkey or {}).get("results", {}).items():
        models.setdefault(name, {})["passkey_accuracy"] = r["accuracy"]
        if "generated_accuracy" in r:
            models[name]["passkey_generated_accuracy"] = r["generated_accuracy"]
    targets = {name: _targets(name, models, passkey) for name in models if _control_of(name)}
    return {"models": models, "targets": targets, "headline": headline(models, targets)}


def headline(models: dict[str, Any], targets: dict[str, Any]) -> dict[str, Any]:
    """Flat keys for the recipes the README reports (`HEADLINE`): `ppl_gsm_over_control_<L>`,
    `ppl_gsm_over_control_<L>_<bucket>`, `kv_bytes_ratio_<L>`, `passkey_gsm_<L>`,
    `passkey_control_<L>`, each suffixed with the recipe's tag (none for the shipped long recipe),
    and `all_targets_met<tag>`."""
    flat: dict[str, Any] = {}
    for name, tag in HEADLINE.items():
        if name not in models:
            continue
        control = _control_of(name)
        for length, row in models[name].items():
            if not isinstance(row, dict) or "ppl_over_control" not in row:
                continue
            flat[f"ppl_gsm_over_control_{length}{tag}"] = row["ppl_over_control"]
            for label, ratio in zip(row["bucket_labels"], row["ppl_over_control_by_bucket"], strict=True):
                flat[f"ppl_gsm_over_control_{length}_{label}{tag}"] = ratio
            if "kv_bytes_ratio" in row:
                flat[f"kv_bytes_ratio_{length}{tag}"] = row["kv_bytes_ratio"]
        if "passkey_accuracy" in models[name] and "passkey_accuracy" in models.get(control, {}):
            length = max(int(key) for key in models[name] if key.isdigit())
            flat[f"passkey_gsm_{length}{tag}"] = models[name]["passkey_accuracy"]
            flat[f"passkey_control_{length}{tag}"] = models[control]["passkey_accuracy"]
        flat[f"all_targets_met{tag}"] = all(check["met"] for check in targets[name].values())
    return flat


def _targets(name: str, models: dict[str, Any], passkey: dict | None) -> dict[str, Any]:
    """Each of `TARGETS` for GSM model `name` at every length: its value and whether it is met."""
    checks: dict[str, Any] = {}
    for length, row in models[name].items():
        if not isinstance(row, dict):
            continue
        if "ppl_over_control" in row:
            checks[f"ppl_over_control_{length}"] = _met(row["ppl_over_control"], "ppl_over_control")
            checks[f"max_bucket_ppl_over_control_{length}"] = _met(
                max(row["ppl_over_control_by_bucket"]), "ppl_over_control_per_bucket"
            )
        if "kv_bytes_ratio" in row:
            checks[f"kv_bytes_ratio_{length}"] = _met(row["kv_bytes_ratio"], "kv_bytes_ratio")
    results = (passkey or {}).get("results", {})
    control = _control_of(name)
    if name in results and control in results:
        points = 100 * (results[control]["accuracy"] - results[name]["accuracy"])
        checks["passkey_points_below_control"] = _met(points, "passkey_points_below_control")
    return checks


def _met(value: float, target: str) -> dict[str, Any]:
    bound = TARGETS[target]
    return {"value": value, "target": bound, "met": value <= bound}


def _number(value: float | None, width: int) -> str:
    return f"{value:{width}.3f}" if value is not None else f"{'-':>{width}}"


def print_summary(result: dict[str, Any]) -> None:
    """Per length a row per model (PPL, over control, per bucket, gate/oracle mass, KV bytes), the
    passkey accuracies and the targets."""
    models = result["summary"]["models"]
    for length, report in result["evals"].items():
        labels = [bucket_label(a, b) for a, b in report["buckets"]]
        print(f"\nat {length} ({report['windows']} windows of {report['data']}):")
        print(
            f"{'model':>20} {'PPL':>8} {'/control':>8} "
            + " ".join(f"{'PPL ' + label:>10}" for label in labels)
            + " "
            + " ".join(f"{'mass ' + label:>11}" for label in labels)
            + f" {'KV/bf16':>8}"
        )
        for name, by_length in models.items():
            row = by_length.get(length)
            if row is None:
                continue
            masses = row.get("gate_over_oracle_by_bucket", [None] * len(labels))
            print(
                f"{name:>20} {row['ppl']:8.3f} {_number(row.get('ppl_over_control'), 8)} "
                + " ".join(f"{p:10.3f}" for p in row["ppl_by_bucket"])
                + " "
                + " ".join(_number(m, 11) for m in masses)
                + f" {_number(row.get('kv_bytes_ratio'), 8)}"
            )
    accuracies = [f"{name} {row['passkey_accuracy']:.2f}" for name, row in models.items() if "passkey_accuracy" in row]
    if accuracies:
        print("\npasskey accuracy: " + ", ".join(accuracies))
    for name, checks in result["summary"]["targets"].items():
        print(
            f"targets {name}: "
            + ", ".join(f"{key} {c['value']:.3f} {'met' if c['met'] else 'MISSED'}" for key, c in checks.items())
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.long_context",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--eval-data", required=True, help="held-out text (WikiText-2 validation)")
    parser.add_argument("--train-data", default=None, help="training text (needed to train)")
    parser.add_argument("--out", required=True, help="working folder: runs/ and stages/")
    parser.add_argument(
        "--result",
        default=str(REPO / "benchmarks" / "results" / "long_context.json"),
        help="the result JSON (command, commit, device, every report)",
    )
    parser.add_argument("--model", default="smollm2-135m", help="the base every run trains on")
    parser.add_argument(
        "--export",
        action="append",
        default=[],
        metavar="NAME=FOLDER",
        help=f"an export trained before, NAME one of {', '.join(RUNS)}; repeatable",
    )
    parser.add_argument(
        "--train",
        nargs="*",
        default=None,
        choices=list(RUNS),
        metavar="NAME",
        help=f"train the runs missing: all, or those named and the runs they start from ({', '.join(RUNS)})",
    )
    parser.add_argument(
        "--train-only",
        action="store_true",
        help="stop after training (two calls that train different runs into one --out can run side by side)",
    )
    parser.add_argument(
        "--override", nargs="*", default=[], metavar="KEY=VALUE", help="recipe settings for every run trained"
    )
    parser.add_argument(
        "--long-override",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="recipe settings for the full-context runs alone",
    )
    parser.add_argument(
        "--lengths",
        nargs="+",
        type=int,
        default=[2048, 8192],
        help="evaluation lengths: the short runs' training length first, the model's full context last",
    )
    parser.add_argument(
        "--windows", nargs="+", type=int, default=[40, 10], help="held-out windows per evaluation length"
    )
    parser.add_argument(
        "--first-bucket", type=int, default=2048, help="position buckets [0, N), [N, 2N), [2N, 4N), ..."
    )
    parser.add_argument(
        "--min-keys", type=int, default=512, help="captured mass counts queries with at least this many keys"
    )
    parser.add_argument(
        "--batch-size", type=int, default=1, help="windows (and passkey cases) per forward in evaluation"
    )
    parser.add_argument(
        "--passkey-length", type=int, default=None, help="tokens per passkey case (default: the last --lengths)"
    )
    parser.add_argument("--passkey-cases", type=int, default=100, help="0: no passkey test")
    parser.add_argument("--passkey-seed", type=int, default=0, help="draws the passkey cases")
    parser.add_argument("--passkey-filler", default="embedded:sample_prose", help="prose the passkey hides in")
    parser.add_argument(
        "--generate", action="store_true", help="score the passkey by greedy generation through the cache too (slow)"
    )
    parser.add_argument(
        "--probe",
        nargs="*",
        default=[],
        metavar="NAME",
        help="run benchmarks/long_context_probe.py on these exports (or variants)",
    )
    parser.add_argument("--probe-windows", type=int, default=4, help="windows of the last length the probe reads")
    args = parser.parse_args(argv)
    if len(args.windows) != len(args.lengths):
        parser.error(f"--windows gives {len(args.windows)} counts for {len(args.lengths)} --lengths")
    if args.train is not None and not args.train_data:
        parser.error("--train needs --train-data")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out = Path(args.out)
    stages = Stages(out)
    exports = find_exports(args)
    training = train_missing(args, exports)
    if args.train_only:
        return {"exports": exports, "training": training}
    names, selections = variants(exports, args.lengths)
    unknown = sorted(set(args.probe) - set(names))
    if unknown:
        raise SystemExit(f"--probe {unknown[0]}: no such export; have {', '.join(names)}")
    evals = {}
    for length, windows in zip(args.lengths, args.windows, strict=True):
        settings = {
            "model": args.model,
            "exports": names,
            "selections": selections,
            "windows": windows,
            "min_keys": args.min_keys,
            "first_bucket": args.first_bucket,
            "data": args.eval_data,
        }

        def evaluate(length: int = length, windows: int = windows) -> dict[str, Any]:
            return evaluate_exports(
                args.model,
                names,
                args.eval_data,
                length,
                windows,
                args.batch_size,
                "sparse",
                args.min_keys,
                first_bucket=args.first_bucket,
                selections=selections,
            )

        evals[length] = stages.run(f"eval_{length}", settings, evaluate)
    passkey_length = args.passkey_length or args.lengths[-1]
    compared = {name: folder for name, folder in names.items() if name.startswith(("joint", "control"))}
    passkey_settings = {
        "model": args.model,
        "exports": compared,
        "selections": selections,
        "cases": args.passkey_cases,
        "seed": args.passkey_seed,
        "filler": args.passkey_filler,
        "length": passkey_length,
        "generate": args.generate,
    }
    passkey = (
        stages.run(
            "passkey",
            passkey_settings,
            lambda: evaluate_passkey(
                args.model,
                compared,
                args.passkey_filler,
                passkey_length,
                args.passkey_cases,
                args.passkey_seed,
                args.batch_size,
                args.generate,
                selections=selections,
            ),
        )
        if args.passkey_cases
        else None
    )
    probes = {}
    for name in args.probe:
        train_len = trained_length(read_training_args(Path(names[name]))) or args.lengths[0]
        settings = {
            "model": args.model,
            "export": names[name],
            "windows": args.probe_windows,
            "length": args.lengths[-1],
            "train_len": train_len,
            "data": args.eval_data,
        }

        def probe(name: str = name, train_len: int = train_len) -> dict[str, Any]:
            return run_probe(
                args.model,
                names[name],
                args.eval_data,
                args.lengths[-1],
                args.probe_windows,
                train_len,
                None,
                args.min_keys,
                args.first_bucket,
                512,
                "dense",
            )

        probes[name] = stages.run(f"probe_{name}", settings, probe)
        print_tables(probes[name])
    recipes = b"".join((RECIPES / RUNS[name][0]).read_bytes() for name in RUNS)
    result = {
        "commit": git_commit(REPO),
        "recipes_sha256": hashlib.sha256(recipes).hexdigest(),
        "exports": exports,
        "selections": selections,
        "training": training,
        "evals": {str(length): report for length, report in evals.items()},
        "passkey": passkey,
        "probes": probes,
        "summary": summary(evals, passkey),
    }
    print_summary(result)
    write_result(Path(args.result), result)
    return result


if __name__ == "__main__":
    main()
