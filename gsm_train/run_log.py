"""Run logging: JSONL always; TensorBoard and wandb when the recipe asks; a progress bar on rank 0."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from gsm_train.config import LoggingConfig
from gsm_train.finite_guard import json_safe


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
    ):
        self.enabled = enabled
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
                project=config.wandb_project, name=run_name, config=recipe, dir=str(run_dir), resume="allow"
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
        scalars = {k: v for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if self._tb is not None:
            for name, value in scalars.items():
                self._tb.add_scalar(f"{kind}/{name}", value, step)
        if self._wandb is not None:
            self._wandb.log({f"{kind}/{k}": v for k, v in scalars.items()}, step=step)

    def progress(self, step: int, postfix: dict[str, float]) -> None:
        """Advance the bar to `step` and show loss and throughput (tqdm shows the ETA)."""
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in postfix.items()}, refresh=False)

    def close(self) -> None:
        """Close the bar, TensorBoard and wandb; a second call does nothing."""
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._bar = self._tb = self._wandb = None
