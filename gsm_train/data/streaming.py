"""Training rows read from a text stream (`data.streaming: true`), for corpora larger than memory.

The documents are read in their order (no shuffle: shuffle the files beforehand if their order is
not random), tokenized as they come, ended with EOS and packed into rows of `seq_len`, exactly the
rows `data.pack_tokens` would cut from the whole corpus, in order. Global batches of
`batch_size x world_size` consecutive rows are walked as `data.PackedBatches` walks them: rank r
takes the r-th `batch_size` rows of each. Every rank reads and tokenizes the whole stream (a row's
boundaries depend on every document before it) and keeps its share. When the stream ends, the rows
short of a global batch are dropped and the next epoch reads it again from the start; the first
`skip_rows` rows of each epoch are skipped (the held-out rows when they come from this stream).

The position is exact and cheap to keep: `state_dict()` holds the epoch, the global batches taken,
and where the stream stands as the start of the first document with tokens not yet taken (the
stream's own `state_dict()` from just before it) and how many of that document's tokens were
taken. `load_state_dict` seeks the stream there, tokenizes that one document again and continues.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import datasets
import torch
from torch import Tensor

from gsm_train.data.chat_data import encode_conversation, is_conversation
from gsm_train.data.text import DataError, join_fields


@dataclass
class _Document:
    """A document's tokens, where the stream stood just before it, and how many were taken."""

    before: dict[str, Any]
    tokens: list[int]
    taken: int = 0


class StreamedBatches:
    """Rank-sharded, resumable batches of packed rows from a stream of records
    (`data.stream_records`)."""

    def __init__(
        self,
        records: datasets.IterableDataset,
        tokenizer: Any,
        seq_len: int,
        batch_size: int,
        *,
        fields: list[str] | None = None,
        separator: str = "\n\n",
        rank: int = 0,
        world_size: int = 1,
        skip_rows: int = 0,
        source: str = "stream",
    ) -> None:
        if tokenizer.eos_token_id is None:
            raise DataError(source, "the tokenizer has no eos token to end documents", "set its eos_token")
        self.records, self.tokenizer, self.seq_len = records, tokenizer, seq_len
        self.fields, self.separator, self.source = (
            list(fields) if fields else ["text"],
            separator,
            source,
        )
        self.batch_size, self.rank, self.skip_rows = batch_size, rank, skip_rows
        self.global_batch_size = batch_size * world_size
        self.start = copy.deepcopy(records.state_dict())  # the stream's beginning
        self.epoch, self.position = 0, 0
        self._rows: Iterator[Tensor] | None = None
        self._pending: deque[_Document] = deque()
        self._resume: tuple[dict[str, Any], int] | None = None  # None: the epoch's start

    def _documents(self, state: dict[str, Any]) -> Iterator[tuple[dict[str, Any], list[int]]]:
        """(stream state just before it, tokens + EOS) of each non-blank document from `state`."""
        self.records.load_state_dict(copy.deepcopy(state))
        before = state
        for record in self.records:
            after = copy.deepcopy(self.records.state_dict())
            missing = [field for field in self.fields if field not in record]
            if missing:
                raise DataError(
                    self.source,
                    f"field {missing[0]!r} is missing from a record, which has {sorted(record)}",
                    f"set fields to names among {sorted(record)}",
                )
            tokens = self._tokens([record[field] for field in self.fields])
            if tokens:
                yield before, tokens
            before = after

    def _tokens(self, values: list[Any]) -> list[int]:
        """A record's tokens as `data.pack_tokens` makes them: a conversation in the chat template (its
        context marked), else the values joined as text and ended with EOS; [] for blank text."""
        if len(values) == 1 and is_conversation(values[0]):
            return encode_conversation(self.tokenizer, values[0], self.source)
        text = join_fields(values, self.separator)
        if not text.strip():
            return []
        ids = self.tokenizer(text, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
        return [*ids, self.tokenizer.eos_token_id]

    def _stream_rows(self, state: dict[str, Any], offset: int) -> Iterator[Tensor]:
        """Rows of `seq_len` from the document at `state`, its first `offset` tokens left out, to
        the end of the stream (the remainder shorter than a row dropped)."""
        self._pending.clear()
        available = 0
        for before, tokens in self._documents(state):
            self._pending.append(_Document(before, tokens, offset))
            available += len(tokens) - offset
            offset = 0
            while available >= self.seq_len:
                yield self._take_row()
                available -= self.seq_len

    def _take_row(self) -> Tensor:
        row: list[int] = []
        while len(row) < self.seq_len:
            document = self._pending[0]
            take = min(self.seq_len - len(row), len(document.tokens) - document.taken)
            row += document.tokens[document.taken : document.taken + take]
            document.taken += take
            if document.taken == len(document.tokens):
                self._pending.popleft()
        return torch.tensor(row, dtype=torch.long)

    def _mark(self) -> tuple[dict[str, Any], int]:
        """Where the stream continues: the first document with tokens not yet taken, and how many
        were."""
        if self._pending:
            return self._pending[0].before, self._pending[0].taken
        return copy.deepcopy(self.records.state_dict()), 0

    def next_batch(self) -> Tensor:
        """This rank's next batch [batch_size, seq_len] (int64); moves on to the next epoch as
        needed."""
        for _ in range(2):
            if self._rows is None and self._resume is None:
                self._rows = self._stream_rows(self.start, 0)
                for _ in zip(range(self.skip_rows), self._rows):
                    pass
            elif self._rows is None:
                self._rows = self._stream_rows(*self._resume)
            batch = [row for _, row in zip(range(self.global_batch_size), self._rows)]
            if len(batch) == self.global_batch_size:
                self.position += 1
                self._resume = self._mark()
                return torch.stack(batch[self.rank * self.batch_size : (self.rank + 1) * self.batch_size])
            if self.position == 0:
                break
            self.epoch, self.position, self._rows, self._resume = self.epoch + 1, 0, None, None
        raise DataError(
            self.source,
            f"the stream holds fewer than one global batch of {self.global_batch_size} "
            f"rows of {self.seq_len} tokens after the {self.skip_rows} held out",
            "give more text, a smaller seq_len or a smaller batch",
        )

    def state_dict(self) -> dict[str, Any]:
        """Where the iteration stands (JSON-serializable; `stream` None: at the epoch's start) and
        the global batch it walks."""
        state, offset = self._resume or (None, 0)
        return {
            "epoch": self.epoch,
            "position": self.position,
            "stream": state,
            "offset": offset,
            "global_batch_size": self.global_batch_size,
            "streaming": True,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`; the global batch must be the same."""
        if not state.get("streaming"):
            raise DataError(
                "streamed batches",
                "the saved data position is of packed rows, not of a stream",
                "resume with data.streaming as the run had it",
            )
        if state["global_batch_size"] != self.global_batch_size:
            raise DataError(
                "streamed batches",
                f"global_batch_size is {state['global_batch_size']} in the saved "
                f"state but {self.global_batch_size} now",
                "resume with the same batch_size x world_size, or start afresh",
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._resume = None if state["stream"] is None else (state["stream"], int(state["offset"]))
        self._rows = None


def first_rows(
    records: datasets.IterableDataset,
    tokenizer: Any,
    seq_len: int,
    count: int,
    *,
    fields: list[str] | None = None,
    separator: str = "\n\n",
    source: str = "stream",
) -> Tensor:
    """The first `count` rows [count, seq_len] of a stream (held-out rows); DataError if it has
    fewer."""
    batches = StreamedBatches(records, tokenizer, seq_len, count, fields=fields, separator=separator, source=source)
    return batches.next_batch()
