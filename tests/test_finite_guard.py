"""The NaN/Inf guard (issue 38, case 3): a non-finite loss or gradient norm stops the run with exit
status 3 naming the step and the terms, or is skipped up to train.max_skipped_steps; nothing
non-finite reaches a checkpoint or an export; good checkpoints are never pruned for it;
metrics.jsonl stays JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from run_helpers import GATE_RECIPE, REPO, TINY_GATE, TINY_LLAMA_64, file_digests
from torch import Tensor, nn

from gsm_train.config.schema import load_recipe
from gsm_train.train import main as train_main
from gsm_train.train import train_recipe
from gsm_train.training.backend import FSDP2Backend
from gsm_train.training.checkpoint import read_trainables, save_checkpoint, verify_checkpoint
from gsm_train.training.distributed import DistInfo
from gsm_train.training.finite_guard import NonFiniteError, json_safe
from gsm_train.training.stages import GateWarmupStage
from gsm_train.training.trainer import run_training

QUICKSTART_JOINT = str(REPO / "recipes" / "quickstart_joint_cpu.yaml")
TINY_JOINT = [
    *TINY_LLAMA_64,
    "init_from=null",
    "logging.recall_min_keys=16",
    "logging.recall_k=8",
    "gsm.sparse_attention.top_k=8",
    "gsm.sparse_attention.k_min=8",
    "gsm.sparse_attention.gate_head_dim=16",  # the tiny model's head_dim (the recipe's 64 is SmolLM2's)
    "gsm.sparse_attention.dense_layers=[0]",
    "gsm.kv_compression.block_size=16",
    "gsm.cross_layer_sharing.bridge_from=1",
    "gsm.cross_layer_sharing.bridge_to_start=2",
    "logging.progress_bar=false",
    "output.checkpoint_every=1",
    "train.batch_size=1",
    "logging.eval_batches=1",
]


def _strict_records(run: Path) -> list[dict]:
    """metrics.jsonl parsed as strict JSON (NaN, Infinity are not JSON)."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"metrics.jsonl holds {constant}, which is not JSON")

    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line, parse_constant=refuse) for line in lines]


@pytest.mark.parametrize(
    "override, bad",
    [("gsm.kv_compression.tau=1e-45", "loss=nan"), ("train.loss_weights.lm=1e38", "loss=inf")],
    ids=["nan", "inf"],
)
def test_a_non_finite_loss_stops_the_run_with_exit_3(
    override: str, bad: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = tmp_path / "run"
    status = train_main(["--recipe", QUICKSTART_JOINT, *TINY_JOINT, "train.steps=3", override, f"output.dir={run}"])
    err = capsys.readouterr().err
    assert status == 3, err
    assert f"step 1: non-finite {bad}" in err and "grad_norm=" in err and "Traceback" not in err
    assert not (run / "checkpoints").exists() and not (run / "export").exists()
    stopped = _strict_records(run)[-1]
    assert (stopped["kind"], stopped["step"], stopped["loss"]) == ("stopped", 1, bad.split("=")[1])
    assert not math.isfinite(float(stopped["loss"]))


def test_resuming_into_nan_keeps_every_good_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    common = [*TINY_JOINT, "output.checkpoint_every=2", f"output.dir={run}"]
    train_recipe(QUICKSTART_JOINT, [*common, "train.steps=4"])
    good = file_digests(run / "checkpoints")
    nan = ["--recipe", QUICKSTART_JOINT, *common, "train.steps=8", "gsm.kv_compression.tau=1e-45", "--resume", "auto"]
    assert train_main(nan) == 2, "tau alters the run: refused without --allow-recipe-change"
    assert "gsm.kv_compression.tau" in capsys.readouterr().err
    assert train_main([*nan, "--allow-recipe-change"]) == 3
    assert "step 5: non-finite loss=nan" in capsys.readouterr().err
    assert file_digests(run / "checkpoints") == good
    assert (run / "checkpoints" / "latest").read_text() == "step_00000004"
    for name in ("step_00000002", "step_00000004"):
        assert verify_checkpoint(run / "checkpoints" / name) is None


class NaNAtSteps(GateWarmupStage):
    """The gate stage with a NaN loss at the steps named (counted from 1; one micro-batch a
    step)."""

    def __init__(self, bad_steps: set[int]):
        super().__init__()
        self.bad_steps = bad_steps
        self.calls = 0

    def loss(self, model: nn.Module, batch: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        self.calls += 1
        loss, terms = super().loss(model, batch)
        return (loss * float("nan") if self.calls in self.bad_steps else loss), terms


def _trainable(run: Path, step: int) -> dict[str, Tensor]:
    return read_trainables(run / "checkpoints" / f"step_{step:08d}")


def test_skipped_steps_make_no_update_up_to_the_limit(tmp_path: Path) -> None:
    run = tmp_path / "run"
    config = load_recipe(
        GATE_RECIPE,
        [
            *TINY_GATE,
            "train.steps=4",
            "output.checkpoint_every=1",
            "output.keep_checkpoints=4",
            "train.max_skipped_steps=1",
            f"output.dir={run}",
        ],
    )
    result = run_training(config, NaNAtSteps({2}))
    assert len(result.losses) == 3 and all(math.isfinite(loss) for loss in result.losses)
    skipped = [r for r in _strict_records(run) if r["kind"] == "skipped"]
    assert [r["step"] for r in skipped] == [2] and skipped[0]["loss"] == "nan"
    one, two, three = (_trainable(run, step) for step in (1, 2, 3))
    assert all(torch.equal(one[name], two[name]) for name in one), "a skipped step does not update"
    assert not all(torch.equal(two[name], three[name]) for name in two)
    again = tmp_path / "again"
    output = config.output.model_copy(update={"dir": str(again)})
    config = config.model_copy(update={"output": output})
    stop = r"step 3: non-finite loss=nan.*after skipping 1 step\(s\) \(\[2\]\)"
    with pytest.raises(NonFiniteError, match=stop):
        run_training(config, NaNAtSteps({2, 3}))
    written = sorted(p.name for p in (again / "checkpoints").glob("step_*"))
    assert written == ["step_00000001", "step_00000002"]


def test_a_checkpoint_of_non_finite_weights_is_never_written(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    backend = FSDP2Backend(load_recipe(GATE_RECIPE, TINY_GATE))
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    refused = r"checkpoint step_00000001 not written: 1 of 2 tensors .*\(weight\)"
    with pytest.raises(NonFiniteError, match=refused):
        save_checkpoint(
            tmp_path,
            1,
            backend,
            model,
            optimizer,
            scheduler,
            {},
            {"weight", "bias"},
            info,
            2,
            {"run_id": "test", "recipe": {}},
        )
    assert not any((tmp_path / "checkpoints").glob("step_*"))


def test_json_safe_writes_non_finite_floats_as_strings_float_reads_back() -> None:
    record = {
        "loss": float("nan"),
        "norm": float("inf"),
        "low": -math.inf,
        "ok": 1.5,
        "n": 3,
        "flag": True,
        "per_layer": [0.5, float("nan")],
        "tensor": torch.tensor(2.0),
        "name": "x",
        "none": None,
    }
    safe = json_safe(record)
    assert safe == {
        "loss": "nan",
        "norm": "inf",
        "low": "-inf",
        "ok": 1.5,
        "n": 3,
        "flag": True,
        "per_layer": [0.5, "nan"],
        "tensor": 2.0,
        "name": "x",
        "none": None,
    }
    json.dumps(safe, allow_nan=False)
    assert math.isinf(float(safe["norm"])) and math.isnan(float(safe["loss"]))
