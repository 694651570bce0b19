"""Resumable checkpoints written atomically: a temporary folder renamed into place when complete.

A checkpoint `step_00000050/` holds the trainable weights (`trainable.safetensors`, full tensors),
the optimizer (`optimizer.pt`, full state, tensors only), `state.json` (step, scheduler, data
position) and one `rng_rank{R}.pt` per rank. `latest` names the newest complete checkpoint.
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
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
)

from gsm_train.distributed import DistInfo, barrier

LATEST = "latest"
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


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


def save_checkpoint(run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any, data_state: dict, trainable: set[str], info: DistInfo, keep: int) -> Path:
    """Write a complete checkpoint (collective: every rank calls it); return its folder."""
    final = run_dir / "checkpoints" / f"step_{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    model_state = get_model_state_dict(model, options=_FULL)
    optim_state = get_optimizer_state_dict(model, optimizer, options=_FULL)
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    torch.save(_rng_state(), tmp / f"rng_rank{info.rank}.pt")
    barrier()
    if info.is_main:
        weights = {name: t.contiguous() for name, t in model_state.items() if name in trainable}
        save_file(weights, str(tmp / "trainable.safetensors"))
        torch.save(optim_state, tmp / "optimizer.pt")
        meta = {"step": step, "world_size": info.world_size, "scheduler": scheduler.state_dict(), "data": data_state}
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


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                    info: DistInfo) -> dict:
    """Restore weights, optimizer, scheduler and RNG; return the saved state (step, data position)."""
    meta = json.loads((path / "state.json").read_text())
    if meta["world_size"] != info.world_size:
        raise RuntimeError(f"checkpoint {path} was written by {meta['world_size']} processes, this run has "
                           f"{info.world_size}; resume with the same number of processes")
    weights = load_file(str(path / "trainable.safetensors"))
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, weights, options=options)
    set_optimizer_state_dict(model, optimizer, torch.load(path / "optimizer.pt", weights_only=True),
                             options=StateDictOptions(full_state_dict=True))
    scheduler.load_state_dict(meta["scheduler"])
    _set_rng_state(torch.load(path / f"rng_rank{info.rank}.pt", weights_only=True))
    return meta
