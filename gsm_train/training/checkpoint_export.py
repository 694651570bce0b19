"""`gsm-train export CHECKPOINT OUT`: rebuild a run's model from the recipe the checkpoint was
trained with, load the checkpoint's trainable tensors (read whole in this one process, whatever
number of processes wrote them: `checkpoint.read_trainables`) and write the adapter export.

Before the model loads, the checkpoint is verified against its manifest (a flipped bit is refused,
as on resume), its index is read without running code (`dcp_safe`), the destination must be
writable and the base model's config readable."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from torch.distributed.checkpoint import CheckpointException

from gsm_train.config.schema import RecipeConfig, load_recipe, validate_recipe_dict
from gsm_train.export.export_folder import check_writable
from gsm_train.export.save_load import ExportError, export_adapter, export_destination
from gsm_train.models.model_zoo import load_model_and_tokenizer
from gsm_train.training.backend_protocol import FULL_TRAINABLES_FILE
from gsm_train.training.checkpoint import (
    CheckpointError,
    checkpoint_shapes,
    read_state,
    read_trainables,
    verify_checkpoint,
)
from gsm_train.training.session import export_options
from gsm_train.training.sharded_checkpoint import DCP_FOLDER
from gsm_train.training.stages import STAGES
from gsm_train.tuning.resolved_recipe import resolve_for_base

RUN_RECIPE = "recipe.resolved.yaml"


def checkpoint_recipe(checkpoint: Path) -> RecipeConfig:
    """The recipe `checkpoint` was trained with: the one its state.json carries (the run's, as
    resumed, with any --allow-recipe-change); for a checkpoint from before recipes were stored
    there, the run's recipe.resolved.yaml two folders up."""
    stored = read_state(checkpoint).get("recipe")
    if isinstance(stored, dict):
        return validate_recipe_dict(stored, f"{checkpoint / 'state.json'} (its recipe)")
    run_dir = checkpoint.parents[1] if len(checkpoint.parents) > 1 else checkpoint
    recipe = run_dir / RUN_RECIPE
    if not recipe.is_file():
        raise ExportError(
            f"{checkpoint}: its state.json carries no recipe and there is no {RUN_RECIPE} two folders up; "
            "give RUN/checkpoints/step_N of a gsm-train run"
        )
    return load_recipe(recipe)


def _checked(checkpoint: Path) -> RecipeConfig:
    """The checkpoint's recipe, once the checkpoint has verified and its index has been read
    without running code (ExportError otherwise)."""
    holds_weights = (checkpoint / DCP_FOLDER).is_dir() or (checkpoint / FULL_TRAINABLES_FILE).is_file()
    if not holds_weights:
        raise ExportError(
            f"{checkpoint}: not a checkpoint of a gsm-train run (need {DCP_FOLDER}/ or {FULL_TRAINABLES_FILE} "
            "here); give RUN/checkpoints/step_N"
        )
    problem = verify_checkpoint(checkpoint)
    if problem is not None:
        raise ExportError(f"{checkpoint} is damaged: {problem}; export an earlier checkpoint of the run")
    try:
        config = checkpoint_recipe(checkpoint)
        checkpoint_shapes(checkpoint)
    except CheckpointError as err:
        raise ExportError(str(err)) from None
    return config


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path) -> Path:
    """Export the GSM tensors of `RUN/checkpoints/step_N` (its recipe says how to rebuild) into
    `out_dir`: a new or empty folder, or a previous export, which is replaced once the new one is
    complete."""
    checkpoint = Path(checkpoint_dir).resolve()
    config = _checked(checkpoint)
    export_destination(out_dir)  # refused before the model loads when it holds anything else
    check_writable(out_dir)
    # a base that cannot be read (offline, a wrong name) is refused before loading; the tuning knobs are
    # resolved as the run resolved them (a checkpoint's recipe may predate their resolution there)
    config, _ = resolve_for_base(config)
    torch.manual_seed(config.train.seed)  # as the run did: frozen modules initialised at random are not in checkpoints
    model, _ = load_model_and_tokenizer(config.model.name_or_path, config.model.gguf_file, config.model.revision)
    STAGES[config.stage]().attach(model, config)
    try:
        weights = read_trainables(checkpoint)
    except (SafetensorError, CheckpointException, OSError, ValueError, RuntimeError) as err:
        reason = " ".join(str(err).split())[:300]  # a damaged file
        raise ExportError(
            f"{checkpoint}: its trainables cannot be read ({reason}); export an earlier checkpoint of the run"
        ) from None
    result = model.load_state_dict(weights, strict=False)
    if result.unexpected_keys:
        raise ExportError(f"{checkpoint}: tensors {result.unexpected_keys[:3]} do not fit the recipe's model")
    return export_adapter(model, out_dir, **export_options(config))
