"""Shared steps of the stage tests: reading a run's losses, resuming after a simulated crash, and
running a recipe in several processes (torchrun, gloo, FSDP2); where the Triton kernels can run."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest
import torch

from gsm_train.train import train_recipe
from gsm_train.training.trainer import TrainResult

# the Triton kernels run with CUDA, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1)
KERNELS_RUN_HERE = importlib.util.find_spec("triton") is not None and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
)
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the marks of a Triton kernel's test: skipped where the kernels cannot run; tests/run_tests.sh runs them
# again (-m triton_kernels) under Triton's interpreter once the suite has passed
TRITON_KERNEL_MARKS = [
    pytest.mark.triton_kernels,
    pytest.mark.skipif(
        not KERNELS_RUN_HERE,
        reason="needs Triton with CUDA, or on CPU TRITON_INTERPRET=1 (tests/run_tests.sh runs "
        "these under Triton's interpreter after the suite)",
    ),
]


def packing_in_pytorch_when_interpreted() -> contextlib.AbstractContextManager:
    """Under Triton's interpreter, caches pack their blocks in PyTorch, as on a CPU outside the tests (the
    interpreted packing kernel, which tests/test_asq_pack_kernel.py checks, adds 10-25 s to a test whose
    subject is another kernel); on a GPU the packing kernel packs, as it does for users."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    from gsm_train.kernels import asq_pack

    return mock.patch.object(asq_pack, "kernel_runs", return_value=False)


def triton_kernel_test(test: Callable) -> Callable:
    """Mark a test of the Triton kernels (`TRITON_KERNEL_MARKS`)."""
    for mark in TRITON_KERNEL_MARKS:
        test = mark(test)
    return test


REPO = Path(__file__).resolve().parents[1]
GATE_RECIPE = str(REPO / "recipes" / "gate_only.yaml")
# the tiny Llama at 64 tokens, selecting in one chunk of its own length: a shorter chunk is padded to
# query_chunk rows and keys (ties fall the same way in a pass of any length), 2048 x 2048 scores a row of 64
# in the joint recipe
TINY_LLAMA_64 = ["model.name_or_path=tiny-llama", "data.seq_len=64", "gsm.sparse_attention.query_chunk=64"]
# the same with a top-k and a recall measure that fit it
TINY_MODEL = [
    *TINY_LLAMA_64,
    "logging.recall_min_keys=16",
    "logging.recall_k=8",
    "gsm.sparse_attention.top_k=8",
    "gsm.sparse_attention.k_min=8",
]
# the gate stage on the tiny Llama at one row a step: about a second a run on a CPU
TINY_GATE = [
    *TINY_MODEL,
    "logging.progress_bar=false",
    "optim.warmup_steps=1",
    "gsm.sparse_attention.gate_init=random",
    "optim.lr=0.01",
    "train.batch_size=1",
    "logging.eval_batches=1",
]


def file_digests(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under `folder` (to show a folder was left as it
    was)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def records(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl records."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[float]:
    """The training losses a run logged, one per step."""
    return [r["loss"] for r in records(run_dir) if r["kind"] == "train"]


def resume_after_crash(recipe: str, overrides: list[str], tmp_path: Path, step: int) -> tuple[Path, TrainResult]:
    """Run `recipe` straight, then again from a copy of only its step-`step` checkpoint (as if it had
    crashed right after writing it) with --resume auto. Returns (the straight run's folder, the resumed result)."""
    straight = tmp_path / "straight"
    train_recipe(recipe, [*overrides, f"output.dir={straight}"])
    crashed = tmp_path / "crashed"
    (crashed / "checkpoints").mkdir(parents=True)
    name = f"step_{step:08d}"
    shutil.copytree(straight / "checkpoints" / name, crashed / "checkpoints" / name)
    return straight, train_recipe(recipe, [*overrides, f"output.dir={crashed}"], resume="auto")


def child_env(**settings: str) -> dict[str, str]:
    """This process's environment for a child Python process: this checkout's gsm_train first on
    PYTHONPATH (any path already there is kept after it: an install by PYTHONPATH, as on the GPU
    image, stays importable), on the CPU as the suite's own runs are (conftest.py; a GPU run would
    not match their figures), then `settings`."""
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    cpu_only = {"ACCELERATE_USE_CPU": "1", "CUDA_VISIBLE_DEVICES": ""}
    return {**os.environ, "PYTHONPATH": python_path, **cpu_only, **settings}


def free_port() -> int:
    """A TCP port nothing listens on now (for a rendezvous that must not meet another run's)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun(count: int, args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node COUNT ARGS` on the CPU (gloo; one thread a process), also on a machine
    with GPUs (one GPU cannot host two ranks), this checkout's gsm_train first on the path. Returns
    the finished process (not checked)."""
    env = child_env(OMP_NUM_THREADS="1")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(count),
        "--master_port",
        str(free_port()),
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, check=False)


def run_processes(count: int, recipe: str, overrides: list[str], out_dir: Path, *options: str) -> None:
    """`gsm_train.train` on RECIPE in COUNT processes (FSDP2 over gloo); `options`: e.g. --resume
    auto. Fails with its stderr if it fails."""
    proc = torchrun(count, ["-m", "gsm_train.train", "--recipe", recipe, *overrides, f"output.dir={out_dir}", *options])
    assert proc.returncode == 0, proc.stderr[-3000:]
