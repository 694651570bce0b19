"""Domain gate fine-tune (recipes/math_gate.yaml) from a gate_only export: gate recall at k=64 on a
held-out slice of GSM8K train before and after, and on WikiText-2 validation before and after
(what the domain fine-tune costs in general recall).

python -m benchmarks.math_gate --init-from RUN/export --gsm8k PATH/gsm8k/train.jsonl \
    --wikitext PATH/wikitext-2/valid.txt --out DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.common import write_result
from gsm_train.config.schema import load_recipe
from gsm_train.train import train_recipe
from gsm_train.training.session import TrainingSession
from gsm_train.training.stages import MathGateStage

REPO = Path(__file__).resolve().parents[1]
RECALL = "recall_ratio_k64"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "math_gate.yaml"))
    parser.add_argument("--init-from", required=True, help="export of the gate_only (or joint) run")
    parser.add_argument("--gsm8k", required=True)
    parser.add_argument("--wikitext", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--result", default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    out = Path(args.out)
    math = [
        f"data.train.path={args.gsm8k}",
        "data.train.fields=[question,answer]",
        "logging.progress_bar=false",
        *args.overrides,
    ]
    wiki = [f"data.eval.path={args.wikitext}", "data.seq_len=2048", "logging.recall_min_keys=512"]

    def recall(init_from: str, extra: list[str]) -> dict:
        config = load_recipe(args.recipe, [*math, *extra, f"init_from={init_from}", f"output.dir={out / 'eval'}"])
        return TrainingSession.setup(config, MathGateStage()).evaluate()

    gsm8k_before = recall(args.init_from, [])
    wikitext_before = recall(args.init_from, wiki)
    trained = train_recipe(args.recipe, [*math, f"init_from={args.init_from}", f"output.dir={out / 'math_gate'}"])
    wikitext_after = recall(str(out / "math_gate" / "export"), wiki)
    result = {
        "gsm8k_recall_before": gsm8k_before[RECALL],
        "gsm8k_recall_after": trained.final_metrics[RECALL],
        "wikitext_recall_before": wikitext_before[RECALL],
        "wikitext_recall_after": wikitext_after[RECALL],
        "gsm8k_gate_mass_before": gsm8k_before["gate_mass_k64"],
        "gsm8k_gate_mass_after": trained.final_metrics["gate_mass_k64"],
        "gsm8k_oracle_mass": trained.final_metrics["oracle_mass_k64"],
        "losses": trained.losses,
        "init_from": args.init_from,
    }
    write_result(Path(args.result) if args.result else out / "math_gate.json", result)
    print(f"{'':12} {'before':>7} {'after':>7}   (gate/oracle captured mass at k=64)")
    print(f"{'GSM8K':12} {result['gsm8k_recall_before']:7.3f} {result['gsm8k_recall_after']:7.3f}")
    print(f"{'WikiText-2':12} {result['wikitext_recall_before']:7.3f} {result['wikitext_recall_after']:7.3f}")


if __name__ == "__main__":
    main()
