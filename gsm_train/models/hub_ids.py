"""Hub ids: their syntax, the Hub id and license of a base model, and which base an export loads.

A base is named in a recipe as a built-in (`tiny-<family>`, `smollm2-135m`), a local folder or a Hub
id. Exports record the name as given plus, where it can be known, the base's Hub id (the id a model
card's `base_model` must hold) and license.
"""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub import ModelCard

from gsm_train.models.model_names import SMOLLM2_NAME, TINY_PREFIX

# built-in names with a Hub original: (Hub id, license). smollm2-135m is the Q4_1 GGUF of this
# model, de-quantized (model_zoo): its weights differ from the Hub's, so loaders load the built-in
# itself.
BUILTIN_BASES = {SMOLLM2_NAME: ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0")}
_REPO_PART = re.compile(r"[A-Za-z0-9._-]+")
_MAX_PART = 96
REPO_ID_FIX = (
    "give ORG/NAME or NAME, each part made of letters, digits, '-', '_' and '.' (no '--' or '..', "
    f"not starting or ending with '-' or '.', at most {_MAX_PART} characters), "
    "e.g. my-org/gsm-adapter"
)
# a folder of the Hub cache: .../models--ORG--NAME/snapshots/COMMIT
_CACHE_SNAPSHOT = re.compile(r"models--(?P<repo>.+)/snapshots/(?P<commit>[0-9a-f]{40})")


def repo_id_problem(repo_id: str) -> str | None:
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


def is_builtin(name: str) -> bool:
    """Whether gsm-train builds or fetches this base itself (no Hub id needed to load it)."""
    return name.startswith(TINY_PREFIX) or name == SMOLLM2_NAME


def base_identity(name_or_path: str, revision: str | None) -> dict[str, str | None]:
    """`{"hub_id", "revision", "license"}` of a base as a recipe names it, where they can be known:
    a built-in's original, a folder of the Hub cache (its repo and commit), a Hub id itself; None
    for a tiny model or a plain local folder (publishing then asks for --base-model-id)."""
    if name_or_path in BUILTIN_BASES:
        hub_id, license_id = BUILTIN_BASES[name_or_path]
        return {"hub_id": hub_id, "revision": None, "license": license_id}
    if is_builtin(name_or_path):
        return {"hub_id": None, "revision": None, "license": None}
    folder = Path(name_or_path).expanduser()
    if folder.exists():
        cached = _CACHE_SNAPSHOT.search(folder.resolve().as_posix())
        hub_id = cached["repo"].replace("--", "/", 1) if cached else None
        return {
            "hub_id": hub_id,
            "revision": cached["commit"] if cached else None,
            "license": _card_license(folder),
        }
    if repo_id_problem(name_or_path) is None:
        return {"hub_id": name_or_path, "revision": revision, "license": None}
    return {"hub_id": None, "revision": None, "license": None}


def _card_license(folder: Path) -> str | None:
    """The license in a model folder's README.md front matter, if it has one."""
    card = folder / "README.md"
    if not card.is_file():
        return None
    try:
        license_id = ModelCard.load(card).data.license
    except (ValueError, OSError, UnicodeDecodeError):
        return None
    return license_id if isinstance(license_id, str) else None


def base_to_load(base: dict) -> tuple[str, str | None]:
    """(name or path, revision) to load the base an export's `base_model` block describes: the name
    it was trained with when this machine can load it the same way (a built-in, an existing folder),
    else its Hub id at its recorded revision, else the name as a Hub id."""
    name = base["name_or_path"]
    if is_builtin(name) or Path(name).expanduser().is_dir():
        return name, None
    if base.get("hub_id"):
        return base["hub_id"], base.get("revision")
    return name, base.get("revision")
