"""The run folder (`output.dir`): one run per folder, a lock while it runs, what a run may remove.

- A folder that holds a run's files (`RUN_MARKERS`) is refused unless `--resume` continues that
  run or `--overwrite` starts over. `--overwrite` removes only what a run writes (`RUN_OUTPUTS`; in
  `checkpoints/` only the checkpoints), never another file, and only once the new run has a good
  checkpoint (`set_aside`).
- `run.lock` is created with O_EXCL when a run starts and removed when it ends; it holds the pid,
  host and start time. A second run on the folder exits with an error naming them. A lock left by
  a process that no longer runs on this host (a run killed with SIGKILL) is taken over with a
  warning; a lock from another host is never taken over (remove it by hand once that run is gone).
- `run.json` holds the run id, which every checkpoint repeats: pruning removes only checkpoints of
  the same run, and `--resume PATH` into a folder requires the folder's run to be the checkpoint's.
- The folder is created, and a 1 MiB file written, fsync'ed and removed, before the model loads,
  so an unwritable folder or a full disk is an error before anything expensive runs; folders
  created for a run that fails before writing a file are removed again.

Only rank 0 writes here; the other ranks of a launch only read.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from gsm_train.errors import GSMError
from gsm_train.training.checkpoint import checkpoint_folders, checkpoint_step, verify_checkpoint
from gsm_train.training.distributed import DistInfo, raise_on_any_rank

LOCK = "run.lock"
RUN_FILE = "run.json"
RECIPE_FILE = "recipe.resolved.yaml"
# files whose presence means the folder holds a run
RUN_MARKERS = ("metrics.jsonl", "checkpoints", RECIPE_FILE, RUN_FILE, "report.json", "export")
# everything a run writes into its folder (what --overwrite may remove); the recipes written beside
# the first one are named recipe.resolved.step_NNNNNNNN.yaml
RUN_OUTPUTS = (*RUN_MARKERS, "export.tmp", "tensorboard", "wandb", "recall_per_layer.png")
RECIPES_BESIDE = "recipe.resolved.step_*.yaml"
_PROBE_BYTES = 1 << 20
_UNREADABLE_LOCK_GRACE_S = 10.0  # a lock another process has created but not yet filled in


class RunFolderError(ValueError, GSMError):
    """A run folder that cannot be used as asked; the message names the folder and the fix."""


def run_files(run_dir: Path) -> list[str]:
    """The names in `run_dir` that show it holds a run (an empty `checkpoints/` does not count)."""
    found = []
    for name in RUN_MARKERS:
        path = run_dir / name
        if path.is_dir() and name == "checkpoints":
            if any(path.iterdir()):
                found.append(name)
        elif path.exists():
            found.append(name)
    return found


def read_run_id(run_dir: Path) -> str | None:
    """The run id in the folder's run.json, or None."""
    try:
        run_id = json.loads((run_dir / RUN_FILE).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return run_id if isinstance(run_id, str) else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True


def _read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from `path`: None if there is no such file, {} if it cannot be read as one."""
    try:
        owner = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


def read_lock(run_dir: Path) -> dict[str, Any] | None:
    """The lock's owner ({pid, host, started}), {} if the lock cannot be read, None if none.
    RunFolderError if `run.lock` is a folder or anything else but a file (no run wrote it)."""
    path = run_dir / LOCK
    if (path.exists() or path.is_symlink()) and (path.is_symlink() or not path.is_file()):
        raise RunFolderError(
            f"output.dir={run_dir}: {path} is not a lock file a run wrote (a folder, a link or a "
            "special file); move it away, or pick another output.dir"
        )
    return _read_json(path)


def _is_stale(run_dir: Path, owner: dict[str, Any]) -> bool:
    """Whether the lock's process is gone: on this host and no longer running; an unreadable lock
    older than a few seconds (its writer died before filling it in)."""
    if not owner:
        try:
            age = time.time() - (run_dir / LOCK).stat().st_mtime
        except OSError:
            return True
        return age > _UNREADABLE_LOCK_GRACE_S
    pid = owner.get("pid")
    here = owner.get("host") == socket.gethostname()
    return here and isinstance(pid, int) and not _pid_alive(pid)


def _in_use_error(run_dir: Path, owner: dict[str, Any]) -> RunFolderError:
    who = "a process that is starting"
    if owner:
        who = f"pid {owner.get('pid')} on host {owner.get('host')}, since {owner.get('started')}"
    return RunFolderError(
        f"output.dir={run_dir} is in use by another run ({who}; "
        f"{run_dir / LOCK}); wait for it to end or pick another output.dir. If "
        f"that run is gone, remove {run_dir / LOCK}"
    )


def check_not_locked(run_dir: Path) -> None:
    """Raise RunFolderError if a live run holds the folder's lock (a stale lock passes)."""
    owner = read_lock(run_dir)
    if owner is not None and not _is_stale(run_dir, owner):
        raise _in_use_error(run_dir, owner)


def _newer_good(run_dir: Path, step: int) -> list[str]:
    """Names of the checkpoints in `run_dir` after `step` that verify."""
    return [
        folder.name
        for folder in checkpoint_folders(run_dir)
        if checkpoint_step(folder) > step and verify_checkpoint(folder) is None
    ]


def check_folder_usable(run_dir: Path, resume_from: str | None, overwrite: bool) -> None:
    """Refuse (RunFolderError) a run folder that is a file or in use, and --overwrite with --resume auto."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunFolderError(f"output.dir={run_dir} is a file, not a folder; pick a folder")
    check_not_locked(run_dir)
    if overwrite and resume_from == "auto":
        raise RunFolderError(
            "--overwrite starts the run in output.dir over and --resume auto continues it; give one of them"
        )


def check_run_folder(
    run_dir: Path, resume_from: str | None, resume: Path | None, resume_state: dict[str, Any] | None, overwrite: bool
) -> None:
    """Refuse to start where the run would mix with, or remove, another run (RunFolderError), once
    `check_folder_usable` has passed. `resume`: the verified checkpoint to resume from and its state
    (None: a fresh start)."""
    if overwrite and resume is not None and resume.resolve().is_relative_to(run_dir.resolve()):
        raise RunFolderError(
            f"--overwrite would remove {resume}, the checkpoint to resume from; resume into another output.dir instead"
        )
    found = run_files(run_dir)
    if not found or overwrite or resume_from == "auto":
        return
    listing = ", ".join(found)
    if resume is None or resume_state is None:
        raise RunFolderError(
            f"output.dir={run_dir} holds another run ({listing}); continue it "
            "with --resume auto, start it over with --overwrite (removes only the "
            "files a run writes), or pick another output.dir"
        )
    folder_run, checkpoint_run = read_run_id(run_dir), resume_state.get("run_id")
    if folder_run is None or folder_run != checkpoint_run:
        raise RunFolderError(
            f"output.dir={run_dir} holds another run ({listing}; run id "
            f"{folder_run}) than the checkpoint {resume} (run id "
            f"{checkpoint_run}); resume into that checkpoint's own folder or a "
            "new output.dir"
        )
    newer = _newer_good(run_dir, resume_state["step"])
    if newer:
        raise RunFolderError(
            f"output.dir={run_dir} holds newer checkpoints of this run "
            f"({', '.join(newer)}) than {resume.name}; resuming there would "
            "replace them: use --resume auto, or resume into a new output.dir"
        )


def _create_folder(run_dir: Path) -> list[Path]:
    """Create `run_dir` (and missing parents); return the folders created, deepest first."""
    missing, path = [], run_dir
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        _remove_empty(missing)
        raise RunFolderError(
            f"output.dir={run_dir}: cannot create the folder ({err.strerror}); pick a folder you can write to"
        ) from None
    return missing


def _remove_empty(folders: list[Path]) -> None:
    """rmdir `folders` in order, stopping at the first that is not empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def _probe_writable(run_dir: Path) -> None:
    """Write, fsync and remove a 1 MiB file in `run_dir` (RunFolderError if that fails)."""
    probe = run_dir / f".write-probe-{os.getpid()}"
    try:
        with probe.open("wb") as handle:
            handle.write(b"\0" * _PROBE_BYTES)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as err:
        raise RunFolderError(
            f"output.dir={run_dir}: cannot write there ({err.strerror}); free space or pick a folder you can write to"
        ) from None
    finally:
        probe.unlink(missing_ok=True)


def _take_over_stale(run_dir: Path, owner: dict[str, Any]) -> None:
    """Move a stale lock aside (a rename: two processes cannot both move it) and remove it; if what
    was moved is no longer the lock judged stale (another process took over first), put it back."""
    aside = run_dir / f"{LOCK}.stale.{os.getpid()}"
    try:
        os.rename(run_dir / LOCK, aside)
    except FileNotFoundError:
        return
    if _read_json(aside) != owner:
        try:
            os.link(aside, run_dir / LOCK)
        except FileExistsError:
            pass
    else:
        who = f"pid {owner.get('pid')}, started {owner.get('started')}" if owner else "unreadable"
        print(
            f"warning: took over the stale lock {run_dir / LOCK} ({who}: that process no longer runs)", file=sys.stderr
        )
    aside.unlink(missing_ok=True)


def acquire_lock(run_dir: Path) -> dict[str, Any]:
    """Create `run_dir/run.lock` exclusively (taking over a stale one); return what it holds.
    RunFolderError if a live run holds it."""
    mine = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    for _ in range(5):
        try:
            handle = os.open(run_dir / LOCK, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            owner = read_lock(run_dir)
            if owner is not None and not _is_stale(run_dir, owner):
                raise _in_use_error(run_dir, owner) from None
            if owner is not None:
                _take_over_stale(run_dir, owner)
            continue
        with os.fdopen(handle, "w") as out:
            out.write(json.dumps(mine))
            out.flush()
            os.fsync(out.fileno())
        return mine
    raise RunFolderError(
        f"output.dir={run_dir}: could not take {LOCK}, other processes keep taking it; is another run starting there?"
    )


def release_lock(run_dir: Path, mine: dict[str, Any]) -> None:
    """Remove the lock if it is still this process's."""
    if _read_json(run_dir / LOCK) == mine:
        (run_dir / LOCK).unlink(missing_ok=True)


@contextmanager
def hold_run_folder(run_dir: Path, info: DistInfo) -> Iterator[None]:
    """For the run's lifetime (collective; rank 0 acts, a failure is raised on every rank): create
    the folder, check that it takes a write, hold its lock. On the way out the lock goes, and so do
    the folders created here if the run left nothing in them."""
    created: list[Path] = []
    mine, error = None, None
    if info.is_main:
        try:
            created = _create_folder(run_dir)
            _probe_writable(run_dir)
            mine = acquire_lock(run_dir)
        except RunFolderError as err:
            _remove_empty(created)
            error = err
    raise_on_any_rank(info, error)
    try:
        yield
    finally:
        if mine is not None:
            release_lock(run_dir, mine)
            _remove_empty(created)


def _without_resume(recipe: dict[str, Any]) -> dict[str, Any]:
    output = {k: v for k, v in recipe.get("output", {}).items() if k != "resume_from"}
    return {**recipe, "output": output}


def record_run(run_dir: Path, run_id: str, resolved: str, start_step: int) -> None:
    """Write what a starting run leaves in its folder (rank 0), once its model and data are ready
    (with --overwrite, after `set_aside` has moved the previous run's files away): `run.json` (if
    missing) and the resolved recipe: `recipe.resolved.yaml` the first time, never replaced; a later
    start whose resolved recipe differs (besides output.resume_from) writes
    `recipe.resolved.step_N.yaml` beside it, N the step it starts from."""
    if not (run_dir / RUN_FILE).exists():
        (run_dir / RUN_FILE).write_text(json.dumps({"run_id": run_id}, indent=2) + "\n")
    first = run_dir / RECIPE_FILE
    if not first.exists():
        first.write_text(resolved)
        return
    try:
        stored = yaml.safe_load(first.read_text())
    except yaml.YAMLError:
        stored = None
    given = yaml.safe_load(resolved)
    if not isinstance(stored, dict) or _without_resume(stored) != _without_resume(given):
        (run_dir / f"recipe.resolved.step_{start_step:08d}.yaml").write_text(resolved)
