"""The decode top-k kernel (`kernels.decode_selection`) keeps exactly the positions of `top_k_positions`'s rule
(lowest positions first at equal scores), on Triton's interpreter or a GPU."""

from __future__ import annotations

import pytest
import torch
from run_helpers import KERNEL_DEVICE, KERNELS_RUN_HERE
from torch import Tensor

from gsm_train.modules.decode_attention import forced_count, kept_slots, top_k_positions

pytestmark = pytest.mark.skipif(not KERNELS_RUN_HERE, reason="needs Triton with CUDA, or on CPU TRITON_INTERPRET=1 "
                                "(Triton's interpreter wants numpy<2.3); CI has neither, the GPU benchmark runs it")


def _reference(scores: Tensor, allowed: Tensor | None, k: int, sinks: int, recent: int) -> list[list[set[int]]]:
    """Per row, the kept positions: visible forced keys, then the best visible others up to k, lowest first
    at equal scores (a stable sort)."""
    position = scores.shape[-1] - 1
    ranked = scores.clone().float()
    keys = torch.arange(scores.shape[-1], device=scores.device)
    forced = (keys == position) | (keys < sinks) | ((position - keys >= 0) & (position - keys < recent))
    ranked[..., forced] = float("inf")
    if allowed is not None:
        ranked = ranked.masked_fill(~allowed[:, None, :], float("-inf"))
    order = torch.sort(ranked, dim=-1, descending=True, stable=True)
    k_eff = kept_slots(scores.shape[-1], k, position, sinks, recent)
    values, index = order.values[..., :k_eff], order.indices[..., :k_eff]
    valid = (values > float("-inf")) & ((values == float("inf")) | (torch.arange(k_eff, device=scores.device) < k))
    return [[set(index[b, n][valid[b, n]].tolist()) for n in range(scores.shape[1])] for b in range(scores.shape[0])]


def _kept(index: Tensor, valid: Tensor | None) -> list[list[set[int]]]:
    valid = torch.ones_like(index, dtype=torch.bool) if valid is None else valid
    return [[set(index[b, n][valid[b, n]].tolist()) for n in range(index.shape[1])] for b in range(index.shape[0])]


def _select(scores: Tensor, allowed: Tensor | None, k: int, sinks: int = 0, recent: int = 0
            ) -> tuple[Tensor, Tensor | None]:
    from gsm_train.kernels.decode_selection import top_k_indices

    position = scores.shape[-1] - 1
    return top_k_indices(scores, allowed, k, kept_slots(scores.shape[-1], k, position, sinks, recent), position, sinks,
                         recent)


SCORES = {
    "continuous": lambda shape: torch.randn(shape),
    "bf16_ties": lambda shape: torch.randn(shape).bfloat16().float() + torch.randint(0, 3, shape) * 1e-6,
    "integer_ties": lambda shape: torch.randint(0, 40, shape).float() / 8,
    "all_equal": lambda shape: torch.zeros(shape),  # one 16-bit bin holds every key: the whole-row search
}


@pytest.mark.parametrize("kind", list(SCORES))
@pytest.mark.parametrize(("length", "k", "sinks", "recent"), [(300, 40, 0, 0), (300, 40, 4, 8), (2500, 200, 2, 16),
                                                              (5000, 1200, 0, 0), (70, 100, 0, 0), (300, 5, 4, 8),
                                                              (20000, 3000, 2, 16)])  # 3 steps of the pass
def test_selection_equals_the_rule(kind: str, length: int, k: int, sinks: int, recent: int) -> None:
    torch.manual_seed(length + k)
    scores = SCORES[kind]((2, 3, length)).to(KERNEL_DEVICE)
    index, valid = _select(scores, None, k, sinks, recent)
    assert valid is None
    assert index.shape[-1] == min(length, max(k, forced_count(length - 1, sinks, recent)))
    assert _kept(index, valid) == _reference(scores, None, k, sinks, recent)
    for row in index.flatten(0, 1):
        assert len(set(row.tolist())) == row.numel()  # every slot a distinct position


@pytest.mark.parametrize("kind", ["continuous", "integer_ties"])
def test_hidden_keys_are_never_kept(kind: str) -> None:
    torch.manual_seed(0)
    length = 400
    scores = SCORES[kind]((2, 1, length)).to(KERNEL_DEVICE)
    allowed = torch.rand(2, length, device=KERNEL_DEVICE) > 0.3
    allowed[1, :390] = False  # fewer visible keys than k: all of them, the rest of the slots invalid
    index, valid = _select(scores, allowed, 64, sinks=3, recent=5)
    assert _kept(index, valid) == _reference(scores, allowed, 64, 3, 5)
    assert int(valid[1].sum()) == int(allowed[1].sum())
    assert bool((index[~valid] == 0).all())


def test_continuous_scores_select_what_torch_topk_selects() -> None:
    torch.manual_seed(1)
    scores = torch.randn(2, 2, 3000, device=KERNEL_DEVICE)
    expected, _ = top_k_positions(scores.clone(), None, 300, 2999, 4, 16)
    index, _ = _select(scores, None, 300, 4, 16)
    assert _kept(index, None) == _kept(expected, None)
