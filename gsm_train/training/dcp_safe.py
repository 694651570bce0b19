"""Reading a torch.distributed.checkpoint (DCP) folder without running code from it.

DCP's own `FileSystemReader` unpickles `.metadata` with `pickle.load`, and its default load planner
reads non-tensor items (the optimizer's hyper-parameters) with `torch.load(weights_only=False)`: a
checkpoint altered by someone else could run any code as the user who reads it. Here:

- `SafeFileSystemReader` unpickles `.metadata` with `MetadataUnpickler`, which admits only the
  classes a DCP index is made of (`ADMITTED`: the metadata dataclasses, `torch.Size`, dtypes,
  layouts, paths) and refuses any other global (`UnsafeCheckpointError`), before it is called;
- `SafeLoadPlanner` reads non-tensor items with `torch.load(weights_only=True)` (containers,
  numbers, strings, tensors); tensors are read so already by DCP.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from gsm_train.errors import GSMError

# (module, name) of every global a DCP `.metadata` pickle is made of
ADMITTED = frozenset(
    {
        *(
            ("torch.distributed.checkpoint.metadata", name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
    }
)


class UnsafeCheckpointError(ValueError, GSMError):
    """A DCP checkpoint whose metadata refers to something a checkpoint never holds (it was made
    to run code, or is damaged); nothing of it was run."""


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds only the `ADMITTED` classes and torch dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ADMITTED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"its index (.metadata) refers to {module}.{name}, which a checkpoint never holds (it was altered to run "
            "code, or is damaged); nothing of it was run"
        )


def read_dcp_metadata(stream: io.BufferedIOBase) -> Metadata:
    """The DCP `Metadata` pickled in `stream`, built without running code (UnsafeCheckpointError
    otherwise, or when it is not a DCP index)."""
    try:
        metadata = MetadataUnpickler(stream).load()
    except UnsafeCheckpointError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as err:
        raise UnsafeCheckpointError(f"its index (.metadata) cannot be read ({type(err).__name__}: {err})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"its index (.metadata) holds a {type(metadata).__name__}, not a checkpoint index")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file system reader, its `.metadata` read by `read_dcp_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = read_dcp_metadata(stream)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, its non-tensor items read with `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(
                f"its item {read_item.dest_index.fqn} {_weights_only_detail(err)}; nothing of it was run"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _weights_only_detail(err: pickle.UnpicklingError) -> str:
    """What torch's weights-only unpickler refused, in one line (its message is a page long and
    suggests loading without it)."""
    found = re.search(r"WeightsUnpickler error: ([^\n]*?)(?:\. |\.?$|\n)", str(err))
    return f"holds what a checkpoint never holds ({found.group(1) if found else 'refused by weights_only'})"


def unsafe_reason(err: BaseException) -> str | None:
    """The one-line reason when `err` (or, for DCP's CheckpointException, any rank's failure) is a
    refusal of something that would run code; None for any other failure."""
    found = [exc for exc, _ in err.failures.values()] if isinstance(err, CheckpointException) else [err]
    for exc in found:
        if isinstance(exc, UnsafeCheckpointError):
            return str(exc)
        if isinstance(exc, pickle.UnpicklingError):  # a tensor item, read by DCP with weights_only=True
            return f"an item {_weights_only_detail(exc)}; nothing of it was run"
    return None
