"""AdamW with bf16 moments (`optim.state_dtype: bf16`): it follows torch's AdamW, its stochastic
rounding lets a moment decay where rounding to nearest would freeze it, its draws repeat on a
resumed run, and a recipe with it trains."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from run_helpers import GATE_RECIPE, TINY_GATE
from torch import nn

from gsm_train.train import train_recipe
from gsm_train.training.optim import AdamWBF16, stochastic_round_bf16


def _pair(shape: tuple[int, ...], **settings: float) -> tuple[nn.Parameter, torch.optim.AdamW, nn.Parameter, AdamWBF16]:
    start = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    ours, theirs = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    return theirs, torch.optim.AdamW([theirs], **settings), ours, AdamWBF16([ours], **settings)


def test_it_follows_torch_adamw_within_the_rounding_of_its_moments() -> None:
    settings = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}
    theirs, reference, ours, optimizer = _pair((512, 64), **settings)
    start = theirs.detach().clone()
    gradients = torch.Generator().manual_seed(1)
    for step in range(30):
        grad = torch.randn(start.shape, generator=gradients) * (1 + step % 3)
        theirs.grad, ours.grad = grad.clone(), grad.clone()
        reference.step()
        optimizer.step()
    moved = (theirs - start).abs().mean()
    # each update differs by the bf16 rounding of m and v (a relative 2^-8 at most per step,
    # unbiased)
    assert (ours - theirs).abs().mean() < 0.01 * moved
    assert (ours - theirs).abs().max() < 0.1 * moved
    state = optimizer.state[ours]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16 and float(state["step"]) == 30
    assert optimizer.state_dict()["state"][0].keys() == reference.state_dict()["state"][0].keys()


def test_stochastic_rounding_lets_the_second_moment_decay() -> None:
    param = nn.Parameter(torch.zeros(20_000))
    optimizer = AdamWBF16([param], lr=1e-3, betas=(0.9, 0.999))
    param.grad = torch.ones_like(param)
    optimizer.step()
    first = optimizer.state[param]["exp_avg_sq"].float()
    for _ in range(200):  # each step scales v by 0.999: below half a bf16 unit, so nearest rounding keeps v
        param.grad = torch.zeros_like(param)
        optimizer.step()
    decayed = optimizer.state[param]["exp_avg_sq"].float()
    assert (decayed.mean() / first.mean()).item() == pytest.approx(0.999**200, rel=2e-3)
    nearest = first.clone()
    for _ in range(200):
        nearest = (nearest * 0.999).bfloat16().float()
    assert torch.equal(nearest, first), "rounding to nearest would not have moved it"


def test_stochastic_rounding_is_unbiased_and_lands_on_bf16_values() -> None:
    values = torch.full((200_000,), 1.0 + 2**-9)  # a quarter of the way from 1 to the next bf16, 1 + 2^-7
    noise = torch.randint(0, 2**16, values.shape, dtype=torch.int32, generator=torch.Generator().manual_seed(2))
    rounded = stochastic_round_bf16(values, noise)
    assert torch.equal(rounded, rounded.bfloat16().float())
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert rounded.mean().item() == pytest.approx(1.0 + 2**-9, abs=2e-5)


def test_its_draws_repeat_after_a_reload() -> None:
    _, _, ours, optimizer = _pair((64, 8), lr=1e-2)
    grads = [torch.randn(64, 8, generator=torch.Generator().manual_seed(seed)) for seed in range(4)]
    for grad in grads[:2]:
        ours.grad = grad.clone()
        optimizer.step()
    saved_param, saved_state = ours.detach().clone(), copy.deepcopy(optimizer.state_dict())
    for grad in grads[2:]:
        ours.grad = grad.clone()
        optimizer.step()
    again = nn.Parameter(saved_param)
    reloaded = AdamWBF16([again], lr=1e-2)
    reloaded.load_state_dict(saved_state)
    for grad in grads[2:]:
        again.grad = grad.clone()
        reloaded.step()
    assert torch.equal(again, ours)


def test_a_recipe_trains_with_bf16_moments(tmp_path: Path) -> None:
    result = train_recipe(
        GATE_RECIPE,
        [*TINY_GATE, "train.steps=8", "optim.state_dtype=bf16", f"output.dir={tmp_path}"],
    )
    assert sum(result.losses[-3:]) < sum(result.losses[:3])
