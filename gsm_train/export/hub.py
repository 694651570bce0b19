"""Publish a validated adapter export to the Hugging Face Hub as one commit.

`publish_export(export_dir, repo_id)` checks everything it can locally first (the export, the repo
id, the base's Hub id, that a token exists, that no export file is a link) and only then talks to
the Hub: it creates the model repo if needed (and the branch, for a `revision` other than `main`)
and commits the export's own files (the allow-list adapter_format.EXPORT_FILES; nothing else in the
folder) in a single commit. The model card is written again with the repo id in its loading snippet
unless it was edited after the export. Every failure is a `PublishError` whose text never contains
the token.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

from huggingface_hub import CommitOperationAdd, HfApi, constants, get_token
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

from gsm_train.errors import GSMError
from gsm_train.export.adapter_format import (
    ARGS_FILE,
    CARD_FILE,
    CONFIG_FILE,
    EXPORT_FILES,
    Export,
    ExportError,
    read_export,
)
from gsm_train.export.model_card import build_card, card_is_users
from gsm_train.export.published_bytes import redact_local_paths, redact_path
from gsm_train.models.hub_ids import REPO_ID_FIX, is_builtin, repo_id_problem

DEFAULT_COMMIT_MESSAGE = "Upload GSM adapter (gsm-train)"
_LOGIN_FIX = "run `hf auth login`, set the HF_TOKEN environment variable, or pass a token"
_HTTP_FIXES = {
    401: "the token was refused; log in again with `hf auth login` or set HF_TOKEN to a valid token",
    403: "use a token with write access to the repo's namespace (a 'write' or fine-grained token)",
    404: "check the repo id and revision, and that the token can see the repo",
}


class PublishError(GSMError):
    """Publishing failed; the message names the problem and the fix, and never holds the token."""


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP client's connection and timeout errors (huggingface_hub 1.x uses httpx, 2.x
    httpx2)."""
    found = []
    for name in ("httpx2", "httpx"):
        try:
            found.append(importlib.import_module(name).TransportError)
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def _resolve_token(token: str | None) -> str:
    """The token argument, else HF_TOKEN, else the stored `hf auth login` token."""
    resolved = token or os.environ.get("HF_TOKEN", "").strip() or get_token()
    if not resolved:
        raise PublishError(f"no Hugging Face token found. Fix: {_LOGIN_FIX}.")
    return resolved


def _with_base_id(config: dict[str, Any], base_model_id: str | None, folder: Path) -> dict[str, Any]:
    """`config` with the base's Hub id set from `base_model_id`; refuses a base that is neither a
    built-in nor known by a Hub id (the card's base_model must be one)."""
    base = config["base_model"]
    if base_model_id is not None:
        problem = repo_id_problem(base_model_id)
        if problem:
            raise PublishError(f"--base-model-id {base_model_id!r} {problem}. Fix: {REPO_ID_FIX}.")
        return {**config, "base_model": {**base, "hub_id": base_model_id}}
    if not base.get("hub_id") and not is_builtin(base["name_or_path"]):
        raise PublishError(
            f"{folder}: its base was loaded from {base['name_or_path']!r}, whose Hub id is not "
            "known, and a model card's base_model must be one. Fix: pass --base-model-id ORG/NAME, "
            "the Hub "
            "repo that base came from."
        )
    return config


def _export_files(folder: Path) -> list[Path]:
    """The export's own files present in `folder` (never anything else it holds); refuses links."""
    files = [folder / name for name in EXPORT_FILES if (folder / name).is_file() or (folder / name).is_symlink()]
    links = [file.name for file in files if file.is_symlink()]
    if links:
        raise PublishError(
            f"{folder}: {', '.join(links)} {'is a link' if len(links) == 1 else 'are links'}; "
            "publish "
            "uploads only the export's own regular files. Fix: replace the link with the file."
        )
    return files


def _operations(export: Export, published: dict[str, Any], repo_id: str) -> list[CommitOperationAdd]:
    """One upload per export file. gsm_config.json carries the base's Hub id when publishing set it,
    and no local path (a base loaded from a folder is named `<local>/NAME`: its Hub id is what a
    downloader loads); training_args.json names no local path either (an export from before they
    were redacted is redacted here); README.md is written again (with the repo id in its snippet)
    unless it was edited after a format-6 export wrote it."""
    folder = export.folder
    contents: dict[str, str | bytes] = {file.name: str(file) for file in _export_files(folder)}
    stored = json.loads((folder / CONFIG_FILE).read_text())
    base = {**stored["base_model"], "name_or_path": redact_path(stored["base_model"]["name_or_path"])}
    if published is not export.config:
        base["hub_id"] = published["base_model"]["hub_id"]
    if base != stored["base_model"]:
        contents[CONFIG_FILE] = json.dumps({**stored, "base_model": base}, indent=2, sort_keys=True).encode()
    args = export.training_args
    shown = redact_local_paths(args)
    if shown != args:
        contents[ARGS_FILE] = json.dumps(shown, indent=2, sort_keys=True).encode()
    if not card_is_users(folder / CARD_FILE, stored, args):
        contents[CARD_FILE] = build_card(published, shown, repo_id).encode()
    return [CommitOperationAdd(path_in_repo=name, path_or_fileobj=content) for name, content in contents.items()]


def publish_export(
    export_dir: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    commit_message: str | None = None,
    base_model_id: str | None = None,
) -> str:
    """Upload a validated export folder to model repo `repo_id` in one commit; return the commit
    URL. `base_model_id`: the base's Hub id, for an export whose base was a local folder."""
    folder = Path(export_dir)
    try:
        export = read_export(folder)
    except ExportError as err:
        raise PublishError(f"refusing to publish an export that does not validate: {err}") from err
    problem = repo_id_problem(repo_id)
    if problem:
        raise PublishError(f"repo id {repo_id!r} {problem}. Fix: {REPO_ID_FIX}.")
    published = _with_base_id(export.config, base_model_id, folder)
    operations = _operations(export, published, repo_id)
    token = _resolve_token(token)
    where = endpoint or constants.ENDPOINT

    api = HfApi(endpoint=endpoint, token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        info = api.create_commit(
            repo_id,
            operations,
            commit_message=commit_message or DEFAULT_COMMIT_MESSAGE,
            repo_type="model",
            revision=revision,
        )
    except OfflineModeIsEnabled:
        raise PublishError("the Hub is in offline mode (HF_HUB_OFFLINE is set). Fix: unset HF_HUB_OFFLINE.") from None
    except HfHubHTTPError as err:
        status = err.response.status_code
        detail = err.server_message or str(err).splitlines()[0]
        fix = _HTTP_FIXES.get(status, "check the endpoint, then retry later")
        message = f"publishing {folder} to {repo_id} failed: the Hub answered HTTP {status}: {detail}. Fix: {fix}."
        raise PublishError(message.replace(token, "<token>")) from None
    except _transport_errors() as err:
        message = (
            f"publishing {folder} to {repo_id} failed: could not reach the Hub at {where} "
            f"({type(err).__name__}: {err}). Fix: check --endpoint / HF_ENDPOINT and the network, "
            "then retry."
        )
        raise PublishError(message.replace(token, "<token>")) from None
    except ValueError as err:  # the Hub rejected the model card's metadata (README.md front matter)
        detail = " ".join(str(err).split()).rstrip(".")
        message = f"publishing {folder} to {repo_id} failed: {detail}. Fix: correct README.md's YAML header."
        raise PublishError(message.replace(token, "<token>")) from None
    return str(info.commit_url)
