"""What a benchmark result says ran: the code digest names the files (`benchmarks.common.code_digest`), and a
commit's digest (`commit_digest`) matches a checkout of it, so a result from a copied tree whose git metadata is
stale can still be matched to the commit it ran."""

from __future__ import annotations

import subprocess
from pathlib import Path

from benchmarks.common import CODE_PATHS, code_digest, commit_digest

FILES = {
    "gsm_train/model.py": "WIDTH = 8\n",
    "gsm_train/kernels/step.py": "STEPS = 2\n",
    "recipes/joint.yaml": "stage: joint\n",
    "benchmarks/generate.py": "ROWS = ()\n",
}


def _tree(root: Path) -> Path:
    for name, text in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_digest_changes_with_the_codes_bytes_and_names_only(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    first = code_digest(root, CODE_PATHS)
    assert len(first) == 12 and code_digest(root, CODE_PATHS) == first
    (root / "README.md").write_text("not code\n")  # outside the code's paths
    (root / "gsm_train/__pycache__").mkdir()
    (root / "gsm_train/__pycache__/model.cpython-312.pyc").write_bytes(b"\x00")
    (root / "benchmarks/results").mkdir()
    (root / "benchmarks/results/run.json").write_text("{}")  # benchmarks/*.py names the scripts only
    assert code_digest(root, CODE_PATHS) == first
    (root / "gsm_train/model.py").write_text("WIDTH = 9\n")
    changed = code_digest(root, CODE_PATHS)
    assert changed != first
    (root / "gsm_train/model.py").rename(root / "gsm_train/models.py")
    assert code_digest(root, CODE_PATHS) not in (first, changed)


def _commit(root: Path) -> str:
    def git(*args: str) -> str:
        command = ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args]
        return subprocess.run(command, cwd=root, check=True, capture_output=True, text=True).stdout.strip()

    if not (root / ".git").exists():
        git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "a commit")
    return git("rev-parse", "HEAD")


def test_a_commits_digest_is_that_of_its_checkout(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    first = _commit(root)
    at_first = code_digest(root, CODE_PATHS)
    (root / "recipes/joint.yaml").write_text("stage: joint\nsteps: 3\n")  # changed, not committed
    assert code_digest(root, CODE_PATHS) != at_first
    assert commit_digest(first, root, CODE_PATHS) == at_first


def test_a_commit_without_one_of_the_code_folders_has_a_digest(tmp_path: Path) -> None:
    (tmp_path / "gsm_train").mkdir()
    (tmp_path / "gsm_train/model.py").write_text("WIDTH = 8\n")  # no recipes/ or benchmarks/ yet
    assert commit_digest(_commit(tmp_path), tmp_path, CODE_PATHS) == code_digest(tmp_path, CODE_PATHS)
