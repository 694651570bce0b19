"""The NaN/Inf guard: a training step whose loss, loss terms or gradient norm is not finite stops
the run, or is skipped (no optimizer update) up to `train.max_skipped_steps` times; non-finite
tensors are never written to a checkpoint or an export; and records stay valid JSON.

In records (metrics.jsonl) a non-finite float is written as the string "nan", "inf" or "-inf", which
`float()` reads back; every finite number stays a JSON number.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from gsm_train.training.distributed import DistInfo

# exit status of a run the guard stopped (2 is a refused input: nothing ran, nothing was written)
NONFINITE_EXIT = 3


class NonFiniteError(RuntimeError):
    """A non-finite loss, gradient norm or tensor; the message names the step and the terms."""


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float replaced by "nan", "inf" or "-inf" (dicts, lists and
    tuples walked), so that `json.dumps(..., allow_nan=False)` accepts it. Numbers of other types
    (numpy, 0-d tensors) become Python floats; anything else is returned as it is."""
    if isinstance(value, Mapping):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        return value
    if math.isnan(number):
        return "nan"
    if math.isinf(number):
        return "inf" if number > 0 else "-inf"
    return number


def nonfinite_terms(record: Mapping[str, Any]) -> list[str]:
    """Names of the float entries of a step record that are NaN or infinite, in record order."""
    return [name for name, value in record.items() if isinstance(value, float) and not math.isfinite(value)]


def nonfinite_tensors(tensors: Mapping[str, Tensor]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an infinity (of a DTensor: this rank's
    part)."""
    return [
        name
        for name, tensor in tensors.items()
        if tensor.is_floating_point() and not bool(torch.isfinite(_local(tensor)).all())
    ]


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _refusal(what: str, bad: list[str], count: int) -> NonFiniteError:
    shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
    return NonFiniteError(
        f"{what} not written: {len(bad)} of {count} tensors hold NaN or infinite "
        f"values ({shown}); the previous checkpoints are kept"
    )


def check_finite_tensors(tensors: Mapping[str, Tensor], what: str) -> None:
    """Raise NonFiniteError naming the first tensors of `what` (e.g. "checkpoint step_00000008")
    that hold a NaN or an infinity; nothing is written by the caller then."""
    bad = nonfinite_tensors(tensors)
    if bad:
        raise _refusal(what, bad, len(tensors))


def refuse_non_finite(tensors: Mapping[str, Tensor], what: str, info: DistInfo) -> None:
    """Collective: `check_finite_tensors` over what every rank holds (rank 0 the full tensors and
    the others nothing, or each rank its shards: DTensors are checked by their local part), the
    same NonFiniteError raised on every rank if any rank finds a NaN or an infinity."""
    bad, count = nonfinite_tensors(tensors), len(tensors)
    if info.distributed and dist.is_initialized():
        found: list[Any] = [None] * info.world_size
        dist.all_gather_object(found, (bad, count))
        bad = list(dict.fromkeys(name for names, _ in found for name in names))
        count = max(number for _, number in found)
    if bad:
        raise _refusal(what, bad, count)


class NonFiniteGuard:
    """Decides what a step with non-finite values does: stop the run (the default), or skip it.

    With `max_skipped_steps` 0 the optimizer update runs and the values are read after it (no extra
    wait for the device); the run then stops before anything more is written, so the update that
    spoiled the weights in memory never reaches a checkpoint or an export. With `max_skipped_steps`
    above 0 the loss and gradient norm are read before the update (`update_check`), a bad step gets
    no update (gradients are dropped, the schedule and the data move on), and the run stops at the
    (max_skipped_steps + 1)-th bad step.
    """

    def __init__(self, max_skipped_steps: int):
        self.max_skipped_steps = max_skipped_steps
        self.skipped: list[int] = []

    def update_check(self, means: Tensor) -> Callable[[Tensor], bool] | None:
        """What the backend asks before it updates (None: update without asking): given the
        gradient norm, whether `means` (the step's loss and terms, reduced over ranks) and the norm
        are finite."""
        if self.max_skipped_steps == 0:
            return None
        return lambda norm: bool(torch.isfinite(means).all() and torch.isfinite(norm).all())

    def observe(self, step: int, record: Mapping[str, Any]) -> bool:
        """Judge step `step` (counted from 1) by its record; True if it was skipped. Raises
        NonFiniteError when the run must stop."""
        bad = nonfinite_terms(record)
        if not bad:
            return False
        values = ", ".join(f"{name}={record[name]}" for name in bad)
        if len(self.skipped) < self.max_skipped_steps:
            self.skipped.append(step)
            return True
        allowed = (
            f"after skipping {len(self.skipped)} step(s) ({self.skipped}), the most train.max_skipped_steps allows"
            if self.max_skipped_steps
            else "train.max_skipped_steps is 0"
        )
        raise NonFiniteError(
            f"step {step}: non-finite {values}; the run stopped ({allowed}). Nothing of this step "
            "was saved; the checkpoints before it are intact. Lower optim.lr or the loss weights, "
            "check the recipe's gsm settings (e.g. gsm.kv_compression.tau), or set "
            "train.max_skipped_steps to skip a few bad steps"
        )
