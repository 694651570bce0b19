"""Training text: load documents, pack them into token rows, iterate over the rows.

Sources accepted by `load_text_dataset(path)`:

- a file, a folder (its supported files, sorted by name, not recursive; hidden files skipped) or a
  glob (`data/*.jsonl`; `**` recurses);
- `embedded:NAME`: a text shipped in `gsm_train/assets` (`embedded:sample_prose`);
- `hf://NAME[:CONFIG][@SPLIT]`: a Hugging Face hub dataset through `datasets.load_dataset`, e.g.
  `hf://openai/gsm8k:main@train`; CONFIG defaults to the dataset's default, SPLIT to `train` (split
  slices such as `train[:1000]` work). This is not an fsspec `hf://datasets/...` path.

Formats: `text` (`.txt`; one file is one document), `jsonl`/`json` (`.jsonl`, `.json`, `.ndjson`)
and `parquet` (`.parquet`), each optionally compressed (`.gz`, `.xz`, `.bz2`, `.zst`). Records of
json/parquet/hub sources become documents by joining their `fields` with `separator`.
"""

from __future__ import annotations

import glob
import numbers
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import torch

from gsm_train.assets import EMBEDDED_PREFIX, embedded_asset_path
from gsm_train.config.schema import DATASET_PREFIX, HUB_PREFIX
from gsm_train.data.chat_data import encode_conversation, is_conversation
from gsm_train.data.data_errors import DataError  # defined apart (chat_data raises it too); importable from here

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_FORMATS = {"text": "text", "txt": "text", "json": "json", "jsonl": "json", "parquet": "parquet"}
_EXTENSIONS = {".txt": "text", ".json": "json", ".jsonl": "json", ".ndjson": "json", ".parquet": "parquet"}
_COMPRESSIONS = (".gz", ".xz", ".bz2", ".zst")
CHAT_COLUMN = "messages"  # the column of conversations `load_text_dataset` returns for chat data
_SOURCE_HINT = "give an existing file, folder or glob, embedded:sample_prose, or hf://NAME[:CONFIG][@SPLIT]"


def _format_of(file: Path) -> str | None:
    """The format a file's extension names, looking through compression suffixes."""
    name = file.name.lower()
    for compression in _COMPRESSIONS:
        name = name.removesuffix(compression)
    return _EXTENSIONS.get(os.path.splitext(name)[1])


def _resolve_files(path: str, fmt: str | None) -> list[Path]:
    """The files a local source names (embedded asset, glob, folder or file), in a stable order."""
    if path.startswith(EMBEDDED_PREFIX):
        try:
            return [embedded_asset_path(path)]
        except FileNotFoundError as err:
            raise DataError(path, str(err), "use embedded:sample_prose") from None
    expanded = os.path.expanduser(path)
    if any(ch in expanded for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
        if not files:
            raise DataError(path, "no file matches this glob", "check the pattern, or give a file or folder")
        return files
    target = Path(expanded)
    if target.is_dir():
        files = sorted(
            f
            for f in target.iterdir()
            if f.is_file() and not f.name.startswith(".") and _format_of(f) in ((fmt,) if fmt else _FORMATS.values())
        )
        if not files:
            kind = f"{fmt} " if fmt else ""
            raise DataError(
                path,
                f"the folder holds no {kind}files (.txt, .jsonl, .json, .ndjson, .parquet; .gz/.xz/.bz2/.zst too)",
                "put data files in it, or point at a file or glob",
            )
        return files
    if target.is_file():
        return [target]
    raise DataError(path, f"no such file or folder (relative paths start at {Path.cwd()})", _SOURCE_HINT)


def _pick_format(files: list[Path], fmt: str | None, source: str) -> str:
    """The one format of `files`: the requested one, or the one their extensions agree on."""
    if fmt is not None:
        return fmt
    found = {file: _format_of(file) for file in files}
    unknown = [file.name for file, kind in found.items() if kind is None]
    if unknown:
        raise DataError(
            source,
            f"cannot tell the format of {unknown[0]!r} from its extension",
            "name files .txt/.jsonl/.json/.parquet (optionally compressed), or set format to text, jsonl or parquet",
        )
    kinds = sorted(set(found.values()))
    if len(kinds) > 1:
        raise DataError(source, f"the files mix formats {kinds}", "point at files of one format, or set format")
    return kinds[0]


def _root_cause(err: BaseException) -> str:
    """`Type: first line` of the innermost exception in an explicit (`raise ... from`) chain."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def _load(source: str, fix: str, load: Callable[[], datasets.Dataset]) -> datasets.Dataset:
    """Run a `datasets` load, turning its failure into a DataError."""
    try:
        return load()
    except Exception as err:  # datasets raises many unrelated types; all mean "could not load"
        raise DataError(source, f"could not be loaded ({_root_cause(err)})", fix) from err


def _parse_hub_name(path: str) -> tuple[str, str | None, str]:
    """`hf://NAME[:CONFIG][@SPLIT]` as (name, config or None, split)."""
    spec, _, split = path.removeprefix(HUB_PREFIX).partition("@")
    name, _, config = spec.partition(":")
    if not name:
        raise DataError(
            path, "the hub dataset name is empty", "write hf://NAME[:CONFIG][@SPLIT], e.g. hf://openai/gsm8k"
        )
    return name, config or None, split or "train"


def join_fields(values: list[Any], separator: str) -> str:
    """A record's field values as one document: the values that are not None, as text, joined."""
    return separator.join(str(value) for value in values if value is not None)


def _documents(ds: datasets.Dataset, fields: list[str], separator: str, source: str) -> datasets.Dataset:
    """One `text` column: each record's `fields` joined by `separator`; blank documents dropped. A single
    field of conversations (`chat_data.is_conversation`) becomes one `messages` column instead."""
    missing = [field for field in fields if field not in ds.column_names]
    if missing and len(ds):
        raise DataError(
            source,
            f"field {missing[0]!r} is missing from the records, which have {ds.column_names}",
            f"set fields to names among {ds.column_names}",
        )
    if len(ds) and _conversation_fields(ds[0], fields, source):
        kept = ds.select_columns(fields)
        kept = kept if fields[0] == CHAT_COLUMN else kept.rename_column(fields[0], CHAT_COLUMN)
        return kept.filter(lambda record: bool(record[CHAT_COLUMN]), desc="collecting conversations")

    def join(batch: dict[str, list[Any]]) -> dict[str, list[str]]:
        texts = (join_fields(values, separator) for values in zip(*(batch[f] for f in fields)))
        return {"text": [text for text in texts if text.strip()]}

    if len(ds):
        ds = ds.map(join, batched=True, remove_columns=ds.column_names, desc="collecting documents")
    if not len(ds):
        raise DataError(source, "holds no non-blank text", "give files that contain text, or check fields")
    return ds


def _conversation_fields(record: dict[str, Any], fields: list[str], source: str) -> bool:
    """Whether `fields` name one field of conversations (judged on a record); DataError when a
    conversation field comes with others (its messages would be joined as Python text)."""
    chats = [field for field in fields if is_conversation(record[field])]
    if chats and len(fields) > 1:
        raise DataError(
            source,
            f"field {chats[0]!r} holds conversations (lists of role/content messages), given with {fields}",
            f"set fields to [{chats[0]}] alone: a conversation is rendered with the tokenizer's chat template",
        )
    return bool(chats)


def _saved_dataset(path: str) -> datasets.Dataset | None:
    """The dataset of a folder written by `Dataset.save_to_disk` (None for any other path); DataError
    for a `DatasetDict`'s folder, which names its splits' folders."""
    folder = Path(os.path.expanduser(path))
    if (folder / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in folder.iterdir() if (p / "state.json").is_file())
        raise DataError(
            path,
            f"a DatasetDict saved with save_to_disk, with splits {splits}",
            f"give one split's folder, e.g. {folder / (splits[0] if splits else 'train')}",
        )
    if not ((folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()):
        return None
    fix = "write it again with Dataset.save_to_disk (its arrow files or state.json are damaged)"
    return _load(path, fix, lambda: datasets.load_from_disk(str(folder)))


def _records(path: str, format: str, streaming: bool) -> datasets.Dataset | datasets.IterableDataset:
    """A source's raw records through `datasets` (text sources: one record `text` per file)."""
    if format != "auto" and format not in _FORMATS:
        raise DataError(path, f"unknown format {format!r}", f"use one of auto, {', '.join(_FORMATS)}")
    fmt = _FORMATS.get(format)
    if path.startswith(HUB_PREFIX):
        name, config, split = _parse_hub_name(path)
        fix = "check the name, config and split; go online (unset HF_HUB_OFFLINE) or give a local copy of the data"
        return _load(path, fix, lambda: datasets.load_dataset(name, config, split=split, streaming=streaming))
    saved = _saved_dataset(path)
    if saved is not None:
        return saved.to_iterable_dataset() if streaming else saved
    files = [file for file in _resolve_files(path, fmt) if file.stat().st_size > 0]
    if not files:
        raise DataError(path, "holds no non-blank text (its files are empty)", "give files that contain text")
    fmt = _pick_format(files, fmt, path)
    options = {"sample_by": "document"} if fmt == "text" else {}
    fix = f"check that the files are valid {fmt} (set format if the extension misleads)"
    data_files = [str(file) for file in files]
    return _load(
        path,
        fix,
        lambda: datasets.load_dataset(fmt, data_files=data_files, split="train", streaming=streaming, **options),
    )


def load_text_dataset(
    path: str | datasets.Dataset,
    *,
    format: str = "auto",
    fields: list[str] | None = None,
    separator: str = "\n\n",
) -> datasets.Dataset:
    """Load documents from a file, folder (a `save_to_disk` folder too), glob, `embedded:NAME`,
    `hf://NAME[:CONFIG][@SPLIT]`, or take the records of a `datasets.Dataset` given itself.

    Returns a `datasets.Dataset` with one string column `text`, one row per non-blank document:
    a whole file for text sources, a record's `fields` (default `["text"]`) joined by `separator`
    otherwise; or, where `fields` names one field of conversations (lists of role/content
    messages), one column `messages` of the non-empty conversations (`chat_data`). Raises
    DataError for a missing path, unknown format, missing field or no text.
    """
    if isinstance(path, datasets.Dataset):
        records, source = path, dataset_source_name(path)
    else:
        records, source = _records(path, format, streaming=False), path
    return _documents(records, list(fields) if fields else ["text"], separator, source)


def dataset_source_name(dataset: datasets.Dataset) -> str:
    """How messages name a `datasets.Dataset` given as a source: by its `datasets` fingerprint."""
    return f"{DATASET_PREFIX}{dataset._fingerprint}"


def stream_records(path: str | datasets.Dataset, *, format: str = "auto") -> datasets.IterableDataset:
    """The raw records of a source as `load_text_dataset` reads it, streamed: read as they are
    iterated, never whole in memory (`datasets` streaming; `state_dict()` marks where the iteration
    stands). Records become documents through `join_fields` (`streaming.StreamedBatches`)."""
    if isinstance(path, datasets.Dataset):
        return path.to_iterable_dataset()
    return _records(path, format, streaming=True)


def pack_tokens(
    dataset: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    *,
    add_eos: bool = True,
    num_proc: int | None = None,
) -> torch.Tensor:
    """Tokenize the `text` documents, end each with EOS, concatenate, cut into rows of `seq_len`.

    No other special tokens are added. The remainder shorter than a row is dropped. Conversations (a
    `messages` column, `load_text_dataset`) are tokenized in the chat template instead, their tokens
    outside the loss marked (`chat_data.encode_conversation`; no EOS: the template ends its turns).
    Returns a LongTensor [rows, seq_len]; raises DataError without an EOS token or a single full row.
    """
    source = f"packing {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__}"
    if seq_len < 1:
        raise DataError(source, f"seq_len is {seq_len}", "use a positive seq_len")
    encode = _conversation_encoder(tokenizer, source) if CHAT_COLUMN in dataset.column_names else None
    if encode is None and "text" not in dataset.column_names:
        raise DataError(source, f"the dataset has no text column, only {dataset.column_names}", "use load_text_dataset")
    eos = [tokenizer.eos_token_id] if add_eos else []
    if encode is None and add_eos and eos[0] is None:
        raise DataError(
            source, "the tokenizer has no eos token to end documents", "set its eos_token, or add_eos=False"
        )

    def encode_text(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        encoding = tokenizer(batch["text"], add_special_tokens=False, return_attention_mask=False, verbose=False)
        return {"input_ids": [doc + eos for doc in encoding["input_ids"]]}

    encode = encode or encode_text

    encoded = dataset.map(
        encode, batched=True, num_proc=num_proc, remove_columns=dataset.column_names, desc="tokenizing"
    )
    flat = encoded.with_format("arrow")["input_ids"].combine_chunks().flatten().to_numpy()
    n_rows = len(flat) // seq_len
    if n_rows < 1:
        raise DataError(
            source, f"{len(flat)} tokens do not fill one row of seq_len={seq_len}", "use a smaller seq_len or more text"
        )
    return torch.from_numpy(flat[: n_rows * seq_len].astype("int64")).view(n_rows, seq_len)


def _conversation_encoder(tokenizer: PreTrainedTokenizerBase, source: str) -> Callable[..., dict[str, list]]:
    """A batched `map` function from a `messages` column to the conversations' marked token ids."""

    def encode(batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        return {"input_ids": [encode_conversation(tokenizer, chat, source) for chat in batch[CHAT_COLUMN]]}

    return encode


def tokens_in_rows(rows: torch.Tensor) -> int:
    """Number of tokens in a [rows, seq_len] tensor."""
    return int(rows.numel())


def _eval_count(eval_rows: int | float, n: int) -> int:
    """Rows to hold out: a value in (0, 1) is a fraction of `n`, a whole number a count."""
    if isinstance(eval_rows, bool) or not isinstance(eval_rows, numbers.Real):
        raise DataError(
            "eval split", f"eval_rows={eval_rows!r} is not a number", "give a fraction in (0, 1) or a count"
        )
    value = float(eval_rows)
    if 0 < value < 1:
        return round(value * n)
    if value.is_integer():
        return int(value)
    raise DataError(
        "eval split", f"eval_rows={eval_rows} is neither a fraction in (0, 1) nor a whole count", "give e.g. 0.05 or 64"
    )


def split_eval(rows: torch.Tensor, eval_rows: int | float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hold out rows for evaluation: returns (train_rows, eval_rows), disjoint, each in original order.

    The choice depends only on the row count, `eval_rows` and `seed` (`split_eval_ids`).
    """
    train_ids, eval_ids = split_eval_ids(rows.shape[0], eval_rows, seed)
    return rows[train_ids], rows[eval_ids]


def split_eval_ids(n: int, eval_rows: int | float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`split_eval` of `n` rows as row indices: (train ids, eval ids), each ascending."""
    n_eval = _eval_count(eval_rows, n)
    if not 0 < n_eval < n:
        raise DataError(
            "eval split",
            f"eval_rows={eval_rows} of {n} rows leaves {n_eval} eval and {n - n_eval} train rows",
            "choose eval_rows so both sides keep at least one row, or give more text / a smaller seq_len",
        )
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return order[n_eval:].sort().values, order[:n_eval].sort().values


class PackedBatches:
    """Deterministic, resumable, rank-sharded batches of packed rows, epoch after epoch.

    Each epoch shuffles all rows with a generator seeded by (seed, epoch), the same on every rank,
    and walks them in global batches of `batch_size * world_size` rows; rank r gets the slice
    [r * batch_size, (r + 1) * batch_size) of each. With `drop_last` the rows after the last full
    global batch are skipped that epoch; without it the last global batch is filled up with rows
    from the start of the same epoch, so every batch is full. `row_ids`: walk only these rows of
    `rows` (e.g. those not held out), as if `rows[row_ids]` were given, without copying them.
    Batches are int64 whatever the rows' integer type.
    """

    def __init__(
        self,
        rows: torch.Tensor,
        batch_size: int,
        *,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
        row_ids: torch.Tensor | None = None,
    ) -> None:
        if rows.dim() != 2:
            raise DataError(
                "PackedBatches", f"rows have shape {tuple(rows.shape)}", "pass pack_tokens' [rows, seq_len]"
            )
        self.row_ids = torch.arange(rows.shape[0]) if row_ids is None else row_ids
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise DataError(
                "PackedBatches",
                f"batch_size={batch_size}, rank={rank}, world_size={world_size} is not a valid layout",
                "use batch_size >= 1, world_size >= 1 and 0 <= rank < world_size",
            )
        self.global_batch_size = batch_size * world_size
        if len(self.row_ids) < self.global_batch_size:
            raise DataError(
                "PackedBatches",
                f"{len(self.row_ids)} rows do not fill one global batch of {batch_size} x {world_size} ranks",
                "give more text, a smaller seq_len or a smaller batch",
            )
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.epoch, self.position = 0, 0
        self._order_epoch, self._order = -1, torch.empty(0, dtype=torch.long)

    @property
    def steps_per_epoch(self) -> int:
        """Global batches (= steps) per epoch."""
        n, g = len(self.row_ids), self.global_batch_size
        return n // g if self.drop_last else -(-n // g)

    def _epoch_order(self) -> torch.Tensor:
        """Row order of the current epoch, `steps_per_epoch * global_batch_size` long."""
        if self._order_epoch != self.epoch:
            seed = (self.seed * 0x9E3779B97F4A7C15 + self.epoch) % 2**64
            perm = torch.randperm(len(self.row_ids), generator=torch.Generator().manual_seed(seed))
            self._order = torch.cat([perm, perm])[: self.steps_per_epoch * self.global_batch_size]
            self._order_epoch = self.epoch
        return self._order

    def next_batch(self) -> torch.Tensor:
        """This rank's next batch, [batch_size, seq_len]; moves on to the next epoch as needed."""
        if self.position >= self.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position * self.global_batch_size + self.rank * self.batch_size
        self.position += 1
        return self.rows[self.row_ids[self._epoch_order()[start : start + self.batch_size]]].long()

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """Where the iteration stands (epoch, global batches taken in it) and what it ran over."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_rows": len(self.row_ids),
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from `state_dict()`; the seed, row count and global batch size must match."""
        current = self.state_dict()
        for key in ("seed", "num_rows", "global_batch_size"):
            if key in state and state[key] != current[key]:
                raise DataError(
                    "PackedBatches state",
                    f"{key} is {state[key]} in the saved state but {current[key]} now",
                    "resume with the same data, seq_len, seed and batch_size x world_size, or start afresh",
                )
        if not 0 <= state["position"] <= self.steps_per_epoch or state["epoch"] < 0:
            raise DataError(
                "PackedBatches state",
                f"epoch={state['epoch']}, position={state['position']} is outside 0..{self.steps_per_epoch} steps",
                "pass a state saved by PackedBatches.state_dict",
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
