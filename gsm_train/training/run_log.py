"""Run logging: JSONL always; TensorBoard and wandb when the recipe asks; a progress bar on rank 0, or
with `logging.progress_bar: false` a line per logged step.

The wandb run is the run folder's: named after the folder, its id the run's id (kept in the folder's
run.json and checkpoints, the same on every resume), opened with `resume="allow"` (what accelerate's
`init_trackers(..., init_kwargs={"wandb": {"id": ..., "resume": "allow"}})` passes to `wandb.init`), so
a resumed run continues its wandb run instead of opening another. Per-layer metrics (lists) are sent
as one scalar per layer: `eval/NAME/layer_L`."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from gsm_train.config.schema import LoggingConfig
from gsm_train.training.finite_guard import json_safe


class RunLogger:
    """Writes one JSON line per record to `metrics.jsonl` (rank 0 only) and mirrors finite scalars.
    A NaN or infinite value is written as the string "nan", "inf" or "-inf"
    (`finite_guard.json_safe`)."""

    def __init__(
        self,
        run_dir: Path,
        config: LoggingConfig,
        total_steps: int,
        start_step: int,
        enabled: bool,
        run_name: str,
        recipe: dict[str, Any],
        run_id: str | None = None,
    ):
        self.enabled, self.total_steps, self.log_every = enabled, total_steps, config.log_every
        self.path = run_dir / "metrics.jsonl"
        self._tb = self._wandb = None
        self._bar = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if config.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise RuntimeError(
                    "logging.tensorboard=true needs TensorBoard: pip install 'gsm-train[tensorboard]'"
                ) from err
            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        if config.wandb:
            try:
                import wandb
            except ImportError as err:
                raise RuntimeError(
                    "logging.wandb=true needs wandb: pip install 'gsm-train[wandb]' "
                    "(set WANDB_MODE=offline to run without a network)"
                ) from err
            self._wandb = wandb.init(
                project=config.wandb_project,
                name=run_name,
                config=recipe,
                dir=str(run_dir),
                **wandb_resume_kwargs(run_id),
            )
        if config.progress_bar:
            self._bar = tqdm(total=total_steps, initial=start_step, desc=run_name, dynamic_ncols=True)
        self._start = time.time()

    def log(self, kind: str, step: int, values: dict[str, Any]) -> None:
        """Record `values` for `step`; `kind` is e.g. train, eval or report."""
        if not self.enabled:
            return
        record = {"kind": kind, "step": step, "time": round(time.time() - self._start, 3), **values}
        with self.path.open("a") as handle:  # NaN and infinities as strings: the line stays JSON
            handle.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
        scalars = tracked_scalars(values)
        if self._tb is not None:
            for name, value in scalars.items():
                self._tb.add_scalar(f"{kind}/{name}", value, step)
        if self._wandb is not None:
            self._wandb.log({f"{kind}/{k}": v for k, v in scalars.items()}, step=step)

    def progress(self, step: int, postfix: dict[str, float]) -> None:
        """Advance the bar to `step` and show loss and throughput (tqdm shows the ETA); without a bar,
        print a line for every `log_every`-th step and the last (on stderr, as the bar)."""
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in postfix.items()}, refresh=False)
        elif self.enabled and (step % self.log_every == 0 or step == self.total_steps):
            shown = " ".join(f"{k} {v:.4g}" for k, v in postfix.items())
            print(f"step {step}/{self.total_steps} {shown} ({time.time() - self._start:.1f} s)", file=sys.stderr)

    def close(self) -> None:
        """Close the bar, TensorBoard and wandb; a second call does nothing."""
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._bar = self._tb = self._wandb = None


def wandb_resume_kwargs(run_id: str | None) -> dict[str, Any]:
    """`wandb.init` arguments that make a run id one wandb run across resumes (accelerate's
    `init_kwargs["wandb"]` for the same)."""
    return {"id": run_id, "resume": "allow"} if run_id else {"resume": "allow"}


def tracked_scalars(values: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a record, as trackers take them: numbers as they are, and each list of
    numbers as `NAME/layer_L`: L from the record's `layers` for a `*_per_layer` list of one value per
    layer, the position in the list otherwise (e.g. `bridge_alphas`); `layers` itself is not sent."""
    layers = values.get("layers")
    scalars: dict[str, float] = {}
    for name, value in values.items():
        if isinstance(value, bool) or name == "layers":
            continue
        if isinstance(value, (int, float)):
            scalars[name] = value
        elif isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
            per_layer = name.endswith("_per_layer") and isinstance(layers, list) and len(layers) == len(value)
            labels = layers if per_layer else range(len(value))
            scalars |= {f"{name}/layer_{label}": v for label, v in zip(labels, value)}
    return {name: value for name, value in scalars.items() if math.isfinite(value)}
