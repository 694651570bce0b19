"""Where a prompt's prefill time goes (time to first token at batch 1): the dense model through transformers
(`dense_eager`, its own dynamic cache, the prompt in one forward), through the dense engine
(`dense_engine`: `gsm_train.inference.dense_engine`, flash prefill in chunks of its PREFILL_CHUNK) and GSM's
prefill as `model.generate` runs it (`gsm`: `enable_gsm_generation`'s chunked prefill into a fresh
`GSMCache`, `--prefill dense|sparse`, `--chunk` prompt tokens per forward), of the same random prompt; and
`gsm_pytorch_pack`, GSM's prefill again with the cache's blocks packed in PyTorch instead of by the packing
kernel (`gsm_train.kernels.asq_pack`; the same where that kernel does not run: the CPU), its A/B in one run.

Per method, after `--warmup` calls: `wall_ms`, the median over `--repeats` calls of the wall time from the
call to its result on the device (synchronized); on CUDA `kernel_ms`, the GPU time of the kernels one call
ran (torch.profiler), so `gpu_busy` = kernel_ms / wall_ms well below 1 says the prefill waits on the host
issuing kernels (launch-bound), not on the GPU, and there `host_op_ms` and `host_ops`, the ops' own CPU time
(what issuing each costs the host; the largest HOST_TOP by op), say where the host spends it, and `idle`
(`benchmarks.gpu_idle`: the GPU's idle gaps of one call, each put on the function that launched late what
ended it) where the GPU waits for it; the per-kernel table (name, calls, microseconds, share) of one call
(on the CPU the ops' own CPU time instead: a smoke test, not a figure); and, eagerly, the aten ops one call
runs (`ops`: views left out, `host_syncs`: the ops that make the host wait for the device, and
`ops_by_part`: GSM's ops by the part of the prefill that runs them, `PARTS`; `us_per_op`: wall time over
ops, near what issuing one eager op costs when the prefill is launch-bound). Resumable as
benchmarks.decode_step_profile is (it shares its model shapes, profiler and op counter).

`--model smollm2` (the default): random weights at SmolLM2-135M's shapes with recipes/joint_long.yaml's
GSM modules (the 8k export's); `8b`: Llama-3-8B's shapes with recipes/joint.yaml's; `tiny`: the tiny Llama
(tests). Gates at random: timing does not depend on the weights.

    python -m benchmarks.prefill_profile --result OUT.json [--model smollm2|8b|tiny] [--context 8144]
        [--prefill dense] [--chunk N] [--repeats 3] [--warmup 1] [--top 25] [--device cuda|cpu]
        [--methods dense_engine gsm ...]

`--methods` picks the methods run (default: all four; on an H100 the 8B shape's `dense_eager` at 16k-32k ran
out of memory, docs/results.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from benchmarks.common import write_result
from benchmarks.decode_step_profile import (
    OpCounter,
    attach_gsm,
    load_result,
    print_kernels,
    profile_model,
    profile_step,
    prompt_ids,
    run_methods,
    say,
)
from benchmarks.gpu_idle import idle_gaps, profiled_trace
from gsm_train.inference import prefill
from gsm_train.inference.cache import DEFAULT_PREFILL, PREFILL_MODES, GSMCache, cache_kwargs
from gsm_train.inference.dense_engine import DenseEngine
from gsm_train.inference.engine import PREFILL_CHUNKS, enable_gsm_generation
from gsm_train.kernels import asq_pack

METHODS = ("dense_eager", "dense_engine", "gsm", "gsm_pytorch_pack")
DENSE_METHODS = METHODS[:2]
HOST_SYNCS = ("aten._local_scalar_dense.default", "aten.nonzero.default", "aten.item.default")
HOST_TOP = 25  # ops kept in a CUDA method's host table
# GSM's prefill by part: the gsm_train function on the stack (innermost first; by name, or a method by its
# qualified name) that names the part an op runs for
PARTS = {
    "pack_blocks": "asq_pack",
    "packed_together": "asq_pack",
    "DeferredEncodings._pack_blocks": "asq_pack",
    "DeferredEncodings.flush": "gate_keys",
    "write_all": "cache_update",
    "_keys_as_seen": "earlier_chunks_dequantized",
    "run_gate": "gate_keys",
    "lazy_initialization": "cache_buffers",
    "update": "cache_update",
    "dense_chunk_attention": "chunk_attention",
    "chunk_attention": "chunk_attention",
    "begin_forward": "cache_begin_forward",
    "gsm_mask": "mask",
    "GSMCache.__init__": "cache_construction",
}
OTHER_PART = "model"  # the base model's own ops (and anything not named in PARTS)


def part_of_caller() -> str:
    """The `PARTS` name of the gsm_train function nearest on the stack that `PARTS` names, else OTHER_PART."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if frame.f_globals.get("__name__", "").startswith("gsm_train."):
            part = PARTS.get(code.co_name) or PARTS.get(code.co_qualname)
            if part is not None:
                return part
        frame = frame.f_back
    return OTHER_PART


class PartCounter(OpCounter):
    """`OpCounter` that also counts the ops by prefill part (`parts`, `part_of_caller`)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.parts: Counter = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        before = self.current.total()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.current.total() > before:  # counted (not a view)
            self.parts[part_of_caller()] += 1
        return out


@contextmanager
def _bias_outside_modes() -> Iterator[None]:
    """Within: `prefill.causal_lower_right` makes its bias outside any dispatch mode (a tensor subclass cannot
    be made while `OpCounter` dispatches; the bias is a Python object that launches nothing)."""
    original = prefill.causal_lower_right

    def outside(*args: Any) -> Any:
        with _disable_current_modes():
            return original(*args)

    prefill.causal_lower_right = outside
    try:
        yield
    finally:
        prefill.causal_lower_right = original


def count_prefill_ops(call: Callable[[], object], model: nn.Module) -> dict:
    """The aten ops one `call` runs (views aside): `ops` in all, `per_layer`, `host_syncs` (by op),
    `ops_by_part` (largest first)."""
    with torch.no_grad(), _bias_outside_modes(), PartCounter(model) as counter:
        call()
    every = sum(counter.layers, Counter()) + counter.outside
    return {
        "ops": every.total(),
        "per_layer": [layer.total() for layer in counter.layers],
        "host_syncs": {op: every[op] for op in HOST_SYNCS if every[op]},
        "ops_by_part": dict(counter.parts.most_common()),
    }


def prefill_call(method: str, model: nn.Module, ids: torch.Tensor) -> Callable[[], object]:
    """One batch's prefill of `ids` [B, T] by `method` into a fresh cache, its last position's logits (the
    model must carry GSM's modules and generation for `gsm`, and none for the others)."""
    ones = torch.ones_like(ids)
    if method == "dense_engine":
        engine = DenseEngine(model)
        return lambda: engine.prefill(engine.new_cache(ids.shape[0], ids.shape[1] + 1), ids)
    if method == "dense_eager":
        return lambda: model(input_ids=ids, attention_mask=ones, use_cache=True, logits_to_keep=1).logits

    def gsm() -> torch.Tensor:
        # every layer's blocks packed together after the forward, as on a GPU (the default there), on the CPU too
        cache = GSMCache(model, capacity=ids.shape[1] + 1, pack_after_forward=True)
        kwargs = cache_kwargs(model, cache)
        return model(input_ids=ids, attention_mask=ones, use_cache=True, logits_to_keep=1, **kwargs).logits

    return gsm


def wall_ms(call: Callable[[], object], repeats: int) -> float:
    """Median wall time of `call` in ms, from the call to its result on the device."""
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def measure_prefill(call: Callable[[], object], model: nn.Module, warmup: int, repeats: int) -> dict:
    """One method's figures (module docstring)."""
    cuda = next(model.parameters()).is_cuda
    with torch.no_grad():
        for _ in range(warmup):
            call()
        figures = {"wall_ms": wall_ms(call, repeats)}
        kernels = profile_step(call, 1, cuda)
    busy_us = sum(row["total_us"] for row in kernels)
    if cuda:
        figures |= {"kernel_ms": busy_us / 1000, "gpu_busy": busy_us / 1000 / figures["wall_ms"]}
        host = profile_step(call, 1, cuda=False)  # the ops' own CPU time: what issuing them costs the host
        figures |= {"host_op_ms": sum(row["total_us"] for row in host) / 1000, "host_ops": host[:HOST_TOP]}
        figures["idle"] = idle_gaps(profiled_trace(call), top=HOST_TOP)  # where the GPU waits on the host
    figures["kernel_launches"] = sum(row["calls"] for row in kernels) if cuda else None
    figures |= count_prefill_ops(call, model)
    return figures | {"us_per_op": figures["wall_ms"] * 1000 / figures["ops"], "kernels": kernels}


def print_prefill(method: str, figures: dict, top: int) -> None:
    """A method's summary line, its ops by part and its kernel table."""
    busy = (
        f", kernels {figures['kernel_ms']:.1f} ms (GPU busy {figures['gpu_busy']:.2f})"
        if "kernel_ms" in figures
        else ""
    )
    ops = f"{figures['ops']} ops ({figures['us_per_op']:.1f} us of wall time an op)"
    print(f"\n{method}: {figures['wall_ms']:.1f} ms wall{busy}; {ops}, host syncs {figures['host_syncs']}")
    if "host_op_ms" in figures:
        largest = ", ".join(f"{row['name']} {row['total_us']:.0f} us" for row in figures["host_ops"][:5])
        print(f"  host: the ops' own CPU time {figures['host_op_ms']:.1f} ms; the largest: {largest}")
    if "idle" in figures:
        idle = figures["idle"]
        waits = ", ".join(f"{row['function']} {row['idle_us']:.0f} us" for row in idle["by_function"][:5])
        print(f"  GPU idle {idle['idle_us'] / 1000:.1f} ms in {idle['gaps']} gaps; launched late by: {waits}")
    print("  ops by part: " + ", ".join(f"{part} {n}" for part, n in figures["ops_by_part"].items()))
    print_kernels(figures["kernels"], top)


def ratios(result: dict) -> dict[str, float]:
    """GSM's wall time and op count over each dense method's, where both were measured."""
    gsm = result.get("gsm")
    if gsm is None:
        return {}
    out = {}
    for method in DENSE_METHODS:
        if method in result:
            out[f"wall_gsm_over_{method}"] = gsm["wall_ms"] / result[method]["wall_ms"]
            out[f"ops_gsm_over_{method}"] = gsm["ops"] / result[method]["ops"]
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--result", required=True)
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "8b", "tiny"])
    parser.add_argument("--context", type=int, default=8144, help="prompt tokens (default: the H100 row's 8144)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prefill", choices=PREFILL_MODES, default=DEFAULT_PREFILL)
    parser.add_argument(
        "--chunk", type=int, default=None, help=f"GSM's prompt tokens per forward (default: by mode, {PREFILL_CHUNKS})"
    )
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="the methods run")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda where there is one")
    args = parser.parse_args(argv)
    for name in ("context", "batch", "chunk", "repeats"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    settings = {k: getattr(args, k) for k in ("model", "context", "batch", "prefill", "chunk", "warmup", "repeats")}
    path = Path(args.result)
    result = load_result(path, settings | {"device": device})
    model = profile_model(args.model, device)
    ids = prompt_ids(model, args.batch, args.context)

    def method(name: str) -> tuple[str, Callable[[], dict]]:
        def run() -> dict:
            if name.startswith("gsm"):
                attach_gsm(model, args.model)
                enable_gsm_generation(model, prefill=args.prefill, prefill_chunk=args.chunk)
            say(f"{name}: prefill of {args.context} tokens, {args.warmup} warm-up, {args.repeats} timed, 1 profiled")
            if name == "gsm_pytorch_pack":  # the A/B of the packing kernel: the same prefill, packed in PyTorch
                with mock.patch.object(asq_pack, "kernel_runs", return_value=False):
                    return measure_prefill(prefill_call("gsm", model, ids), model, args.warmup, args.repeats)
            return measure_prefill(prefill_call(name, model, ids), model, args.warmup, args.repeats)

        return name, run

    run_methods(path, result, [method(name) for name in args.methods], lambda name, f: print_prefill(name, f, args.top))
    result["ratios"] = ratios(result)
    print("\n" + ", ".join(f"{k} {v:.2f}" for k, v in result["ratios"].items()))
    write_result(path, result)


if __name__ == "__main__":
    main()
