"""Sharded checkpoints across numbers of processes (torchrun, gloo, FSDP2 on CPU): a run of 2
processes killed while writing its second checkpoint leaves the first one whole, and that one
resumes on 3 processes and on 1, each continuing as an uninterrupted run at its own size (the one on
3 with activation checkpointing under FSDP2); what a resumed run loads is exactly what the 2
processes wrote; a checkpoint exports in one process.

The joint stage trains the base in full (sharded by FSDP2) with the gate and the bridge; attention
stays dense and ASQ off, so that no discrete choice (top-k, cluster ids) can amplify the rounding
differences between reductions over 2, 3 or 1 processes."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest
import torch
from run_helpers import REPO, TINY_LLAMA_64, losses, records, run_processes, torchrun
from safetensors.torch import load_file

from gsm_train.config.schema import load_recipe
from gsm_train.train import train_recipe
from gsm_train.training.checkpoint import (
    newest_good_checkpoint,
    read_state,
    read_trainables,
    verify_checkpoint,
)
from gsm_train.training.checkpoint_export import export_checkpoint
from gsm_train.training.session import TrainingSession
from gsm_train.training.sharded_checkpoint import read_full_tensors
from gsm_train.training.stages import JointStage

JOINT = str(REPO / "recipes" / "joint.yaml")
ROWS = 6  # rows a micro-step: 3 on each of 2 processes, 2 on each of 3, 6 on 1
COMMON = [
    *TINY_LLAMA_64,
    "init_from=null",
    "logging.recall_min_keys=16",
    "logging.recall_k=8",
    "logging.progress_bar=false",
    "logging.eval_every=100",
    "logging.eval_batches=1",
    "gsm.sparse_attention.mode=dense",
    "gsm.sparse_attention.top_k=8",
    "gsm.sparse_attention.k_min=8",
    "gsm.kv_compression.enabled=false",
    "gsm.kv_compression.layer_bits={}",
    "gsm.cross_layer_sharing.enabled=true",
    "gsm.cross_layer_sharing.bridge_from=1",
    "gsm.cross_layer_sharing.bridge_to_start=2",
    "gsm.sparse_attention.gate_init=random",
    "train.base=full",
    "train.distill_queries=16",
    "optim.lr=1e-3",
    "optim.warmup_steps=1",
    "train.steps=6",
    "output.checkpoint_every=3",
]
# the same steps reduced over 2, 3 or 1 processes differ by fp32 rounding (resumed in one process:
# at most 5e-7 from the run in one); a resume that dropped the optimizer state, or took the data one
# micro-step late, was off by 0.017 and 0.036
TOLERANCE = 1e-5


def _at(processes: int) -> list[str]:
    return [*COMMON, f"train.batch_size={ROWS // processes}"]


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-process run killed (SIGKILL, both ranks) after writing half of its step-6 checkpoint's
    shards."""
    run = tmp_path_factory.mktemp("killed") / "run"
    proc = torchrun(
        2,
        [
            str(REPO / "tests" / "fault_injection_run.py"),
            "half_write",
            "2",
            "--recipe",
            JOINT,
            *_at(2),
            f"output.dir={run}",
        ],
    )
    killed_ranks = proc.stderr.count(f"exitcode  : -{int(signal.SIGKILL)} ")  # torchrun's report of each rank
    assert proc.returncode != 0 and killed_ranks == 2, proc.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run on 3 processes, its decoder layers under activation checkpointing inside
    their FSDP2 units (which computes the same steps: tests/test_activation_checkpoint.py)."""
    run = tmp_path_factory.mktemp("three") / "run"
    run_processes(3, JOINT, [*_at(3), "train.activation_checkpointing=true"], run)
    return run


def test_a_kill_while_writing_shards_leaves_the_previous_checkpoint_whole(killed: Path) -> None:
    good, problems = newest_good_checkpoint(killed)
    assert good is not None and good.name == "step_00000003" and problems == []
    assert (killed / "checkpoints" / "latest").read_text() == "step_00000003"
    assert (killed / "checkpoints" / "step_00000006.tmp").is_dir(), "the kill came while step 6 was written"
    state = read_state(good)
    assert (state["world_size"], state["format"], state["data"]["global_batch_size"]) == (
        2,
        "dcp",
        ROWS,
    )
    shards = sorted(p.name for p in (good / "dcp").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # each rank wrote its own


def test_resume_on_three_processes_continues_as_a_run_on_three(killed: Path, three: Path, tmp_path: Path) -> None:
    run = shutil.copytree(killed, tmp_path / "run")  # with the dead run's lock, as a crash leaves it
    run_processes(3, JOINT, _at(3), run, "--resume", "auto")
    setup = [r for r in records(run) if r["kind"] == "setup"][-1]
    assert setup["world_size"] == 3 and setup["resumed_from"].endswith("step_00000003")
    assert losses(run)[-3:] == pytest.approx(losses(three)[3:], abs=TOLERANCE)
    assert losses(killed)[:3] == pytest.approx(losses(three)[:3], abs=TOLERANCE)  # the same steps at 2 and 3
    assert verify_checkpoint(run / "checkpoints" / "step_00000006") is None


def test_resume_in_one_process_continues_as_a_run_in_one(killed: Path, tmp_path: Path) -> None:
    one = train_recipe(JOINT, [*_at(1), f"output.dir={tmp_path / 'one'}"])
    run = shutil.copytree(killed, tmp_path / "run")  # with the dead run's lock, as a crash leaves it
    resumed = train_recipe(JOINT, [*_at(1), f"output.dir={run}"], resume="auto")
    assert resumed.losses == pytest.approx(one.losses[3:], abs=TOLERANCE)


def test_what_a_resumed_run_loads_is_what_the_shards_hold(killed: Path) -> None:
    checkpoint = killed / "checkpoints" / "step_00000003"
    config = load_recipe(JOINT, [*_at(1), f"output.dir={killed}"])
    session = TrainingSession.setup(config, JointStage())
    assert session.resume(checkpoint) == 3
    saved = read_trainables(checkpoint)
    params = dict(session.model.named_parameters())
    assert saved.keys() == session.trainable and any(".mlp." in name for name in saved)
    assert all(torch.equal(params[name].detach(), tensor) for name, tensor in saved.items())
    moments = read_full_tensors(checkpoint, "optim")
    for name in saved:
        state = session.optimizer.state[params[name]]
        assert torch.equal(state["exp_avg"], moments[f"state.{name}.exp_avg"])
        assert torch.equal(state["exp_avg_sq"], moments[f"state.{name}.exp_avg_sq"])
        assert float(state["step"]) == 3


def test_a_sharded_checkpoint_exports_in_one_process(killed: Path, tmp_path: Path) -> None:
    checkpoint = killed / "checkpoints" / "step_00000003"
    out = export_checkpoint(checkpoint, tmp_path / "export")
    saved = read_trainables(checkpoint)
    exported = load_file(str(out / "gsm_modules.safetensors"))
    gsm = {name: t for name, t in saved.items() if ".gsm." in name}
    assert gsm.keys() <= exported.keys() and all(torch.equal(exported[n], t) for n, t in gsm.items())
