"""Entry point for `accelerate launch -m gsm_train.train --recipe RECIPE [key=value ...]`."""

from __future__ import annotations

import argparse
import sys

from gsm_train.config import ConfigError, Problem, load_recipe
from gsm_train.data import DataError
from gsm_train.export import ExportError
from gsm_train.modules import GSMError
from gsm_train.stages import STAGES
from gsm_train.trainer import TrainResult, run_training


def train_recipe(recipe: str, overrides: list[str], resume: str | None = None) -> TrainResult:
    """Validate the recipe and run its stage (raises ConfigError before anything is written)."""
    if resume is not None:
        overrides = [*overrides, f"output.resume_from={resume}"]
    config = load_recipe(recipe, overrides)
    if config.stage not in STAGES:
        raise ConfigError(recipe, [Problem("stage", config.stage, "this stage is not implemented in this version",
                                           f"use one of {', '.join(STAGES)}")])
    return run_training(config, STAGES[config.stage]())


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gsm_train.train", description=__doc__)
    parser.add_argument("--recipe", required=True, help="recipe YAML, e.g. recipes/gate_only.yaml")
    parser.add_argument("--resume", default=None, help="'auto' (latest checkpoint of the run) or a checkpoint folder")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, validated like the recipe")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result = train_recipe(args.recipe, args.overrides, args.resume)
    except (ConfigError, DataError, GSMError, ExportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if result.summary:
        for key, value in result.summary.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
