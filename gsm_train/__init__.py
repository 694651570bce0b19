"""gsm-train: retrofit and train GSM sparse-attention, KV-compression and cache-bridge adapters.

The names a user touches are importable from here (`from gsm_train import GSMModel, load_gsm`); each is
imported on first use, so `import gsm_train` loads neither torch nor transformers. Everything else lives in
the folders docs/architecture.md maps and may move between releases.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the module that defines it
_PUBLIC = {
    "GSMModel": "gsm_train.export.pretrained",
    "load_gsm": "gsm_train.export.save_load",
    "export_adapter": "gsm_train.export.save_load",
    "read_export": "gsm_train.export.adapter_format",
    "Export": "gsm_train.export.adapter_format",
    "enable_gsm_generation": "gsm_train.inference.engine",
    "GSMCache": "gsm_train.inference.cache",
    "cache_kwargs": "gsm_train.inference.cache",
    "GSMConfig": "gsm_train.config.schema",
    "inject_gsm": "gsm_train.attention",
    "inject_sparse_gate": "gsm_train.attention",
    "gsm_collect": "gsm_train.attention",
    "gsm_disabled": "gsm_train.attention",
    "gsm_settings": "gsm_train.attention",
    "set_gsm_mode": "gsm_train.attention",
    "load_model_and_tokenizer": "gsm_train.models.model_zoo",
    "train_recipe": "gsm_train.train",
    "GSMError": "gsm_train.errors",
}
__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (most load torch and transformers)."""
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'gsm_train' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
