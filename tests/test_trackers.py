"""Trackers: a resumed run continues its wandb run (one run id, named after the run folder), per-layer
metrics are sent, the joint stage writes its recall plot, `logging.progress_bar: false` prints a line
per logged step, and `gsm-train eval` shows its progress."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from run_helpers import GATE_RECIPE, REPO, TINY_GATE, TINY_MODEL, records

from gsm_train.commands.evaluate import perplexity_and_recall
from gsm_train.models.model_zoo import tiny_model
from gsm_train.train import train_recipe
from gsm_train.training.run_log import tracked_scalars

wandb = pytest.importorskip("wandb")
JOINT = str(REPO / "recipes" / "joint.yaml")


@pytest.fixture
def wandb_runs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """wandb offline; each `wandb.init` (the real one) recorded: its arguments, the run's id and name,
    and what the run was sent through `log`."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    runs: list[dict[str, Any]] = []
    real_init = wandb.init

    def init(**kwargs: Any) -> Any:
        run = real_init(**kwargs)
        record = {"kwargs": kwargs, "id": run.id, "name": run.name, "logged": {}}
        real_log = run.log

        def log(values: dict[str, Any], step: int | None = None) -> None:
            record["logged"].update(values)
            real_log(values, step=step)

        run.log = log
        runs.append(record)
        return run

    monkeypatch.setattr(wandb, "init", init)
    return runs


def test_a_resumed_run_continues_its_wandb_run(tmp_path: Path, wandb_runs: list[dict[str, Any]]) -> None:
    run_dir = tmp_path / "my_gate_run"
    common = [*TINY_GATE, "logging.wandb=true", "output.checkpoint_every=2", f"output.dir={run_dir}"]
    train_recipe(GATE_RECIPE, [*common, "train.steps=2"])
    train_recipe(GATE_RECIPE, [*common, "train.steps=4"], resume="auto")
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    assert [run["id"] for run in wandb_runs] == [run_id, run_id]
    assert [run["name"] for run in wandb_runs] == ["my_gate_run", "my_gate_run"]  # the folder's, not the stage's
    assert all(run["kwargs"]["resume"] == "allow" for run in wandb_runs)
    folders = sorted(p.name for p in (run_dir / "wandb").glob("offline-run-*"))
    # wandb names an offline run's folder by the second it started and the run's id, with "-1" appended when
    # the resumed run starts within the same second as the first
    named = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?")
    assert len(folders) == 2 and all(named.fullmatch(name) for name in folders), folders
    evaluated = [r for r in records(run_dir) if r["kind"] == "eval"][-1]
    per_layer = {key for key in wandb_runs[-1]["logged"] if key.startswith("eval/recall_ratio_k8_per_layer/")}
    assert evaluated["layers"] and per_layer == {
        f"eval/recall_ratio_k8_per_layer/layer_{i}" for i in evaluated["layers"]
    }
    assert [wandb_runs[-1]["logged"][f"eval/kl_per_layer/layer_{i}"] for i in evaluated["layers"]] == pytest.approx(
        evaluated["kl_per_layer"]
    )


def test_per_layer_lists_become_one_scalar_per_layer() -> None:
    values = {"layers": [2, 5], "kl": 0.5, "kl_per_layer": [0.25, float("nan")], "alphas": [0.1, 0.2], "on": True}
    assert tracked_scalars(values) == {
        "kl": 0.5,
        "kl_per_layer/layer_2": 0.25,  # NaN is not sent
        "alphas/layer_0": 0.1,  # not a per-layer list of the `layers`: by position
        "alphas/layer_1": 0.2,
    }


def test_without_a_progress_bar_each_logged_step_prints_a_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train_recipe(GATE_RECIPE, [*TINY_GATE, "train.steps=3", "logging.log_every=2", f"output.dir={tmp_path}"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/3", "3/3"]  # every log_every-th step, and the last
    assert all(" loss " in line and " tok/s " in line for line in lines)


def test_the_joint_stage_writes_its_recall_plot(tmp_path: Path) -> None:
    overrides = [
        *TINY_MODEL,
        "init_from=null",
        "gsm.sparse_attention.dense_layers=[0]",
        "gsm.kv_compression.enabled=false",
        "gsm.kv_compression.layer_bits={}",
        "logging.progress_bar=false",
        "optim.warmup_steps=1",
        "train.steps=1",
        "train.batch_size=1",
        "logging.eval_batches=1",
        f"output.dir={tmp_path}",
    ]
    result = train_recipe(JOINT, overrides)
    assert result.summary["plot"] == str(tmp_path / "recall_per_layer.png")
    assert (tmp_path / "recall_per_layer.png").read_bytes().startswith(b"\x89PNG")
    final = json.loads((tmp_path / "report.json").read_text())["final"]
    assert final["layers"] == [1, 2, 3] and len(final["gate_mass_k8_per_layer"]) == 3
    # every layer counts the same queries: the layers' mean is the total
    for key in ("gate_mass_k8", "oracle_mass_k8"):
        assert sum(final[f"{key}_per_layer"]) / 3 == pytest.approx(final[key], rel=1e-9)


def test_evaluation_shows_its_progress(capsys: pytest.CaptureFixture[str]) -> None:
    rows = torch.randint(0, 256, (3, 16))
    perplexity_and_recall(tiny_model("llama").eval(), rows, 1, None, label="base")
    err = capsys.readouterr().err
    assert "base" in err and "3/3" in err
