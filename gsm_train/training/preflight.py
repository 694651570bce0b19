"""Checks that run before a training run loads its model: each failure is one clear error (exit
status 2) naming the field, file or folder, and nothing has been written yet.

In order: the optional packages the recipe needs; the base model's config (read without weights: a
Hub id is first accessed here) against `data.seq_len`, the layer indices and the heads, and the
recipe's tuning knobs resolved against it (an impossible `tuning.kv_compression_ratio` is refused
here: `resolved_recipe`); the token cache's folder; the checkpoint to resume from (it must verify
against its manifest, and its index read without running code; train.steps must not lie below
its step; its backend and recipe must match this run's, or with --allow-recipe-change leave every
trained tensor's shape as it is; a different number of processes must take the same rows a
micro-step: `checkpoint.check_resumable`); the run folder (no live lock, no other run's files
unless told, nothing an --overwrite run that was killed left set aside; its export/ holds an export
or nothing). The result says where the run starts, under which run id, and the resolved recipe it
runs.
"""

from __future__ import annotations

import importlib.util
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gsm_train.config.schema import ConfigError, Problem, RecipeConfig
from gsm_train.export.export_folder import export_destination
from gsm_train.training.checkpoint import check_resumable, checkpoint_shapes, read_state, resolve_resume
from gsm_train.training.recipe_shapes import check_shapes_fit
from gsm_train.training.run_folder import check_folder_usable, check_run_folder, read_run_id
from gsm_train.training.set_aside import check_nothing_aside
from gsm_train.training.token_cache import token_cache_dir
from gsm_train.tuning.resolved_recipe import resolve_for_base

# recipe fields a resumed run may change without --allow-recipe-change: they do not alter the
# trained weights (how long it runs, what it logs, how often it saves, where)
RESUMABLE_CHANGES = (
    "train.steps",
    "output.checkpoint_every",
    "output.keep_checkpoints",
    "output.resume_from",
    "output.dir",
)
RESUMABLE_PREFIXES = ("logging.",)
# (recipe field, the module it needs, how to install it)
_OPTIONAL = (
    ("logging.wandb", "wandb", "pip install 'gsm-train[wandb]' (WANDB_MODE=offline: no network)"),
    ("logging.tensorboard", "tensorboard", "pip install 'gsm-train[tensorboard]'"),
    ("train.base", "peft", "pip install 'gsm-train[lora]'"),
)


@dataclass(frozen=True)
class StartOptions:
    """What the command line says about the run folder: `overwrite` starts a folder that holds a
    run over; `allow_recipe_change` lets a resumed run change fields that alter training."""

    overwrite: bool = False
    allow_recipe_change: bool = False


@dataclass(frozen=True)
class RunPlan:
    """Where and how a run starts, once the checks have passed."""

    config: RecipeConfig  # the recipe resolved against the base's config (`resolved_recipe`): what runs
    run_dir: Path
    run_id: str
    recipe: dict[str, Any]  # `config` as a mapping, stored in every checkpoint
    resume: Path | None  # the verified checkpoint to resume from
    overwrite: bool


def _field(config: RecipeConfig, dotted: str) -> Any:
    block, name = dotted.split(".")
    return getattr(getattr(config, block), name)


def check_optional_packages(config: RecipeConfig) -> None:
    """ConfigError naming each recipe field whose package is not installed."""
    wanted = {
        "logging.wandb": config.logging.wandb,
        "logging.tensorboard": config.logging.tensorboard,
        "train.base": config.train.base == "lora",
    }
    problems = [
        Problem(field, _field(config, field), f"needs the package {module!r}, which is not installed", fix)
        for field, module, fix in _OPTIONAL
        if wanted[field] and importlib.util.find_spec(module) is None
    ]
    if problems:
        raise ConfigError("recipe vs installed packages", problems)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _with_defaults(stored: dict[str, Any]) -> dict[str, Any]:
    """The stored recipe with the fields added since it was written at their defaults (it trained as
    they do); as stored when today's schema refuses it."""
    try:
        return RecipeConfig.model_validate(stored).model_dump(mode="json")
    except (ValidationError, ValueError):
        return stored


def recipe_changes(stored: dict[str, Any], given: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, stored value, given value) for each field that differs and alters training (a field the
    stored recipe lacks counts at its default)."""
    old, new = _flatten(_with_defaults(stored)), _flatten(given)
    changed = sorted(key for key in old.keys() | new.keys() if old.get(key) != new.get(key))
    return [
        (key, old.get(key), new.get(key))
        for key in changed
        if key not in RESUMABLE_CHANGES and not key.startswith(RESUMABLE_PREFIXES)
    ]


def check_recipe_unchanged(
    state: dict[str, Any], given: dict[str, Any], checkpoint: Path, allow: bool, resized: bool = False
) -> None:
    """Refuse to resume with a recipe that alters training (ConfigError listing each field), unless
    `allow`. A checkpoint from before recipes were stored in it is not compared. `resized`: the run
    resumes on another number of processes taking the same rows a micro-step (`check_resumable`), so
    `train.batch_size` may differ."""
    stored = state.get("recipe")
    if not isinstance(stored, dict) or allow:
        return
    fix = "resume with the recipe the run started with, start a new run, or pass --allow-recipe-change"
    problems = [
        Problem(key, now, f"differs from the run being resumed ({was!r})", fix)
        for key, was, now in recipe_changes(stored, given)
        if not (resized and key == "train.batch_size")
    ]
    if problems:
        raise ConfigError(f"resume from {checkpoint}", problems)


def check_steps_ahead(config: RecipeConfig, state: dict[str, Any], checkpoint: Path) -> None:
    """Refuse `train.steps` below the step of the checkpoint a run resumes from (ConfigError): the run
    would train no step and export the checkpoint as if it were the run's end."""
    step = state.get("step")
    if isinstance(step, int) and config.train.steps < step:
        raise ConfigError(
            f"resume from {checkpoint}",
            [
                Problem(
                    "train.steps",
                    config.train.steps,
                    f"below the step of the checkpoint to resume from ({step})",
                    f"set train.steps above {step} to train on, or export that checkpoint: "
                    f"gsm-train export {checkpoint} OUT",
                )
            ],
        )


def plan_run(config: RecipeConfig, backend: str, world_size: int, options: StartOptions) -> RunPlan:
    """Every check that can run before the model loads (read only: nothing is written); the plan, with
    `config` resolved against the base's config."""
    check_optional_packages(config)
    config, model_config = resolve_for_base(config)
    recipe = config.model_dump(mode="json")
    if not config.data.streaming:
        token_cache_dir()  # a file there is refused now, not once the model has loaded
    run_dir = Path(config.output.dir)
    resume_from = config.output.resume_from
    check_folder_usable(run_dir, resume_from, options.overwrite)
    check_nothing_aside(run_dir)
    resume = resolve_resume(resume_from, run_dir)
    state = read_state(resume) if resume is not None else None
    if resume is not None and state is not None:
        check_resumable(state, resume, backend, world_size, config.train.batch_size)
        check_steps_ahead(config, state, resume)
        check_recipe_unchanged(
            state, recipe, resume, options.allow_recipe_change, resized=state.get("world_size") != world_size
        )
        saved = checkpoint_shapes(resume)  # its index read without running code, or refused
        changed = [key for key, _, _ in recipe_changes(state.get("recipe") or {}, recipe)]
        if changed:
            check_shapes_fit(config, model_config, saved, resume, changed)
    check_run_folder(run_dir, resume_from, resume, state, options.overwrite)
    # the run's own export goes there at the end (--overwrite leaves a previous one in place until
    # then): a folder holding anything else is refused now, not after training
    export_destination(run_dir / "export")
    run_id = (state or {}).get("run_id")
    if run_id is None and resume_from == "auto":
        run_id = read_run_id(run_dir)
    return RunPlan(
        config=config,
        run_dir=run_dir,
        run_id=run_id or uuid.uuid4().hex,
        recipe=recipe,
        resume=resume,
        overwrite=options.overwrite,
    )
