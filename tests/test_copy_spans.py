"""`data.copy_spans`: training windows that repeat a span of themselves at a distance anywhere in the
window (far content matches for the gate), drawn from the data seed and the window's place in the
training stream, so that ranks and resumed runs see the same windows; off, nothing changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from run_helpers import GATE_RECIPE, TINY_GATE, losses, resume_after_crash

from gsm_train.config.schema import ConfigError, load_recipe
from gsm_train.data.copy_spans import copy_spans, window_generator
from gsm_train.data.streaming import StreamedBatches
from gsm_train.data.text import PackedBatches, stream_records
from gsm_train.models.model_zoo import byte_tokenizer
from gsm_train.train import train_recipe
from gsm_train.training.distributed import DistInfo
from gsm_train.training.training_data import SpanCopiedBatches, load_training_data

ONE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
SEQ = 64


def _repeats(window: torch.Tensor, length: int) -> list[tuple[int, int]]:
    """(s, d) of every pair of equal spans of `length` tokens, d >= s + length, in a window whose
    tokens were all different before the copies."""
    size = len(window)
    return [
        (s, d)
        for s in range(size - length + 1)
        for d in range(s + length, size - length + 1)
        if torch.equal(window[s : s + length], window[d : d + length])
    ]


def test_one_copy_repeats_a_span_within_the_bounds() -> None:
    distances = []
    for seed in range(300):
        window = torch.arange(SEQ)
        [(source, destination)] = copy_spans(window, 1, 8, window_generator(seed, 0, 0, 0))
        assert source + 8 <= destination and destination + 8 <= SEQ
        assert _repeats(window, 8) == [(source, destination)]
        kept = torch.ones(SEQ, dtype=torch.bool)
        kept[destination : destination + 8] = False
        assert torch.equal(window[kept], torch.arange(SEQ)[kept])  # only the destination is written
        distances.append(destination - source)
    # the distance is uniform over [8, 56]: both ends are drawn, and half the copies reach past the middle
    assert min(distances) == 8 and max(distances) == SEQ - 8
    assert 0.4 < sum(d > 32 for d in distances) / len(distances) < 0.6


def test_the_copied_tokens_carry_their_labels() -> None:
    window = torch.arange(SEQ)
    window[::2] = -1 - window[::2]  # chat data: a token outside the loss is stored marked (`chat_data`)
    marked = window.clone()
    [(source, destination)] = copy_spans(window, 1, 5, window_generator(3, 0, 0, 0))
    assert torch.equal(window[destination : destination + 5], marked[source : source + 5])


def test_the_draws_follow_the_seed_and_the_window_s_place() -> None:
    def copies(*place: int) -> list[tuple[int, int]]:
        return copy_spans(torch.arange(4096), 4, 32, window_generator(*place))

    assert copies(0, 1, 2, 3) == copies(0, 1, 2, 3)
    others = [copies(1, 1, 2, 3), copies(0, 2, 2, 3), copies(0, 1, 3, 3), copies(0, 1, 2, 4), copies(-1, 1, 2, 3)]
    assert all(other != copies(0, 1, 2, 3) for other in others)
    assert len({tuple(other) for other in others}) == len(others)
    with pytest.raises(ValueError, match="spans of 33 tokens do not fit twice in a window of 64"):
        copy_spans(torch.arange(SEQ), 1, 33, window_generator(0, 0, 0, 0))


def _packed(world_size: int = 1, rank: int = 0, batch: int = 4) -> PackedBatches:
    rows = torch.arange(40 * SEQ, dtype=torch.int32).view(40, SEQ)  # every token of every row different
    return PackedBatches(rows, batch, seed=5, rank=rank, world_size=world_size)


def _copied(batches, count: int = 2) -> SpanCopiedBatches:
    return SpanCopiedBatches(batches, count=count, length=6, seed=11)


def test_each_window_repeats_spans_and_no_two_windows_alike() -> None:
    plain, copied = _packed(), _copied(_packed(), count=1)
    spans = set()
    for _ in range(25):  # two epochs and more: the rows come again, with other spans
        batch, original = copied.next_batch(), plain.next_batch()
        for window, row in zip(batch, original):
            [(source, destination)] = _repeats(window, 6)
            assert torch.equal(window[destination : destination + 6], row[source : source + 6])
            spans.add((int(row[0]), source, destination))
    assert copied.epoch == plain.epoch == 2 and len(spans) == 100


def test_ranks_get_the_windows_one_process_gets() -> None:
    single = _copied(_packed(batch=6))
    ranks = [_copied(_packed(world_size=3, rank=rank, batch=2)) for rank in range(3)]
    for _ in range(15):  # over epochs
        assert torch.equal(torch.cat([r.next_batch() for r in ranks]), single.next_batch())


def test_a_resumed_iterator_gives_the_same_windows() -> None:
    straight = _copied(_packed())
    reference = [straight.next_batch() for _ in range(20)]
    for stop in (3, 10, 11):
        interrupted = _copied(_packed())
        for _ in range(stop):
            interrupted.next_batch()
        resumed = _copied(_packed())
        resumed.load_state_dict(json.loads(json.dumps(interrupted.state_dict())))
        assert all(torch.equal(resumed.next_batch(), batch) for batch in reference[stop:]), stop


def test_streamed_windows_get_the_spans_packed_ones_get(tmp_path: Path) -> None:
    """The place of a window, not its path: the stream's rows in order are the packed rows walked in order."""
    words = (" ".join(str(i * 37 + j) for j in range(9 + i % 5)) for i in range(40))
    text = "".join(json.dumps({"text": line}) + "\n" for line in words)
    (tmp_path / "corpus.jsonl").write_text(text)
    streamed = StreamedBatches(stream_records(str(tmp_path)), byte_tokenizer(), 16, 2, rank=1, world_size=2)
    plain = StreamedBatches(stream_records(str(tmp_path)), byte_tokenizer(), 16, 2, rank=1, world_size=2)
    copied = SpanCopiedBatches(streamed, count=1, length=4, seed=0)
    for step in range(3):
        windows, rows = copied.next_batch(), plain.next_batch()
        for index in range(2):
            expected = rows[index].clone()
            copy_spans(expected, 1, 4, window_generator(0, 0, step, 2 + index))
            assert torch.equal(windows[index], expected) and not torch.equal(expected, rows[index])
    resumed = SpanCopiedBatches(
        StreamedBatches(stream_records(str(tmp_path)), byte_tokenizer(), 16, 2, rank=1, world_size=2), 1, 4, 0
    )
    resumed.load_state_dict(copied.state_dict())
    assert torch.equal(resumed.next_batch(), copied.next_batch())


def _tiny(*overrides: str):
    return load_recipe(GATE_RECIPE, [*TINY_GATE, *overrides])


def test_off_the_training_data_is_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GSM_TOKEN_CACHE", str(tmp_path))
    config = _tiny()
    assert config.data.copy_spans.count == 0
    off = load_training_data(config, byte_tokenizer(), ONE)
    assert type(off.batches) is PackedBatches  # not wrapped: the batches are today's, byte for byte
    on = load_training_data(_tiny("data.copy_spans.count=3", "data.copy_spans.length=8"), byte_tokenizer(), ONE)
    assert isinstance(on.batches, SpanCopiedBatches) and torch.equal(on.eval_rows, off.eval_rows)
    assert on.batches.state_dict() == off.batches.state_dict()
    copied, plain = on.batches.next_batch(), off.batches.next_batch()
    changed = (copied != plain).sum(dim=1)
    assert bool((changed > 0).all()) and bool((changed <= 3 * 8).all())


def test_the_recipe_refuses_spans_that_do_not_fit() -> None:
    assert _tiny("data.copy_spans.count=2").data.copy_spans.count == 2
    assert _tiny("data.copy_spans.count=1", "data.copy_spans.length=32").data.copy_spans.length == 32
    with pytest.raises(ConfigError) as refused:
        _tiny("data.copy_spans.count=1", "data.copy_spans.length=33")
    assert "- data.copy_spans: length (33) does not fit twice in a window of data.seq_len (64)" in str(
        refused.value
    ) and "fix: set data.copy_spans.length to at most 32, or data.copy_spans.count=0" in str(refused.value)
    assert _tiny("data.copy_spans.length=33").data.copy_spans.count == 0  # off: no span is copied
    with pytest.raises(ConfigError) as refused:
        _tiny("data.copy_spans.count=-1", "data.copy_spans.length=0", "data.copy_spans.size=4")
    text = str(refused.value)
    assert "data.copy_spans.count" in text and "data.copy_spans.length" in text
    assert "data.copy_spans.size" in text and "allowed keys here: count, length" in text


def test_a_run_with_copied_spans_resumes_exactly(tmp_path: Path) -> None:
    steps = [*TINY_GATE, "data.copy_spans.count=2", "data.copy_spans.length=8", "train.steps=4"]
    straight, resumed = resume_after_crash(GATE_RECIPE, [*steps, "output.checkpoint_every=2"], tmp_path, step=2)
    assert resumed.losses == losses(straight)[2:]
    plain = train_recipe(GATE_RECIPE, [*steps, "data.copy_spans.count=0", f"output.dir={tmp_path / 'plain'}"])
    assert plain.losses[0] != losses(straight)[0]  # the run trained on the copied windows
