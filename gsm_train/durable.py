"""Writes that survive a crash or a power cut: fsync'ed files and folders, atomic replacement (as far as
the filesystem honours fsync: some network filesystems do not)."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's entries to the disk (a folder: the names in it)."""
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def write_durable(path: Path, text: str) -> None:
    """Replace `path` with `text` atomically and durably: written beside, fsync'ed, renamed, and the
    folder fsync'ed (a crash leaves the old content or the new, never a mix)."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)
