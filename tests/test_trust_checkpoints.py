"""What a checkpoint or an export may be trusted with (issue 44, security and silent corruption):
reading a checkpoint runs no code from it; every reader verifies the manifest first; a checkpoint is
exported with the recipe it was trained with, and a resumed recipe that changes a trained tensor's
shape is refused before the model loads; the token cache is verified and rebuilt when damaged;
exports of one checkpoint are byte-identical and name no local path."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from run_helpers import GATE_RECIPE, TINY_GATE, file_digests
from safetensors.torch import load_file

from gsm_train import checkpoint_export, cli, session
from gsm_train.checkpoint import verify_checkpoint, write_manifest

STEPS = [*TINY_GATE, "train.steps=2", "output.checkpoint_every=2"]
STEP = "step_00000002"


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
