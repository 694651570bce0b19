"""One run per output folder: a folder holding a run is refused unless --resume or --overwrite
says so, --overwrite removes only what a run writes, and a lock keeps a second run out (issue 38,
cases 2 and 4)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from run_helpers import GATE_RECIPE, TINY_GATE, child_env, file_digests, records
from safetensors.torch import load_file

from gsm_train import cli
from gsm_train.train import train_recipe
from gsm_train.training.run_folder import LOCK, RUN_FILE

EIGHT_STEPS = [*TINY_GATE, "train.steps=8", "output.checkpoint_every=4"]
# the second run into a reused folder: another seed and learning rate, 2 steps
OTHER_RUN = [*TINY_GATE, "train.steps=2", "output.checkpoint_every=2", "train.seed=7", "optim.lr=0.02"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 8-step run with checkpoints at steps 4 and 8."""
    run = tmp_path_factory.mktemp("finished") / "run"
    train_recipe(GATE_RECIPE, [*EIGHT_STEPS, f"output.dir={run}"])
    return run


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


def _adapter(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "export" / "gsm_modules.safetensors"))


def test_a_folder_holding_a_run_is_refused_and_left_as_it_was(
    finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    reused = _copy(finished_run, tmp_path / "reused")
    before = file_digests(reused)
    status = cli.main(["train", GATE_RECIPE, *OTHER_RUN, f"output.dir={reused}"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert f"output.dir={reused} holds another run" in err
    assert "--resume auto" in err and "--overwrite" in err
    assert file_digests(reused) == before


def test_overwrite_starts_over_removing_only_what_a_run_writes(finished_run: Path, tmp_path: Path) -> None:
    reused = _copy(finished_run, tmp_path / "reused")
    (reused / "notes.txt").write_text("mine\n")
    (reused / "data").mkdir()
    (reused / "data" / "corpus.txt").write_text("mine too\n")
    (tmp_path / "canary.txt").write_text("beside the run\n")
    assert cli.main(["train", GATE_RECIPE, *OTHER_RUN, f"output.dir={reused}", "--overwrite"]) == 0
    fresh = tmp_path / "fresh"
    train_recipe(GATE_RECIPE, [*OTHER_RUN, f"output.dir={fresh}"])
    assert (reused / "notes.txt").read_text() == "mine\n"
    assert (reused / "data" / "corpus.txt").read_text() == "mine too\n"
    assert (tmp_path / "canary.txt").read_text() == "beside the run\n"
    checkpoints = reused / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_00000002"]
    assert (checkpoints / "latest").read_text() == "step_00000002"
    old, new = _adapter(finished_run), _adapter(reused)
    assert all(torch.equal(new[name], tensor) for name, tensor in _adapter(fresh).items())
    assert not all(torch.equal(new[name], old[name]) for name in old)
    args = json.loads((reused / "export" / "training_args.json").read_text())["recipe"]
    assert args["optim"]["lr"] == 0.02 and args["train"]["seed"] == 7
    # --resume auto now continues the new run (from its step 2), not the old one's step 8
    assert (
        cli.main(["train", GATE_RECIPE, *OTHER_RUN, "train.steps=4", f"output.dir={reused}", "--resume", "auto"]) == 0
    )
    setups = [r for r in records(reused) if r["kind"] == "setup"]
    assert [s["step"] for s in setups] == [0, 2]
    assert setups[-1]["resumed_from"].endswith("step_00000002")


def test_resume_from_another_runs_checkpoint_into_a_folder_is_refused(
    finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    other = _copy(finished_run, tmp_path / "other")
    (other / RUN_FILE).write_text(json.dumps({"run_id": "another-run"}))
    checkpoint = finished_run / "checkpoints" / "step_00000004"
    before = file_digests(other)
    status = cli.main(["train", GATE_RECIPE, *EIGHT_STEPS, f"output.dir={other}", "--resume", str(checkpoint)])
    err = capsys.readouterr().err
    assert status == 2 and "holds another run" in err and "another-run" in err, err
    assert file_digests(other) == before
    same = _copy(finished_run, tmp_path / "same")  # its own older checkpoint: step 8 would go
    status = cli.main(
        [
            "train",
            GATE_RECIPE,
            *EIGHT_STEPS,
            f"output.dir={same}",
            "--resume",
            str(same / "checkpoints" / "step_00000004"),
        ]
    )
    err = capsys.readouterr().err
    assert status == 2 and "newer checkpoints of this run (step_00000008)" in err, err


def _write_lock(run: Path, pid: int) -> None:
    run.mkdir(parents=True, exist_ok=True)
    owner = {"pid": pid, "host": socket.gethostname(), "started": "earlier"}
    (run / LOCK).write_text(json.dumps(owner))


def test_a_live_lock_refuses_the_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    _write_lock(run, os.getpid())  # this test's process: alive
    status = cli.main(["train", GATE_RECIPE, *TINY_GATE, "train.steps=1", f"output.dir={run}"])
    err = capsys.readouterr().err
    assert status == 2 and f"is in use by another run (pid {os.getpid()} on host" in err, err
    assert sorted(p.name for p in run.iterdir()) == [LOCK]


def test_a_stale_lock_is_taken_over_with_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    run = tmp_path / "run"
    _write_lock(run, gone.pid)
    assert cli.main(["train", GATE_RECIPE, *TINY_GATE, "train.steps=1", f"output.dir={run}"]) == 0
    assert f"took over the stale lock {run / LOCK} (pid {gone.pid}" in capsys.readouterr().err
    assert not (run / LOCK).exists(), "the lock goes when the run ends"


def test_two_runs_started_together_on_one_folder(tmp_path: Path) -> None:
    """Two processes on one output.dir: one runs, the other exits 2 (on the lock, or, if the first
    already finished, on the run it left); the first run's records are not mixed with another's."""
    run = tmp_path / "run"
    env = child_env(OMP_NUM_THREADS="1")
    command = [
        sys.executable,
        "-m",
        "gsm_train.train",
        "--recipe",
        GATE_RECIPE,
        *TINY_GATE,
        "train.steps=20",
        "output.checkpoint_every=10",
        f"output.dir={run}",
    ]
    both = [
        subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    outcomes = sorted(_finish(proc) for proc in both)
    (ok, _), (refused, message) = outcomes
    assert (ok, refused) == (0, 2), outcomes
    assert "is in use by another run" in message or "holds another run" in message, message
    assert [r["kind"] for r in records(run)].count("setup") == 1
    assert not (run / LOCK).exists()


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    """(exit status, stderr) of a process started with stderr piped."""
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


def test_a_run_whose_export_folder_holds_other_files_is_refused_before_training(tmp_path: Path) -> None:
    """The run's own RUN/export is checked with the other early checks: a folder there holding files
    that are not an export stops the run before the model loads, and the files stay."""
    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    (run / "export" / "notes.txt").write_text("keep")
    assert cli.main(["train", GATE_RECIPE, *TINY_GATE, "train.steps=1", f"output.dir={run}"]) == 2
    assert (run / "export" / "notes.txt").read_text() == "keep"
    assert not (run / "metrics.jsonl").exists()
