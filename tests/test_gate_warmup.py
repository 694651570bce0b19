"""Stage 1 end to end on a tiny Llama: learning, frozen base, exact resume, FSDP2 on 2 processes, data errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from run_helpers import TINY_MODEL, losses, records, resume_after_crash, run_processes
from safetensors.torch import load_file

from gsm_train.attention import gsm_parameters
from gsm_train.data.text import DataError
from gsm_train.models.model_zoo import tiny_model
from gsm_train.train import main as train_main
from gsm_train.train import train_recipe

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "gate_only.yaml")
TINY = [
    *TINY_MODEL,
    "logging.progress_bar=false",
    "optim.warmup_steps=1",
    "gsm.sparse_attention.gate_init=random",
    "optim.lr=0.01",
]


def test_loss_falls_and_base_stays_bit_identical(tmp_path: Path) -> None:
    result = train_recipe(RECIPE, [*TINY, "train.steps=30", "logging.eval_every=30", f"output.dir={tmp_path}"])
    losses = result.losses
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
    reference = tiny_model("llama").state_dict()
    trained = result.model.state_dict()
    base_names = [n for n in trained if ".gsm." not in n]
    assert base_names and all(torch.equal(trained[n].cpu(), reference[n]) for n in base_names)
    gate_names = {n for n, _ in gsm_parameters(result.model)}
    assert gate_names and all(".gate." in n for n in gate_names)
    report = json.loads((tmp_path / "report.json").read_text())
    assert 0 < report["final"]["gate_mass_k8"] <= report["final"]["oracle_mass_k8"] <= 1
    assert (tmp_path / "recall_per_layer.png").stat().st_size > 1000


@pytest.mark.parametrize("distill_queries", [0, 20])
def test_resume_reproduces_an_uninterrupted_run(tmp_path: Path, distill_queries: int) -> None:
    steps = [
        "train.steps=6",
        "output.checkpoint_every=3",
        "logging.eval_every=100",
        f"train.distill_queries={distill_queries}",
    ]
    straight, resumed = resume_after_crash(RECIPE, [*TINY, *steps], tmp_path, step=3)
    assert resumed.losses == pytest.approx(losses(straight)[3:], abs=1e-6)
    kept = sorted(p.name for p in (straight / "checkpoints").iterdir())
    assert kept == ["latest", "step_00000003", "step_00000006"]
    assert not list(tmp_path.rglob("*.tmp")), "no half-written checkpoint is left behind"


def test_two_process_fsdp2_matches_one_process(tmp_path: Path) -> None:
    common = [*TINY, "train.steps=4", "logging.eval_every=2"]
    single = train_recipe(RECIPE, [*common, "train.batch_size=4", f"output.dir={tmp_path / 'one'}"])
    run_processes(2, RECIPE, [*common, "train.batch_size=2"], tmp_path / "two")
    two = records(tmp_path / "two")
    setup = next(r for r in two if r["kind"] == "setup")
    assert setup["world_size"] == 2 and setup["fsdp_sharded_params"] > 0
    assert losses(tmp_path / "two") == pytest.approx(single.losses, abs=1e-4)
    evals = [r for r in two if r["kind"] == "eval"]
    assert evals[-1]["gate_mass_k8"] == pytest.approx(single.final_metrics["gate_mass_k8"], abs=1e-4)
    one_export = load_file(str(tmp_path / "one" / "export" / "gsm_modules.safetensors"))
    two_export = load_file(str(tmp_path / "two" / "export" / "gsm_modules.safetensors"))
    assert one_export.keys() == two_export.keys()
    assert all(torch.allclose(one_export[n], two_export[n], atol=1e-6) for n in one_export)


def test_empty_dataset_is_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n\n")
    status = train_main(["--recipe", RECIPE, *TINY, f"data.train.path={empty}", f"output.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert status == 2 and "empty.txt" in err and "Fix:" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
    with pytest.raises(DataError):
        train_recipe(RECIPE, [*TINY, f"data.train.path={empty}", f"output.dir={tmp_path / 'run'}"])


def test_missing_data_file_is_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    status = train_main(
        ["--recipe", RECIPE, *TINY, f"data.train.path={tmp_path / 'nope.txt'}", f"output.dir={tmp_path / 'run'}"]
    )
    err = capsys.readouterr().err
    assert status == 2 and "data.train.path" in err and "nope.txt" in err and "fix:" in err
    assert not (tmp_path / "run").exists()


def test_query_sampling_estimates_the_full_loss(tmp_path: Path) -> None:
    full = train_recipe(RECIPE, [*TINY, "train.steps=2", f"output.dir={tmp_path / 'full'}"])
    everything = train_recipe(
        RECIPE, [*TINY, "train.steps=2", "train.distill_queries=64", f"output.dir={tmp_path / 'all'}"]
    )
    sampled = train_recipe(
        RECIPE, [*TINY, "train.steps=2", "train.distill_queries=16", f"output.dir={tmp_path / 'sampled'}"]
    )
    assert everything.losses == pytest.approx(full.losses, abs=1e-7), "sampling >= all counted queries is exact"
    assert sampled.losses != pytest.approx(full.losses, abs=1e-7)
    assert sampled.losses[0] == pytest.approx(full.losses[0], rel=0.5)
