"""Tests of gsm_train.data.text: loading, packing, eval split and batch iteration (CPU, offline)."""

from __future__ import annotations

import gzip
import hashlib
import json
import lzma
import re
from pathlib import Path

import datasets
import huggingface_hub.constants
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from gsm_train.assets import embedded_asset_path
from gsm_train.data.text import (
    DataError,
    PackedBatches,
    load_text_dataset,
    pack_tokens,
    split_eval,
    tokens_in_rows,
)

DOC_A = "Dorothy lived in the midst of the great Kansas prairies.\r\nUncle Henry was a farmer.\n"
DOC_B = "The quick brown fox jumps over the lazy dog.\n\nTwice.\n"


@pytest.fixture(autouse=True)
def offline_datasets(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """No network, and `datasets` caches in a temporary folder."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.getbasetemp() / "hf_datasets")


def write(path: Path, text: str) -> Path:
    """Write `text` (bytes as given, no newline translation), compressed by the file's suffix."""
    opener = {".xz": lzma.open, ".gz": gzip.open}.get(path.suffix, open)
    with opener(path, "wb") as f:
        f.write(text.encode())
    return path


def texts(ds: datasets.Dataset) -> list[str]:
    return list(ds["text"])


# --- loading ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["doc.txt", "doc.txt.xz", "doc.txt.gz"])
def test_text_file_is_one_document(tmp_path: Path, name: str) -> None:
    ds = load_text_dataset(str(write(tmp_path / name, DOC_A)))
    assert ds.column_names == ["text"]
    assert texts(ds) == [DOC_A.replace("\r\n", "\n")]


def test_explicit_format_overrides_extension(tmp_path: Path) -> None:
    ds = load_text_dataset(str(write(tmp_path / "doc.dat", DOC_B)), format="text")
    assert texts(ds) == [DOC_B]


def test_jsonl_joins_fields(tmp_path: Path) -> None:
    records = [{"question": "2+2?", "answer": "4 #### 4", "id": 1}, {"question": "1+2?", "answer": "3 #### 3", "id": 2}]
    path = write(tmp_path / "gsm.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    ds = load_text_dataset(str(path), fields=["question", "answer"])
    assert texts(ds) == ["2+2?\n\n4 #### 4", "1+2?\n\n3 #### 3"]
    assert texts(load_text_dataset(str(path), format="jsonl", fields=["question", "answer"], separator=" = ")) == [
        "2+2? = 4 #### 4",
        "1+2? = 3 #### 3",
    ]


def test_parquet_default_field_and_fields(tmp_path: Path) -> None:
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"text": ["first doc", "  ", "second doc"], "title": ["A", "B", "C"]}), path)
    assert texts(load_text_dataset(str(path))) == ["first doc", "second doc"]  # blank record dropped
    assert texts(load_text_dataset(str(path), fields=["title", "text"], separator=": ")) == [
        "A: first doc",
        "B:   ",
        "C: second doc",
    ]


def test_directory_and_glob(tmp_path: Path) -> None:
    write(tmp_path / "b.txt", DOC_B)
    write(tmp_path / "a.txt", DOC_A)
    write(tmp_path / "c.txt.gz", "third\n")
    write(tmp_path / "README.md", "not data")
    write(tmp_path / ".hidden.txt", "hidden")
    assert texts(load_text_dataset(str(tmp_path))) == [DOC_A.replace("\r\n", "\n"), DOC_B, "third\n"]
    assert texts(load_text_dataset(str(tmp_path / "*.txt"))) == [DOC_A.replace("\r\n", "\n"), DOC_B]


def test_embedded_sample_matches_its_sources_entry() -> None:
    shipped = embedded_asset_path("embedded:sample_prose")
    sources = (shipped.parent / "SOURCES.md").read_text()
    assert hashlib.sha256(shipped.read_bytes()).hexdigest() in sources
    (doc,) = texts(load_text_dataset("embedded:sample_prose"))
    assert doc.startswith("The Wonderful Wizard of Oz") and "Gutenberg" not in doc and "\r" not in doc
    assert 200_000 < len(doc) < 400_000


@pytest.mark.parametrize(
    ("make", "kwargs", "pattern"),
    [
        (lambda d: d / "nope.txt", {}, r"nope\.txt: no such file or folder.*Fix: give an existing file"),
        (lambda d: d / "*.jsonl", {}, r"no file matches this glob"),
        (lambda d: write(d / "empty.txt", ""), {}, r"empty\.txt: holds no non-blank text"),
        (lambda d: write(d / "blank.txt.xz", "  \n\n"), {}, r"blank\.txt\.xz: holds no non-blank text"),
        (lambda d: write(d / "empty.jsonl", ""), {}, r"holds no non-blank text"),
        (
            lambda d: write(d / "r.jsonl", '{"question": "q", "answer": "a"}\n'),
            {"fields": ["question", "solution"]},
            r"field 'solution' is missing from the records, which have \['question', 'answer'\]",
        ),
        (lambda d: write(d / "r.jsonl", '{"question": "q"}\n'), {}, r"field 'text' is missing"),
        (lambda d: write(d / "doc.txt", DOC_A), {"format": "csv"}, r"unknown format 'csv'.*Fix: use one of auto, text"),
        (lambda d: write(d / "doc.csv", "a,b\n"), {}, r"cannot tell the format of 'doc\.csv'"),
        (lambda d: write(d / "bad.jsonl", '{"text": oops\n'), {}, r"bad\.jsonl: could not be loaded \(.*Fix: check"),
        (lambda d: d, {}, r"the folder holds no files"),
    ],
)
def test_load_errors(tmp_path: Path, make, kwargs: dict, pattern: str) -> None:
    with pytest.raises(DataError, match=pattern) as info:
        load_text_dataset(str(make(tmp_path)), **kwargs)
    assert "Fix: " in str(info.value)


def test_mixed_formats_in_folder(tmp_path: Path) -> None:
    write(tmp_path / "a.txt", DOC_A)
    write(tmp_path / "b.jsonl", '{"text": "x"}\n')
    with pytest.raises(DataError, match=r"mix formats \['json', 'text'\]"):
        load_text_dataset(str(tmp_path))
    assert texts(load_text_dataset(str(tmp_path), format="jsonl")) == ["x"]


def test_hub_name_offline_is_a_clear_error() -> None:
    name = "hf://gsm-train-tests/no-such-set:main@train"
    with pytest.raises(DataError, match=re.escape(name) + r": could not be loaded .*Fix: .*HF_HUB_OFFLINE"):
        load_text_dataset(name)


# --- packing ---------------------------------------------------------------------------------


def test_pack_tokens_separates_documents_with_eos(tiny_tokenizer) -> None:
    docs = ["the quick brown fox", "jumps over", "the lazy dog " * 5]
    ds = datasets.Dataset.from_dict({"text": docs})
    eos = tiny_tokenizer.eos_token_id
    stream = [t for doc in docs for t in tiny_tokenizer(doc, add_special_tokens=False)["input_ids"] + [eos]]
    rows = pack_tokens(ds, tiny_tokenizer, 7)
    assert rows.dtype == torch.long and rows.shape == (len(stream) // 7, 7)
    assert rows.flatten().tolist() == stream[: rows.numel()]
    assert tokens_in_rows(rows) == rows.numel()
    assert (rows == eos).sum() == sum(1 for t in stream[: rows.numel()] if t == eos) >= 2
    no_eos = pack_tokens(ds, tiny_tokenizer, 7, add_eos=False)
    assert eos not in no_eos.flatten().tolist()


def test_pack_tokens_multiprocess_matches(tiny_tokenizer) -> None:
    ds = datasets.Dataset.from_dict({"text": [f"document {i} about the fox" for i in range(40)]})
    assert torch.equal(pack_tokens(ds, tiny_tokenizer, 16), pack_tokens(ds, tiny_tokenizer, 16, num_proc=2))


def test_pack_tokens_errors(tiny_tokenizer) -> None:
    ds = datasets.Dataset.from_dict({"text": ["short"]})
    with pytest.raises(DataError, match=r"\d+ tokens do not fill one row of seq_len=4096.*smaller seq_len or more"):
        pack_tokens(ds, tiny_tokenizer, 4096)
    no_eos = tiny_tokenizer.__class__(tokenizer_object=tiny_tokenizer.backend_tokenizer)
    with pytest.raises(DataError, match="the tokenizer has no eos token"):
        pack_tokens(ds, no_eos, 2)


def test_pack_embedded_sample(tiny_tokenizer) -> None:
    rows = pack_tokens(load_text_dataset("embedded:sample_prose"), tiny_tokenizer, 256)
    assert rows.shape[1] == 256 and rows.shape[0] > 100


# --- eval split ------------------------------------------------------------------------------


def numbered_rows(n: int, seq_len: int = 3) -> torch.Tensor:
    """Rows whose first token is their index, so rows can be identified."""
    return torch.arange(n * seq_len).view(n, seq_len) // seq_len


@pytest.mark.parametrize(("eval_rows", "n_eval"), [(0.1, 10), (7, 7), (7.0, 7), (0.004, 0)])
def test_split_eval(eval_rows: float, n_eval: int) -> None:
    rows = numbered_rows(100)
    if n_eval == 0:
        with pytest.raises(DataError, match=r"leaves 0 eval and 100 train rows"):
            split_eval(rows, eval_rows, seed=0)
        return
    train, held = split_eval(rows, eval_rows, seed=0)
    train_ids, held_ids = train[:, 0].tolist(), held[:, 0].tolist()
    assert len(held_ids) == n_eval and not set(train_ids) & set(held_ids)
    assert sorted(train_ids + held_ids) == list(range(100))
    assert train_ids == sorted(train_ids) and held_ids == sorted(held_ids)
    again_train, again_held = split_eval(rows, eval_rows, seed=0)
    assert torch.equal(train, again_train) and torch.equal(held, again_held)
    assert not torch.equal(held, split_eval(rows, eval_rows, seed=1)[1])


@pytest.mark.parametrize("eval_rows", [0, 100, 1.5, -0.1, -3, True, "0.1"])
def test_split_eval_errors(eval_rows: float) -> None:
    with pytest.raises(DataError, match="eval split"):
        split_eval(numbered_rows(100), eval_rows, seed=0)


# --- batches ---------------------------------------------------------------------------------


def take(loader: PackedBatches, n: int) -> list[torch.Tensor]:
    return [loader.next_batch() for _ in range(n)]


def test_batches_cover_each_epoch_and_are_deterministic() -> None:
    rows = numbered_rows(24)
    loader = PackedBatches(rows, 4, seed=3)
    assert loader.steps_per_epoch == 6
    batches = take(loader, 12)
    assert all(b.shape == (4, 3) for b in batches)
    epoch0 = torch.cat(batches[:6])[:, 0].tolist()
    epoch1 = torch.cat(batches[6:])[:, 0].tolist()
    assert sorted(epoch0) == sorted(epoch1) == list(range(24)) and epoch0 != epoch1
    assert all(torch.equal(a, b) for a, b in zip(batches, take(PackedBatches(rows, 4, seed=3), 12)))
    assert not torch.equal(torch.cat(batches), torch.cat(take(PackedBatches(rows, 4, seed=4), 12)))


@pytest.mark.parametrize("drop_last", [True, False])
def test_two_ranks_equal_one_process(drop_last: bool) -> None:
    rows = numbered_rows(27)
    single = PackedBatches(rows, 6, seed=5, drop_last=drop_last)
    ranks = [PackedBatches(rows, 3, seed=5, rank=r, world_size=2, drop_last=drop_last) for r in range(2)]
    assert single.steps_per_epoch == ranks[0].steps_per_epoch == (4 if drop_last else 5)
    for _ in range(3 * single.steps_per_epoch):
        assert torch.equal(torch.cat([r.next_batch() for r in ranks]), single.next_batch())


def test_without_drop_last_every_row_is_seen() -> None:
    loader = PackedBatches(numbered_rows(10), 4, seed=0, drop_last=False)
    epoch = torch.cat(take(loader, loader.steps_per_epoch))
    assert epoch.shape == (12, 3) and set(epoch[:, 0].tolist()) == set(range(10))


@pytest.mark.parametrize("stop", [3, 6, 8])  # mid-epoch, exactly at the epoch boundary, in the next epoch
def test_resume_from_state_dict(stop: int) -> None:
    rows = numbered_rows(26)
    reference = take(PackedBatches(rows, 2, seed=9, rank=1, world_size=2), 14)
    interrupted = PackedBatches(rows, 2, seed=9, rank=1, world_size=2)
    take(interrupted, stop)
    state = json.loads(json.dumps(interrupted.state_dict()))  # survives a checkpoint round trip
    resumed = PackedBatches(rows, 2, seed=9, rank=1, world_size=2)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(take(resumed, 14 - stop), reference[stop:]))


def test_batch_errors() -> None:
    rows = numbered_rows(7)
    with pytest.raises(DataError, match=r"7 rows do not fill one global batch of 4 x 2 ranks"):
        PackedBatches(rows, 4, seed=0, world_size=2)
    with pytest.raises(DataError, match="not a valid layout"):
        PackedBatches(rows, 2, seed=0, rank=2, world_size=2)
    state = PackedBatches(rows, 2, seed=0).state_dict()
    with pytest.raises(DataError, match="seed is 0 in the saved state but 1 now"):
        PackedBatches(rows, 2, seed=1).load_state_dict(state)
