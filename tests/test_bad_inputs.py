"""Every bad recipe, override, flag or folder of `gsm-train train` ends in exit status 2 with one
message naming the field, file or folder, before the model loads, with nothing written (issue 38:
the table of bad inputs; issue 36: the early checks)."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest
from run_helpers import GATE_RECIPE, TINY_GATE, child_env, file_digests

from gsm_train import cli
from gsm_train.training import session


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to load the model fails the test: the checks must come first."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(session, "load_model_and_tokenizer", refuse)


@pytest.fixture
def sandbox(tmp_path: Path) -> Path:
    """A folder with the odd inputs some rows point at."""
    (tmp_path / "binary.yaml").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "not_a_model").mkdir()
    (tmp_path / "a_file").write_text("not a folder\n")
    return tmp_path


# (id, the arguments after `gsm-train train`, what the message must name); {tmp} is the sandbox,
# {recipe} the tiny gate recipe; output.dir is {tmp}/run unless the row sets it. wandb,
# tensorboard and peft are made unimportable for every row.
ROWS = [
    ("binary recipe file", ["{tmp}/binary.yaml"], "binary.yaml: 1 problem"),
    ("recipe file missing", ["{tmp}/nope.yaml"], "nope.yaml"),
    ("unclosed bracket", ["{recipe}", "train.steps=[1"], "train.steps"),
    ("a tab", ["{recipe}", "train.steps=\t5"], "train.steps"),
    ("a YAML tag", ["{recipe}", "train.steps=!!python/object/apply:os.system [ls]"], "train.steps"),
    ("bool for an int", ["{recipe}", "train.steps=true"], "train.steps = True"),
    ("bool for a float", ["{recipe}", "optim.lr=false"], "optim.lr = False"),
    ("betas above 1", ["{recipe}", "optim.betas=[2,3]"], "optim.betas.0 = 2"),
    ("negative beta", ["{recipe}", "optim.betas=[0.9,-0.1]"], "optim.betas.1"),
    ("unknown key", ["{recipe}", "train.stpes=5"], "train.stpes"),
    ("negative skip count", ["{recipe}", "train.max_skipped_steps=-1"], "train.max_skipped_steps"),
    ("unknown tiny family", ["{recipe}", "model.name_or_path=tiny-lama"], "model.name_or_path"),
    ("unknown built-in name", ["{recipe}", "model.name_or_path=smollm2"], "model.name_or_path"),
    ("missing model folder", ["{recipe}", "model.name_or_path=/no/model"], "model.name_or_path"),
    ("folder that is no model", ["{recipe}", "model.name_or_path={tmp}/not_a_model"], "without config.json"),
    (
        "unreachable hub id",
        ["{recipe}", "model.name_or_path=nobody-gsm/no-such-model"],
        "model.name_or_path = 'nobody-gsm/no-such-model': its config cannot be read",
    ),
    ("seq_len beyond the context", ["{recipe}", "data.seq_len=8192"], "data.seq_len = 8192"),
    (
        "layer index beyond the model",
        ["{recipe}", "gsm.sparse_attention.dense_layers=[9]"],
        "gsm.sparse_attention.dense_layers.0",
    ),
    ("output in /proc", ["{recipe}", "output.dir=/proc/gsm-run"], "output.dir=/proc/gsm-run"),
    ("output below a file", ["{recipe}", "output.dir={tmp}/a_file/run"], "output.dir={tmp}/a_file/run"),
    ("output is a file", ["{recipe}", "output.dir={tmp}/a_file"], "output.dir={tmp}/a_file"),
    ("wandb not installed", ["{recipe}", "logging.wandb=true"], "logging.wandb"),
    ("tensorboard not installed", ["{recipe}", "logging.tensorboard=true"], "logging.tensorboard"),
    ("peft not installed", ["{recipe}", "train.base=lora"], "train.base = 'lora'"),
    ("resume from a missing folder", ["{recipe}", "--resume", "/missing"], "output.resume_from='/missing'"),
    ("overwrite and resume auto", ["{recipe}", "--resume", "auto", "--overwrite"], "--overwrite"),
]


@pytest.mark.parametrize("args, needle", [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_bad_input_exits_2_naming_it_before_the_model_loads(
    args: list[str],
    needle: str,
    sandbox: Path,
    no_model_load: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # a Hub id fails at once
    for package in ("wandb", "tensorboard", "peft"):  # as if not installed: an import fails
        monkeypatch.setitem(sys.modules, package, None)
    filled = [arg.format(tmp=sandbox, recipe=GATE_RECIPE) for arg in args]
    sets_output = any(arg.startswith("output.dir=") for arg in filled)
    tail = [] if sets_output else [f"output.dir={sandbox / 'run'}"]
    before = file_digests(sandbox)
    status = cli.main(["train", filled[0], *TINY_GATE, *tail, *filled[1:]])
    err = capsys.readouterr().err
    assert status == 2, err
    assert needle.format(tmp=sandbox) in err, err
    assert "Traceback" not in err and [line[:6] for line in err.splitlines()].count("error:") == 1
    assert file_digests(sandbox) == before and not (sandbox / "run").exists(), "nothing is written"


def test_a_folder_that_is_not_writable_is_refused(
    tmp_path: Path, no_model_load: None, capsys: pytest.CaptureFixture
) -> None:
    if os.geteuid() == 0:  # root writes into a read-only folder; stand in with one it cannot enter
        read_only = Path("/proc/self/gsm-run")
    else:
        read_only = tmp_path / "read_only"
        read_only.mkdir(mode=0o555)
    status = cli.main(["train", GATE_RECIPE, *TINY_GATE, f"output.dir={read_only / 'run'}"])
    err = capsys.readouterr().err
    assert status == 2 and f"output.dir={read_only / 'run'}" in err, err


def test_a_full_disk_is_refused_with_exit_2_from_a_fresh_process(tmp_path: Path) -> None:
    """Through the console entry point, in a process whose files may not grow beyond 256 KiB (as on
    a full disk or quota, the first write beyond fails; SIGXFSZ ignored): exit 2 before the model
    loads, nothing left behind."""

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))

    env = child_env(PYTHONDONTWRITEBYTECODE="1")
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "gsm_train.cli", "train", GATE_RECIPE, *TINY_GATE, f"output.dir={run}"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
        preexec_fn=limit_file_size,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"output.dir={run}: cannot write there (File too large)" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not run.exists(), "the folder created for the run is removed again"
