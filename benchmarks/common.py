"""Shared helpers for the benchmark scripts: CUDA-event timing, result files, device description.

`python -m benchmarks.common [--digest-of COMMIT]` prints the code digest a result names (`code_digest`) of
this checkout's files, or of COMMIT's (to match a result whose `commit` came from stale git metadata)."""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import platform
import shlex
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from gsm_train.compiled import captured
from gsm_train.durable import write_durable
from gsm_train.train import train_recipe
from gsm_train.training.checkpoint import newest_good_checkpoint
from gsm_train.training.preflight import StartOptions

REPO = Path(__file__).resolve().parents[1]


def device_name() -> str:
    """The GPU (or CPU) this ran on, with torch's version."""
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    return f"CPU {platform.processor() or platform.machine()}, torch {torch.__version__}"


def median_ms(fn: Callable[[], object], warmup: int = 3, repeat: int = 15) -> float:
    """Median wall time of fn in milliseconds (CUDA events on GPU, after warm-up)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if torch.cuda.is_available():
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            import time

            tic = time.perf_counter()
            fn()
            times.append((time.perf_counter() - tic) * 1000)
    return statistics.median(times)


def graph_ms(step: Callable[[], torch.Tensor], replays: int = 50) -> float:
    """Median time of one replay of `step` captured in a CUDA graph."""
    graph, _ = captured(step, warmups=3)
    return median_ms(graph.replay, warmup=5, repeat=replays)


def _profiled(step: Callable[[], object], repeats: int, with_ops: bool) -> torch.profiler.profile:
    """torch.profiler over `repeats` calls of `step` after one warm-up: GPU activity, and with `with_ops` the
    PyTorch ops (with input shapes) that launched it."""
    from torch.profiler import ProfilerActivity, profile

    step()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if with_ops else [ProfilerActivity.CUDA]
    with profile(activities=activities, record_shapes=with_ops) as prof:
        for _ in range(repeats):
            step()
        torch.cuda.synchronize()
    return prof


def kernel_times(step: Callable[[], object], repeats: int = 3) -> list[dict]:
    """GPU time per kernel name (and copy) of one call of `step`, averaged over `repeats` profiled calls after
    one warm-up, the largest first: [{"kernel", "ms_per_step", "calls_per_step"}]."""
    rows = [
        {
            "kernel": event.key[:120],
            "ms_per_step": event.device_time_total / repeats / 1e3,
            "calls_per_step": event.count / repeats,
        }
        for event in _profiled(step, repeats, with_ops=False).key_averages()
        if event.device_time_total > 0
    ]
    return sorted(rows, key=lambda row: -row["ms_per_step"])


def op_times(step: Callable[[], object], repeats: int = 3) -> list[dict]:
    """GPU time of the kernels each PyTorch op launches itself, per op and input shapes, for one eager call
    of `step` (mean of `repeats` profiled calls after one warm-up), the largest first: which op and
    tensor behind a kernel of `kernel_times` (a CUDA graph's replay shows kernels only)."""
    from torch.autograd import DeviceType

    prof = _profiled(step, repeats, with_ops=True)
    rows = [
        {
            "op": event.key[:120],
            "input_shapes": str(event.input_shapes)[:200],
            "ms_per_step": event.self_device_time_total / repeats / 1e3,
            "calls_per_step": event.count / repeats,
        }
        for event in prof.key_averages(group_by_input_shape=True)
        if event.device_type == DeviceType.CPU and event.self_device_time_total > 0
    ]  # ops, not their kernels
    return sorted(rows, key=lambda row: -row["ms_per_step"])


def kernel_benchmark_args(
    description: str, more: Callable[[argparse.ArgumentParser], None] | None = None
) -> argparse.Namespace:
    """The command line of a benchmark that times GPU kernels and takes `--result OUT.json` (and what `more`
    adds to the parser); refuses to run without CUDA."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--result", required=True)
    if more is not None:
        more(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("this benchmark times GPU kernels; run it on a CUDA device")
    return args


def _gsm_setting(item: str) -> str:
    if not item.startswith("gsm."):
        raise argparse.ArgumentTypeError(f"--gsm takes gsm.* settings only, got {item!r}")
    return item


def add_gsm_argument(parser: argparse.ArgumentParser, help: str) -> None:
    """`--gsm gsm.KEY=VALUE ...`: GSM settings on top of the shipped recipes (anything else is refused)."""
    parser.add_argument("--gsm", nargs="*", default=[], type=_gsm_setting, metavar="gsm.KEY=VALUE", help=help)


CODE_PATHS = ("gsm_train", "recipes", "benchmarks/*.py")


def git_commit(repo: Path = REPO, paths: tuple[str, ...] = CODE_PATHS) -> str:
    """The short commit of `repo`'s checkout, noting uncommitted changes to `paths` (the code that
    ran may differ from the commit, e.g. in a copied tree whose git metadata is older)."""

    def git(*command: str) -> str:
        return subprocess.run(
            ["git", "--no-optional-locks", *command], cwd=repo, capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout)"
    try:
        if git("status", "--porcelain", "--untracked-files=no", "--", *paths):
            commit += " with uncommitted changes"
    except (OSError, subprocess.CalledProcessError):
        commit += " (uncommitted changes unknown)"
    return commit


def train_unless_exported(recipe: Path, overrides: list[str], run_dir: Path) -> None:
    """Train `recipe` into `run_dir` unless its export is there (exports are written to a temporary
    folder and renamed when complete); a run with a checkpoint that verifies resumes from the newest
    one, any other (killed before its first) starts over."""
    if (run_dir / "export").is_dir():
        print(f"{run_dir / 'export'} exists: {recipe.name} is not trained again", flush=True)
        return
    good, _ = newest_good_checkpoint(run_dir)
    resume, options = ("auto", None) if good is not None else (None, StartOptions(overwrite=True))
    result = train_recipe(str(recipe), [*overrides, f"output.dir={run_dir}"], resume=resume, options=options)
    del result
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def code_digest(root: Path = REPO, paths: tuple[str, ...] = CODE_PATHS) -> str:
    """The first 12 hex digits of SHA-256 over the relative path and bytes of every file `paths` names under
    `root` (folders whole, Python's caches left out), in path order. It names the files that ran, where
    `git_commit` names the checkout's metadata, which a copied tree may carry stale."""
    files: set[Path] = set()
    for pattern in paths:
        for found in root.glob(pattern):
            files.update(p for p in (found.rglob("*") if found.is_dir() else [found]) if p.is_file())
    digest = hashlib.sha256()
    for path in sorted(p for p in files if "__pycache__" not in p.parts and p.suffix != ".pyc"):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:12]


def commit_digest(commit: str, repo: Path = REPO, paths: tuple[str, ...] = CODE_PATHS) -> str:
    """`code_digest` of `commit`'s files (as `git archive` gives them), whatever the checkout holds."""

    def git(*command: str) -> bytes:
        return subprocess.run(["git", *command], cwd=repo, capture_output=True, check=True).stdout

    held = set(git("ls-tree", "--name-only", commit).decode().split("\n"))
    tops = sorted({pattern.split("/")[0] for pattern in paths} & held)  # a commit may lack a folder
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryFile() as tar_bytes:
        tar_bytes.write(git("archive", commit, *tops))
        tar_bytes.seek(0)
        with tarfile.open(fileobj=tar_bytes) as tar:
            for member in tar.getmembers():
                if member.isfile():  # files only, each at its own path below the folder
                    with tar.extractfile(member) as source:
                        target = Path(folder, member.name)
                        target.parent.mkdir(parents=True, exist_ok=True)
                        target.write_bytes(source.read())
        return code_digest(Path(folder), paths)


PROVENANCE_KEYS = ("command", "commit", "code_digest", "device")  # what `provenance` gives a result


def provenance() -> dict[str, str]:
    """The command line, commit, code digest and device of this run."""
    return {
        "command": "python " + shlex.join(sys.argv),
        "commit": git_commit(),
        "code_digest": code_digest(),
        "device": device_name(),
    }


def write_result(path: Path, result: dict) -> None:
    """Write the JSON result with the command line, commit and device that produced it (keys of `result` win)."""
    result = {**provenance(), **result}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_durable(path, json.dumps(result, indent=2))  # a run killed while writing keeps the last result
    print(f"wrote {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--digest-of", metavar="COMMIT", help="the digest of COMMIT's files, not the checkout's")
    options = parser.parse_args()
    print(commit_digest(options.digest_of) if options.digest_of else code_digest())
