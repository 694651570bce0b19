"""Nothing the user owns is deleted, and no good run is lost to a failing one (issue 44, "Data loss" and
the path refusals): --overwrite removes only what a run wrote, and only once the new run has a good
checkpoint (a run that fails first puts the previous one back); an exported model card the user
edited survives a new export; --resume auto with nothing to resume is refused; `~` in a path is the
home folder everywhere, and an empty path is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from run_helpers import GATE_RECIPE, REPO, TINY_GATE, file_digests, records
from safetensors.torch import load_file
from test_finite_guard import QUICKSTART_JOINT, TINY_JOINT, NaNAtSteps

from gsm_train import cli
from gsm_train.attention import inject_gsm
from gsm_train.config.schema import GSMConfig, load_recipe
from gsm_train.export.adapter_format import ARGS_FILE, CARD_FILE, CONFIG_FILE, GSM_FILE
from gsm_train.export.model_card import build_card
from gsm_train.export.save_load import export_adapter
from gsm_train.models.model_zoo import tiny_model
from gsm_train.train import train_recipe
from gsm_train.training.checkpoint import read_state
from gsm_train.training.finite_guard import NonFiniteError
from gsm_train.training.preflight import StartOptions
from gsm_train.training.run_folder import read_run_id
from gsm_train.training.trainer import run_training

MATH_GATE = str(REPO / "recipes" / "math_gate.yaml")
TWO_STEPS = [*TINY_GATE, "train.steps=2", "output.checkpoint_every=1"]
# the new run that overwrites: another seed and learning rate
OTHER_RUN = [*TINY_GATE, "train.steps=2", "output.checkpoint_every=2", "train.seed=7", "optim.lr=0.02"]
# the joint stage on the tiny Llama with a tau that makes the loss NaN at step 1 (the NaN guard: exit 3)
NAN_AT_STEP_1 = [*TINY_JOINT, "train.steps=2", "gsm.kv_compression.tau=1e-45"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step gate run with checkpoints at steps 1 and 2 and its export."""
    run = tmp_path_factory.mktemp("finished") / "run"
    train_recipe(GATE_RECIPE, [*TWO_STEPS, f"output.dir={run}"])
    return run


def _no_aside_left(run: Path) -> bool:
    return not any(p.name == ".overwritten" for p in run.rglob("*"))


def test_overwrite_keeps_a_file_the_user_put_into_checkpoints(finished_run: Path, tmp_path: Path) -> None:
    run = shutil.copytree(finished_run, tmp_path / "run")
    (run / "checkpoints" / "notes.txt").write_text("mine\n")
    (run / "checkpoints" / "best").mkdir()
    (run / "checkpoints" / "best" / "weights.bin").write_bytes(b"mine too")
    assert cli.main(["train", GATE_RECIPE, *OTHER_RUN, f"output.dir={run}", "--overwrite"]) == 0
    assert (run / "checkpoints" / "notes.txt").read_text() == "mine\n"
    assert (run / "checkpoints" / "best" / "weights.bin").read_bytes() == b"mine too"
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["best", "latest", "notes.txt", "step_00000002"], "the previous run's step 1 is gone"
    assert (
        json.loads((run / "checkpoints" / "step_00000002" / "state.json").read_text())["recipe"]["train"]["seed"] == 7
    )
    assert _no_aside_left(run)


def test_overwrite_refuses_an_export_folder_holding_a_user_file_and_touches_nothing(
    finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The run's export goes to RUN/export at its end; a file of the user's there is neither removed nor
    left to fail the run after training: refused before anything runs."""
    run = shutil.copytree(finished_run, tmp_path / "run")
    (run / "export" / "notes.txt").write_text("mine\n")
    before = file_digests(run)
    assert cli.main(["train", GATE_RECIPE, *OTHER_RUN, f"output.dir={run}", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert f"{run / 'export'}" in err and "notes.txt" in err and "Traceback" not in err, err
    assert file_digests(run) == before


def test_a_failing_overwrite_run_puts_the_previous_run_back(
    finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = shutil.copytree(finished_run, tmp_path / "run")
    (run / "notes.txt").write_text("mine\n")
    before = file_digests(run)
    status = cli.main(["train", QUICKSTART_JOINT, *NAN_AT_STEP_1, f"output.dir={run}", "--overwrite"])
    err = capsys.readouterr().err
    assert status == 3 and "step 1: non-finite loss=nan" in err, err
    assert "the previous run's files" in err and "are back" in err
    assert file_digests(run) == before, "the previous run's export, checkpoints, log and recipe, as they were"
    assert _no_aside_left(run) and not (run / "run.lock").exists()
    # and it still continues: its checkpoint verifies and --resume auto takes it
    assert cli.main(["train", GATE_RECIPE, *TWO_STEPS, "train.steps=3", f"output.dir={run}", "--resume", "auto"]) == 0
    assert [r["step"] for r in records(run) if r["kind"] == "setup"] == [0, 2]


def test_an_overwrite_run_failing_after_its_first_checkpoint_keeps_its_own(finished_run: Path, tmp_path: Path) -> None:
    """Once the new run has a good checkpoint, the previous run's files are gone and a later failure
    leaves the new run to resume; the previous export stays until the new run exports."""
    run = shutil.copytree(finished_run, tmp_path / "run")
    old_id, old_export = read_run_id(run), file_digests(run / "export")
    config = load_recipe(GATE_RECIPE, [*TWO_STEPS, "train.steps=3", f"output.dir={run}"])
    with pytest.raises(NonFiniteError, match="step 2: non-finite loss=nan"):
        run_training(config, NaNAtSteps({2}), options=StartOptions(overwrite=True))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_00000001"]
    new_id = read_state(run / "checkpoints" / "step_00000001")["run_id"]
    assert new_id == read_run_id(run) != old_id
    assert [r["step"] for r in records(run) if r["kind"] == "setup"] == [0], "the new run's log only"
    assert file_digests(run / "export") == old_export and _no_aside_left(run)


def test_a_start_where_a_killed_overwrite_left_the_previous_run_aside_is_refused(
    finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """As a SIGKILL between setting the previous run aside and the new run's first checkpoint leaves it."""
    run = shutil.copytree(finished_run, tmp_path / "run")
    aside = run / "checkpoints" / ".overwritten"
    aside.mkdir()
    (run / "checkpoints" / "step_00000002").rename(aside / "step_00000002")
    before = file_digests(run)
    for flags in (["--overwrite"], ["--resume", "auto"]):
        assert cli.main(["train", GATE_RECIPE, *TWO_STEPS, f"output.dir={run}", *flags]) == 2
        err = capsys.readouterr().err
        assert f"{aside} holds the files of the run that an --overwrite run set aside" in err, err
    assert file_digests(run) == before


def _card_export(folder: Path, scale: float) -> Path:
    """An export of the tiny Llama with GSM tensors set from `scale` (each export of another scale differs)."""
    model = tiny_model("llama")
    inject_gsm(model, GSMConfig.model_validate({"sparse_attention": {"top_k": 4, "k_min": 4}}), mode="sparse")
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if ".gsm." in name and tensor.is_floating_point():
                tensor.fill_(scale)
    return export_adapter(model, folder, base_name="tiny-llama", metrics={"kl": scale})


def test_an_export_over_a_previous_one_keeps_a_card_the_user_edited(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    folder = _card_export(tmp_path / "export", 0.1)
    edited = (folder / CARD_FILE).read_text() + "\n## Notes\n\nMy own words.\n"
    (folder / CARD_FILE).write_text(edited)
    first_weights = (folder / GSM_FILE).read_bytes()
    _card_export(folder, 0.2)
    assert (folder / CARD_FILE).read_text() == edited
    assert (folder / GSM_FILE).read_bytes() != first_weights, "the rest of the export is the new one"
    assert f"kept {folder / CARD_FILE}" in capsys.readouterr().err
    # a card as gsm-train wrote it is written anew, from the new export's config and metrics
    (folder / CARD_FILE).unlink()
    _card_export(folder, 0.3)
    _card_export(folder, 0.4)
    config = json.loads((folder / CONFIG_FILE).read_text())
    args = json.loads((folder / ARGS_FILE).read_text())
    assert args["metrics"] == {"kl": 0.4}
    assert (folder / CARD_FILE).read_text() == build_card(config, args)


@pytest.mark.parametrize("damaged", [False, True], ids=["none written", "only a damaged one"])
def test_resume_auto_with_no_checkpoint_to_continue_is_refused(
    finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture, damaged: bool
) -> None:
    run = tmp_path / "run"
    if damaged:
        shutil.copytree(finished_run, run)
        shutil.rmtree(run / "checkpoints" / "step_00000001")
        (run / "checkpoints" / "step_00000002" / "manifest.json").unlink()
    before = file_digests(run) if run.exists() else None
    status = cli.main(["train", GATE_RECIPE, *TWO_STEPS, f"output.dir={run}", "--resume", "auto"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.count("\n") == 1 and err.startswith("error: --resume auto:"), err
    assert "no checkpoint to continue from" in err and "without --resume" in err
    assert ("manifest.json is missing" in err) == damaged
    assert (file_digests(run) if run.exists() else None) == before


def test_a_tilde_in_a_path_is_the_home_folder(
    finished_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """output.dir='~/x' is a folder in the home folder, never one named `~` here; init_from='~/...'
    that exists is taken; the same in a command line's paths."""
    home, here = tmp_path / "home", tmp_path / "here"
    home.mkdir()
    here.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(here)
    shutil.copytree(finished_run / "export", home / "gate_export")
    math = [*TINY_GATE, "train.steps=1", "init_from=~/gate_export", "output.dir=~/math"]
    assert cli.main(["train", MATH_GATE, *math]) == 0
    assert not (here / "~").exists() and list(here.iterdir()) == []
    setup = next(r for r in records(home / "math") if r["kind"] == "setup")
    assert setup["step"] == 0 and (home / "math" / "export" / GSM_FILE).is_file()
    recipe = (home / "math" / "recipe.resolved.yaml").read_text()
    assert f"init_from: {home / 'gate_export'}" in recipe and f"dir: {home / 'math'}" in recipe
    checkpoint = "~/math/checkpoints/step_00000001"
    assert cli.main(["export", checkpoint, "~/again"]) == 0
    again, trained = load_file(str(home / "again" / GSM_FILE)), load_file(str(home / "math" / "export" / GSM_FILE))
    assert again.keys() == trained.keys() and all(torch.equal(again[k], trained[k]) for k in again)
    assert list(here.iterdir()) == []


@pytest.mark.parametrize("field", ["output.dir", "init_from", "data.train.path", "output.resume_from"])
def test_an_empty_path_in_a_recipe_is_refused(
    field: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    status = cli.main(["train", GATE_RECIPE, *TWO_STEPS, f"{field}=''"])
    err = capsys.readouterr().err
    assert status == 2 and f"{field} = '': an empty path" in err, err
    assert list(tmp_path.iterdir()) == [], "nothing trained into the current folder"


@pytest.mark.parametrize(
    "argv", [["export", "", "out"], ["train", GATE_RECIPE, "--resume", ""], ["eval", "--data", " ", "--out", "x"]]
)
def test_an_empty_path_on_the_command_line_is_refused(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    assert "an empty path" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
