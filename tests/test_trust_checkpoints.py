"""What a checkpoint or an export may be trusted with (issue 44, security and silent corruption):
reading a checkpoint runs no code from it; every reader verifies the manifest first; a checkpoint is
exported with the recipe it was trained with, and a resumed recipe that changes a trained tensor's
shape is refused before the model loads; the token cache is verified and rebuilt when damaged;
exports of one checkpoint are byte-identical and name no local path."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import pickle
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hub_stand_in import StandInHub, serve_stand_in
from run_helpers import GATE_RECIPE, TINY_GATE, file_digests
from safetensors.torch import load_file
from test_hub import hub_env  # noqa: F401 (the Hub client's settings, autouse)

from gsm_train import cli
from gsm_train.attention import inject_gsm
from gsm_train.config.schema import DataSourceConfig, GSMConfig, load_recipe
from gsm_train.export.hub import publish_export
from gsm_train.export.published_bytes import redact_local_paths
from gsm_train.export.save_load import export_adapter
from gsm_train.models.model_zoo import byte_tokenizer, tiny_model
from gsm_train.training import checkpoint_export, session, token_cache
from gsm_train.training.checkpoint import verify_checkpoint, write_manifest
from gsm_train.training.dcp_safe import UnsafeCheckpointError, read_dcp_metadata
from gsm_train.training.distributed import DistInfo
from gsm_train.training.preflight import recipe_changes

STEPS = [*TINY_GATE, "train.steps=2", "output.checkpoint_every=2"]
STEP = "step_00000002"
SOURCE = "embedded:sample_prose"
ONE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-step gate run with its checkpoint at step 2 and its own export."""
    run = tmp_path_factory.mktemp("trained") / "run"
    assert cli.main(["train", GATE_RECIPE, *STEPS, f"output.dir={run}"]) == 0
    return run


@pytest.fixture
def run(trained: Path, tmp_path: Path) -> Path:
    """A copy of the trained run, free to alter."""
    return shutil.copytree(trained, tmp_path / "run")


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the checkpoint was refused")

    monkeypatch.setattr(session, "load_model_and_tokenizer", refuse)
    monkeypatch.setattr(checkpoint_export, "load_model_and_tokenizer", refuse)


class _Payload:
    """Unpickled, runs `code` (what a hostile checkpoint would carry)."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self) -> tuple:
        return (exec, (self.code,))


def _plant_payload(checkpoint: Path, marker: Path) -> None:
    """Hide a payload that writes `marker` in the checkpoint's DCP index, and make its manifest
    match again (as whoever altered it would)."""
    index = checkpoint / "dcp" / ".metadata"
    metadata = pickle.loads(index.read_bytes())
    metadata.extra = _Payload(f"open({str(marker)!r}, 'w').write('ran')")
    index.write_bytes(pickle.dumps(metadata))
    write_manifest(checkpoint)
    assert verify_checkpoint(checkpoint) is None


def test_a_checkpoint_whose_index_would_run_code_is_refused_by_export_and_resume(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    marker = tmp_path / "payload-ran"
    checkpoint = run / "checkpoints" / STEP
    _plant_payload(checkpoint, marker)
    status = cli.main(["export", str(checkpoint), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert status == 2 and "refers to builtins.exec" in err and "nothing of it was run" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not marker.exists(), "the payload ran on export"
    assert not (tmp_path / "out").exists()
    before = file_digests(run)
    status = cli.main(["train", GATE_RECIPE, *STEPS, "train.steps=4", f"output.dir={run}", "--resume", "auto"])
    err = capsys.readouterr().err
    assert status == 2 and "refers to builtins.exec" in err, err
    assert not marker.exists(), "the payload ran on resume"
    assert file_digests(run) == before


def test_the_index_reader_builds_a_real_index_and_refuses_any_other_global(trained: Path) -> None:
    data = (trained / "checkpoints" / STEP / "dcp" / ".metadata").read_bytes()
    assert read_dcp_metadata(io.BytesIO(data)) == pickle.loads(data)
    hostile = {
        "builtins.exec": pickle.dumps(_Payload("pass")),
        "posix.system": pickle.dumps(os.system),
        "subprocess.Popen": pickle.dumps(subprocess.Popen),
    }
    for name, payload in hostile.items():
        with pytest.raises(UnsafeCheckpointError, match=f"refers to {name}, which a checkpoint never holds"):
            read_dcp_metadata(io.BytesIO(payload))
    with pytest.raises(UnsafeCheckpointError, match="holds a dict, not a checkpoint index"):
        read_dcp_metadata(io.BytesIO(pickle.dumps({"a": 1})))
    with pytest.raises(UnsafeCheckpointError, match="cannot be read"):
        read_dcp_metadata(io.BytesIO(data[: len(data) // 2]))


def _plant_item_payload(checkpoint: Path, marker: Path) -> None:
    """Point the checkpoint's optimizer learning rate (a non-tensor item, read with torch.load) at a
    payload appended to its shard, and make its manifest match again."""
    index, shard = checkpoint / "dcp" / ".metadata", checkpoint / "dcp" / "__0_0.distcp"
    metadata = pickle.loads(index.read_bytes())
    (key,) = [key for key in metadata.storage_data if key.fqn == "optim.param_groups.0.lr"]
    buffer = io.BytesIO()
    torch.save(_Payload(f"open({str(marker)!r}, 'w').write('ran')"), buffer)
    offset = shard.stat().st_size
    with shard.open("ab") as handle:
        handle.write(buffer.getvalue())
    metadata.storage_data[key] = dataclasses.replace(
        metadata.storage_data[key], offset=offset, length=len(buffer.getvalue())
    )
    index.write_bytes(pickle.dumps(metadata))
    write_manifest(checkpoint)


def test_a_checkpoint_item_that_would_run_code_is_refused_on_resume(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    marker = tmp_path / "payload-ran"
    _plant_item_payload(run / "checkpoints" / STEP, marker)
    before = file_digests(run)
    status = cli.main(["train", GATE_RECIPE, *STEPS, "train.steps=4", f"output.dir={run}", "--resume", "auto"])
    err = capsys.readouterr().err
    assert status == 2 and "its item optim.param_groups.0.lr holds what a checkpoint never holds" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not marker.exists(), "the payload ran on resume"
    assert file_digests(run) == before


def test_export_refuses_a_checkpoint_that_no_longer_matches_its_manifest(
    run: Path, tmp_path: Path, no_model_load: None, capsys: pytest.CaptureFixture
) -> None:
    shard = run / "checkpoints" / STEP / "dcp" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40  # one bit, inside a tensor
    shard.write_bytes(bytes(data))
    status = cli.main(["export", str(run / "checkpoints" / STEP), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert status == 2 and f"{shard} does not match its sha256 in the manifest" in err, err
    assert not (tmp_path / "out").exists()


def _top_k(export: Path) -> int:
    return json.loads((export / "gsm_config.json").read_text())["sparse_attention"]["top_k"]


def test_export_of_a_resumed_checkpoint_uses_the_recipe_it_was_trained_with(run: Path, tmp_path: Path) -> None:
    changed = [*STEPS, "train.steps=4", "gsm.sparse_attention.top_k=16", f"output.dir={run}"]
    assert cli.main(["train", GATE_RECIPE, *changed, "--resume", "auto", "--allow-recipe-change"]) == 0
    assert _top_k(run / "export") == 16
    out = tmp_path / "out"
    assert cli.main(["export", str(run / "checkpoints" / "step_00000004"), str(out)]) == 0
    assert _top_k(out) == 16, "rebuilt from the run's first recipe (top_k 8)"
    ours, theirs = (
        load_file(str(out / "gsm_modules.safetensors")),
        load_file(str(run / "export/gsm_modules.safetensors")),
    )
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_recipe_change_that_alters_a_trained_shape_is_refused_before_the_model_loads(
    run: Path, no_model_load: None, capsys: pytest.CaptureFixture
) -> None:
    before = file_digests(run)
    changed = [*STEPS, "train.steps=4", "gsm.sparse_attention.gate_head_dim=8", f"output.dir={run}"]
    status = cli.main(["train", GATE_RECIPE, *changed, "--resume", "auto", "--allow-recipe-change"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert "the recipe changes the shape of 8 trained tensors" in err
    assert "model.layers.0.self_attn.gsm.gate.k_proj.weight is [16, 64] there, [8, 64] here" in err
    assert "changed fields: gsm.sparse_attention.gate_head_dim" in err
    assert file_digests(run) == before


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "tokens"
    monkeypatch.setenv("GSM_TOKEN_CACHE", str(folder))
    return folder


def _rows() -> torch.Tensor:
    return token_cache.cached_rows(DataSourceConfig(path=SOURCE), byte_tokenizer(), 64, ONE)


@pytest.mark.parametrize("damage", ["zero-filled", "truncated"])
def test_a_damaged_token_cache_entry_is_tokenized_again(
    cache: Path, damage: str, capsys: pytest.CaptureFixture
) -> None:
    expected = _rows().clone()
    (tokens,) = cache.glob("*.tokens")
    size = tokens.stat().st_size
    if damage == "zero-filled":
        tokens.write_bytes(b"\0" * size)
    else:
        os.truncate(tokens, size // 3)
    rows = _rows()
    assert torch.equal(rows, expected)
    err = capsys.readouterr().err
    assert f"warning: damaged token cache entry: {tokens}" in err and f"tokenizing {SOURCE} again" in err, err
    assert tokens.stat().st_size == size
    assert torch.equal(_rows(), expected) and "damaged" not in capsys.readouterr().err


def test_the_token_cache_digest_samples_a_large_file(tmp_path: Path) -> None:
    big = tmp_path / "big.tokens"
    big.write_bytes(bytes(range(256)) * (1 << 15))  # 8 MiB: above the 4 MiB read whole
    digest = token_cache.sampled_digest(big)
    with big.open("r+b") as handle:
        handle.seek(big.stat().st_size - 1)  # the last byte is always sampled
        handle.write(b"\1")
    assert token_cache.sampled_digest(big) != digest


def test_a_token_cache_that_names_a_file_is_one_error_before_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_model_load: None, capsys: pytest.CaptureFixture
) -> None:
    file = tmp_path / "cache-file"
    file.write_text("mine")
    monkeypatch.setenv("GSM_TOKEN_CACHE", str(file))
    status = cli.main(["train", GATE_RECIPE, *STEPS, f"output.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert f"GSM_TOKEN_CACHE={file}: names a file, not a folder" in err
    assert file.read_text() == "mine" and not (tmp_path / "run").exists()


def _header(path: Path) -> bytes:
    length = int.from_bytes(path.read_bytes()[:8], "little")
    return path.read_bytes()[8 : 8 + length]


def test_exports_of_one_checkpoint_are_byte_identical(trained: Path, tmp_path: Path) -> None:
    checkpoint = trained / "checkpoints" / STEP
    for out in ("a", "b"):
        assert cli.main(["export", str(checkpoint), str(tmp_path / out)]) == 0
    assert file_digests(tmp_path / "a") == file_digests(tmp_path / "b")
    model = tiny_model("llama", num_layers=2)
    inject_gsm(model, GSMConfig(), mode="sparse")
    headers = set()
    for n in range(8):  # safetensors orders its metadata at random: 8 exports agree by chance 1 time in 128
        export = export_adapter(model, tmp_path / f"direct{n}", base_name="tiny-llama")
        headers.add(_header(export / "gsm_modules.safetensors"))
    (header,) = headers
    assert header.rstrip() == json.dumps(json.loads(header), sort_keys=True, separators=(",", ":")).encode()


def _absolute_paths(text: str, *roots: Path) -> list[str]:
    return [str(root) for root in roots if str(root) in text]


def test_an_export_names_no_local_path(trained: Path, tmp_path: Path) -> None:
    home = Path.home()
    exports = [trained / "export"]
    assert cli.main(["export", str(trained / "checkpoints" / STEP), str(tmp_path / "out")]) == 0
    exports.append(tmp_path / "out")
    for export in exports:
        for file in export.iterdir():
            text = file.read_bytes().decode("utf-8", errors="replace")
            assert not _absolute_paths(text, trained, tmp_path, home), f"{file} names a local path"
        recipe = json.loads((export / "training_args.json").read_text())["recipe"]
        assert recipe["output"]["dir"] == "<local>/run"
        assert recipe["data"]["train"]["path"] == SOURCE


def test_local_paths_are_redacted_and_relative_ones_kept() -> None:
    recipe = {
        "model": {"name_or_path": "/home/alice/models/base"},
        "data": {"train": {"path": "/srv/corpus/*.jsonl"}, "eval": {"path": "data/eval.txt"}},
        "init_from": "~/runs/gate/export",
        "output": {"dir": "runs/joint"},
        "layers": [1, "/x/y"],
    }
    assert redact_local_paths(recipe) == {
        "model": {"name_or_path": "<local>/base"},
        "data": {"train": {"path": "<local>/*.jsonl"}, "eval": {"path": "data/eval.txt"}},
        "init_from": "<local>/export",
        "output": {"dir": "runs/joint"},
        "layers": [1, "<local>/y"],
    }


@pytest.fixture
def stand_in() -> Iterator[StandInHub]:
    with serve_stand_in() as state:
        yield state


def test_publish_names_no_local_path(stand_in: StandInHub, tmp_path: Path) -> None:
    base = tmp_path / "my-base"
    model = tiny_model("llama")
    model.save_pretrained(base)
    inject_gsm(model, GSMConfig(), mode="sparse")
    recipe = {"data": {"train": {"path": str(tmp_path / "corpus.txt")}}, "output": {"dir": str(tmp_path / "run")}}
    folder = export_adapter(model, tmp_path / "export", base_name=str(base), recipe=recipe)
    card = (folder / "README.md").read_text()
    assert str(tmp_path) not in card and "`<local>/my-base`" in card  # the card as exported, too
    publish_export(
        folder,
        "my-org/gsm",
        token="hf_standInToken0123456789",
        endpoint=stand_in.url,
        base_model_id="my-org/local-base",
    )
    lines = stand_in.requests[-1].ndjson()
    files = {line["value"]["path"]: base64.b64decode(line["value"]["content"]) for line in lines[1:]}
    assert files.keys() >= {"gsm_config.json", "training_args.json", "README.md"}
    for name, content in files.items():
        assert str(tmp_path) not in content.decode("utf-8", errors="replace"), f"{name} names a local path"
    config = json.loads(files["gsm_config.json"])["base_model"]
    assert config["name_or_path"] == "<local>/my-base" and config["hub_id"] == "my-org/local-base"


def test_a_field_added_since_a_checkpoint_was_written_counts_at_its_default() -> None:
    """A checkpoint's recipe from before a field existed (here `data.copy_spans`) resumes without
    --allow-recipe-change while the field stays at its default; set otherwise, it is a change."""
    given = load_recipe(GATE_RECIPE, list(TINY_GATE)).model_dump(mode="json")
    stored = json.loads(json.dumps(given))
    del stored["data"]["copy_spans"]
    assert recipe_changes(stored, given) == []
    changed = json.loads(json.dumps(given))
    changed["data"]["copy_spans"]["count"] = 2
    assert recipe_changes(stored, changed) == [("data.copy_spans.count", 0, 2)]
