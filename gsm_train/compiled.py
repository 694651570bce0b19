"""torch.compile for the training paths on the GPU, once per function; CUDA graph capture for every path
that replays one (`captured`).

Training steps have one shape, so each path compiles with static shapes and runs as a few fused
kernels instead of dozens of small ones (and their backward). Callers use `compiled(fn)` on the GPU
in training and `fn` as written elsewhere (CPU, evaluation and generation, whose lengths change).
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)
Out = TypeVar("Out")


@functools.cache
def compiled(fn: F, mode: str | None = None) -> F:
    """`fn` compiled by torch.compile (static shapes; `mode` as torch.compile takes it), built once per
    function, mode and process."""
    return torch.compile(fn, dynamic=False, mode=mode)


def _nothing_to_reset() -> None:
    """`captured`'s default `reset`: `run` changes nothing a later call would see."""


def captured(
    run: Callable[[], Out], reset: Callable[[], None] = _nothing_to_reset, warmups: int = 2
) -> tuple[torch.cuda.CUDAGraph, Out]:
    """`run` captured in a CUDA graph, and what it returned (buffers each replay overwrites): `warmups` eager
    calls first on a side stream (Triton compiles and autotunes, libraries build their handles), each followed
    by `reset()` (which puts back what `run` changed), then the capture (which runs nothing), then `reset()`.

    Python's garbage collector is paused during the capture: a reference cycle it collected there could hold
    an earlier CUDA graph, whose destruction is not permitted while a stream captures and invalidates the
    capture ("operation failed due to a previous error during capture"; torch.cuda.graph no longer collects
    before it captures). Where the capture fails, the stream current before it is current again (torch leaves
    its capture stream current when ending the capture raises)."""
    graph = torch.cuda.CUDAGraph()
    before = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(before)
    with torch.cuda.stream(side):
        for _ in range(warmups):
            run()
            reset()
    before.wait_stream(side)
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph):
            out = run()
    finally:
        if collecting:
            gc.enable()
        torch.cuda.set_stream(before)
    reset()
    return graph, out
