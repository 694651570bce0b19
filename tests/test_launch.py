"""Launches that would run each process alone are refused before anything loads: `accelerate launch
--cpu --num_processes 2` starts one process (accelerate runs several CPU processes only through
mpirun), and mpirun's ranks get no WORLD_SIZE. torchrun's (tests/test_joint.py's two processes) run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from run_helpers import TINY_GATE, child_env

from gsm_train.training.distributed import LaunchError, check_launch

TORCHRUN = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    "env",
    [{}, {"ACCELERATE_USE_CPU": "True"}, {"ACCELERATE_USE_CPU": "True", **TORCHRUN}, {"OMPI_COMM_WORLD_SIZE": "1"}],
)
def test_launches_that_start_every_process_pass(env: dict[str, str]) -> None:
    check_launch(env)


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, "accelerate launch"),
        ({"PMI_SIZE": "2", "PMI_RANK": "1"}, "mpirun started 2 processes"),
    ],
)
def test_launches_whose_processes_would_train_alone_are_refused(env: dict[str, str], says: str) -> None:
    with pytest.raises(LaunchError, match=says) as refused:
        check_launch(env)
    assert "Fix: " in str(refused.value) and "torchrun --nproc_per_node N -m gsm_train.train" in str(refused.value)


def test_accelerate_launch_cpu_with_two_processes_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    run = subprocess.run(
        [*launch, "-m", "gsm_train.train", "--recipe", "gate_only", *TINY_GATE, f"output.dir={tmp_path / 'run'}"],
        env=child_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0 and "error: accelerate launch --cpu with --num_processes above 1" in run.stderr
    assert not (tmp_path / "run").exists()


def test_a_refused_launch_is_a_refusal_of_the_entry_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """LaunchError is a GSMError: `python -m gsm_train.train` ends with status 2 and one line, no traceback."""
    from gsm_train.errors import GSMError
    from gsm_train.train import main as train_main

    assert issubclass(LaunchError, GSMError)
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setenv("PMI_RANK", "1")
    status = train_main(["--recipe", "gate_only", *TINY_GATE, f"output.dir={tmp_path / 'run'}"])
    assert status == 2
    assert capsys.readouterr().err.startswith("error: mpirun started 2 processes")
    assert not (tmp_path / "run").exists()
