"""`gsm-train`: validate recipes, train, evaluate (perplexity, passkey retrieval), generate,
inspect what GSM attaches, export checkpoints, publish exports."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, NoReturn

from gsm_train import __version__
from gsm_train.commands.evaluate import check_report_folder, evaluate_exports, write_report
from gsm_train.commands.generate import Sampling, generate
from gsm_train.commands.inspect_model import inspect_model
from gsm_train.commands.passkey import evaluate_passkey
from gsm_train.commands.passkey import markdown_table as passkey_table
from gsm_train.config.builtin_recipes import builtin_recipes, copy_recipe, recipe_summary
from gsm_train.config.schema import expand_user_path, load_recipe, override_value, path_arg, resolved_yaml
from gsm_train.data.text import DataError
from gsm_train.entry import exit_process, run_command
from gsm_train.export.hub import publish_export
from gsm_train.export.int4 import FULL, WEIGHT_CHOICES
from gsm_train.export.save_load import ExportError
from gsm_train.inference.cache import DEFAULT_PREFILL, PREFILL_MODES
from gsm_train.train import add_start_flags
from gsm_train.train import main as train_main
from gsm_train.training.checkpoint_export import export_checkpoint
from gsm_train.tuning.resolved_recipe import resolve_for_base


def _print_written(table: Path) -> int:
    """Print a written report's markdown table and where it and its JSON are; exit status 0."""
    print(table.read_text(), end="")
    print(f"written: {table} and {table.with_suffix('.json')}")
    return 0


def _positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (argparse names the option in its error)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {text!r}")
    return value


def _probability(text: str) -> float:
    """argparse type: a number in (0, 1]."""
    value = _positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


def _validate(args: argparse.Namespace) -> int:
    """Print the recipe checked against its base model's config and resolved (read without weights)."""
    config, _ = resolve_for_base(load_recipe(args.recipe, args.overrides))
    print(resolved_yaml(config), end="")
    return 0


def _train(args: argparse.Namespace) -> int:
    argv = ["--recipe", args.recipe, *args.overrides] + (["--resume", args.resume] if args.resume else [])
    flags = [
        flag
        for flag, on in (("--overwrite", args.overwrite), ("--allow-recipe-change", args.allow_recipe_change))
        if on
    ]
    return train_main([*argv, *flags])


def _inspect(args: argparse.Namespace) -> int:
    print(inspect_model(args.model, args.recipe, args.seq_len, args.overrides))
    return 0


def _export(args: argparse.Namespace) -> int:
    print(f"export written to {export_checkpoint(args.checkpoint, args.out)}")
    return 0


def _exports(items: list[str]) -> dict[str, str]:
    """--export NAME=FOLDER arguments as {name: folder or Hub repo id}."""
    exports = {}
    for item in items:
        name, sep, folder = item.partition("=")
        if not sep or not name or not folder.strip():
            raise ExportError(f"--export {item!r}: give NAME=FOLDER, e.g. --export gsm=runs/joint/export")
        if name in exports:
            raise ExportError(
                f"--export {item!r}: the name {name!r} is given twice (also --export {name}={exports[name]}); "
                "give each export its own name"
            )
        try:
            exports[name] = expand_user_path(folder)
        except ValueError as err:
            raise ExportError(f"--export {item!r}: {err}") from None
    return exports


def parse_selection(items: list[str]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The sparse_attention fields `--select FIELD=VALUE` gives every export, and those `--select
    NAME.FIELD=VALUE` gives the export NAME (over the former), values parsed as recipe overrides."""
    selection: dict[str, Any] = {}
    selections: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        name, _, field = key.rpartition(".")  # field names have no dot
        if not sep or not field or key.startswith("."):
            raise ExportError(
                f"--select {item!r}: give FIELD=VALUE or NAME.FIELD=VALUE, e.g. --select top_k=1024 or "
                "--select gsm.retrieval_layers=[7,14]"
            )
        target = selections.setdefault(name, {}) if name else selection
        target[field] = override_value(f"--select {key}", value)
    return selection, selections


def _eval(args: argparse.Namespace) -> int:
    exports = _exports(args.export)
    check_report_folder(args.out)
    selection, selections = parse_selection(args.select)
    report = evaluate_exports(
        args.model,
        exports,
        args.data,
        args.seq_len,
        args.windows,
        args.batch_size,
        args.mode,
        args.min_keys,
        first_bucket=args.first_bucket,
        selection=selection,
        selections=selections,
        weights=args.weights,
    )
    return _print_written(write_report(report, args.out))


def _passkey(args: argparse.Namespace) -> int:
    check_report_folder(args.out)
    selection, selections = parse_selection(args.select)
    report = evaluate_passkey(
        args.model,
        _exports(args.export),
        args.filler,
        args.length,
        args.cases,
        args.seed,
        args.batch_size,
        args.generate,
        args.mode,
        selection=selection,
        selections=selections,
    )
    return _print_written(write_report(report, args.out, "passkey", passkey_table))


def _prompt_text(args: argparse.Namespace) -> str:
    """The prompt: --prompt as given, or the text of --prompt-file; refused when empty or not
    UTF-8."""
    if args.prompt is not None:
        source, text = "--prompt", args.prompt
    else:
        source = f"--prompt-file {args.prompt_file}"
        path = Path(args.prompt_file)
        if not path.is_file():
            raise DataError(source, "no such file", "give a UTF-8 text file, or the text itself with --prompt")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as err:
            raise DataError(
                source,
                f"not UTF-8 text ({err.reason} at byte {err.start})",
                "save the prompt as UTF-8, or give the text itself with --prompt",
            ) from None
    if not text.strip():
        raise DataError(source, "the prompt is empty", "give some text to continue")
    return text


def _generate(args: argparse.Namespace) -> int:
    runs = generate(
        args.model,
        args.adapter,
        _prompt_text(args),
        args.max_new_tokens,
        args.mode,
        revision=args.revision,
        compare_dense=args.compare_dense,
        echo=True,
        sampling=Sampling(args.temperature, args.top_p, args.top_k, args.seed),
        chat=args.chat,
        prefill=args.prefill,
        weights=args.weights,
        fused_decode=args.fused_decode,
    )
    print()
    for run in runs:
        print(f"--- {run.summary()}", file=sys.stderr)
    if len(runs) == 2 and runs[1].decode_tokens_per_s > 0:
        print(
            f"--- decode speed-up over the dense base: "
            f"{runs[0].decode_tokens_per_s / runs[1].decode_tokens_per_s:.2f}x",
            file=sys.stderr,
        )
    return 0


def _publish(args: argparse.Namespace) -> int:
    where = publish_export(
        args.export,
        args.repo_id,
        private=args.private,
        revision=args.revision,
        endpoint=args.endpoint,
        base_model_id=args.base_model_id,
    )
    print(f"published {args.export} to {args.repo_id}: {where}")
    return 0


def _recipes(args: argparse.Namespace) -> int:
    """`recipes list`: each built-in recipe's name and description; `recipes copy NAME DEST`: a copy to edit."""
    if args.action == "list":
        recipes = builtin_recipes()
        width = max(map(len, recipes))
        for name, path in recipes.items():
            print(f"{name:<{width}}  {recipe_summary(path)}")
        return 0
    try:
        written = copy_recipe(args.name, args.destination)
    except (FileNotFoundError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"copied {args.name} to {written}; run it with: gsm-train train {written}")
    return 0


def _add_recipes_command(commands: argparse._SubParsersAction) -> None:
    """The `recipes` subcommand's arguments (`list`, `copy NAME DEST`)."""
    recipes = commands.add_parser("recipes", help="the built-in recipes: list them, or copy one to edit")
    actions = recipes.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="each built-in recipe's name and description")
    copy = actions.add_parser("copy", help="copy a built-in recipe to a file or folder (never overwrites)")
    copy.add_argument("name", help="a built-in recipe's name, e.g. gate_only")
    copy.add_argument("destination", type=path_arg, help="a file to write, or a folder to write NAME.yaml in")
    recipes.set_defaults(run=_recipes)


def _add_validate_command(commands: argparse._SubParsersAction) -> None:
    """The `validate` subcommand's arguments."""
    validate = commands.add_parser(
        "validate",
        help="check a recipe against its base model's config (no weights loaded) and print it fully resolved",
    )
    validate.add_argument("recipe", type=path_arg)
    validate.add_argument("overrides", nargs="*", help="key.sub=value")
    validate.set_defaults(run=_validate)


def _add_train_command(commands: argparse._SubParsersAction) -> None:
    """The `train` subcommand's arguments."""
    train = commands.add_parser("train", help="run a recipe (same code path as accelerate launch -m gsm_train.train)")
    train.add_argument(
        "recipe", type=path_arg, help="a recipe YAML, or a built-in recipe's name (gsm-train recipes list)"
    )
    train.add_argument("overrides", nargs="*", help="key.sub=value")
    add_start_flags(train)
    train.set_defaults(run=_train)


def _add_inspect_command(commands: argparse._SubParsersAction) -> None:
    """The `inspect` subcommand's arguments."""
    inspect = commands.add_parser("inspect", help="per layer: GSM modules, parameters, KV bytes per token")
    inspect.add_argument("--model", required=True, type=path_arg, help="tiny-llama, smollm2-135m, a folder or a hub id")
    inspect.add_argument("--recipe", default=None, type=path_arg, help="take the gsm block from this recipe")
    inspect.add_argument("--seq-len", type=_positive_int, default=2048, help="context for the KV byte account")
    inspect.add_argument("overrides", nargs="*", help="key.sub=value applied to the recipe")
    inspect.set_defaults(run=_inspect)


def _add_eval_command(commands: argparse._SubParsersAction) -> None:
    """The `eval` subcommand's arguments."""
    evaluate = commands.add_parser("eval", help="perplexity, KV bytes and gate recall of the base and exports")
    evaluate.add_argument(
        "--model", default=None, type=path_arg, help="the base model (default: the one the first export names)"
    )
    evaluate.add_argument(
        "--data", required=True, type=path_arg, help="evaluation text (file, folder, glob, embedded:NAME, hf://...)"
    )
    evaluate.add_argument(
        "--export", action="append", default=[], help="NAME=FOLDER or NAME=ORG/REPO (a Hub repo id), repeatable"
    )
    evaluate.add_argument("--seq-len", type=_positive_int, default=2048)
    evaluate.add_argument("--windows", type=_positive_int, default=40, help="non-overlapping windows to evaluate")
    evaluate.add_argument("--batch-size", type=_positive_int, default=1)
    evaluate.add_argument(
        "--mode",
        choices=("sparse", "oracle", "dense"),
        default="sparse",
        help="main attention of the exports (inference runs sparse)",
    )
    evaluate.add_argument(
        "--min-keys", type=_positive_int, default=512, help="recall counts queries with at least this many keys"
    )
    evaluate.add_argument(
        "--first-bucket",
        type=_positive_int,
        default=2048,
        help="figures also per query-position bucket: [0, N), [N, 2N), [2N, 4N), ... up to --seq-len",
    )
    add_select_argument(evaluate)
    _add_weights_argument(evaluate)
    evaluate.add_argument("--out", default="runs/eval", type=path_arg)
    evaluate.set_defaults(run=_eval)


def _add_weights_argument(parser: argparse.ArgumentParser) -> None:
    """`--weights`: the base's weights as loaded, or 4-bit (gsm_train/export/int4.py)."""
    parser.add_argument(
        "--weights",
        choices=WEIGHT_CHOICES,
        default=FULL,
        help="the base's weights: full (as loaded) or 4-bit in groups of 128/64/32 inputs (needs torchao)",
    )


def add_select_argument(parser: argparse.ArgumentParser) -> None:
    """`--select [NAME.]FIELD=VALUE`: a selection field the exports (the export NAME) run with instead of their
    own."""
    parser.add_argument(
        "--select",
        action="append",
        default=[],
        metavar="[NAME.]FIELD=VALUE",
        help="run the exports (NAME.: only the export NAME) with this sparse_attention selection field "
        "instead of their own (top_k, k_min, top_k_schedule, "
        "top_k_fraction, decay_rate, sink_tokens, recent_tokens, "
        "query_chunk, retrieval_layers), e.g. --select top_k=1024 or "
        "--select gsm.retrieval_layers=[7,14]; repeatable",
    )


def _add_passkey_command(commands: argparse._SubParsersAction) -> None:
    """The `passkey` subcommand's arguments."""
    passkey = commands.add_parser(
        "passkey", help="retrieval of a key hidden in long filler text, for the base and exports"
    )
    passkey.add_argument(
        "--model", default=None, type=path_arg, help="the base model (default: the one the first export names)"
    )
    passkey.add_argument(
        "--export", action="append", default=[], help="NAME=FOLDER or NAME=ORG/REPO (a Hub repo id), repeatable"
    )
    passkey.add_argument(
        "--filler",
        default="embedded:sample_prose",
        type=path_arg,
        help="prose the key hides in (file, folder, glob, embedded:NAME)",
    )
    passkey.add_argument("--length", type=_positive_int, default=8192, help="tokens per case")
    passkey.add_argument("--cases", type=_positive_int, default=100)
    passkey.add_argument("--seed", type=int, default=0, help="draws the cases (keys, depths, filler)")
    passkey.add_argument("--batch-size", type=_positive_int, default=1)
    passkey.add_argument(
        "--generate", action="store_true", help="also generate greedily through the GSM cache (slow at long lengths)"
    )
    passkey.add_argument(
        "--mode",
        choices=("sparse", "oracle", "dense"),
        default="sparse",
        help="main attention of the exports: the gate's top-k (as inference runs), the true top-k, or all keys",
    )
    add_select_argument(passkey)
    passkey.add_argument("--out", default="runs/passkey", type=path_arg)
    passkey.set_defaults(run=_passkey)


def _add_generate_command(commands: argparse._SubParsersAction) -> None:
    """The `generate` subcommand's arguments."""
    gen = commands.add_parser(
        "generate",
        help="greedy generation with an adapter over the GSM cache, streamed, "
        "with time to first token, decode tokens/s, memory and KV bytes",
    )
    gen.add_argument(
        "--model",
        default=None,
        type=path_arg,
        help="the base model (default: the one the adapter names; needed without --adapter)",
    )
    gen.add_argument(
        "--adapter", default=None, type=path_arg, help="an export folder or Hub repo id (without it: the dense base)"
    )
    gen.add_argument("--revision", default=None, help="branch, tag or commit of a Hub repo --adapter")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", default=None)
    source.add_argument("--prompt-file", default=None, type=path_arg)
    gen.add_argument("--max-new-tokens", type=_positive_int, default=64)
    gen.add_argument("--mode", choices=("sparse", "dense"), default="sparse", help="main attention of the adapter")
    gen.add_argument(
        "--prefill",
        choices=PREFILL_MODES,
        default=DEFAULT_PREFILL,
        help="how the prompt attends: dense (as the base model, flash kernels on a GPU; the GSM cache is filled "
        "from its K/V) or sparse (as --mode, the teacher-forced GSM pass)",
    )
    gen.add_argument(
        "--fused-decode",
        action="store_true",
        help="on a GPU with Triton: each GSM token step runs the RMSNorms, RoPE and SwiGLU as one kernel each",
    )
    gen.add_argument(
        "--compare-dense",
        action="store_true",
        help="also run the dense base on the prompt (static cache on a GPU) and report both",
    )
    _add_sampling_flags(gen)
    _add_weights_argument(gen)
    gen.set_defaults(run=_generate)


def _add_sampling_flags(gen: argparse.ArgumentParser) -> None:
    """`generate`'s sampling flags (greedy unless one of --temperature, --top-p, --top-k is given) and --chat."""
    sampling = gen.add_argument_group("sampling (greedy unless --temperature, --top-p or --top-k is given)")
    sampling.add_argument("--temperature", type=_positive_float, default=None, help="sample at this temperature")
    sampling.add_argument("--top-p", type=_probability, default=None, help="sample from the top-p nucleus")
    sampling.add_argument("--top-k", type=_positive_int, default=None, help="sample from the k likeliest tokens")
    sampling.add_argument("--seed", type=int, default=None, help="seed torch before each run (reproducible samples)")
    gen.add_argument(
        "--chat",
        action="store_true",
        help="wrap the prompt in the tokenizer's chat template as a user message (instruct models)",
    )


def _add_export_command(commands: argparse._SubParsersAction) -> None:
    """The `export` subcommand's arguments."""
    export = commands.add_parser("export", help="write the adapter export of a checkpoint")
    export.add_argument("checkpoint", type=path_arg, help="RUN/checkpoints/step_N")
    export.add_argument(
        "out",
        type=path_arg,
        help="folder to write: new, empty, or a previous export (replaced once the new one is complete)",
    )
    export.set_defaults(run=_export)


def _add_publish_command(commands: argparse._SubParsersAction) -> None:
    """The `publish` subcommand's arguments."""
    publish = commands.add_parser("publish", help="upload an export to the Hugging Face Hub (one commit)")
    publish.add_argument("export", type=path_arg, help="an export folder")
    publish.add_argument("--repo-id", required=True, help="ORG/NAME")
    publish.add_argument("--private", action="store_true")
    publish.add_argument("--revision", default=None, help="branch to commit to (created if missing)")
    publish.add_argument("--endpoint", default=None, help="Hub URL (default: huggingface.co or HF_ENDPOINT)")
    publish.add_argument(
        "--base-model-id",
        default=None,
        help="the base's Hub id (ORG/NAME), for an export whose base was a local folder",
    )
    publish.set_defaults(run=_publish)


def build_parser() -> argparse.ArgumentParser:
    """`gsm-train` and its subcommands (each added by its `_add_*_command`)."""
    parser = argparse.ArgumentParser(prog="gsm-train", description=__doc__)
    parser.add_argument("--version", action="version", version=f"gsm-train {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for add_command in (
        _add_validate_command,
        _add_train_command,
        _add_inspect_command,
        _add_eval_command,
        _add_passkey_command,
        _add_generate_command,
        _add_export_command,
        _add_publish_command,
        _add_recipes_command,
    ):
        add_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point; exit status 2 on a bad input, others as `gsm_train.entry` says."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if (
        extra
        and getattr(args, "overrides", None) is not None
        and all("=" in item and not item.startswith("-") for item in extra)
    ):
        args.overrides += extra  # key=value after a flag: argparse ends the positionals at the flag
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.run is _train:  # the run's own entry point says how a stopped run continues
        return args.run(args)
    return run_command(lambda: args.run(args))


def console() -> NoReturn:
    """The `gsm-train` command: `main()` on the command line's arguments, its status the process's
    (`exit_process`)."""
    exit_process(main())


if __name__ == "__main__":
    console()
