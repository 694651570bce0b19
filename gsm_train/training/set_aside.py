"""`--overwrite` without losing the previous run before the new one is good.

Once a run started with --overwrite has loaded its model and data, the previous run's files, and only
those (`run_folder.RUN_OUTPUTS` but `export/`, the recipes written beside the first, and in
`checkpoints/` only the checkpoints, their temporary folders and `latest`), are moved (renamed, so
nothing is copied) into `RUN/.overwritten/` and `RUN/checkpoints/.overwritten/`. Each stays within
its own folder, so a `checkpoints/` on another filesystem works as well. Files the user put there stay
where they are. The previous export stays in place until the new run's export replaces it
(`export_folder.write_export_folder`, which keeps an edited model card).

The files set aside are deleted once the new run has written its first checkpoint (or has ended well),
and put back, after the new run's own files are removed, when it fails before that (the NaN guard at
step 1, an error, Ctrl-C). A run killed outright (SIGKILL, a power cut) meanwhile leaves `.overwritten/`
behind; the next start in that folder is refused, naming it and what to do (`check_nothing_aside`).

Only rank 0 calls these.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from gsm_train.training.checkpoint import LATEST, STEP_PREFIX
from gsm_train.training.run_folder import RECIPES_BESIDE, RUN_OUTPUTS, RunFolderError

ASIDE = ".overwritten"
CHECKPOINTS = "checkpoints"
# left in place by --overwrite: replaced atomically by the new run's export at its end
_KEPT_IN_PLACE = ("export",)


def _checkpoint_entries(folder: Path) -> list[Path]:
    """What a run writes into `checkpoints/`: `step_N/`, `step_N.tmp/` and `latest`."""
    return sorted(p for p in folder.iterdir() if p.name == LATEST or p.name.startswith(STEP_PREFIX))


def _run_entries(run_dir: Path) -> dict[Path, list[Path]]:
    """What a run wrote into `run_dir` that --overwrite sets aside, by the folder it lies in (the run
    folder, and `checkpoints/` when it is a folder)."""
    top = [
        run_dir / name
        for name in RUN_OUTPUTS
        if name not in _KEPT_IN_PLACE and name != CHECKPOINTS and os.path.lexists(run_dir / name)
    ]
    top += sorted(run_dir.glob(RECIPES_BESIDE))
    entries = {run_dir: top}
    checkpoints = run_dir / CHECKPOINTS
    if checkpoints.is_dir():
        entries[checkpoints] = _checkpoint_entries(checkpoints)
    elif os.path.lexists(checkpoints):  # a file or a broken link where the folder belongs
        top.append(checkpoints)
    return entries


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


class SetAside:
    """The previous run's files, moved aside by `move` until the new run `discard`s them (it has a
    good checkpoint) or `restore`s them (it failed before one)."""

    def __init__(self, run_dir: Path, moved: dict[Path, list[str]]):
        self.run_dir = run_dir
        self.moved = moved  # folder -> names moved into folder/ASIDE

    @classmethod
    def move(cls, run_dir: Path) -> SetAside:
        """Move what the previous run wrote into the `ASIDE` folder of the folder it lies in."""
        moved: dict[Path, list[str]] = {}
        for folder, paths in _run_entries(run_dir).items():
            if not paths:
                continue
            (folder / ASIDE).mkdir()
            for path in paths:
                os.rename(path, folder / ASIDE / path.name)
            moved[folder] = [path.name for path in paths]
        return cls(run_dir, moved)

    def discard(self) -> None:
        """Delete what was set aside (the new run has a good checkpoint). Idempotent."""
        for folder in self.moved:
            shutil.rmtree(folder / ASIDE, ignore_errors=True)
        self.moved = {}

    def restore(self) -> None:
        """Remove what the new run wrote (the same kinds of files that were set aside) and put the
        previous run's files back where they were."""
        if not self.moved:
            return
        for paths in _run_entries(self.run_dir).values():
            for path in paths:
                _remove(path)
        for folder, names in self.moved.items():
            for name in names:
                os.rename(folder / ASIDE / name, folder / name)
            (folder / ASIDE).rmdir()
        self.moved = {}
        print(
            f"the run failed before its first checkpoint: the previous run's files in {self.run_dir} are back",
            file=sys.stderr,
        )


def check_nothing_aside(run_dir: Path) -> None:
    """Refuse (RunFolderError) a folder where a run started with --overwrite was killed while the
    previous run's files were set aside."""
    for aside in (run_dir / ASIDE, run_dir / CHECKPOINTS / ASIDE):
        if os.path.lexists(aside):
            raise RunFolderError(
                f"output.dir={run_dir}: {aside} holds the files of the run that an --overwrite run set aside; "
                f"that run was killed before it finished. If {run_dir / CHECKPOINTS} holds a checkpoint you "
                f"want, remove {aside}; else move what it holds back into {aside.parent} (replacing the files "
                "of the killed run) and remove it"
            )
