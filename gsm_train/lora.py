"""LoRA on the base model's projections through peft (the `lora` extra), in place, so that module
names and the GSM modules stay where they are."""

from __future__ import annotations

import re

from torch import nn

from gsm_train.config import LoraSettings


def base_modules_pattern(names: list[str]) -> str:
    """peft's `target_modules` as a regex (a full match): modules named `names`, as peft matches a list
    (the whole name or its last parts), except inside the GSM modules (`.gsm.`), whose gate has
    projections named `q_proj` and `k_proj` too."""
    alternatives = "|".join(re.escape(name) for name in names)
    return rf"(?!.*\.gsm\.)(.*\.)?({alternatives})"


def inject_lora(model: nn.Module, settings: LoraSettings) -> None:
    """Add LoRA deltas (B initialised to zero, so the model is unchanged) to the base's
    `settings.target_modules`."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as err:
        raise RuntimeError("train.base: lora needs peft: pip install 'gsm-train[lora]'") from err
    config = LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=base_modules_pattern(settings.target_modules))
    inject_adapter_in_model(config, model)
