"""Packed token rows tokenized once per node and mapped from a file by every process.

`cached_rows` gives the [rows, seq_len] token rows of a data source (`data.pack_tokens`'s rows, as
int32). On each node the local main process (LOCAL_RANK 0) looks the rows up in the token cache and,
if they are not there, tokenizes the source (`data.num_proc` processes) and writes them; the other
processes wait meanwhile, then map the same file. The rows are memory-mapped (copy-on-write), so a
node holds one copy of them in its page cache whatever its number of processes, and only the batches
taken are read.

The cache (`GSM_TOKEN_CACHE`, default ~/.cache/gsm-train/tokens; a file there is refused) holds
`KEY.tokens` (raw int32, row after row) and `KEY.json` (the row count, the byte count, a sampled
digest and what the key was made of), written last, each written beside and renamed into place.

Every open checks the entry: the header parses, the file has the bytes the rows need, and the
sampled digest matches (sha256 over the size and `SAMPLE_BLOCKS` blocks of `SAMPLE_BYTES` spread
evenly over the file: the whole file up to 4 MiB). A damaged entry (zero-filled, truncated,
replaced, from a gsm-train before digests) is tokenized again, with a warning. Sampled rather than
whole: a whole digest would read a many-GB cache on every start, undoing what mapping it saves
(only the batches taken are read); the damage seen in practice (a file truncated, zero-filled or
replaced) is caught by the size and the samples, while a few bytes altered between samples are not.

KEY is a sha256 of: the dataset's `datasets` fingerprint (which changes with the files' contents,
paths and modification times, or a Hub dataset's revision, and with the fields joined), the
tokenizer (its full definition for fast tokenizers), `seq_len` and the EOS rule. A changed input
gives a new key; old entries stay until removed by hand.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from datasets.fingerprint import Hasher

from gsm_train.config.schema import DataSourceConfig
from gsm_train.data.text import CHAT_COLUMN, DataError, load_text_dataset, pack_tokens
from gsm_train.durable import replace_atomically
from gsm_train.training.distributed import DistInfo, raise_on_any_rank

CACHE_VERSION = 1  # part of every key: a change to how rows are made invalidates the cache
SAMPLE_BLOCKS = 64
SAMPLE_BYTES = 1 << 16
_ROW_ITEM = 4  # bytes of one int32 token


def token_cache_dir() -> Path:
    """Where token rows are cached (`GSM_TOKEN_CACHE`, default ~/.cache/gsm-train/tokens); a
    DataError if that is something other than a folder (or a place one can be made)."""
    folder = Path(os.environ.get("GSM_TOKEN_CACHE", Path.home() / ".cache" / "gsm-train" / "tokens"))
    if folder.exists() and not folder.is_dir():
        raise DataError(
            f"GSM_TOKEN_CACHE={folder}",
            "names a file, not a folder",
            "point GSM_TOKEN_CACHE at a folder (created if missing), or unset it to cache in ~/.cache/gsm-train/tokens",
        )
    return folder


def sampled_digest(path: Path) -> str:
    """sha256 of `path`'s size and `SAMPLE_BLOCKS` blocks of `SAMPLE_BYTES` at evenly spread
    offsets (first and last included): the whole file when it is no larger than those blocks."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as handle:
        if size <= SAMPLE_BLOCKS * SAMPLE_BYTES:
            digest.update(handle.read())
            return digest.hexdigest()
        for block in range(SAMPLE_BLOCKS):
            handle.seek(block * (size - SAMPLE_BYTES) // (SAMPLE_BLOCKS - 1))
            digest.update(handle.read(SAMPLE_BYTES))
    return digest.hexdigest()


def _damage(tokens: Path, header: Path, seq_len: int) -> tuple[int | None, str | None]:
    """(the entry's row count, None) when `tokens` is whole as `header` describes it; else (None,
    what is wrong)."""
    try:
        meta = json.loads(header.read_text())
        rows, size, digest = meta["rows"], meta["bytes"], meta["sample_sha256"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return None, f"{header} cannot be read as a verified entry ({type(err).__name__}: {err})"
    if not isinstance(rows, int) or size != rows * seq_len * _ROW_ITEM:
        return None, f"{header} is inconsistent ({rows} rows of {seq_len} tokens, {size} bytes)"
    if not tokens.is_file():
        return None, f"{tokens} is missing"
    actual = tokens.stat().st_size
    if actual != size:
        return None, f"{tokens} has {actual} bytes, its header says {size} (truncated or replaced)"
    if sampled_digest(tokens) != digest:
        return None, f"{tokens} does not match its digest (overwritten or damaged)"
    return rows, None


def tokenizer_digest(tokenizer: Any) -> str:
    """A sha256 of what decides the tokenizer's output: a fast tokenizer's whole definition
    (vocabulary, merges, normalizer, pre-tokenizer) and its EOS id; else `datasets`' hash of the
    object."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = backend.to_str() if backend is not None else Hasher.hash(tokenizer)
    return hashlib.sha256(f"{type(tokenizer).__name__}\n{tokenizer.eos_token_id}\n{spec}".encode()).hexdigest()


def _build(
    source: DataSourceConfig, tokenizer: Any, seq_len: int, num_proc: int | None, folder: Path, verify: bool = True
) -> tuple[Path, int]:
    """(the cache file of `source`'s rows, their count), tokenizing them first if they are not
    cached. `verify`: check the entry against its header (`_damage`) first; the processes that wait for
    their node's main process, which has verified or written it, read the count alone."""
    documents = load_text_dataset(source.records, format=source.format, fields=source.fields)
    described = {
        "version": CACHE_VERSION,
        "data": documents._fingerprint,
        "source": source.model_dump(),
        "tokenizer": tokenizer_digest(tokenizer),
        "seq_len": seq_len,
        "eos": True,
    }
    if CHAT_COLUMN in documents.column_names:  # conversations: the template decides the tokens too
        described["chat_template"] = tokenizer.chat_template
    key = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:32]
    tokens, header = folder / f"{key}.tokens", folder / f"{key}.json"
    if header.is_file():
        count, problem = _damage(tokens, header, seq_len) if verify else (json.loads(header.read_text())["rows"], None)
        if count is not None:
            return tokens, count
        print(f"warning: damaged token cache entry: {problem}; tokenizing {source.path} again", file=sys.stderr)
    rows = pack_tokens(documents, tokenizer, seq_len, num_proc=num_proc)
    folder.mkdir(parents=True, exist_ok=True)
    replace_atomically(tokens, lambda handle: handle.write(rows.to(torch.int32).numpy().tobytes()))
    verified = {"rows": len(rows), "bytes": tokens.stat().st_size, "sample_sha256": sampled_digest(tokens)}
    replace_atomically(header, lambda handle: handle.write(json.dumps({**verified, **described}).encode()))
    return tokens, len(rows)


def cached_rows(
    source: DataSourceConfig,
    tokenizer: Any,
    seq_len: int,
    info: DistInfo,
    num_proc: int | None = None,
) -> torch.Tensor:
    """[rows, seq_len] int32 token rows of `source` (`pack_tokens`' rows), memory-mapped from the
    token cache; built by each node's local main process while the others wait (collective). A
    DataError of the local main process is raised there and OtherRankFailed on the others."""
    folder, built, error = token_cache_dir(), None, None
    if info.local_rank == 0:
        try:
            built = _build(source, tokenizer, seq_len, num_proc, folder)
        except ValueError as err:  # DataError: the source cannot be read or packed
            error = err
    raise_on_any_rank(info, error)  # a barrier: the local main processes have written
    path, count = built if built is not None else _build(source, tokenizer, seq_len, num_proc, folder, verify=False)
    mapped = np.memmap(path, dtype=np.int32, mode="c", shape=(count, seq_len))
    return torch.from_numpy(mapped)
