"""The package as users install it: a wheel built from this checkout carries the recipes, and installed
in a fresh virtual environment outside the checkout, `gsm-train train gate_only` trains the built-in
recipe by name; `gsm-train recipes list` / `copy` (as torchtune's `tune ls` / `tune cp`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
from run_helpers import REPO, TINY_GATE

from gsm_train import cli
from gsm_train.config.builtin_recipes import builtin_recipes, resolve_recipe
from gsm_train.config.schema import load_recipe


def _checkout_copy(target: Path) -> Path:
    """This checkout's files as a clean clone of its working tree would hold them (tracked, and
    untracked but not ignored; links kept as links)."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = REPO / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the working tree
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            os.symlink(os.readlink(source), target / name)
        else:
            shutil.copy2(source, target / name)
    return target


def _fresh_venv(folder: Path) -> Path:
    """A new virtual environment whose packages beyond its own are this one's (torch and the other
    dependencies need no download): its site folders and the other folders on its path (PYTHONPATH's, where a
    machine keeps some dependencies there), except those that hold a `gsm_train` (the checkout); returns its
    python."""
    venv.create(folder, with_pip=False)
    python = folder / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    here = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    here |= {entry for entry in sys.path if Path(entry).is_dir() and not (Path(entry) / "gsm_train").exists()}
    (Path(purelib) / "dependencies.pth").write_text("".join(f"{path}\n" for path in sorted(here)))
    return python


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="builds the wheel from a git checkout")
def test_a_wheel_installed_outside_the_checkout_trains_the_builtin_gate_recipe(tmp_path: Path) -> None:
    pytest.importorskip("setuptools")
    source = _checkout_copy(tmp_path / "clone")
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist"]
    subprocess.run([*build, source], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("gsm_train-*.whl")
    shipped = {name for name in zipfile.ZipFile(wheel).namelist() if name.startswith("gsm_train/recipes/")}
    assert shipped == {f"gsm_train/recipes/{path.name}" for path in (REPO / "recipes").glob("*.yaml")}

    python = _fresh_venv(tmp_path / "venv")
    install = [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel]
    subprocess.run(install, check=True, capture_output=True, timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"ACCELERATE_USE_CPU": "1"}
    where = subprocess.run(
        [python, "-c", "import gsm_train; print(gsm_train.__file__)"], cwd=elsewhere, env=env, capture_output=True
    )
    assert where.stdout.decode().startswith(str(tmp_path / "venv")), where
    run = subprocess.run(
        [tmp_path / "venv" / "bin" / "gsm-train", "train", "gate_only", *TINY_GATE, "train.steps=2", "output.dir=run"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert (elsewhere / "run" / "export" / "gsm_modules.safetensors").is_file()
    assert "stage: gate_warmup" in (elsewhere / "run" / "recipe.resolved.yaml").read_text()


def test_recipes_list_and_copy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["recipes", "list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
    assert listed[0].split(None, 1)[1].startswith("Stage 1 (gate warm-up)")
    assert cli.main(["recipes", "copy", "gate_only", str(tmp_path) + "/"]) == 0
    copied = tmp_path / "gate_only.yaml"
    assert copied.read_bytes() == (REPO / "recipes" / "gate_only.yaml").read_bytes()
    copied.write_text("# mine\n")
    assert cli.main(["recipes", "copy", "joint", str(copied)]) == 2
    assert "exists; give another destination" in capsys.readouterr().err
    assert copied.read_text() == "# mine\n"  # never overwritten
    assert cli.main(["recipes", "copy", "nope", str(tmp_path)]) == 2
    assert "no built-in recipe 'nope'; the built-in recipes are gate_only, " in capsys.readouterr().err


def test_a_recipe_name_resolves_to_the_builtin_unless_a_file_of_that_name_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve_recipe("gate_only") == resolve_recipe("gate_only.yaml") == builtin_recipes()["gate_only"]
    assert load_recipe("joint").stage == "joint"
    (tmp_path / "gate_only.yaml").write_text("stage: joint\n")
    assert resolve_recipe("gate_only.yaml") == Path("gate_only.yaml")  # the user's file first
    assert resolve_recipe("sub/gate_only") == Path("sub/gate_only")  # a path is never a name
