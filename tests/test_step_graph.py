"""Capturing the training step in a CUDA graph: when it is allowed, its errors, and (on a GPU) that
captured gate and joint steps train exactly like the eager ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from run_helpers import records
from test_gate_warmup import RECIPE, TINY
from test_joint import JOINT
from test_joint import TINY as TINY_JOINT

from gsm_train.attention.forward_state import CollectRequest, ForwardState
from gsm_train.attention.layout import sampled_rows
from gsm_train.attention.settings import GSMSettings
from gsm_train.config.schema import ConfigError, GSMConfig, load_recipe
from gsm_train.modules import GSMError
from gsm_train.train import train_recipe
from gsm_train.training.stages import GateWarmupStage, JointStage
from gsm_train.training.stages.math_gate import MathGateStage
from gsm_train.training.step_graph import cuda_graph_blockers, use_cuda_graph

CUDA = torch.device("cuda")


def test_gate_warmup_and_joint_steps_on_one_gpu_with_fsdp2_can_be_captured() -> None:
    assert cuda_graph_blockers(CUDA, 1, "fsdp2", GateWarmupStage()) == []
    assert cuda_graph_blockers(CUDA, 1, "fsdp2", JointStage()) == []
    for blockers, says in (
        (cuda_graph_blockers(torch.device("cpu"), 1, "fsdp2", GateWarmupStage()), "on cpu"),
        (cuda_graph_blockers(CUDA, 2, "fsdp2", JointStage()), "2 processes"),
        (cuda_graph_blockers(CUDA, 1, "deepspeed", GateWarmupStage()), "deepspeed backend"),
        (cuda_graph_blockers(CUDA, 1, "fsdp2", MathGateStage()), "stage math_gate: its adapter"),
    ):
        assert len(blockers) == 1 and says in blockers[0]
    checkpointed = cuda_graph_blockers(CUDA, 1, "fsdp2", JointStage(), activation_checkpointing=True)
    assert len(checkpointed) == 1 and "train.activation_checkpointing runs each layer" in checkpointed[0]


def test_auto_captures_where_possible_and_true_names_what_blocks_it() -> None:
    assert use_cuda_graph("auto", []) and not use_cuda_graph("auto", ["x"])
    assert use_cuda_graph(True, []) and not use_cuda_graph(False, []) and not use_cuda_graph(False, ["x"])
    with pytest.raises(
        ConfigError, match=r"train\.cuda_graph = True: the run is on cpu.*\n.*fix: set train\.cuda_graph"
    ):
        use_cuda_graph(True, cuda_graph_blockers(torch.device("cpu"), 1, "fsdp2", GateWarmupStage()))


def test_recipe_field_takes_auto_or_a_bool() -> None:
    assert load_recipe(RECIPE).train.cuda_graph == "auto"
    assert load_recipe(RECIPE, ["train.cuda_graph=false"]).train.cuda_graph is False
    with pytest.raises(ConfigError, match="train.cuda_graph"):
        load_recipe(RECIPE, ["train.cuda_graph=sometimes"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_cuda_graph_true_on_cpu_fails_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="train.cuda_graph"):
        train_recipe(RECIPE, [*TINY, "train.steps=1", "train.cuda_graph=true", f"output.dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()


def _forward_state(distill_queries: int) -> ForwardState:
    settings = GSMSettings(config=GSMConfig(), base_fingerprint="", gate_layers=())
    return ForwardState(settings, CollectRequest(distill=True, distill_queries=distill_queries))


def test_gate_kl_rows_are_drawn_once_per_forward_among_counted_queries() -> None:
    torch.manual_seed(0)
    state = _forward_state(5)
    counted = torch.arange(40) >= 12
    rows = sampled_rows(state, counted, torch.device("cpu"))
    assert sampled_rows(state, counted, torch.device("cpu")) is rows  # shared by all layers of the forward
    assert len(rows) == 5 and len(set(rows.tolist())) == 5 and bool((rows >= 12).all() and (rows < 40).all())
    assert torch.equal(rows, rows.sort().values)
    assert not torch.equal(sampled_rows(_forward_state(5), counted, torch.device("cpu")), rows)  # a new forward
    assert torch.equal(sampled_rows(_forward_state(50), counted, torch.device("cpu")), torch.arange(12, 40))
    with pytest.raises(GSMError, match="not a suffix"):
        sampled_rows(_forward_state(5), torch.arange(40) % 2 == 0, torch.device("cpu"))


BEYOND_WINDOW = ["gsm.sparse_attention.recent_tokens=16", "gsm.sparse_attention.gate_target=beyond_forced"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.gpu_training
@pytest.mark.parametrize(("grad_accum", "window"), [(1, []), (2, []), (1, BEYOND_WINDOW)])
def test_captured_gate_steps_train_exactly_like_eager_ones(tmp_path: Path, grad_accum: int, window: list[str]) -> None:
    """`BEYOND_WINDOW`: the KL's mask less the forced keys, built in the captured step as well."""
    common = [
        *TINY,
        *window,
        "train.steps=4",
        "train.batch_size=2",
        f"train.grad_accum={grad_accum}",
        "train.distill_queries=16",
        "logging.eval_every=4",
    ]
    eager = train_recipe(RECIPE, [*common, "train.cuda_graph=false", f"output.dir={tmp_path / 'eager'}"])
    graphed = train_recipe(RECIPE, [*common, "train.cuda_graph=true", f"output.dir={tmp_path / 'graphed'}"])
    assert graphed.losses == pytest.approx(eager.losses, abs=1e-6)
    assert graphed.losses[-1] != pytest.approx(graphed.losses[0], abs=1e-6)  # it trained
    weights = dict(eager.model.named_parameters())
    for name, param in graphed.model.named_parameters():
        torch.testing.assert_close(param, weights[name], atol=1e-6, rtol=0)


def _logged_terms(run_dir: Path) -> list[dict[str, float]]:
    """The stage's logged loss terms of each training step."""
    return [
        {k: v for k, v in r.items() if k in ("lm_loss", "gate_kl", "asq_loss")}
        for r in records(run_dir)
        if r["kind"] == "train"
    ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.gpu_training
@pytest.mark.parametrize(("gsm_enabled", "grad_accum"), [(True, 1), (True, 2), (False, 1)])
def test_captured_joint_steps_train_like_eager_ones_and_log_the_same_scalars(
    tmp_path: Path, gsm_enabled: bool, grad_accum: int
) -> None:
    """Sparse attention, ASQ, the share bridge and a fully trained base (or, GSM off, the dense control):
    the replayed step gives the eager losses, logged terms and weights. Not bit for bit: attention's and
    the embedding's backward add with atomics, so two eager runs differ too, and AdamW turns a last-bit
    difference in a near-zero gradient into up to a step's full update (about lr) on that element. So a
    weight may differ by at most lr per step, and a parameter by a tenth of that on average (one the
    replay failed to update would be a whole trajectory, about lr per step on most elements, away)."""
    common = [
        *TINY_JOINT,
        "train.steps=4",
        "train.batch_size=2",
        "train.distill_queries=16",
        "optim.lr=3e-3",
        f"gsm.gsm_enabled={str(gsm_enabled).lower()}",
        f"train.grad_accum={grad_accum}",
    ]
    eager = train_recipe(JOINT, [*common, "train.cuda_graph=false", f"output.dir={tmp_path / 'eager'}"])
    graphed = train_recipe(JOINT, [*common, "train.cuda_graph=true", f"output.dir={tmp_path / 'graphed'}"])
    assert graphed.losses == pytest.approx(eager.losses, abs=1e-3)
    assert graphed.losses[-1] < graphed.losses[0]  # it trained
    logged, expected = (_logged_terms(tmp_path / run) for run in ("graphed", "eager"))
    assert [sorted(r) for r in logged] == [sorted(r) for r in expected] and logged[0]
    for got, want in zip(logged, expected):
        assert got == pytest.approx(want, abs=1e-3)
    steps, lr = 4, 3e-3
    weights = dict(eager.model.named_parameters())
    for name, param in graphed.model.named_parameters():
        difference = (param - weights[name]).abs()
        assert difference.max() <= steps * lr and difference.mean() <= steps * lr / 10, name
