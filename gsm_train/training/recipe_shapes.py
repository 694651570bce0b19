"""The shapes of the tensors a recipe's model holds, computed before the model loads: the base's
config only (no weights), the modules the recipe's stage attaches built on the meta device.

A resumed run compares them with its checkpoint's (`check_shapes_fit`), so that a recipe change
that alters a tensor's shape (`--allow-recipe-change`) is one clear error before anything loads.
"""

from __future__ import annotations

from pathlib import Path

from transformers import PretrainedConfig

from gsm_train.config.schema import LoraSettings, RecipeConfig
from gsm_train.export.adapter_format import read_config
from gsm_train.export.save_load import build_settings, skeleton_state
from gsm_train.training.checkpoint import CheckpointError


def recipe_shapes(config: RecipeConfig, model_config: PretrainedConfig) -> dict[str, list[int]] | None:
    """Name -> shape of every tensor of the model `config` (resolved: `resolved_recipe`) trains (the
    base described by `model_config` with the stage's modules: the recipe's gsm block, or for
    `math_gate` the `init_from` export's; LoRA as the recipe or export says). None where that
    cannot be known without downloading (a `math_gate` starting from a Hub repo)."""
    if config.stage == "math_gate":
        if not (config.init_from and Path(config.init_from).is_dir()):
            return None
        export = read_config(Path(config.init_from))
        _, build = build_settings(export)
        lora = LoraSettings.model_validate(export["lora"]) if export.get("lora") else None
    else:
        sparse = config.gsm.sparse_attention.model_copy(update={"gate_init": "random"})  # no weights to start from
        build = config.gsm.model_copy(update={"sparse_attention": sparse}, deep=True)
        lora = config.train.lora if config.train.base == "lora" else None
    state, _ = skeleton_state(model_config, build, lora)
    return {name: list(tensor.shape) for name, tensor in state.items()}


def check_shapes_fit(
    config: RecipeConfig,
    model_config: PretrainedConfig,
    saved: dict[str, list[int]],
    checkpoint: Path,
    changed: list[str],
) -> None:
    """Refuse (CheckpointError, one line) the checkpoint whose tensors have the shapes `saved`
    (`checkpoint.checkpoint_shapes`) when one differs from the same tensor of the model `config`
    builds; `changed`: the recipe fields that differ from the checkpoint's, named in the message."""
    planned = recipe_shapes(config, model_config)
    if planned is None:
        return
    misfits = [
        f"{name} is {shape} there, {planned[name]} here"
        for name, shape in sorted(saved.items())
        if name in planned and planned[name] != shape
    ]
    if misfits:
        fields = ", ".join(changed) or "none"
        raise CheckpointError(
            f"resume from {checkpoint}: the recipe changes the shape of {len(misfits)} trained tensors "
            f"({misfits[0]}{', ...' if len(misfits) > 1 else ''}); changed fields: {fields}. A change of shape "
            "cannot resume: undo it, or start a new run (init_from an export of this one)"
        )
