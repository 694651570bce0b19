"""Checkpoints that survive faults: a manifest written last, verified on resume with a fall back to
the previous good checkpoint; a kill at any point of a save loses nothing and the resumed run
equals an uninterrupted one; resume refuses a changed recipe or a changed number of rows a
micro-step before the model loads and keeps the original recipe (issue 38, case 5); pruning removes
only this run's older checkpoints."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from run_helpers import GATE_RECIPE, REPO, TINY_GATE, child_env, file_digests, losses, records
from safetensors.torch import load_file

from gsm_train import cli
from gsm_train.train import train_recipe
from gsm_train.training import session
from gsm_train.training.checkpoint import (
    checkpoint_folders,
    newest_good_checkpoint,
    read_state,
    read_trainables,
    verify_checkpoint,
    write_manifest,
)

STEPS = [*TINY_GATE, "train.steps=6", "output.checkpoint_every=2", "output.keep_checkpoints=3"]
AUTO = ["--resume", "auto"]
FAULT_SCRIPT = str(REPO / "tests" / "fault_injection_run.py")


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 6-step run with checkpoints at steps 2, 4 and 6."""
    run = tmp_path_factory.mktemp("straight") / "run"
    train_recipe(GATE_RECIPE, [*STEPS, f"output.dir={run}"])
    return run


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the bad resume was refused")

    monkeypatch.setattr(session, "load_model_and_tokenizer", refuse)


def _adapter(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "export" / "gsm_modules.safetensors"))


def _assert_same_export(run: Path, reference: Path) -> None:
    ours, theirs = _adapter(run), _adapter(reference)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def _resumed_from(run: Path) -> str | None:
    return [r for r in records(run) if r["kind"] == "setup"][-1]["resumed_from"]


@pytest.mark.parametrize("damaged", ["dcp/__0_0.distcp", "dcp/.metadata", "rng_rank0.pt", "state.json"])
def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one(
    straight: Path, tmp_path: Path, damaged: str, capsys: pytest.CaptureFixture
) -> None:
    run = shutil.copytree(straight, tmp_path / "run")
    newest = run / "checkpoints" / "step_00000006"
    os.truncate(newest / damaged, (newest / damaged).stat().st_size // 2)
    resumed = train_recipe(GATE_RECIPE, [*STEPS, f"output.dir={run}"], resume="auto")
    err = capsys.readouterr().err
    assert f"warning: skipping a damaged checkpoint: {newest / damaged} has" in err
    assert "resuming from step_00000004" in err
    assert _resumed_from(run).endswith("step_00000004")
    assert resumed.losses == losses(straight)[4:]
    _assert_same_export(run, straight)
    assert verify_checkpoint(newest) is None, "step 6 written again, whole"


def test_a_damaged_checkpoint_named_explicitly_is_refused(
    straight: Path, tmp_path: Path, no_model_load: None, capsys: pytest.CaptureFixture
) -> None:
    run = shutil.copytree(straight, tmp_path / "run")
    newest = run / "checkpoints" / "step_00000006"
    (newest / "dcp" / "__0_0.distcp").write_bytes(b"\0" * 64)
    status = cli.main(["train", GATE_RECIPE, *STEPS, f"output.dir={run}", "--resume", str(newest)])
    err = capsys.readouterr().err
    assert status == 2 and "__0_0.distcp has 64 bytes" in err, err
    assert "step_00000004 verifies" in err


def test_a_different_global_batch_is_refused_before_the_model_loads(
    straight: Path, tmp_path: Path, no_model_load: None, capsys: pytest.CaptureFixture
) -> None:
    run = shutil.copytree(straight, tmp_path / "run")
    newest = run / "checkpoints" / "step_00000006"
    state = read_state(newest)
    state |= {"world_size": 2, "data": state["data"] | {"global_batch_size": 2}}
    (newest / "state.json").write_text(json.dumps(state))
    write_manifest(newest)  # a consistent checkpoint, written by 2 processes at batch 1
    before = file_digests(run)
    status = cli.main(["train", GATE_RECIPE, *STEPS, f"output.dir={run}", *AUTO])
    err = capsys.readouterr().err
    assert status == 2 and "written by 2 processes taking 2 rows a micro-step" in err, err
    assert "set train.batch_size=2 so that the data continues where it stopped" in err
    assert file_digests(run) == before


def test_resume_refuses_a_changed_recipe_and_keeps_the_original(
    straight: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = shutil.copytree(straight, tmp_path / "run")
    original = (run / "recipe.resolved.yaml").read_text()
    before = file_digests(run)
    changed = [*STEPS, "train.steps=8", "train.seed=7", "optim.lr=0.02", f"output.dir={run}"]
    status = cli.main(["train", GATE_RECIPE, *changed, *AUTO])
    err = capsys.readouterr().err
    assert status == 2 and "2 problems" in err, err
    assert "optim.lr = 0.02: differs from the run being resumed (0.01)" in err
    assert "train.seed = 7: differs from the run being resumed (0)" in err
    assert "--allow-recipe-change" in err
    assert file_digests(run) == before
    assert cli.main(["train", GATE_RECIPE, *changed, *AUTO, "--allow-recipe-change"]) == 0
    assert (run / "recipe.resolved.yaml").read_text() == original
    beside = yaml.safe_load((run / "recipe.resolved.step_00000006.yaml").read_text())
    assert beside["train"]["seed"] == 7 and beside["optim"]["lr"] == 0.02


def test_resume_accepts_changes_to_length_logging_and_checkpointing(straight: Path, tmp_path: Path) -> None:
    run = shutil.copytree(straight, tmp_path / "run")
    allowed = [
        "train.steps=8",
        "logging.log_every=2",
        "logging.eval_every=4",
        "output.checkpoint_every=4",
        "output.keep_checkpoints=1",
    ]
    assert cli.main(["train", GATE_RECIPE, *STEPS, *allowed, f"output.dir={run}", *AUTO]) == 0
    assert _resumed_from(run).endswith("step_00000006")


def _foreign_copy(run: Path, name: str) -> Path:
    """A checkpoint of another run (another run id) among the run's own."""
    foreign = run / "checkpoints" / name
    shutil.copytree(run / "checkpoints" / "step_00000002", foreign)
    (foreign / "state.json").write_text(json.dumps(read_state(foreign) | {"run_id": "another-run"}))
    write_manifest(foreign)
    return foreign


def test_pruning_removes_only_this_runs_older_checkpoints(straight: Path, tmp_path: Path) -> None:
    run = shutil.copytree(straight, tmp_path / "run")
    foreign = _foreign_copy(run, "step_00000001")
    foreign_files = file_digests(foreign)
    train_recipe(
        GATE_RECIPE, [*STEPS, "train.steps=8", "output.keep_checkpoints=1", f"output.dir={run}"], resume="auto"
    )
    names = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert names == ["step_00000001", "step_00000008"]
    assert (run / "checkpoints" / "latest").read_text() == "step_00000008"
    assert file_digests(foreign) == foreign_files


def _kill_points() -> list[tuple[str, int]]:
    """A torn write of the second checkpoint's weights, and a kill at a flush to disk drawn at
    random (seeded) among the about 24 of the run's three saves."""
    return [("half_write", 2), ("fsync", random.Random(38).randint(1, 24))]


@pytest.mark.parametrize("point, n", _kill_points())
def test_a_kill_during_a_save_loses_nothing_and_resume_is_exact(
    straight: Path, tmp_path: Path, point: str, n: int
) -> None:
    run = tmp_path / "run"
    env = child_env(OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, FAULT_SCRIPT, point, str(n), "--recipe", GATE_RECIPE, *STEPS, f"output.dir={run}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    good, _ = newest_good_checkpoint(run)
    if good is not None:  # the last good checkpoint verifies and equals the straight run's
        reference = read_trainables(straight / "checkpoints" / good.name)
        ours = read_trainables(good)
        assert all(torch.equal(ours[k], reference[k]) for k in reference)
    resumed = train_recipe(GATE_RECIPE, [*STEPS, f"output.dir={run}"], resume="auto")
    start = 0 if good is None else read_state(good)["step"]
    assert resumed.losses == losses(straight)[start:]
    _assert_same_export(run, straight)
    assert all(verify_checkpoint(p) is None for p in checkpoint_folders(run))
