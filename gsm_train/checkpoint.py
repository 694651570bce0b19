"""Resumable checkpoints written atomically: a temporary folder renamed into place when complete.

A checkpoint `step_00000050/` holds the trainable weights (`trainable.safetensors`, full fp32
tensors), the optimizer (FSDP2: `optimizer.pt`, full state, tensors only; DeepSpeed: the engine's own
checkpoint in `deepspeed/`, one optimizer partition per rank), `state.json` (step, backend, world
size, scheduler, data position) and one `rng_rank{R}.pt` per rank. `latest` names the newest complete
checkpoint. Resuming needs the same backend and number of processes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from gsm_train.backend import Backend
from gsm_train.distributed import DistInfo, barrier

LATEST = "latest"


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(run_dir: Path, step: int, backend: Backend, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any, data_state: dict, trainable: set[str], info: DistInfo, keep: int) -> Path:
    """Write a complete checkpoint (collective: every rank calls it); return its folder."""
    final = run_dir / "checkpoints" / f"step_{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    weights = {name: t.contiguous() for name, t in backend.full_state_dict(model).items() if name in trainable}
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    torch.save(_rng_state(), tmp / f"rng_rank{info.rank}.pt")
    backend.save_optimizer(model, optimizer, tmp, info)
    barrier()
    if info.is_main:
        save_file(weights, str(tmp / "trainable.safetensors"))
        meta = {"step": step, "backend": backend.name, "world_size": info.world_size,
                "scheduler": scheduler.state_dict(), "data": data_state}
        (tmp / "state.json").write_text(json.dumps(meta, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _write_atomic(run_dir / "checkpoints" / LATEST, final.name)
        _prune(run_dir / "checkpoints", keep)
    barrier()
    return final


def _prune(folder: Path, keep: int) -> None:
    done = sorted(p for p in folder.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def find_latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run folder, or None."""
    pointer = run_dir / "checkpoints" / LATEST
    if pointer.exists():
        candidate = pointer.parent / pointer.read_text().strip()
        if (candidate / "state.json").exists():
            return candidate
    done = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / "state.json").exists())
    return done[-1] if done else None


def resolve_resume(resume_from: str | None, run_dir: Path) -> Path | None:
    """`auto` -> the run's latest checkpoint (or None); a path -> that checkpoint, which must be complete."""
    if resume_from is None:
        return None
    if resume_from == "auto":
        return find_latest(run_dir)
    path = Path(resume_from)
    if not (path / "state.json").exists():
        raise FileNotFoundError(f"output.resume_from={resume_from!r} is not a complete checkpoint (no state.json); "
                                "give a checkpoints/step_* folder or 'auto'")
    return path


def load_checkpoint(path: Path, backend: Backend, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any, info: DistInfo) -> dict:
    """Restore weights, optimizer, scheduler and RNG; return the saved state (step, data position)."""
    meta = json.loads((path / "state.json").read_text())
    written_by = meta.get("backend", "fsdp2")
    if (written_by, meta["world_size"]) != (backend.name, info.world_size):
        raise RuntimeError(f"checkpoint {path} was written by {meta['world_size']} processes with {written_by}, "
                           f"this run has {info.world_size} with {backend.name}; resume with the same number of "
                           "processes and the same backend (accelerate config)")
    backend.load_state(model, optimizer, path, load_file(str(path / "trainable.safetensors")))
    scheduler.load_state_dict(meta["scheduler"])
    _set_rng_state(torch.load(path / f"rng_rank{info.rank}.pt", weights_only=True))
    return meta
