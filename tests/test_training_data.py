"""Data for large corpora: token rows tokenized once per node and memory-mapped from the token cache
(keyed by the data, the tokenizer and seq_len), `data.num_proc`, and `data.streaming` for text
larger than memory, whose batches are the packed rows in order and resume exactly."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from run_helpers import GATE_RECIPE, REPO, TINY_GATE, losses, resume_after_crash, torchrun

from gsm_train.config.schema import ConfigError, DataSourceConfig, load_recipe
from gsm_train.data.streaming import StreamedBatches, first_rows
from gsm_train.data.text import DataError, PackedBatches, load_text_dataset, pack_tokens, stream_records
from gsm_train.models.model_zoo import byte_tokenizer
from gsm_train.training import token_cache
from gsm_train.training.distributed import DistInfo

ONE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
SOURCE = "embedded:sample_prose"


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "tokens"
    monkeypatch.setenv("GSM_TOKEN_CACHE", str(folder))
    return folder


@pytest.fixture
def counted_packing(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of rows of each `pack_tokens` call the token cache makes."""
    calls: list[int] = []
    pack = token_cache.pack_tokens

    def counted(*args, **kwargs):
        rows = pack(*args, **kwargs)
        calls.append(len(rows))
        return rows

    monkeypatch.setattr(token_cache, "pack_tokens", counted)
    return calls


def _jsonl(path: Path, count: int, words: int = 9) -> Path:
    path.write_text(
        "".join(json.dumps({"text": f"record {i} " + "word " * (words + i % 5)}) + "\n" for i in range(count))
    )
    return path


def test_cached_rows_are_the_packed_rows_tokenized_once(fresh_cache: Path, counted_packing: list[int]) -> None:
    tokenizer = byte_tokenizer()
    expected = pack_tokens(load_text_dataset(SOURCE), tokenizer, 64)
    first = token_cache.cached_rows(DataSourceConfig(path=SOURCE), tokenizer, 64, ONE)
    again = token_cache.cached_rows(DataSourceConfig(path=SOURCE), tokenizer, 64, ONE)
    assert first.dtype == torch.int32 and torch.equal(first.long(), expected) and torch.equal(again, first)
    assert counted_packing == [len(expected)], "the second call read the cache"
    assert sorted(p.suffix for p in fresh_cache.iterdir()) == [".json", ".tokens"]
    assert _mapped_from(again, next(fresh_cache.glob("*.tokens")))


def _mapped_from(tensor: torch.Tensor, path: Path) -> bool:
    """Whether the tensor's memory is a mapping of the file `path` (Linux: /proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *_, name = line.split(maxsplit=5)
        start, end = (int(bound, 16) for bound in span.split("-"))
        if name.strip() == str(path) and start <= tensor.data_ptr() < end:
            return True
    return False


def test_a_changed_source_tokenizer_or_seq_len_is_tokenized_again(
    fresh_cache: Path, tmp_path: Path, counted_packing: list[int]
) -> None:
    data = _jsonl(tmp_path / "data.jsonl", 40)
    source, tokenizer = DataSourceConfig(path=str(data)), byte_tokenizer()
    token_cache.cached_rows(source, tokenizer, 16, ONE)
    token_cache.cached_rows(source, tokenizer, 32, ONE)
    other = byte_tokenizer()
    other.eos_token = "Ā"  # another token ends documents
    token_cache.cached_rows(source, other, 16, ONE)
    _jsonl(data, 41)  # the file changes
    rows = token_cache.cached_rows(source, tokenizer, 16, ONE)
    assert len(counted_packing) == 4 and len(list(fresh_cache.glob("*.tokens"))) == 4
    assert torch.equal(rows.long(), pack_tokens(load_text_dataset(str(data)), tokenizer, 16))


def test_num_proc_tokenizes_the_same_rows(fresh_cache: Path, tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "data.jsonl", 60)
    config = load_recipe(GATE_RECIPE, [*TINY_GATE, f"data.train.path={data}", "data.num_proc=2"])
    rows = token_cache.cached_rows(config.data.train, byte_tokenizer(), 16, ONE, config.data.num_proc)
    assert torch.equal(rows.long(), pack_tokens(load_text_dataset(str(data)), byte_tokenizer(), 16))


def test_the_ranks_of_a_node_tokenize_once(fresh_cache: Path) -> None:
    proc = torchrun(3, [str(REPO / "tests" / "token_cache_ranks.py"), SOURCE, "64"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(re.findall(r"rank (\d) tokenized (\d+) rows ([0-9a-f]{64})", proc.stdout))
    assert [(rank, calls) for rank, calls, _ in lines] == [("0", "1"), ("1", "0"), ("2", "0")], proc.stdout
    assert len({digest for *_, digest in lines}) == 1


def test_packed_batches_walk_row_ids_as_the_rows_they_name() -> None:
    rows = torch.arange(40 * 3, dtype=torch.int32).view(40, 3)
    ids = torch.tensor([i for i in range(40) if i % 4])
    subset = PackedBatches(rows[ids], 2, seed=3, rank=1, world_size=2)
    walked = PackedBatches(rows, 2, seed=3, rank=1, world_size=2, row_ids=ids)
    assert walked.state_dict() == subset.state_dict()
    for _ in range(20):  # across epochs
        batch = walked.next_batch()
        assert batch.dtype == torch.long and torch.equal(batch, subset.next_batch().long())


# --- streaming -----------------------------------------------------------------------------


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """Records over three files: the stream crosses files and documents within rows."""
    for index in range(3):
        _jsonl(tmp_path / f"part{index}.jsonl", 30 + index)
    return tmp_path


def _packed(corpus: Path, seq_len: int) -> torch.Tensor:
    return pack_tokens(load_text_dataset(str(corpus)), byte_tokenizer(), seq_len)


def _streamed(corpus: Path, batch: int, **layout) -> StreamedBatches:
    return StreamedBatches(stream_records(str(corpus)), byte_tokenizer(), 16, batch, **layout)


def test_streamed_batches_are_the_packed_rows_in_order_shared_by_rank(corpus: Path) -> None:
    rows = _packed(corpus, 16)
    ranks = [_streamed(corpus, 2, rank=rank, world_size=3) for rank in range(3)]
    steps = len(rows) // 6
    walked = torch.cat([torch.cat([r.next_batch() for r in ranks]) for _ in range(steps)])
    assert walked.dtype == torch.long and torch.equal(walked, rows[: steps * 6])
    again = torch.cat([r.next_batch() for r in ranks])  # the next epoch starts over
    assert torch.equal(again, rows[:6]) and ranks[0].epoch == 1 and ranks[0].position == 1


def test_a_streamed_position_resumes_exactly_mid_document(corpus: Path) -> None:
    straight = _streamed(corpus, 3, skip_rows=4)
    reference = [straight.next_batch() for _ in range(40)]  # over two epochs
    for stop in (1, 7, 23, 29):
        interrupted = _streamed(corpus, 3, skip_rows=4)
        for _ in range(stop):
            interrupted.next_batch()
        state = json.loads(json.dumps(interrupted.state_dict()))
        resumed = _streamed(corpus, 3, skip_rows=4)
        resumed.load_state_dict(state)
        assert all(torch.equal(resumed.next_batch(), batch) for batch in reference[stop:]), stop
    assert any(_streamed_offset(corpus, stop) > 0 for stop in (1, 7)), "a resume inside a document"


def _streamed_offset(corpus: Path, steps: int) -> int:
    batches = _streamed(corpus, 3)
    for _ in range(steps):
        batches.next_batch()
    return batches.state_dict()["offset"]


def test_streamed_held_out_rows_are_the_first_and_training_skips_them(corpus: Path) -> None:
    rows = _packed(corpus, 16)
    held_out = first_rows(stream_records(str(corpus)), byte_tokenizer(), 16, 5)
    assert torch.equal(held_out, rows[:5])
    assert torch.equal(_streamed(corpus, 2, skip_rows=5).next_batch(), rows[5:7])


def test_streaming_errors(corpus: Path) -> None:
    with pytest.raises(DataError, match="fewer than one global batch of 400 rows"):
        _streamed(corpus, 400).next_batch()
    with pytest.raises(DataError, match="field 'body' is missing from a record"):
        StreamedBatches(stream_records(str(corpus)), byte_tokenizer(), 16, 1, fields=["body"]).next_batch()
    packed_state = PackedBatches(torch.zeros(8, 16, dtype=torch.long), 2, seed=0).state_dict()
    with pytest.raises(DataError, match="of packed rows, not of a stream"):
        _streamed(corpus, 2).load_state_dict(packed_state)
    with pytest.raises(
        ConfigError,
        match=r"- data: streaming: true reads.* eval_rows \(0.1\) cannot be a "
        r"fraction.*\n.*fix: set data.eval_rows to a number of rows",
    ):
        load_recipe(GATE_RECIPE, [*TINY_GATE, "data.streaming=true"])


def test_a_streamed_run_resumes_exactly(tmp_path: Path) -> None:
    steps = [
        *TINY_GATE,
        "data.streaming=true",
        "data.eval_rows=4",
        "train.steps=6",
        "output.checkpoint_every=3",
    ]
    straight, resumed = resume_after_crash(GATE_RECIPE, steps, tmp_path, step=3)
    assert resumed.losses == losses(straight)[3:]
