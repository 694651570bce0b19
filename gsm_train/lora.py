"""LoRA on the base model's projections through peft (the `lora` extra), in place, so that module
names and the GSM modules stay where they are."""

from __future__ import annotations

from torch import nn

from gsm_train.config import LoraSettings


def inject_lora(model: nn.Module, settings: LoraSettings) -> None:
    """Add LoRA deltas (B initialised to zero, so the model is unchanged) to `settings.target_modules`."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as err:
        raise RuntimeError("train.base: lora needs peft: pip install 'gsm-train[lora]'") from err
    config = LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=settings.target_modules)
    inject_adapter_in_model(config, model)
