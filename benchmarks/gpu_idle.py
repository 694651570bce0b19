"""Where a launch-bound call leaves the GPU idle, from a profiler trace (torch.profiler's Chrome trace, CPU
and CUDA activities, `with_stack=True`): the gaps between consecutive device activities (kernels, copies,
memsets) and, for each, who launched the activity that ended it late: the innermost host op enclosing its
launch (`cuda_runtime` event, matched by correlation id) and the innermost Python function of the project or
of transformers on the host stack at that moment. A prefill whose GPU is busy for a small share of its wall
time waits on the host; this names where (`benchmarks.prefill_profile` records it per method).

    trace = profiled_trace(call)            # on CUDA
    idle = idle_gaps(trace, top=15)          # {"idle_us", "gaps", "largest", "by_function"}
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
BLAMED_CODE = ("gsm_train/", "transformers/", "benchmarks/")  # Python functions a gap is put on
MIN_GAP_US = 1.0  # smaller gaps are the launch cadence itself, not a wait


def profiled_trace(call: Callable[[], object]) -> dict:
    """The Chrome trace (parsed) of one `call` under torch.profiler, CPU and CUDA activities with Python
    stacks (CUDA only)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        call()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())


def innermost_spans(spans: list[dict], moments: list[tuple[float, object]]) -> list[dict | None]:
    """For each (moment, thread) of `moments`, the innermost of the host spans (Chrome "X" events) on that
    thread that encloses the moment (ts <= moment <= ts + dur; None: none). A thread's spans nest, so one
    sweep with a stack of the open spans answers every moment."""
    by_thread: dict[object, list[dict]] = {}
    for span in spans:
        by_thread.setdefault(span.get("tid"), []).append(span)
    for thread in by_thread.values():
        thread.sort(key=lambda span: (span["ts"], -span.get("dur", 0)))  # an outer span before the inner
    found: list[dict | None] = [None] * len(moments)
    for thread, thread_spans in by_thread.items():
        asked = sorted((moment, at) for at, (moment, tid) in enumerate(moments) if tid == thread)
        stack: list[dict] = []
        following = 0
        for moment, at in asked:
            while following < len(thread_spans) and thread_spans[following]["ts"] <= moment:
                span = thread_spans[following]
                while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) < span["ts"]:
                    stack.pop()  # closed before this one opened
                stack.append(span)
                following += 1
            while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) < moment:
                stack.pop()
            found[at] = stack[-1] if stack else None
    return found


def _blamed(name: str) -> bool:
    return any(part in name for part in BLAMED_CODE)


def idle_gaps(trace: dict, top: int = 15) -> dict:
    """The device's idle time between its first and last activity in `trace` (`idle_us`, gaps of at least
    `MIN_GAP_US`), their count (`gaps`), the `top` largest (`largest`: gap, the activity that ended it, the
    host op and the project / transformers function that launched it) and the idle time summed by that
    function (`by_function`, largest first; "(none)" where no such function was on the stack)."""
    events = [event for event in trace.get("traceEvents", []) if event.get("ph") == "X"]
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda event: event["ts"])
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    functions = [e for e in events if e.get("cat") == "python_function" and _blamed(e.get("name", ""))]
    ended: list[tuple[float, dict]] = []  # (gap, the activity that ended it)
    busy_until = device[0]["ts"] + device[0].get("dur", 0) if device else 0.0
    for activity in device[1:]:
        gap = activity["ts"] - busy_until
        busy_until = max(busy_until, activity["ts"] + activity.get("dur", 0))
        if gap >= MIN_GAP_US:
            ended.append((gap, activity))
    launched = [launches.get(activity.get("args", {}).get("correlation")) for _, activity in ended]
    moments = [(launch["ts"], launch.get("tid")) if launch else (float("-inf"), None) for launch in launched]
    host_ops, host_functions = innermost_spans(ops, moments), innermost_spans(functions, moments)
    gaps = [
        {
            "gap_us": gap,
            "next": activity["name"][:120],
            "host_op": op["name"] if op else None,
            "function": function["name"] if function else "(none)",
        }
        for (gap, activity), op, function in zip(ended, host_ops, host_functions, strict=True)
    ]
    by_function: Counter = Counter()
    for gap in gaps:
        by_function[gap["function"]] += gap["gap_us"]
    return {
        "idle_us": sum(gap["gap_us"] for gap in gaps),
        "gaps": len(gaps),
        "largest": sorted(gaps, key=lambda gap: -gap["gap_us"])[:top],
        "by_function": [{"function": name, "idle_us": us} for name, us in by_function.most_common(top)],
    }
