"""Small files shipped with the package: the embedded default training text."""

from __future__ import annotations

from pathlib import Path

EMBEDDED_PREFIX = "embedded:"
_ASSETS = Path(__file__).resolve().parent
_EMBEDDED = {"sample_prose": "sample_prose.txt"}


def embedded_asset_path(name: str) -> Path:
    """Path of a shipped asset given as `embedded:NAME`."""
    key = name.removeprefix(EMBEDDED_PREFIX)
    if key not in _EMBEDDED:
        raise FileNotFoundError(f"unknown embedded asset {name!r}; known: {', '.join(sorted(_EMBEDDED))}")
    return _ASSETS / _EMBEDDED[key]
