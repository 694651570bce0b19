"""What gsm-train knows about each supported model family, in one table.

A family is supported when its attention runs through transformers' attention interface with
q/k/v projections and RoPE (rotate-half layout), so that GSM's attention function sees every layer's
post-RoPE query and key. `FAMILIES` says, per `config.model_type`, where the decoder stack, its layers
and their attention modules sit, what the projections are called, how RoPE pairs channels, and what a
tiny random test model of the family sets beyond the shared tiny shape. Injection, the model zoo,
`gsm-train inspect` and the generation cache read the model through the functions below.

Adding a family: one row in `FAMILIES` (tests/test_families.py then runs the injection, export and
decode checks on its tiny model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from gsm_train.errors import GSMError


class UnsupportedModel(ValueError, GSMError):
    """The model is not of a family in `FAMILIES`, or not laid out as its row says."""


@dataclass(frozen=True)
class ModelFamily:
    """Where the parts of one family's causal LM are, by attribute name."""

    model_type: str  # config.model_type
    stack: str = "model"  # the causal LM's attribute holding the decoder stack
    layers: str = "layers"  # the stack's nn.ModuleList of decoder layers
    attention: str = "self_attn"  # a decoder layer's attention module
    projections: tuple[str, str, str, str] = ("q_proj", "k_proj", "v_proj", "o_proj")
    rope: str = "rotate_half"  # channel i pairs with i + head_dim / 2 (the gate's RoPE and its init assume it)
    tiny: dict[str, Any] = field(default_factory=dict)  # config fields of the tiny test model beyond the shared ones


FAMILIES: dict[str, ModelFamily] = {
    family.model_type: family
    for family in (
        ModelFamily("llama"),
        ModelFamily("qwen2"),
        ModelFamily("qwen3"),
        ModelFamily("mistral"),
    )
}

TINY_SHAPE = dict(
    vocab_size=257,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    eos_token_id=256,
    pad_token_id=256,
    bos_token_id=256,
    tie_word_embeddings=False,
)


def _unwrapped(model: nn.Module) -> nn.Module:
    """The Hugging Face causal LM inside DeepSpeed's engine (`.module`) or a PEFT model (`.base_model.model`)."""
    while True:
        if hasattr(model, "config") and hasattr(model.config, "model_type"):
            return model
        inner = getattr(model, "module", None) or getattr(getattr(model, "base_model", None), "model", None)
        if inner is None:
            return model
        model = inner


def family_of(model: nn.Module) -> ModelFamily:
    """The family row of a causal LM (unwrapping engine and PEFT wrappers); UnsupportedModel if none."""
    model = _unwrapped(model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FAMILIES:
        raise UnsupportedModel(
            f"model family {model_type!r} is not supported: GSM needs attention through transformers' "
            f"attention interface with q/k/v projections and RoPE ({', '.join(FAMILIES)}); use a model "
            "of one of these families"
        )
    return FAMILIES[model_type]


def decoder_stack(model: nn.Module) -> nn.Module:
    """The decoder stack (e.g. `LlamaModel`) of a supported causal LM, or the stack itself."""
    model = _unwrapped(model)
    family = family_of(model)
    stack = getattr(model, family.stack, None)
    if stack is not None and hasattr(stack, family.layers):
        return stack
    if hasattr(model, family.layers):  # given the stack itself
        return model
    raise UnsupportedModel(f"{type(model).__name__} has no decoder layers at .{family.stack}.{family.layers}")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a supported causal LM (or of its stack)."""
    return getattr(decoder_stack(model), family_of(model).layers)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """Each decoder layer's attention module, in layer order."""
    name = family_of(model).attention
    return [getattr(layer, name) for layer in decoder_layers(model)]


def model_dims(model: nn.Module) -> dict[str, int]:
    """hidden size, query heads, KV heads, head_dim, layers and context length of a causal LM's config."""
    return config_dims(_unwrapped(model).config)


def config_dims(cfg: Any) -> dict[str, int]:
    """`model_dims` from a causal LM's config alone (a transformers `PretrainedConfig`, no model
    needed); context 0 where the config names none."""
    heads = cfg.num_attention_heads
    return {
        "hidden": cfg.hidden_size,
        "heads": heads,
        "kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "layers": cfg.num_hidden_layers,
        "context": getattr(cfg, "max_position_embeddings", None) or 0,
    }


def tiny_config_fields(model_type: str, num_layers: int) -> dict[str, Any]:
    """Config fields of a tiny random model of a family (4 query heads over 2 KV heads, head_dim 16)."""
    if model_type not in FAMILIES:
        raise ValueError(f"unknown tiny family {model_type!r}; use one of {', '.join(FAMILIES)}")
    return {**TINY_SHAPE, "num_hidden_layers": num_layers, **FAMILIES[model_type].tiny}
