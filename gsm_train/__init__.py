"""gsm-train: retrofit and train GSM sparse-attention, KV-compression and cache-bridge adapters."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["GSMModel", "__version__"]


def __getattr__(name: str) -> Any:
    """`gsm_train.GSMModel`, imported on first use (it loads torch and transformers)."""
    if name == "GSMModel":
        from gsm_train.export.pretrained import GSMModel

        return GSMModel
    raise AttributeError(f"module 'gsm_train' has no attribute {name!r}")
