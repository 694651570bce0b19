"""The trainables and optimizer state of an FSDP2 run as a torch.distributed.checkpoint (DCP)
folder.

Every rank writes its own shards at once (`__R_0.distcp`), rank 0 the index (`.metadata`); nothing
is gathered. Only what trains is in it: the trainable parameters (`model.NAME`, DTensor shards under
FSDP2, whole tensors in one process) and their optimizer state (`optim.state.NAME.exp_avg`, ...,
`optim.param_groups`), as `torch.distributed.checkpoint.state_dict` names them. The frozen base is
neither gathered nor written.

Loading builds the same structure from the model and optimizer as they are now and lets DCP fill it:
DCP reads each rank's part of every tensor from whichever shards hold it, so a checkpoint written by
N processes loads on M (resharding). `read_full_tensors` reads the trainables back as whole tensors
in one process, without a process group (for `gsm-train export CHECKPOINT` and inspection).
`tensor_shapes` reads only the index. Every read goes through `dcp_safe`: nothing in the folder can
run code (an altered index raises `UnsafeCheckpointError`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from gsm_train.training.dcp_safe import SafeFileSystemReader, SafeLoadPlanner

DCP_FOLDER = "dcp"
DCP_FORMAT = "dcp"  # state.json's `format` of a checkpoint written so
MODEL_KEY = "model"
OPTIM_KEY = "optim"


def trainable_state(model: nn.Module, trainable: set[str]) -> dict[str, Tensor]:
    """The model's trainable tensors by name, as this rank holds them (FSDP2: DTensor shards; no
    communication)."""
    return {name: t for name, t in get_model_state_dict(model).items() if name in trainable}


def _single_process() -> bool:
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every call in one process that it assumes one process, which it is told."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def save_sharded(folder: Path, tensors: dict[str, Tensor], model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write `tensors` (`trainable_state`) and the optimizer's state into `folder/dcp` (collective:
    every rank writes its shards; each file is fsync'ed)."""
    state = {MODEL_KEY: tensors, OPTIM_KEY: get_optimizer_state_dict(model, optimizer)}
    with _quiet_single_process():
        dcp.save(
            state,
            storage_writer=FileSystemWriter(folder / DCP_FOLDER, sync_files=True),
            no_dist=_single_process(),
        )


def load_sharded(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, trainable: set[str]) -> None:
    """Restore the trainables and the optimizer's state from `folder/dcp`, written at any number of
    processes (collective)."""
    state: dict[str, Any] = {
        MODEL_KEY: trainable_state(model, trainable),
        OPTIM_KEY: get_optimizer_state_dict(model, optimizer),
    }
    with _quiet_single_process():
        dcp.load(
            state,
            storage_reader=SafeFileSystemReader(folder / DCP_FOLDER),
            planner=SafeLoadPlanner(),
            no_dist=_single_process(),
        )
    set_model_state_dict(model, state[MODEL_KEY], options=StateDictOptions(strict=False))
    set_optimizer_state_dict(model, optimizer, state[OPTIM_KEY])


def read_full_tensors(folder: Path, part: str = MODEL_KEY) -> dict[str, Tensor]:
    """The tensors of one part of the DCP checkpoint in `folder/dcp` (`model`: the trainables by
    name; `optim`: the optimizer's, e.g. `state.NAME.exp_avg`) as whole CPU tensors, read in this
    process alone (no process group needed)."""
    reader = SafeFileSystemReader(folder / DCP_FOLDER)
    tensors = {name: torch.empty(size, dtype=dtype) for name, (size, dtype) in _tensor_entries(reader, part).items()}
    with _quiet_single_process():
        dcp.load({part: tensors}, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return tensors


def _tensor_entries(reader: SafeFileSystemReader, part: str) -> dict[str, tuple[torch.Size, torch.dtype]]:
    prefix = f"{part}."
    return {
        key.removeprefix(prefix): (entry.size, entry.properties.dtype)
        for key, entry in reader.read_metadata().state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }


def tensor_shapes(folder: Path, part: str = MODEL_KEY) -> dict[str, list[int]]:
    """The shapes of one part's tensors in the DCP checkpoint in `folder/dcp`, read from its index
    alone."""
    entries = _tensor_entries(SafeFileSystemReader(folder / DCP_FOLDER), part)
    return {name: list(size) for name, (size, _) in entries.items()}
