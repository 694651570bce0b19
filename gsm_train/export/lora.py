"""LoRA on the base model's projections through peft (the `lora` extra), in place, so that module
names and the GSM modules stay where they are; and the adapter tensors of a model (GSM and LoRA),
found by module type."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from gsm_train.attention import gsm_state_dict
from gsm_train.config.schema import ConfigError, LoraSettings, Problem


def base_modules_pattern(names: list[str]) -> str:
    """peft's `target_modules` as a regex (a full match): modules named `names`, as peft matches a list
    (the whole name or its last parts), except inside the GSM modules (`.gsm.`), whose gate has
    projections named `q_proj` and `k_proj` too."""
    alternatives = "|".join(re.escape(name) for name in names)
    return rf"(?!.*\.gsm\.)(.*\.)?({alternatives})"


def inject_lora(model: nn.Module, settings: LoraSettings) -> None:
    """Add LoRA deltas (B initialised to zero, so the model is unchanged) to the base's
    `settings.target_modules`, each LoRA layer in the mode of the linear layer it wraps (peft builds them
    in training mode: in a loaded model, in eval mode, their dropout would then run at inference). The
    model's own parameters keep their `requires_grad` (peft's injection freezes all but the deltas; stages
    choose what trains themselves), and the deltas require gradients."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as err:
        raise RuntimeError("train.base: lora needs peft: pip install 'gsm-train[lora]'") from err
    check_targets(model, settings.target_modules)
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=base_modules_pattern(settings.target_modules),
    )
    wanted_grad = [(param, param.requires_grad) for param in model.parameters()]
    inject_adapter_in_model(config, model)
    for param, wanted in wanted_grad:
        param.requires_grad_(wanted)
    for _, layer in _lora_layers(model):
        layer.train(layer.get_base_layer().training)


def check_targets(model: nn.Module, names: list[str]) -> None:
    """ConfigError naming those of `names` that no linear layer of the base (outside the GSM modules)
    matches as peft matches them, with the names that would."""
    linear = [name for name, module in model.named_modules() if isinstance(module, nn.Linear) and ".gsm." not in name]
    unknown = [n for n in names if not any(re.fullmatch(base_modules_pattern([n]), m) for m in linear)]
    if unknown:
        known = sorted({m.rsplit(".", 1)[-1] for m in linear})
        raise ConfigError(
            "recipe vs model",
            [
                Problem(
                    "train.lora.target_modules",
                    unknown,
                    "no linear layer of the base model has this name",
                    f"use names of its linear layers: {', '.join(known)}",
                )
            ],
        )


def _lora_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # without peft no model has LoRA layers
        return
    yield from ((name, module) for name, module in model.named_modules() if isinstance(module, LoraLayer))


def lora_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """The LoRA deltas' parameters (peft's `LoraLayer.adapter_layer_names` parts of each LoRA layer)."""
    for prefix, layer in _lora_layers(model):
        for part in layer.adapter_layer_names:
            for name, param in getattr(layer, part).named_parameters():
                yield f"{prefix}.{part}.{name}", param


def adapter_tensor_names(model: nn.Module) -> set[str]:
    """Names (as the model's state dict has them) of the tensors an export holds: GSM tensors and LoRA deltas."""
    return set(gsm_state_dict(model)) | {name for name, _ in lora_parameters(model)}


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The export's tensors of `model` by name (GSM tensors and LoRA deltas)."""
    names = adapter_tensor_names(model)
    return {name: tensor for name, tensor in model.state_dict().items() if name in names}


PEFT_PREFIX = "base_model.model."
_MODEL_LORA = re.compile(r"(\.lora_[A-Za-z_]+)\.default\.")
_PEFT_LORA = re.compile(r"(\.lora_[A-Za-z_]+)\.(?!default\.)")


def peft_name(name: str) -> str:
    """The name PEFT's adapter file gives a LoRA tensor of the model
    (`...q_proj.lora_A.default.weight` -> `base_model.model....q_proj.lora_A.weight`), as
    `PeftModel.save_pretrained` writes it."""
    return PEFT_PREFIX + _MODEL_LORA.sub(r"\1.", name)


def model_name(name: str) -> str:
    """Inverse of `peft_name`: the model's own name of a tensor in PEFT's adapter file."""
    return _PEFT_LORA.sub(r"\1.default.", name.removeprefix(PEFT_PREFIX))


# A key of adapter_config.json that no PEFT config has: PEFT's config loader drops it with a warning
# that names it ("Unexpected keyword arguments [...] for class LoraConfig, these are ignored"), so a
# model loaded through PEFT says that it has no GSM modules. Its value says so in full.
PEFT_NOTE_KEY = "gsm_modules_not_loaded_by_peft__load_with_gsm_train_GSMModel"
PEFT_NOTE = (
    "This is a GSM adapter (gsm-train). PEFT applies only its LoRA deltas: the GSM modules "
    "(gsm_modules.safetensors: sparse gate, KV compressor, cache bridge) are not loaded, so the model "
    "PEFT gives is dense, with the dense model's perplexity and KV cache. Load the whole adapter with "
    "gsm_train.GSMModel.from_pretrained(THIS_FOLDER). PeftModel.save_pretrained writes only the LoRA "
    "deltas: a copy saved that way has no GSM modules."
)


def peft_base_name(base: dict) -> str:
    """`base_model_name_or_path` for adapter_config.json from an export's `base_model` block: the
    base's Hub id when the base holds the Hub's weights, else the name it was trained with (e.g. the
    built-in `smollm2-135m`, a de-quantized GGUF: naming the Hub id would make PEFT's AutoPeftModel
    load weights the adapter was not trained on)."""
    if base.get("hub_id") and not base.get("weights"):
        return base["hub_id"]
    return base["name_or_path"]


def write_peft_config(folder: Path, settings: LoraSettings, base_model: str | None, revision: str | None) -> None:
    """`adapter_config.json` for `settings`, so that `PeftModel.from_pretrained(base, folder)`
    rebuilds the same LoRA layers on a base without GSM modules, and warns (`PEFT_NOTE_KEY`) that it
    does not load them."""
    from peft import LoraConfig

    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=base_modules_pattern(settings.target_modules),
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
        revision=revision,
        inference_mode=True,
    )
    config.save_pretrained(str(folder))
    path = folder / "adapter_config.json"
    written = json.loads(path.read_text())
    path.write_text(json.dumps({**written, PEFT_NOTE_KEY: PEFT_NOTE}, indent=2, sort_keys=True))


def merge_lora(model: nn.Module) -> list[str]:
    """Merge every LoRA layer's deltas into its base layer and put the base layer back in the LoRA
    layer's place, as peft's `merge_and_unload` does: the model then computes what it computed (up
    to rounding in the weights' dtype) with plain projections. Returns the state-dict names of the
    merged weights. Raises ValueError (peft's safe merge) where a merged weight is not finite."""
    merged = []
    for name, layer in list(_lora_layers(model)):
        layer.merge(safe_merge=True)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer.get_base_layer())
        merged.append(f"{name}.weight")
    if merged and hasattr(model, "peft_config"):  # left by peft's inject_adapter_in_model
        del model.peft_config
    return merged
