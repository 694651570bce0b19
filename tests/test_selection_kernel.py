"""The training selection kernel (`gsm_train.kernels.selection`): the k best scores of each row, ties at
the k-th going to the lowest positions, exactly as a stable descending sort picks them."""

from __future__ import annotations

import pytest
import torch
from run_helpers import KERNEL_DEVICE, KERNELS_RUN_HERE

pytestmark = pytest.mark.skipif(not KERNELS_RUN_HERE, reason="needs Triton with CUDA, or on CPU TRITON_INTERPRET=1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("length", "k"), [(300, 40), (2048, 256), (100, 100), (64, 200), (2048, 1), (5000, 700)])
def test_mask_holds_the_k_best_of_each_row(dtype: torch.dtype, length: int, k: int) -> None:
    """Forced (+inf) and hidden (-inf) keys as select_top_k ranks them, negative scores, bf16's many ties,
    k beyond the row, a row longer than 4,096."""
    from gsm_train.kernels.selection import top_k_mask

    torch.manual_seed(0)
    scores = torch.randn(2, 3, length, device=KERNEL_DEVICE).to(dtype)
    scores[0, 0, :5], scores[0, 1, 7] = float("-inf"), float("inf")
    expected = torch.zeros(scores.shape, dtype=torch.bool, device=KERNEL_DEVICE).scatter(
        -1, torch.sort(-scores.float(), dim=-1, stable=True).indices[..., :min(k, length)], True)
    assert torch.equal(top_k_mask(scores, k), expected)


def test_ties_at_the_boundary_go_to_the_lowest_positions() -> None:
    from gsm_train.kernels.selection import top_k_mask

    scores = torch.tensor([[1.0, 3.0, 2.0, 2.0, 2.0, -1.0, 2.0]], device=KERNEL_DEVICE)
    assert top_k_mask(scores, 3).tolist() == [[False, True, True, True, False, False, False]]
