"""Resumable checkpoints: written by every rank at once, atomic, verified when a run resumes.

A checkpoint `step_00000050/` holds:
- the trainable parameters and their optimizer state, never the frozen base. FSDP2 (`format: dcp`):
  a torch.distributed.checkpoint in `dcp/`, each rank writing its own shards, nothing gathered
  (`sharded_checkpoint`). DeepSpeed (`format: deepspeed`): the engine's own checkpoint in
  `deepspeed/` and the full trainables in `trainable.safetensors` (`deepspeed_backend`);
- `state.json` (step, run id, backend, format, world size, scheduler, data position, the recipe as
  given), one `rng_rank{R}.pt` per rank, and `manifest.json`, written last: the size and sha256 of
  every other file (each rank digests the files it wrote, rank 0 the rest).

It is built in `step_00000050.tmp/`; every file and folder in it is fsync'ed, the folder is renamed
into place and its parent fsync'ed; then `latest` (the newest checkpoint's name) is replaced the
same way. A crash at any point leaves every earlier checkpoint whole; weights holding NaN or
infinities are never written (`finite_guard`).

Resuming verifies a checkpoint against its manifest: `auto` takes the newest one that verifies and
warns about each newer one that does not (none verifying is refused); a checkpoint named explicitly
must verify. It needs the backend that wrote it. An FSDP2 checkpoint resumes on any number of
processes (DCP reshards the trainables and the optimizer state) provided each micro-step still takes
the same rows: the data position counts global micro-batches of `train.batch_size` x processes, so
that product must stay the same (2 processes at batch 3 -> 3 processes at batch 2 or 1 at batch 6;
`train.batch_size` may change for that without --allow-recipe-change); every rank then takes rank
0's random state (ranks are seeded alike). A DeepSpeed checkpoint resumes on the number of processes
that wrote it. Pruning (`output.keep_checkpoints`) removes only older checkpoints of the same run
(same run id), never the one `latest` names. `read_trainables` reads a checkpoint's trainables in
one process (export), `checkpoint_shapes` their shapes alone.

Nothing read from a checkpoint runs code: DCP's index is unpickled admitting only its own classes,
its other items and the random states are read with `torch.load(weights_only=True)` (`dcp_safe`); an
index that refers to anything else is a CheckpointError. A DeepSpeed checkpoint's `deepspeed/`
folder is read by DeepSpeed itself, which unpickles it: resume only DeepSpeed checkpoints you made.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import random
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint import CheckpointException

from gsm_train.durable import fsync_path, write_durable
from gsm_train.errors import GSMError
from gsm_train.training.backend_protocol import FULL_TRAINABLES_FILE, Backend
from gsm_train.training.dcp_safe import UnsafeCheckpointError, unsafe_reason
from gsm_train.training.distributed import DistInfo, barrier
from gsm_train.training.finite_guard import refuse_non_finite
from gsm_train.training.sharded_checkpoint import DCP_FOLDER, DCP_FORMAT, read_full_tensors, tensor_shapes

LATEST = "latest"
MANIFEST = "manifest.json"
STATE = "state.json"
STEP_PREFIX = "step_"


class CheckpointError(ValueError, GSMError):
    """A checkpoint that cannot be resumed from; the message names the folder or file, and the
    fix."""


def step_folder_name(step: int) -> str:
    """`step_00000050` for step 50."""
    return f"{STEP_PREFIX}{step:08d}"


def checkpoint_step(folder: Path) -> int:
    """50 for a folder `step_00000050`."""
    return int(folder.name.removeprefix(STEP_PREFIX))


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _digest(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def write_manifest(folder: Path, digests: dict[str, dict[str, Any]] | None = None) -> None:
    """fsync every file under `folder`, then write `manifest.json` (relative path -> size and sha256
    of every other file) and fsync it and every folder under `folder`. `digests`: entries already
    taken (by the ranks that wrote those files, after fsync'ing them)."""
    entries = dict(digests or {})
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        name = path.relative_to(folder).as_posix()
        if name not in entries:
            fsync_path(path)
            entries[name] = _digest(path)
    write_durable(folder / MANIFEST, json.dumps({"files": entries}, indent=2, sort_keys=True))
    for sub in sorted((p for p in folder.rglob("*") if p.is_dir()), reverse=True):
        fsync_path(sub)
    fsync_path(folder)


def verify_checkpoint(folder: Path) -> str | None:
    """What is wrong with the checkpoint `folder` (naming the file), or None if every file its
    manifest lists is there with the recorded size and sha256. A checkpoint written before manifests
    existed (its state.json has no run id) is accepted as it is, unverified."""
    if not folder.is_dir():
        return f"{folder} does not exist"
    manifest = folder / MANIFEST
    if not manifest.is_file():
        if _legacy_state(folder):
            return None
        return f"{manifest} is missing (the checkpoint was not completed, or was altered)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{manifest} is unreadable ({err})"
    if STATE not in files:
        return f"{manifest} does not list {STATE}"
    for name, expected in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != expected["size"]:
            return f"{path} has {size} bytes, the manifest says {expected['size']} (truncated or altered)"
        if _digest(path)["sha256"] != expected["sha256"]:
            return f"{path} does not match its sha256 in the manifest (altered or damaged)"
    return None


def _legacy_state(folder: Path) -> bool:
    """Whether `folder` holds a readable state.json without a run id (a checkpoint from before the
    manifests)."""
    try:
        state = json.loads((folder / STATE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and "run_id" not in state


def read_state(folder: Path) -> dict[str, Any]:
    """The checkpoint's state.json (CheckpointError if it cannot be read)."""
    try:
        state = json.loads((folder / STATE).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{folder / STATE}: cannot be read ({err})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CheckpointError(f"{folder / STATE}: not a checkpoint state (no step)")
    return state


def checkpoint_folders(run_dir: Path) -> list[Path]:
    """The run's checkpoint folders (complete or not; temporary ones excluded), newest first."""
    folder = run_dir / "checkpoints"
    found = [p for p in folder.glob(f"{STEP_PREFIX}*") if p.is_dir() and p.name.removeprefix(STEP_PREFIX).isdigit()]
    return sorted(found, key=checkpoint_step, reverse=True)


def newest_good_checkpoint(run_dir: Path) -> tuple[Path | None, list[str]]:
    """(the newest checkpoint of `run_dir` that verifies, or None; what is wrong with each newer
    one)."""
    problems = []
    for folder in checkpoint_folders(run_dir):
        problem = verify_checkpoint(folder)
        if problem is None:
            return folder, problems
        problems.append(problem)
    return None, problems


def resolve_resume(resume_from: str | None, run_dir: Path) -> Path | None:
    """`auto` -> the run's newest checkpoint that verifies (a warning on stderr for each newer one
    skipped), CheckpointError if none does: starting over is asked for by leaving --resume out; a
    path -> that checkpoint, which must verify (else CheckpointError)."""
    if resume_from is None:
        return None
    if resume_from == "auto":
        found, problems = newest_good_checkpoint(run_dir)
        if found is None:
            held = f"none verifies: {problems[0]}" if problems else "none was written"
            raise CheckpointError(
                f"--resume auto: {run_dir / 'checkpoints'} holds no checkpoint to continue from ({held}); "
                "to start the run over from step 0, run without --resume (with --overwrite if the folder "
                "holds the run's files)"
            )
        for problem in problems:
            print(f"warning: skipping a damaged checkpoint: {problem}; resuming from {found.name}", file=sys.stderr)
        return found
    path = Path(resume_from)
    if not (path / STATE).is_file() and not (path / MANIFEST).is_file():
        raise CheckpointError(
            f"output.resume_from={resume_from!r} is not a checkpoint (no "
            f"{STATE}); give a RUN/checkpoints/step_N folder, or --resume auto"
        )
    problem = verify_checkpoint(path)
    if problem is not None:
        good, _ = newest_good_checkpoint(path.parent.parent)
        other = f"; {good} verifies" if good is not None else ""
        raise CheckpointError(
            f"output.resume_from={resume_from!r} is damaged: {problem}{other}; "
            "resume from a checkpoint that verifies, or --resume auto"
        )
    return path


def check_resumable(state: dict[str, Any], folder: Path, backend: str, world_size: int, batch_size: int) -> None:
    """Refuse a checkpoint this run cannot continue: written by another backend, in FSDP2's former
    full-tensor format, or at another number of processes where the format cannot reshard or the
    data position would not carry over (see the module docstring)."""
    written_by, fmt = state.get("backend", "fsdp2"), state.get("format")
    written_at = state.get("world_size")
    if written_by != backend:
        raise CheckpointError(
            f"checkpoint {folder} was written with {written_by}, this run "
            f"has {backend}; resume with the backend that wrote it (accelerate "
            "config)"
        )
    if backend == "fsdp2" and fmt != DCP_FORMAT:
        raise CheckpointError(
            f"checkpoint {folder} holds full tensors "
            f"({FULL_TRAINABLES_FILE}), as FSDP2 checkpoints were before they "
            "were sharded, which this gsm-train does not resume; export it "
            f"(gsm-train export {folder} OUT), or resume with the gsm-train that "
            "wrote it"
        )
    if written_at == world_size:
        return
    if fmt != DCP_FORMAT:
        raise CheckpointError(
            f"checkpoint {folder} was written by {written_at} processes with "
            f"{written_by}, this run has {world_size}; resume with {written_at} "
            "processes (DeepSpeed checkpoints do not reshard)"
        )
    rows = state["data"]["global_batch_size"]
    taken = f"checkpoint {folder} was written by {written_at} processes taking {rows} rows a micro-step"
    if rows % world_size:
        raise CheckpointError(
            f"{taken}, which do not split evenly over {world_size} processes; "
            f"resume on a number of processes that divides {rows}, with "
            f"train.batch_size = {rows} / that number, so that the data "
            "continues where it stopped"
        )
    if batch_size * world_size != rows:
        raise CheckpointError(
            f"{taken}; this run's {world_size} take {batch_size * world_size} "
            f"(train.batch_size {batch_size} each); set train.batch_size="
            f"{rows // world_size} so that the data continues where it stopped, "
            f"or resume on {written_at} processes"
        )


def _own_digests(folder: Path, info: DistInfo) -> dict[str, dict[str, Any]]:
    """fsync and digest the files this rank wrote into the checkpoint `folder` (its random state
    and, as DCP names them, its shards `dcp/__R_*.distcp`); rank 0 takes any other file."""
    shards = sorted((folder / DCP_FOLDER).glob(f"__{info.rank}_*.distcp"))
    own = [folder / f"rng_rank{info.rank}.pt", *shards]
    entries = {}
    for path in own:
        fsync_path(path)
        entries[path.relative_to(folder).as_posix()] = _digest(path)
    return entries


def _gathered(entries: dict[str, Any], info: DistInfo) -> dict[str, Any]:
    """Every rank's `entries` merged (collective)."""
    if not (info.distributed and dist.is_initialized()):
        return entries
    found: list[Any] = [None] * info.world_size
    dist.all_gather_object(found, entries)
    return {name: entry for part in found for name, entry in part.items()}


def save_checkpoint(
    run_dir: Path,
    step: int,
    backend: Backend,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    data_state: dict,
    trainable: set[str],
    info: DistInfo,
    keep: int,
    run: dict[str, Any],
) -> Path:
    """Write a complete checkpoint (collective: every rank calls it and writes its part); return
    its folder. `run`: the run's identity stored in state.json (`run_id`, `recipe`). Raises
    NonFiniteError on every rank, writing nothing, if a trainable tensor holds NaN or an
    infinity."""
    final = run_dir / "checkpoints" / step_folder_name(step)
    tmp = final.with_name(final.name + ".tmp")
    tensors = backend.trainable_tensors(model, trainable)
    refuse_non_finite(tensors, f"checkpoint {final.name}", info)
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    torch.save(_rng_state(), tmp / f"rng_rank{info.rank}.pt")
    backend.save_state(model, optimizer, tmp, tensors, info)
    digests = _gathered(_own_digests(tmp, info), info)
    if info.is_main:
        meta = {
            "step": step,
            **run,
            "backend": backend.name,
            "format": backend.checkpoint_format,
            "world_size": info.world_size,
            "scheduler": scheduler.state_dict(),
            "data": data_state,
        }
        (tmp / STATE).write_text(json.dumps(meta, indent=2))
        write_manifest(tmp, digests)
        shutil.rmtree(final, ignore_errors=True)  # a damaged one of the same step, resumed past
        os.replace(tmp, final)
        fsync_path(final.parent)
        write_durable(final.parent / LATEST, final.name)
        _prune(run_dir, keep, run["run_id"], final)
    barrier()
    return final


def _prune(run_dir: Path, keep: int, run_id: str, newest: Path) -> None:
    """Keep `newest` and the keep - 1 checkpoints of run `run_id` just before it; remove this
    run's older ones. Other runs' checkpoints, damaged ones and any of a later step stay."""
    older = []
    for folder in checkpoint_folders(run_dir):
        if checkpoint_step(folder) >= checkpoint_step(newest):
            continue
        try:
            owner = read_state(folder).get("run_id")
        except CheckpointError:
            continue
        if owner == run_id:
            older.append(folder)
    for folder in older[keep - 1 :]:
        shutil.rmtree(folder, ignore_errors=True)


def load_checkpoint(
    path: Path,
    backend: Backend,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    trainable: set[str],
    batch_size: int,
    info: DistInfo,
) -> dict:
    """Restore the trainables, optimizer, scheduler and random state (collective); return the saved
    state (step, data position). `trainable`: the names of the trainables; `batch_size`: this run's
    `train.batch_size` (checked, with the number of processes, by `check_resumable`)."""
    meta = read_state(path)
    check_resumable(meta, path, backend.name, info.world_size, batch_size)
    with _refusing_unsafe(path):
        backend.load_state(model, optimizer, path, trainable, info)
    scheduler.load_state_dict(meta["scheduler"])
    rank = info.rank if meta["world_size"] == info.world_size else 0
    _set_rng_state(torch.load(path / f"rng_rank{rank}.pt", weights_only=True))
    return meta


@contextlib.contextmanager
def _refusing_unsafe(folder: Path) -> Iterator[None]:
    """Turn a DCP index or item that would run code (`dcp_safe`) into a CheckpointError naming the
    checkpoint."""
    try:
        yield
    except (UnsafeCheckpointError, pickle.UnpicklingError, CheckpointException) as err:
        reason = unsafe_reason(err)
        if reason is None:
            raise
        raise CheckpointError(
            f"{folder / DCP_FOLDER}: refused, {reason}; do not use this checkpoint (take one you or your runs wrote)"
        ) from None


def read_trainables(folder: Path) -> dict[str, torch.Tensor]:
    """The trainables of checkpoint `folder` as whole CPU tensors by name, read in this process (no
    process group): from `dcp/` (FSDP2) or `trainable.safetensors` (DeepSpeed, and FSDP2 before).
    Verify the checkpoint first (`verify_checkpoint`); CheckpointError for an index that would
    run code."""
    if (folder / DCP_FOLDER).is_dir():
        with _refusing_unsafe(folder):
            return read_full_tensors(folder)
    return load_file(str(folder / FULL_TRAINABLES_FILE))


def checkpoint_shapes(folder: Path) -> dict[str, list[int]]:
    """The shapes of checkpoint `folder`'s trainables by name, read from the DCP index or the
    safetensors header alone (CheckpointError for an index that would run code)."""
    if (folder / DCP_FOLDER).is_dir():
        with _refusing_unsafe(folder):
            return tensor_shapes(folder)
    if not (folder / FULL_TRAINABLES_FILE).is_file():
        raise CheckpointError(f"{folder}: holds neither {DCP_FOLDER}/ nor {FULL_TRAINABLES_FILE}; not a checkpoint")
    with safe_open(str(folder / FULL_TRAINABLES_FILE), framework="pt") as handle:
        return {name: list(handle.get_slice(name).get_shape()) for name in handle.keys()}
