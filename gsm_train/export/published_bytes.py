"""What makes an export's bytes the same every time and free of the exporting machine's paths.

- `save_reproducible`: a safetensors file whose header is canonical. safetensors writes its
  `__metadata__` map in a random order (a Rust HashMap), so two exports of one checkpoint differed;
  the header is rewritten in place with sorted keys (the same bytes, so the same length; the tensor
  data is not touched).
- `redact_local_paths`: a JSON value with each absolute (or `~`) path replaced by `<local>/NAME`
  (its last part): an export names no folder of the machine that made it (training_args.json, the
  model card). Paths given relative stay as given (they name no machine); the result does not
  depend on the folder the export ran in, so exports stay reproducible.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import Tensor

LOCAL = "<local>"
_HEADER_LENGTH_BYTES = 8


def save_reproducible(tensors: dict[str, Tensor], path: Path, metadata: dict[str, str]) -> None:
    """`safetensors.torch.save_file`, then its JSON header rewritten with sorted keys (padded with
    spaces to its length, as safetensors pads): the file's bytes depend on the tensors and
    `metadata` alone."""
    save_file(tensors, str(path), metadata=metadata)
    with path.open("r+b") as handle:
        length = int.from_bytes(handle.read(_HEADER_LENGTH_BYTES), "little")
        header = json.loads(handle.read(length))
        canonical = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        assert len(canonical) <= length, "a header of the same content is never longer"
        handle.seek(_HEADER_LENGTH_BYTES)
        handle.write(canonical.ljust(length))


def redact_path(text: str) -> str:
    """`text` unchanged unless it is an absolute or `~` path: then `<local>/NAME`."""
    if not (os.path.isabs(text) or text.startswith("~")):
        return text
    name = Path(os.path.normpath(text)).name
    return f"{LOCAL}/{name}" if name and name != "~" else LOCAL


def redact_local_paths(value: Any) -> Any:
    """`value` (JSON: dicts, lists, strings, numbers) with every string `redact_path`ed."""
    if isinstance(value, str):
        return redact_path(value)
    if isinstance(value, dict):
        return {key: redact_local_paths(item) for key, item in value.items()}
    if isinstance(value, list):
        return [redact_local_paths(item) for item in value]
    return value
