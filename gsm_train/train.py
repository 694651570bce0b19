"""Entry point for `accelerate launch -m gsm_train.train --recipe RECIPE [key=value ...]`.

Exit status: 0 done; 2 refused (a bad recipe, override, checkpoint or run folder: nothing ran,
nothing was written); 3 stopped by the NaN guard (a non-finite loss or gradient norm; earlier
checkpoints are intact); 4 a write failed (a full disk, a file-size limit; earlier checkpoints are
intact: continue with --resume auto); 130 interrupted (Ctrl-C). Each with one line on stderr
(`gsm_train.entry`)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from gsm_train.config.schema import ConfigError, DataSourceConfig, Problem, RecipeConfig, load_recipe, path_arg
from gsm_train.entry import exit_process, run_command
from gsm_train.training.preflight import StartOptions
from gsm_train.training.stages import STAGES
from gsm_train.training.trainer import TrainResult, run_training

if TYPE_CHECKING:
    import datasets


def train_recipe(
    recipe: str,
    overrides: list[str],
    resume: str | None = None,
    options: StartOptions | None = None,
    *,
    train_dataset: datasets.Dataset | None = None,
    eval_dataset: datasets.Dataset | None = None,
) -> TrainResult:
    """Validate the recipe and run its stage (raises ConfigError before anything is written);
    `options`: --overwrite and --allow-recipe-change (default: neither). `train_dataset` /
    `eval_dataset`: `datasets.Dataset`s to train / evaluate on instead of the recipe's
    `data.train` / `data.eval` (read with the recipe's `fields`; `with_datasets`)."""
    if resume is not None:
        overrides = [*overrides, f"output.resume_from={resume}"]
    config = with_datasets(load_recipe(recipe, overrides), train_dataset, eval_dataset)
    if config.stage not in STAGES:
        raise ConfigError(
            recipe,
            [
                Problem(
                    "stage",
                    config.stage,
                    "this stage is not implemented in this version",
                    f"use one of {', '.join(STAGES)}",
                )
            ],
        )
    return run_training(config, STAGES[config.stage](), options=options)


def with_datasets(
    config: RecipeConfig, train_dataset: datasets.Dataset | None, eval_dataset: datasets.Dataset | None
) -> RecipeConfig:
    """The recipe with `data.train` / `data.eval` replaced by the datasets given (None: kept), each read
    with the `fields` of the source it replaces (`data.train`'s for an eval set the recipe lacks)."""
    data, sources = config.data, {}
    if train_dataset is not None:
        sources["train"] = DataSourceConfig.from_dataset(train_dataset, data.train.fields)
    if eval_dataset is not None:
        sources["eval"] = DataSourceConfig.from_dataset(eval_dataset, (data.eval or data.train).fields)
    return config.model_copy(update={"data": data.model_copy(update=sources)}) if sources else config


def add_start_flags(parser: argparse.ArgumentParser) -> None:
    """--resume, --overwrite and --allow-recipe-change (shared with `gsm-train train`)."""
    parser.add_argument(
        "--resume",
        default=None,
        type=path_arg,
        help="'auto' (the newest checkpoint of output.dir that verifies; refused if none does) or a checkpoint folder",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in an output.dir that holds a run: only the files a run writes are removed, once this "
        "run has a checkpoint (put back if it fails before)",
    )
    parser.add_argument(
        "--allow-recipe-change",
        action="store_true",
        help="resume with a recipe that changes more than steps, logging and checkpointing",
    )


def start_options(args: argparse.Namespace) -> StartOptions:
    return StartOptions(overwrite=args.overwrite, allow_recipe_change=args.allow_recipe_change)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gsm_train.train", description=__doc__)
    parser.add_argument(
        "--recipe",
        required=True,
        help="recipe YAML, e.g. recipes/gate_only.yaml, or a built-in recipe's name (gate_only)",
    )
    add_start_flags(parser)
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, validated like the recipe")
    return parser.parse_intermixed_args(argv)  # overrides may follow --resume


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return run_command(lambda: _train_and_report(args), run=True)


def _train_and_report(args: argparse.Namespace) -> int:
    """Run the recipe the arguments name and print its summary; exit status 0."""
    result = train_recipe(args.recipe, args.overrides, args.resume, start_options(args))
    for key, value in (result.summary or {}).items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    exit_process(main())
