"""Inputs that cannot mean what they say are refused with one line naming the field, the value and the
fix, before anything expensive runs; failures of the machine (a full disk, Ctrl-C) end in one line that
says what holds and what to do (issue 44, "Inputs that should be refusals")."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub.constants
import pytest
from run_helpers import GATE_RECIPE, TINY_GATE

from gsm_train import cli
from gsm_train import train as train_entry
from gsm_train.commands import evaluate
from gsm_train.training import checkpoint, checkpoint_export, session, trainer
from gsm_train.training.checkpoint import verify_checkpoint, write_manifest


@contextlib.contextmanager
def within(seconds: int) -> Iterator[None]:
    """Fail the test (TimeoutError) if the block runs longer than `seconds` (SIGALRM: the main thread)."""

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def one_line_error(capsys: pytest.CaptureFixture) -> str:
    """The captured stderr, checked to hold no traceback and one `error:` line."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and [line[:6] for line in err.splitlines()].count("error:") == 1, err
    return err


def refuse_to_load(*args: object, **kwargs: object) -> None:
    raise AssertionError("the model was loaded before the bad input was refused")


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to load a model fails the test: the checks must come first."""
    for module in (session, evaluate, checkpoint_export):
        monkeypatch.setattr(module, "load_model_and_tokenizer", refuse_to_load)


def train(run: Path, *args: str) -> int:
    """`gsm-train train` of the tiny gate recipe into `run` in this process: its exit status."""
    return cli.main(["train", GATE_RECIPE, *TINY_GATE, f"output.dir={run}", *args])


EVAL = ["eval", "--model", "tiny-llama", "--data", "embedded:sample_prose", "--windows", "1"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-step run of the tiny gate recipe with a checkpoint at each step."""
    run = tmp_path_factory.mktemp("finished") / "run"
    assert train(run, "train.steps=2", "output.checkpoint_every=1") == 0
    return run


def validate(recipe: Path, capsys: pytest.CaptureFixture, *overrides: str) -> tuple[int, str, str]:
    """`gsm-train validate RECIPE OVERRIDES` in this process: (status, stdout, stderr)."""
    status = cli.main(["validate", str(recipe), *overrides])
    out = capsys.readouterr()
    assert "Traceback" not in out.err, out.err
    return status, out.out, out.err


# --- recipe parsing -------------------------------------------------------------------------------


def alias_bomb(levels: int) -> str:
    """A YAML flow list whose last item expands to 9**`levels` strings: each anchor nine aliases of the one before."""
    items = ["&l0 lol", *(f"&l{n} [{', '.join([f'*l{n - 1}'] * 9)}]" for n in range(1, levels + 1))]
    return f"[{', '.join(items)}]"


def test_an_alias_bomb_in_a_list_field_is_refused_at_once(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Nine levels of nine aliases (9**9 strings from one line): refused in well under a second."""
    recipe = tmp_path / "bomb.yaml"
    recipe.write_text(
        f"stage: gate_warmup\ndata:\n  train:\n    path: embedded:sample_prose\n    fields: {alias_bomb(9)}\n"
    )
    start = time.perf_counter()
    with within(20):
        status, _, err = validate(recipe, capsys)
    assert status == 2
    assert "aliases expand to more than 100000 values" in err and "fix: write the values out" in err, err
    assert time.perf_counter() - start < 5


def test_an_alias_bomb_in_an_override_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with within(20):
        status, _, err = validate(Path(GATE_RECIPE), capsys, f"data.train.fields={alias_bomb(8)}")
    assert status == 2 and "data.train.fields" in err and "aliases expand" in err, err


def test_an_alias_bomb_in_an_eval_selection_is_refused(
    tmp_path: Path, no_model_load: None, capsys: pytest.CaptureFixture
) -> None:
    argv = [*EVAL, "--select", f"top_k={alias_bomb(9)}", "--out", str(tmp_path / "eval")]
    with within(20):
        assert cli.main(argv) == 2
    assert "--select top_k" in one_line_error(capsys)


def test_a_recursive_alias_is_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    recipe = tmp_path / "recursive.yaml"
    recipe.write_text(
        "stage: gate_warmup\ndata:\n  train:\n    path: embedded:sample_prose\n    fields: &me [a, *me]\n"
    )
    status, _, err = validate(recipe, capsys)
    assert status == 2, err
    assert "a recursive alias: the value from line 5 holds an alias of itself" in err, err


def test_merge_keys_are_accepted_and_the_mapping_s_own_keys_win(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    recipe = tmp_path / "merge.yaml"
    recipe.write_text(
        "stage: gate_warmup\n"
        "optim: &optim\n  lr: 0.002\n  warmup_steps: 3\n"
        "logging: {log_every: 2}\n"
        "train:\n  steps: 7\n"
        "gsm:\n  sparse_attention:\n    <<: {top_k: 40, k_min: 8}\n    top_k: 48\n"
    )
    status, out, err = validate(recipe, capsys)
    assert status == 0, err
    assert "  top_k: 48\n" in out and "  k_min: 8\n" in out, out
    duplicate = tmp_path / "duplicate.yaml"
    duplicate.write_text("stage: gate_warmup\ntrain:\n  <<: {seed: 1}\n  steps: 7\n  steps: 8\n")
    status, _, err = validate(duplicate, capsys)
    assert status == 2 and "- steps: duplicate key (again on line 5)" in err, err


# --- eval, passkey and generate within the model -----------------------------------------------


def test_eval_past_the_model_s_positions_is_refused_before_it_loads(
    tmp_path: Path, no_model_load: None, capsys: pytest.CaptureFixture
) -> None:
    assert cli.main([*EVAL, "--seq-len", "8192", "--out", str(tmp_path / "eval")]) == 2
    err = one_line_error(capsys)
    assert "--seq-len = 8192: runs past the model's context: 4096 positions" in err, err
    assert "fix: keep it within 4096 positions" in err and not (tmp_path / "eval").exists()


def test_passkey_past_the_model_s_positions_is_refused_before_it_loads(
    tmp_path: Path, no_model_load: None, capsys: pytest.CaptureFixture
) -> None:
    argv = ["passkey", "--model", "tiny-llama", "--length", "5000", "--cases", "1", "--out", str(tmp_path / "pk")]
    assert cli.main(argv) == 2
    assert "--length = 5000: runs past the model's context: 4096 positions" in one_line_error(capsys)


def test_generate_past_the_model_s_positions_is_refused(capsys: pytest.CaptureFixture) -> None:
    with within(60):
        status = cli.main(["generate", "--model", "tiny-llama", "--prompt", "Once", "--max-new-tokens", "4096"])
    assert status == 2
    err = one_line_error(capsys)
    assert "--max-new-tokens = 4096: runs past the model's context (" in err and "in all): 4096 positions" in err, err


def test_eval_of_one_token_windows_is_refused(
    tmp_path: Path, no_model_load: None, capsys: pytest.CaptureFixture
) -> None:
    assert cli.main([*EVAL, "--seq-len", "1", "--out", str(tmp_path / "eval")]) == 2
    assert "--seq-len = 1: a window of one token predicts nothing" in one_line_error(capsys)


def test_two_exports_of_one_name_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = [*EVAL, "--export", "gsm=runs/a/export", "--export", "gsm=runs/b/export", "--out", str(tmp_path)]
    assert cli.main(argv) == 2
    err = one_line_error(capsys)
    assert "the name 'gsm' is given twice (also --export gsm=runs/a/export)" in err, err


# --- settings that cannot mean what they say --------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["gsm.sparse_attention.top_k=128", "gsm.sparse_attention.k_min=8"], "top_k (128) exceeds data.seq_len (64)"),
        (["logging.recall_k=65"], "logging.recall_k (65) exceeds data.seq_len (64)"),
    ],
    ids=["top_k above seq_len", "recall_k above seq_len"],
)
def test_selection_wider_than_the_window_is_refused(
    overrides: list[str], needle: str, capsys: pytest.CaptureFixture
) -> None:
    status, _, err = validate(Path(GATE_RECIPE), capsys, *TINY_GATE, *overrides)
    assert status == 2 and needle in err, err


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (
            ["gsm.sparse_attention.gate_head_dim=32"],
            "gsm.sparse_attention.gate_head_dim = 32: wider than the model's attention heads (16)",
        ),
        (
            [
                "gsm.cross_layer_sharing.enabled=true",
                "gsm.cross_layer_sharing.mode=share",
                "gsm.cross_layer_sharing.bridge_from=0",
                "gsm.cross_layer_sharing.bridge_to_start=1",
                "gsm.cross_layer_sharing.shared_kv_heads=3",
            ],
            "gsm.cross_layer_sharing.shared_kv_heads = 3: more than the model's 2 K/V heads",
        ),
    ],
    ids=["gate wider than the heads", "more shared KV heads than the model"],
)
def test_modules_wider_than_the_model_are_refused_before_it_loads(
    overrides: list[str], needle: str, tmp_path: Path, no_model_load: None, capsys: pytest.CaptureFixture
) -> None:
    assert train(tmp_path / "run", *overrides) == 2
    assert needle in one_line_error(capsys)
    assert not (tmp_path / "run").exists()


def test_steps_below_the_resumed_checkpoint_s_are_refused(
    finished_run: Path, no_model_load: None, capsys: pytest.CaptureFixture
) -> None:
    assert train(finished_run, "train.steps=1", "output.checkpoint_every=1", "--resume", "auto") == 2
    err = one_line_error(capsys)
    assert "train.steps = 1: below the step of the checkpoint to resume from (2)" in err, err


# --- one line where a traceback was -----------------------------------------------------------


def test_a_full_disk_mid_run_is_one_line_and_the_run_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The disk fills while step 2's checkpoint is written: exit 4, one line saying that the earlier
    checkpoints are intact and how to continue; continuing then finishes the run."""
    write_manifest = checkpoint.write_manifest

    def full_at_step_2(folder: Path, digests: dict | None = None) -> None:
        if folder.name.startswith("step_00000002"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder / "manifest.json"))
        write_manifest(folder, digests)

    monkeypatch.setattr(checkpoint, "write_manifest", full_at_step_2)
    run = tmp_path / "run"
    assert train(run, "train.steps=3", "output.checkpoint_every=1") == 4
    err = one_line_error(capsys)
    assert "error: a write failed: No space left on device" in err and "continue with --resume auto" in err, err
    assert verify_checkpoint(run / "checkpoints" / "step_00000001") is None
    assert not (run / "run.lock").exists()
    monkeypatch.setattr(checkpoint, "write_manifest", write_manifest)
    assert train(run, "train.steps=3", "output.checkpoint_every=1", "--resume", "auto") == 0
    assert verify_checkpoint(run / "checkpoints" / "step_00000003") is None


def test_ctrl_c_is_one_line_and_exit_130(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Through `python -m gsm_train.train`'s main: Ctrl-C while the run sets up."""

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer.TrainingSession, "setup", interrupted)
    run = tmp_path / "run"
    try:
        status = train_entry.main(["--recipe", GATE_RECIPE, *TINY_GATE, f"output.dir={run}"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C reached the user as a traceback")
    err = capsys.readouterr().err
    assert status == 130 and err.startswith("interrupted;") and "--resume auto" in err and len(err.splitlines()) == 1
    assert not (run / "run.lock").exists()


def test_a_read_only_export_destination_is_refused_before_the_model_loads(
    finished_run: Path, tmp_path: Path, no_model_load: None, capsys: pytest.CaptureFixture
) -> None:
    if os.geteuid() == 0:  # root writes into a read-only folder; stand in with one it cannot write in
        out = Path("/proc/self/gsm-export")
    else:
        (tmp_path / "read_only").mkdir(mode=0o555)
        out = tmp_path / "read_only" / "export"
    assert cli.main(["export", str(finished_run / "checkpoints" / "step_00000002"), str(out)]) == 2
    err = one_line_error(capsys)
    assert f"error: {out}" in err and "cannot write in" in err and "give a folder you can write to" in err, err


def test_eval_out_naming_a_file_is_refused_before_the_model_loads(
    tmp_path: Path, no_model_load: None, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "report").write_text("mine\n")
    assert cli.main([*EVAL, "--seq-len", "32", "--out", str(tmp_path / "report")]) == 2
    assert f"--out = '{tmp_path / 'report'}': names a file, not a folder" in one_line_error(capsys)
    assert (tmp_path / "report").read_text() == "mine\n"


def test_a_run_lock_that_is_a_folder_is_refused_and_left_alone(
    tmp_path: Path, no_model_load: None, capsys: pytest.CaptureFixture
) -> None:
    lock = tmp_path / "run" / "run.lock"
    lock.mkdir(parents=True)
    (lock / "notes.txt").write_text("mine\n")
    os.utime(lock, (time.time() - 60, time.time() - 60))  # not a lock being written just now
    assert train(tmp_path / "run") == 2
    assert f"{lock} is not a lock file a run wrote" in one_line_error(capsys)
    assert (lock / "notes.txt").read_text() == "mine\n"


def test_an_export_whose_base_cannot_be_loaded_is_refused(
    finished_run: Path, tmp_path: Path, no_model_load: None, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    checkpoint = run / "checkpoints" / "step_00000002"
    state = json.loads((checkpoint / "state.json").read_text())  # export rebuilds from the recipe kept here
    state["recipe"]["model"]["name_or_path"] = "nobody-gsm/no-such-model"
    (checkpoint / "state.json").write_text(json.dumps(state))
    write_manifest(checkpoint)  # a checkpoint that verifies: only its base cannot be had
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert cli.main(["export", str(checkpoint), str(tmp_path / "export")]) == 2
    assert "model.name_or_path = 'nobody-gsm/no-such-model': its config cannot be read" in one_line_error(capsys)


def test_export_of_the_root_folder_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["export", "/", str(tmp_path / "export")]) == 2
    assert "/: not a checkpoint of a gsm-train run" in one_line_error(capsys)


def test_empty_lora_target_modules_are_refused(capsys: pytest.CaptureFixture) -> None:
    status, _, err = validate(Path(GATE_RECIPE), capsys, "train.base=lora", "train.lora.target_modules=[]")
    assert status == 2 and "train.lora.target_modules" in err, err


def test_unknown_lora_target_modules_are_refused_before_training(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    overrides = ["stage=joint", "train.base=lora", "train.lora.target_modules=[q_proj,qkv_proj]"]
    assert train(tmp_path / "run", *overrides) == 2
    err = one_line_error(capsys)
    assert "train.lora.target_modules = ['qkv_proj']: no linear layer of the base model has this name" in err, err
    assert "q_proj" in err.split("fix:")[1] and not (tmp_path / "run").exists()


def test_a_deeply_nested_gsm_config_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    export = tmp_path / "export"
    export.mkdir()
    (export / "gsm_config.json").write_text("[" * 100_000 + "]" * 100_000)
    assert cli.main([*EVAL, "--export", f"gsm={export}", "--out", str(tmp_path / "eval")]) == 2
    assert "gsm_config.json: JSON nested too deeply" in one_line_error(capsys)
