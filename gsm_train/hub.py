"""Publish a validated adapter export to the Hugging Face Hub as one commit.

`publish_export(export_dir, repo_id)` checks everything it can locally first (the export, the repo
id, that a token exists) and only then talks to the Hub: it creates the model repo if needed (and
the branch, for a `revision` other than `main`) and uploads the export folder in a single commit.
Every failure is a `PublishError` whose text never contains the token.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from huggingface_hub import HfApi, get_token
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

from gsm_train.export import ExportError, validate_export

DEFAULT_COMMIT_MESSAGE = "Upload GSM adapter (gsm-train)"
_REPO_PART = re.compile(r"[A-Za-z0-9._-]+")
_MAX_PART = 96
_REPO_ID_FIX = (
    "give ORG/NAME or NAME, each part made of letters, digits, '-', '_' and '.' (no '--' or '..', "
    f"not starting or ending with '-' or '.', at most {_MAX_PART} characters), e.g. my-org/gsm-adapter"
)
_LOGIN_FIX = "run `hf auth login`, set the HF_TOKEN environment variable, or pass a token"
_HTTP_FIXES = {
    401: "the token was refused; log in again with `hf auth login` or set HF_TOKEN to a valid token",
    403: "use a token with write access to the repo's namespace (a 'write' or fine-grained token)",
    404: "check the repo id and revision, and that the token can see the repo",
}


class PublishError(RuntimeError):
    """Publishing failed; the message names the problem and the fix, and never holds the token."""


def _repo_id_problem(repo_id: str) -> str | None:
    """Why `repo_id` is not a valid Hub model id, or None when it is."""
    parts = repo_id.split("/")
    if len(parts) > 2:
        return "has more than one '/'"
    for part in parts:
        if not part:
            return "has an empty part"
        if not _REPO_PART.fullmatch(part):
            return f"part {part!r} has characters the Hub does not allow"
        if "--" in part or ".." in part:
            return f"part {part!r} contains '--' or '..'"
        if part[0] in "-." or part[-1] in "-.":
            return f"part {part!r} starts or ends with '-' or '.'"
        if len(part) > _MAX_PART:
            return f"part {part[:12]!r}... is longer than {_MAX_PART} characters"
    return None


def _resolve_token(token: str | None) -> str:
    """The token argument, else HF_TOKEN, else the stored `hf auth login` token."""
    resolved = token or os.environ.get("HF_TOKEN", "").strip() or get_token()
    if not resolved:
        raise PublishError(f"no Hugging Face token found. Fix: {_LOGIN_FIX}.")
    return resolved


def publish_export(
    export_dir: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    commit_message: str | None = None,
) -> str:
    """Upload a validated export folder to model repo `repo_id` in one commit; return the commit URL."""
    export_dir = Path(export_dir)
    try:
        validate_export(export_dir)
    except ExportError as err:
        raise PublishError(f"refusing to publish an export that does not validate: {err}") from err
    problem = _repo_id_problem(repo_id)
    if problem:
        raise PublishError(f"repo id {repo_id!r} {problem}. Fix: {_REPO_ID_FIX}.")
    token = _resolve_token(token)

    api = HfApi(endpoint=endpoint, token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        info = api.upload_folder(
            folder_path=export_dir,
            repo_id=repo_id,
            repo_type="model",
            revision=revision,
            commit_message=commit_message or DEFAULT_COMMIT_MESSAGE,
        )
    except OfflineModeIsEnabled:
        raise PublishError("the Hub is in offline mode (HF_HUB_OFFLINE is set). Fix: unset HF_HUB_OFFLINE.") from None
    except HfHubHTTPError as err:
        status = err.response.status_code
        detail = err.server_message or str(err).splitlines()[0]
        fix = _HTTP_FIXES.get(status, "check the endpoint, then retry later")
        message = f"publishing {export_dir} to {repo_id} failed: the Hub answered HTTP {status}: {detail}. Fix: {fix}."
        raise PublishError(message.replace(token, "<token>")) from None
    except ValueError as err:  # the Hub rejected the model card's metadata (README.md front matter)
        detail = " ".join(str(err).split()).rstrip(".")
        message = f"publishing {export_dir} to {repo_id} failed: {detail}. Fix: correct README.md's YAML header."
        raise PublishError(message.replace(token, "<token>")) from None
    return str(info.commit_url)
