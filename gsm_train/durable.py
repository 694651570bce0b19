"""Writes that survive a crash or a power cut: fsync'ed files and folders, atomic replacement (as far as
the filesystem honours fsync: some network filesystems do not)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's entries to the disk (a folder: the names in it)."""
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def replace_atomically(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Replace `path` with what `write(handle)` writes: into a file beside it (named by this process, so
    that processes writing the same path do not meet), fsync'ed, then renamed over `path` (a crash
    leaves the old content or the new, never a mix)."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with tmp.open("wb") as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_durable(path: Path, text: str) -> None:
    """Replace `path` with `text` atomically and durably (`replace_atomically`, then the folder
    fsync'ed, so the rename itself survives a power cut)."""
    replace_atomically(path, lambda handle: handle.write(text.encode()))
    fsync_path(path.parent)
