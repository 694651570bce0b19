"""Where an export is written, without ever deleting what gsm-train did not write.

`export_destination` resolves the folder (`..` and symlinks first) and accepts it only when it is
new, empty, or a previous gsm-train export holding nothing but export files. `write_export_folder`
writes the new export into a temporary folder beside it, syncs it to disk, moves the previous export
aside, renames the new one into place, and only then deletes the previous one's files (by name). A
model card (README.md) the user edited in the previous export is the user's (`model_card.card_is_users`,
as publishing judges it): the new export keeps it instead of its own, with a note on stderr.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

from gsm_train.durable import fsync_path
from gsm_train.export.adapter_format import ARGS_FILE, CARD_FILE, CONFIG_FILE, EXPORT_FILES, FORMAT, ExportError
from gsm_train.export.model_card import card_is_users

_REFUSED_FIX = "gsm-train replaces only its own exports: give a new or empty folder, or move those files away first"


def _is_export_config(path: Path) -> bool:
    """Whether `path` is a gsm_config.json that gsm-train wrote (any format version, even if damaged
    elsewhere)."""
    config = _json_object(path)
    return config is not None and config.get("format") == FORMAT


def export_destination(out_dir: str | Path) -> Path:
    """`out_dir` resolved, when an export may be written there: it does not exist, is empty, or is a
    previous export (a gsm_config.json of this format and only export files, no links). Else
    ExportError."""
    given = Path(out_dir).expanduser()
    path = given.resolve()
    shown = f"{given}" if str(given) == str(path) else f"{given} (that is {path})"
    if path.parent == path:
        raise ExportError(f"{shown}: the root folder; give a new folder for the export")
    if path.exists() and not path.is_dir():
        raise ExportError(f"{shown}: exists and is not a folder; {_REFUSED_FIX}")
    if not path.is_dir():
        return path
    entries = sorted(path.iterdir())
    if not entries:
        return path
    foreign = [e.name for e in entries if e.name not in EXPORT_FILES or e.is_symlink() or not e.is_file()]
    if foreign or not _is_export_config(path / CONFIG_FILE):
        held = foreign or [e.name for e in entries]
        raise ExportError(
            f"{shown}: not empty and not a previous gsm-train export (it holds "
            f"{', '.join(held[:5])}{', ...' if len(held) > 5 else ''}); {_REFUSED_FIX}"
        )
    return path


def check_writable(out_dir: str | Path) -> None:
    """ExportError unless this process may create files in the folder `out_dir` goes in (where the
    export is built before it moves into place): checked before a model loads."""
    path = Path(out_dir).expanduser().resolve()
    parent = next((p for p in path.parents if p.exists()), path.parent)
    if not parent.is_dir():
        raise ExportError(f"{out_dir}: {parent} is a file, not a folder; give a folder for the export")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(
            f"{out_dir}: cannot write in {parent} (no permission or a read-only file system); "
            "give a folder you can write to"
        )


def _json_object(path: Path) -> dict | None:
    """The JSON object in `path`; {} if there is no such file; None if it cannot be read as one."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):  # RecursionError: nested too deeply
        return None
    return value if isinstance(value, dict) else None


def _users_card(previous: Path) -> bytes | None:
    """The README.md of the previous export in `previous` when it is the user's (edited after
    gsm-train wrote it; kept too when the export's JSON files are damaged and so cannot tell), else
    None."""
    card = previous / CARD_FILE
    if not card.is_file():
        return None
    config, args = _json_object(previous / CONFIG_FILE), _json_object(previous / ARGS_FILE)
    if config is None or args is None or card_is_users(card, config, args):
        return card.read_bytes()
    return None


def write_export_folder(out_dir: str | Path, write: Callable[[Path], None]) -> Path:
    """Write an export with `write(folder)` and put it at `out_dir` (checked by
    `export_destination`), replacing a previous export only once the new one is complete on disk.
    Returns the resolved folder.

    A crash leaves either the previous export in place, or both exports beside it: the new one in
    `.NAME.tmp-*` or at NAME, the previous one in `.NAME.old-*`."""
    destination = export_destination(out_dir)
    destination.parent.mkdir(parents=True, exist_ok=True)
    users_card = _users_card(destination) if destination.is_dir() else None
    tmp = Path(tempfile.mkdtemp(prefix=f".{destination.name}.tmp-", dir=destination.parent))
    try:
        write(tmp)
        if users_card is not None:
            (tmp / CARD_FILE).write_bytes(users_card)
            print(
                f"note: kept {destination / CARD_FILE}, edited after gsm-train wrote it; remove it before "
                "exporting to have the card written anew",
                file=sys.stderr,
            )
        for file in tmp.iterdir():
            fsync_path(file)
        fsync_path(tmp)
    except BaseException:
        for file in tmp.iterdir():  # only what this call wrote into its own temporary folder
            file.unlink()
        tmp.rmdir()
        raise
    previous = None
    if destination.is_dir() and any(destination.iterdir()):
        export_destination(destination)  # still only a previous export
        previous = destination.with_name(f".{destination.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(destination, previous)
    try:
        os.replace(tmp, destination)  # onto nothing, or onto an empty folder
    except OSError:
        if previous is not None:
            os.rename(previous, destination)
        raise
    fsync_path(destination.parent)
    if previous is not None:
        for name in EXPORT_FILES:
            (previous / name).unlink(missing_ok=True)
        try:
            previous.rmdir()
        except OSError:  # something not written by gsm-train appeared there meanwhile: leave it
            pass
    return destination
