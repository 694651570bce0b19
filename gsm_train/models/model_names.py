"""What `model.name_or_path` may be, checked without loading anything: a built-in name
(`tiny-<family>[-<layers>]`, `smollm2-135m`, a `random-*` model of `RANDOM_MODELS`), a local
folder holding a model, or a Hub id `ORG/NAME` (whose existence is checked when its config is first
read; see `model_zoo.read_model_config`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from gsm_train.models.families import FAMILIES

SMOLLM2_NAME = "smollm2-135m"
TINY_PREFIX = "tiny-"
TINY_FAMILIES = tuple(FAMILIES)
# the Hub's repo id rules (huggingface_hub.utils.validate_repo_id): ORG/NAME of letters, digits,
# - _ and .
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
# models built from a config with random weights, nothing downloaded (benchmarks at full size):
# name -> (family, config fields). random-llama3-8b has Llama-3-8B's shapes: 8.03e9 parameters.
RANDOM_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "random-llama3-8b": (
        "llama",
        {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 128256,
            "max_position_embeddings": 8192,
            "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
    ),
    # SmolLM2-135M's shapes (the real weights are `smollm2-135m`): launch-bound timing at a small size
    "random-smollm2-135m": (
        "llama",
        {
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "head_dim": 64,
            "vocab_size": 49152,
            "max_position_embeddings": 8192,
            "rope_theta": 100000.0,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
        },
    ),
}
_BUILT_IN = (
    f"{', '.join(TINY_PREFIX + family for family in TINY_FAMILIES)} (optionally -LAYERS), "
    f"{SMOLLM2_NAME}, {', '.join(RANDOM_MODELS)}"
)


def parse_tiny_name(name: str) -> tuple[str, int] | None:
    """(family, layers) of `tiny-<family>[-<layers>]`, or None if `name` is not one."""
    if not name.startswith(TINY_PREFIX):
        return None
    family, _, layers = name.removeprefix(TINY_PREFIX).partition("-")
    if family not in TINY_FAMILIES or (layers and not (layers.isdigit() and int(layers) >= 1)):
        return None
    return family, int(layers) if layers else 4


def is_hub_id(name: str) -> bool:
    """Whether `name` has the form of a Hub model id (ORG/NAME) and is no existing local path."""
    well_formed = bool(_HUB_ID.match(name)) and "--" not in name and ".." not in name
    return well_formed and not Path(name).exists()


def model_name_problem(name: str) -> tuple[str, str] | None:
    """(what is wrong, the fix) for a `model.name_or_path` that cannot name a model, or None."""
    if name == SMOLLM2_NAME or name in RANDOM_MODELS or parse_tiny_name(name) is not None:
        return None
    if name.startswith(TINY_PREFIX):
        families = ", ".join(TINY_FAMILIES)
        return (f"not a built-in tiny model (families: {families}; layers a whole number)", f"use one of {_BUILT_IN}")
    folder = Path(name).expanduser()
    if folder.is_dir():
        if (folder / "config.json").is_file() or any(folder.glob("*.gguf")):
            return None
        return (
            "a folder without config.json (or a .gguf file): not a Hugging Face model folder",
            "give the folder that save_pretrained wrote, or a Hub id ORG/NAME",
        )
    if folder.exists():
        return "a file, not a model folder", "give the folder that holds config.json"
    if is_hub_id(name):
        return None
    return (
        f"neither a built-in model ({_BUILT_IN}), an existing folder, nor a Hub id ORG/NAME",
        ("fix the spelling, or give an existing folder or a Hub id such as HuggingFaceTB/SmolLM2-135M"),
    )
