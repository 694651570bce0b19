"""A run's data on this process: its share of the training batches and the held-out rows.

Packed (the default): the rows are tokenized once per node and memory-mapped by every process
(`token_cache`); the held-out rows come from `data.eval`, or are drawn out of the training rows
(`data.split_eval_ids`), which the batches then walk without them (`data.PackedBatches`). Streamed
(`data.streaming: true`): rows are cut from the text as training reads it (`streaming`); the
held-out rows are the first `data.eval_rows` rows of `data.eval`, or of the training text, whose
batches then start after them. `data.copy_spans` copies spans within each training window
(`copy_spans`; `SpanCopiedBatches`), never within the held-out rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from gsm_train.config.schema import DataConfig, DataSourceConfig, RecipeConfig
from gsm_train.data.copy_spans import copy_spans, window_generator
from gsm_train.data.streaming import StreamedBatches, first_rows
from gsm_train.data.text import PackedBatches, split_eval_ids, stream_records
from gsm_train.training.distributed import DistInfo
from gsm_train.training.token_cache import cached_rows


class Batches(Protocol):
    """This rank's training batches (`PackedBatches`, `StreamedBatches`): rank `rank`'s `batch_size`
    rows of each global batch; after `next_batch`, `epoch` is the batch's epoch and `position` the
    number of global batches taken in it, that one included."""

    global_batch_size: int
    batch_size: int
    rank: int
    epoch: int
    position: int

    def next_batch(self) -> Tensor:
        """The next [batch_size, seq_len] int64 batch."""

    def state_dict(self) -> dict[str, Any]:
        """Where the iteration stands (JSON-serializable; holds `global_batch_size`)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`."""


class SpanCopiedBatches:
    """`Batches` whose windows each get `copy_spans.copy_spans` (`count` spans of `length` tokens), drawn
    from the window's place in the global batch stream the wrapped batches walk (`window_generator`
    of the data seed, the epoch, the global batch and the row in it): the same on any rank and after a
    resume. The position (`state_dict`) is the wrapped batches' own."""

    def __init__(self, batches: Batches, count: int, length: int, seed: int) -> None:
        self.batches, self.count, self.length, self.seed = batches, count, length, seed
        self.global_batch_size, self.batch_size, self.rank = batches.global_batch_size, batches.batch_size, batches.rank

    @property
    def epoch(self) -> int:
        """The wrapped batches' epoch."""
        return self.batches.epoch

    @property
    def position(self) -> int:
        """The wrapped batches' global batches taken in the epoch."""
        return self.batches.position

    def next_batch(self) -> Tensor:
        """The wrapped batches' next batch (a copy of it) with the spans copied in each window."""
        batch = self.batches.next_batch().clone()
        for index, window in enumerate(batch):
            row = self.rank * self.batch_size + index  # its row in the global batch
            copy_spans(window, self.count, self.length, window_generator(self.seed, self.epoch, self.position - 1, row))
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The wrapped batches' position."""
        return self.batches.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`."""
        self.batches.load_state_dict(state)


def with_copied_spans(batches: Batches, data: DataConfig) -> Batches:
    """`batches` with `data.copy_spans` applied to their windows; themselves when its count is 0."""
    spans = data.copy_spans
    return SpanCopiedBatches(batches, spans.count, spans.length, data.seed) if spans.count else batches


@dataclass
class TrainingData:
    """This rank's training batches, the held-out rows [n, seq_len] (int64) and how many rows the
    batches walk per epoch (None where streamed: unknown)."""

    batches: Batches
    eval_rows: Tensor
    train_rows: int | None


def load_training_data(config: RecipeConfig, tokenizer: Any, info: DistInfo) -> TrainingData:
    """The recipe's data on this process (collective: tokenizing waits for each node's main
    process)."""
    data, batch_size = config.data, config.train.batch_size
    if data.streaming:
        return _streamed(config, tokenizer, info)
    rows = cached_rows(data.train, tokenizer, data.seq_len, info, data.num_proc)
    layout = {"seed": data.seed, "rank": info.rank, "world_size": info.world_size}
    if data.eval is not None:
        eval_rows = cached_rows(data.eval, tokenizer, data.seq_len, info, data.num_proc).long()
        return TrainingData(with_copied_spans(PackedBatches(rows, batch_size, **layout), data), eval_rows, len(rows))
    train_ids, eval_ids = split_eval_ids(len(rows), data.eval_rows, data.seed)
    return TrainingData(
        with_copied_spans(PackedBatches(rows, batch_size, row_ids=train_ids, **layout), data),
        rows[eval_ids].long(),
        len(train_ids),
    )


def _stream(source: DataSourceConfig) -> dict[str, Any]:
    return {
        "records": stream_records(source.records, format=source.format),
        "fields": source.fields,
        "source": source.path,
    }


def _streamed(config: RecipeConfig, tokenizer: Any, info: DistInfo) -> TrainingData:
    data = config.data
    count = int(data.eval_rows)
    held_out = first_rows(tokenizer=tokenizer, seq_len=data.seq_len, count=count, **_stream(data.eval or data.train))
    batches = StreamedBatches(
        tokenizer=tokenizer,
        seq_len=data.seq_len,
        batch_size=config.train.batch_size,
        rank=info.rank,
        world_size=info.world_size,
        skip_rows=0 if data.eval else count,
        **_stream(data.train),
    )
    return TrainingData(with_copied_spans(batches, data), held_out, None)
