"""An export named by a local folder or by a Hub repo id: `resolve_export` gives a local folder,
downloading a repo's export files (only those: the allow-list of adapter_format.EXPORT_FILES) with
`snapshot_download` into the Hub cache. `HF_ENDPOINT`, `HF_TOKEN` and `HF_HUB_OFFLINE` apply as for
any Hugging Face download."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from gsm_train.export.adapter_format import EXPORT_FILES, ExportError
from gsm_train.models.hub_ids import repo_id_problem


def resolve_export(adapter: str | Path, revision: str | None = None) -> Path:
    """The local folder of an export: `adapter` itself when it is a folder, else the snapshot of Hub
    repo `adapter` at `revision` (a branch, tag or commit; default main)."""
    folder = Path(adapter).expanduser()
    if folder.is_dir():
        if revision is not None:
            raise ExportError(
                f"{adapter}: a local folder, but a revision ({revision!r}) was given; a revision "
                "pins a Hub repo: give ORG/NAME, or drop the revision"
            )
        return folder
    repo_id = str(adapter)
    if repo_id_problem(repo_id) is not None or folder.is_absolute() or repo_id.startswith("."):
        raise ExportError(
            f"{adapter}: not a GSM export (no such folder, and not a Hub repo id); give an export "
            "folder (OUTPUT_DIR/export) or a Hub repo id ORG/NAME"
        )
    where = f"Hub repo {repo_id}" + (f" at revision {revision}" if revision else "")
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(EXPORT_FILES)))
    except RevisionNotFoundError:
        raise ExportError(f"{where}: no such revision; give a branch, tag or commit of the repo") from None
    except RepositoryNotFoundError:
        raise ExportError(
            f"{repo_id}: no such folder here and no such Hub repo (or it is private: log in with "
            "`hf auth login` or set HF_TOKEN); check the id"
        ) from None
    except (LocalEntryNotFoundError, EntryNotFoundError) as err:
        cause = err.__cause__ or err
        raise ExportError(
            f"{where}: could not be fetched ({type(cause).__name__}: {str(cause).splitlines()[0]}) "
            "and is not in the local Hub cache; check the network, HF_ENDPOINT and HF_HUB_OFFLINE"
        ) from None
    except HfHubHTTPError as err:
        raise ExportError(
            f"{where}: the Hub answered HTTP {err.response.status_code}; check the id, the "
            "token (HF_TOKEN) and HF_ENDPOINT, or retry later"
        ) from None
