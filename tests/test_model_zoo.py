"""The converted-model folder is published whole, also when several processes build it at once (the three runs
of a benchmark side by side on a fresh machine once deleted each other's half-written folder); SmolLM2's config
is read without its weights before the first conversion."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from gsm_train.models import model_zoo
from gsm_train.models.families import config_dims
from gsm_train.models.model_zoo import fetch_smollm2, publish_folder, read_model_config


def _build_slowly(tmp: Path) -> None:
    (tmp / "model.safetensors").write_bytes(b"x" * 1_000_000)
    (tmp / "config.json").write_text("{}")


def _publish(folder: str) -> None:
    publish_folder(Path(folder), _build_slowly)


def test_processes_publishing_together_leave_one_complete_folder(tmp_path: Path) -> None:
    folder = tmp_path / "model-hf"
    context = multiprocessing.get_context("fork")  # the children only write files: no import of their own
    workers = [context.Process(target=_publish, args=(str(folder),)) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert [worker.exitcode for worker in workers] == [0] * 4
    assert sorted(path.name for path in folder.iterdir()) == ["config.json", "model.safetensors"]
    assert [path.name for path in tmp_path.iterdir()] == ["model-hf"]  # no private folder left behind


def test_a_folder_published_first_by_another_process_stands(tmp_path: Path) -> None:
    folder = tmp_path / "model-hf"

    def build_while_another_wins(tmp: Path) -> None:
        folder.mkdir()
        (folder / "config.json").write_text('{"winner": true}')
        (tmp / "config.json").write_text('{"winner": false}')

    assert publish_folder(folder, build_while_another_wins) == folder
    assert (folder / "config.json").read_text() == '{"winner": true}'
    assert [path.name for path in tmp_path.iterdir()] == ["model-hf"]


def test_a_folder_left_incomplete_by_a_crash_is_replaced(tmp_path: Path) -> None:
    folder = tmp_path / "model-hf"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"half")
    publish_folder(folder, _build_slowly)
    assert (folder / "config.json").exists() and (folder / "model.safetensors").stat().st_size == 1_000_000


def test_smollm2_s_config_before_its_first_conversion_comes_from_the_gguf_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GGUF never converted (no `smollm2-135m-hf` folder beside it): the config is read from the GGUF's
    header, so a recipe resolves against it before any weights load; nothing is converted or written."""
    alone = tmp_path / model_zoo.SMOLLM2_FILE
    alone.symlink_to(fetch_smollm2())  # the cached file (fetched once)
    monkeypatch.setenv("GSM_SMOLLM2_GGUF", str(alone))

    def no_conversion() -> Path:
        raise AssertionError("the weights were converted to read the config")

    monkeypatch.setattr(model_zoo, "_smollm2_converted", no_conversion)
    dims = config_dims(read_model_config("smollm2-135m"))
    assert dims == {"hidden": 576, "heads": 9, "kv_heads": 3, "head_dim": 64, "layers": 30, "context": 8192}
    assert sorted(path.name for path in tmp_path.iterdir()) == [model_zoo.SMOLLM2_FILE]
