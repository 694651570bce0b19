"""benchmarks.gpu_idle on a small Chrome trace of the profiler's shape: the device's gaps, each put on the host
op and the project's function that launched the activity ending it; spans nest per thread."""

from __future__ import annotations

from benchmarks.gpu_idle import idle_gaps, innermost_spans


def _span(cat: str, name: str, ts: float, dur: float, tid: int = 1, **args: object) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def _trace() -> dict:
    """Host: forward (0-100) > flush (40-90) > aten::cat (50-60); two kernels launched at 5 and 55, one at 95.
    Device: kernel A 10-20, kernel B 70-75 (50 us idle before it: launched inside flush's cat), kernel C 95.5-99
    (20.5 us idle, launched in forward after flush)."""
    return {
        "traceEvents": [
            _span("python_function", "/tmp/w/gsm_train/model.py(1): forward", 0, 100),
            _span("python_function", "/tmp/w/gsm_train/attention/kv_store.py(423): flush", 40, 50),
            _span("python_function", "torch/functional.py(9): cat", 50, 10),  # not the project's: not blamed
            _span("cpu_op", "aten::mm", 2, 5),
            _span("cpu_op", "aten::cat", 50, 10),
            _span("cuda_runtime", "cudaLaunchKernel", 5, 1, correlation=1),
            _span("cuda_runtime", "cudaLaunchKernel", 55, 1, correlation=2),
            _span("cuda_runtime", "cudaLaunchKernel", 95, 0.5, correlation=3),
            _span("kernel", "A", 10, 10, tid=7, correlation=1),
            _span("kernel", "B", 70, 5, tid=7, correlation=2),
            _span("kernel", "C", 95.5, 3.5, tid=7, correlation=3),
            {"ph": "i", "cat": "kernel", "name": "marker", "ts": 80},  # not a span: left out
        ]
    }


def test_each_gap_is_put_on_what_launched_the_activity_after_it() -> None:
    idle = idle_gaps(_trace(), top=5)
    assert idle["gaps"] == 2 and idle["idle_us"] == 50 + 20.5
    assert idle["largest"][0] == {
        "gap_us": 50,
        "next": "B",
        "host_op": "aten::cat",
        "function": "/tmp/w/gsm_train/attention/kv_store.py(423): flush",
    }
    assert idle["largest"][1]["host_op"] is None  # launched outside any aten op
    assert idle["largest"][1]["function"] == "/tmp/w/gsm_train/model.py(1): forward"
    assert [row["idle_us"] for row in idle["by_function"]] == [50, 20.5]


def test_innermost_spans_follow_each_thread_s_nesting() -> None:
    spans = [_span("cpu_op", "outer", 0, 100), _span("cpu_op", "first", 10, 10), _span("cpu_op", "second", 30, 10)]
    spans.append(_span("cpu_op", "other thread", 0, 100, tid=2))
    found = innermost_spans(spans, [(15, 1), (25, 1), (35, 1), (150, 1), (15, 2), (15, 3)])
    names = [span["name"] if span else None for span in found]
    assert names == ["first", "outer", "second", None, "other thread", None]


def test_a_trace_without_device_activity_has_no_idle_time() -> None:
    assert idle_gaps({"traceEvents": [_span("cpu_op", "aten::mm", 0, 5)]}) == {
        "idle_us": 0,
        "gaps": 0,
        "largest": [],
        "by_function": [],
    }
