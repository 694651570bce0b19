"""The training selection kernel (`gsm_train.kernels.selection`): `select_top_k`'s selection for a k every
query keeps, in one pass; the k best allowed scores of each row, ties at the k-th going to the lowest
positions, plus the forced keys, where allowed."""

from __future__ import annotations

import pytest
import torch
from run_helpers import KERNEL_DEVICE, TRITON_KERNEL_MARKS

from gsm_train.functional.top_k import select_top_k

pytestmark = TRITON_KERNEL_MARKS


def _torch_selection(scores, allowed, k, positions, start, sinks=0, recent=0):
    """select_top_k's PyTorch path (sorted top-k: the same set when no two scores tie)."""
    queries = positions[start : start + scores.shape[2]]
    k_per_query = torch.full((scores.shape[2],), k, device=scores.device)
    return select_top_k(
        scores.cpu(),
        allowed.cpu(),
        k_per_query.cpu(),
        queries.cpu(),
        positions.cpu(),
        sinks,
        recent,
        k,
        uniform_k=False,
    )


@pytest.mark.parametrize(
    ("length", "k", "sinks", "recent"),
    [(300, 40, 0, 0), (300, 40, 4, 8), (2048, 256, 0, 0), (64, 200, 0, 0), (2048, 1, 1, 0), (5000, 700, 0, 16)],
)
@pytest.mark.parametrize("padded", [False, True])
def test_selection_equals_the_pytorch_path(length: int, k: int, sinks: int, recent: int, padded: bool) -> None:
    """Causal rows (early ones hold fewer than k keys), a chunk of later queries (a strided slice of the mask),
    two selectors, a batch whose second row hides its first keys (padding), sinks and recent keys, a row
    longer than 4,096. fp32 scores: no ties, so the set is unique."""
    from gsm_train.kernels.selection import top_k_selection

    torch.manual_seed(0)
    start = length // 3
    chunk = min(length - start, 48)  # a chunk of later queries (the interpreter runs one row at a time)
    positions = torch.arange(length, device=KERNEL_DEVICE)
    allowed = (positions[None, :] <= positions[:, None])[None, None].repeat(2 if padded else 1, 1, 1, 1)
    if padded:
        allowed[1, :, :, :7] = False
    allowed = allowed[..., start : start + chunk, :]
    scores = torch.randn(2, 2, chunk, length, device=KERNEL_DEVICE)
    got = top_k_selection(scores, allowed, k, positions[start : start + chunk], positions, sinks, recent)
    assert torch.equal(got.cpu(), _torch_selection(scores, allowed, k, positions, start, sinks, recent))


def test_select_top_k_hands_a_uniform_k_to_the_kernel_from_the_first_chunk() -> None:
    """The first chunk's rows hold fewer allowed keys than k (they keep all of them); select_top_k with
    `uniform_k` gives the kernel's selection, which equals the PyTorch path's."""
    torch.manual_seed(0)
    positions = torch.arange(300, device=KERNEL_DEVICE)
    allowed = (positions[None, :] <= positions[:, None])[None, None, :48]
    scores = torch.randn(2, 1, 48, 300, device=KERNEL_DEVICE)
    k = torch.full((48,), 40, device=KERNEL_DEVICE)
    got = select_top_k(scores, allowed, k, positions[:48], positions, k_max=40, uniform_k=True)
    assert torch.equal(got.cpu(), _torch_selection(scores, allowed, 40, positions, 0))
    assert torch.equal(got[0, 0, 10].cpu(), allowed[0, 0, 10].cpu())  # 11 keys < k: all kept


def test_bf16_keeps_the_same_scores_and_ties_go_to_the_lowest_positions() -> None:
    """bf16 ties: the kept scores are the PyTorch path's as a multiset; at the k-th score the lowest positions win."""
    from gsm_train.kernels.selection import top_k_selection

    torch.manual_seed(0)
    positions = torch.arange(2048, device=KERNEL_DEVICE)
    allowed = (positions[None, :] <= positions[:, None])[None, None, -64:]
    scores = torch.randn(2, 1, 64, 2048, device=KERNEL_DEVICE).to(torch.bfloat16)
    got = top_k_selection(scores, allowed, 256, positions[-64:], positions)

    def kept(mask: torch.Tensor) -> torch.Tensor:
        return scores.float().cpu().masked_fill(~mask.cpu(), float("-inf")).sort(dim=-1).values

    assert torch.equal(kept(got), kept(_torch_selection(scores, allowed, 256, positions, 2048 - 64)))
    row = torch.tensor([[[[1.0, 3.0, 2.0, 2.0, 2.0, -1.0, 2.0, 0.0]]]], device=KERNEL_DEVICE)
    last = torch.tensor([7], device=KERNEL_DEVICE)
    everything = torch.ones(1, 1, 1, 8, dtype=torch.bool, device=KERNEL_DEVICE)
    picked = top_k_selection(row, everything, 3, last, torch.arange(8, device=KERNEL_DEVICE))
    # its own position ranks first and counts toward k, then 3.0, then the lowest of the tied 2.0s
    assert picked.flatten().tolist() == [False, True, True, False, False, False, False, True]
