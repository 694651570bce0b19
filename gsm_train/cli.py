"""`gsm-train`: validate recipes, train, and inspect what GSM attaches to a model."""

from __future__ import annotations

import argparse
import sys

from gsm_train.config import ConfigError, load_recipe, resolved_yaml


def _validate(args: argparse.Namespace) -> int:
    config = load_recipe(args.recipe, args.overrides)
    print(resolved_yaml(config), end="")
    return 0


def _train(args: argparse.Namespace) -> int:
    from gsm_train.train import main as train_main

    argv = ["--recipe", args.recipe, *args.overrides] + (["--resume", args.resume] if args.resume else [])
    return train_main(argv)


def _inspect(args: argparse.Namespace) -> int:
    from gsm_train.inspect_model import inspect_model

    print(inspect_model(args.model, args.recipe, args.seq_len, args.overrides))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gsm-train", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    validate = commands.add_parser("validate", help="check a recipe and print it fully resolved")
    validate.add_argument("recipe")
    validate.add_argument("overrides", nargs="*", help="key.sub=value")
    validate.set_defaults(run=_validate)
    train = commands.add_parser("train", help="run a recipe (same code path as accelerate launch -m gsm_train.train)")
    train.add_argument("recipe")
    train.add_argument("overrides", nargs="*", help="key.sub=value")
    train.add_argument("--resume", default=None, help="'auto' or a checkpoint folder")
    train.set_defaults(run=_train)
    inspect = commands.add_parser("inspect", help="per layer: GSM modules, parameters, KV bytes per token")
    inspect.add_argument("--model", required=True, help="tiny-llama, smollm2-135m, a folder or a hub id")
    inspect.add_argument("--recipe", default=None, help="take the gsm block from this recipe")
    inspect.add_argument("--seq-len", type=int, default=2048, help="context for the KV byte account")
    inspect.add_argument("overrides", nargs="*", help="key.sub=value applied to the recipe")
    inspect.set_defaults(run=_inspect)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point; exit status 2 on a bad recipe."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
