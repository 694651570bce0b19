"""`gsm-train export CHECKPOINT OUT`: rebuild a run's model from its resolved recipe, load a
checkpoint's trainable tensors (read whole in this one process, whatever number of processes wrote
them: `checkpoint.read_trainables`) and write the adapter export."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from torch.distributed.checkpoint import CheckpointException

from gsm_train.backend_protocol import FULL_TRAINABLES_FILE
from gsm_train.checkpoint import read_trainables
from gsm_train.config import load_recipe
from gsm_train.export import ExportError, export_adapter, export_destination
from gsm_train.export_folder import check_writable
from gsm_train.model_zoo import load_model_and_tokenizer
from gsm_train.preflight import check_model_config
from gsm_train.session import export_options
from gsm_train.sharded_checkpoint import DCP_FOLDER
from gsm_train.stages import STAGES


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path) -> Path:
    """Export the GSM tensors of `RUN/checkpoints/step_N` (the run's recipe.resolved.yaml says how
    to rebuild) into `out_dir`: a new or empty folder, or a previous export, which is replaced once
    the new one is complete."""
    checkpoint = Path(checkpoint_dir).resolve()
    run_dir = checkpoint.parents[1] if len(checkpoint.parents) > 1 else checkpoint
    recipe = run_dir / "recipe.resolved.yaml"
    holds_weights = (checkpoint / DCP_FOLDER).is_dir() or (checkpoint / FULL_TRAINABLES_FILE).is_file()
    if not holds_weights or not recipe.is_file():
        raise ExportError(
            f"{checkpoint}: not a checkpoint of a gsm-train run (need {DCP_FOLDER}/ "
            f"or {FULL_TRAINABLES_FILE} here and {recipe.name} two folders up); "
            "give RUN/checkpoints/step_N"
        )
    export_destination(out_dir)  # refused before the model loads when it holds anything else
    check_writable(out_dir)
    config = load_recipe(recipe)
    check_model_config(config)  # a base that cannot be read (offline, a wrong name): refused before loading
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
