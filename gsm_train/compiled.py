"""torch.compile for the training paths on the GPU, once per function.

Training steps have one shape, so each path compiles with static shapes and runs as a few fused
kernels instead of dozens of small ones (and their backward). Callers use `compiled(fn)` on the GPU
in training and `fn` as written elsewhere (CPU, evaluation and generation, whose lengths change).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


@functools.cache
def compiled(fn: F, mode: str | None = None) -> F:
    """`fn` compiled by torch.compile (static shapes; `mode` as torch.compile takes it), built once per
    function, mode and process."""
    return torch.compile(fn, dynamic=False, mode=mode)
