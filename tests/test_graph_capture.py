"""`gsm_train.compiled.captured`, which every CUDA graph of the package goes through (token steps, the dense
engine's step, block packs, training steps): a capture survives garbage the collector would free within it,
and a capture that fails leaves the process as it found it (GPU only: graphs need CUDA)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch

from gsm_train.compiled import captured

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.fixture
def collect_often() -> Iterator[None]:
    """Python's collector run at almost every allocation of a container (restored after)."""
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


def test_an_earlier_graph_in_a_reference_cycle_does_not_break_a_capture(collect_often: None) -> None:
    """An earlier graph left in a reference cycle is garbage the collector would destroy during the next
    capture (not permitted while a stream captures): the capture pauses it, and replays right."""
    counter = torch.zeros(4, device="cuda")
    earlier, _ = captured(lambda: counter.add_(1))
    cycle: dict = {"graph": earlier}
    cycle["self"] = cycle
    del earlier, cycle
    values = torch.arange(4.0, device="cuda")

    def doubled() -> torch.Tensor:
        [[] for _ in range(50)]  # containers: each one would give the collector its turn
        return values * 2

    graph, out = captured(doubled)
    values.copy_(torch.tensor([5.0, 6.0, 7.0, 8.0]))
    graph.replay()
    assert torch.equal(out, torch.tensor([10.0, 12.0, 14.0, 16.0], device="cuda"))
    assert gc.isenabled()
    gc.collect()  # the cycle goes now, outside any capture


def test_a_failed_capture_gives_back_the_stream_and_the_collector() -> None:
    """A capture whose function raises ends with the stream current before it current again and the
    collector on, so the process's later work does not run on a dead capture stream."""
    before = torch.cuda.current_stream()
    calls = []

    def fails_in_the_capture() -> torch.Tensor:
        calls.append(torch.cuda.is_current_stream_capturing())
        if calls[-1]:
            raise RuntimeError("refused inside the capture")
        return torch.ones(1, device="cuda")

    with pytest.raises(RuntimeError, match="refused inside the capture"):
        captured(fails_in_the_capture, warmups=1)
    assert calls == [False, True]
    assert torch.cuda.current_stream() == before and not torch.cuda.is_current_stream_capturing()
    assert gc.isenabled()
    assert torch.equal(torch.ones(2, device="cuda") * 3, torch.full((2,), 3.0, device="cuda"))
