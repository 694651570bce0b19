"""The decode top-k (CUDA kernel, `gsm_train.kernels.decode_topk`): the same set as torch.topk, run after
run the same positions, one clear error for what it does not take, and torch.topk wherever it cannot run.
The kernel needs a CUDA device: on CPU (CI) the GPU cases skip, and the GPU run of this file covers them."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor

from gsm_train.inference.decode_attention import top_k_positions
from gsm_train.kernels.decode_topk import (
    cuda_topk_available,
    decode_topk,
    fastest_blocks_per_row,
    row_fits,
    unordered_top_k,
)

on_gpu = pytest.mark.skipif(not cuda_topk_available(), reason="needs a CUDA device (NVRTC); the H200 run covers it")


def _assert_top_k(scores: Tensor, index: Tensor, k: int) -> None:
    """`index` holds k distinct in-range positions whose scores are exactly torch.topk's k values."""
    assert index.shape == (*scores.shape[:-1], k) and index.dtype == torch.int64
    ordered = index.sort(dim=-1).values
    assert bool((ordered[..., 1:] > ordered[..., :-1]).all()) and bool((index >= 0).all())
    assert bool((index < scores.shape[-1]).all())
    got = scores.gather(-1, index).sort(dim=-1, descending=True).values
    torch.testing.assert_close(got, scores.topk(k, dim=-1).values, atol=0, rtol=0, equal_nan=True)


@on_gpu
@pytest.mark.parametrize("length", [1, 5, 1000, 1024, 1025, 4097, 32768, 50000])
@pytest.mark.parametrize("rows", [1, 3, 128])
def test_kernel_takes_the_k_largest(length: int, rows: int) -> None:
    generator = torch.Generator(device="cuda").manual_seed(length * rows)
    normal = torch.randn(rows, length, device="cuda", generator=generator)
    forced = normal.clone()  # decode's forced keys (+inf) and scores that cannot win (-inf)
    forced[:, : min(4, length)] = float("inf")
    forced[:, -min(3, length) :] = float("-inf")
    forced[:, length // 2] = float("nan")  # NaN ranks first, as in torch.topk, whatever its sign bit
    forced[:, length // 3] = -float("nan")
    cases = {
        "normal": normal,
        "ties": torch.randint(0, 7, (rows, length), device="cuda", generator=generator).float(),
        "forced": forced,
        "tiny negative": -normal.abs() * 1e-30,
        "one value": torch.full_like(normal, 0.5),
    }
    for name, scores in cases.items():
        for k in sorted({1, min(64, length), min(2048, length), max(1, length // 2), length}):
            poisoned = torch.full((rows, k), -1, dtype=torch.int64, device="cuda")  # every position must be written
            try:
                _assert_top_k(scores, decode_topk(scores, k, out=poisoned), k)
            except AssertionError as error:
                raise AssertionError(f"{name} scores, k={k}") from error


def _launcher_here():  # noqa: ANN202
    from gsm_train.kernels.decode_topk import _launcher

    return _launcher(torch.device("cuda"))


H200_CAPACITY = {1: 132, 2: 66, 4: 30, 8: 15}  # rows at once per blocks-per-row size (cuOccupancyMaxActiveClusters)


@pytest.mark.parametrize(
    ("rows", "length", "expected"),
    [
        (1, 8192, 1),
        (64, 8192, 1),  # short rows: a cluster's barriers cost more than its blocks save
        (1, 32768, 8),
        (16, 32768, 4),
        (64, 32768, 2),
        (128, 32768, 1),  # the H200's fastest, or within 0.4 us of it
        (1, 131072, 8),
        (16, 131072, 4),
    ],
)
def test_blocks_per_row_follow_the_cost_model(rows: int, length: int, expected: int) -> None:
    """Clusters go to few long rows, one block to short or many rows, as the H200's timings ranked them."""
    assert fastest_blocks_per_row(rows, length, H200_CAPACITY) == expected


def test_blocks_per_row_only_from_the_sizes_given() -> None:
    """A size missing from the capacities (it does not hold the row, or this GPU has no clusters) is never chosen."""
    assert fastest_blocks_per_row(1, 131072, {4: 30}) == 4
    assert fastest_blocks_per_row(1, 32768, {1: 132}) == 1


@on_gpu
@pytest.mark.parametrize("length", [1, 5, 1000, 4097, 32768, 50000, 131072])
def test_every_cluster_size_takes_the_k_largest(length: int) -> None:
    """Rows split over 2, 4 or 8 blocks of a cluster (Hopper on; one block elsewhere) select as one block does."""
    launcher = _launcher_here()
    if torch.cuda.get_device_capability() >= (9, 0):  # no size may drop out silently where clusters exist
        assert launcher.cluster_sizes == (1, 2, 4, 8)
    generator = torch.Generator(device="cuda").manual_seed(length)
    normal = torch.randn(3, length, device="cuda", generator=generator)
    forced = normal.clone()
    forced[:, : min(4, length)] = float("inf")
    forced[:, -min(3, length) :] = float("-inf")
    forced[:, length // 2] = float("nan")
    cases = {
        "normal": normal,
        "ties": torch.randint(0, 7, (3, length), device="cuda", generator=generator).float(),
        "forced": forced,
        "one value": torch.full_like(normal, 0.5),
    }
    for cluster in (size for size in launcher.cluster_sizes if launcher.holds(size, length)):
        for name, scores in cases.items():
            for k in sorted({1, min(2048, length), max(1, length // 2), length}):
                poisoned = torch.full((3, k), -1, dtype=torch.int64, device="cuda")
                try:
                    got = decode_topk(scores, k, out=poisoned, blocks_per_row=cluster)
                    _assert_top_k(scores, got, k)
                    assert torch.equal(got, decode_topk(scores, k, blocks_per_row=cluster))  # the same run after run
                except AssertionError as error:
                    raise AssertionError(f"{cluster} blocks per row, {name} scores, k={k}") from error


@on_gpu
def test_clusters_repeat_under_many_launches_and_refuse_other_sizes() -> None:
    """A race between a cluster's blocks would show as a launch that differs from the first: 300 launches
    per size on tied scores (the write order of tied keys is the most sensitive part)."""
    launcher = _launcher_here()
    scores = torch.randint(0, 50, (5, 40000), device="cuda").float()
    for cluster in launcher.cluster_sizes:
        first = decode_topk(scores, 2048, blocks_per_row=cluster)
        _assert_top_k(scores, first, 2048)
        runs = torch.stack([decode_topk(scores, 2048, blocks_per_row=cluster) for _ in range(300)])
        assert bool((runs == first).all()), f"{cluster} blocks per row"
    with pytest.raises(ValueError, match=r"blocks_per_row must be one of .* got 3"):
        decode_topk(scores, 1, blocks_per_row=3)


@on_gpu
def test_kernel_is_deterministic_and_shaped_like_its_input() -> None:
    scores = torch.randint(0, 50, (2, 4, 20000), device="cuda").float()  # many ties at the k-th value
    first = decode_topk(scores, 2048)
    assert first.shape == (2, 4, 2048)
    assert torch.equal(first, decode_topk(scores, 2048))
    _assert_top_k(scores, first, 2048)


@on_gpu
def test_long_rows_and_other_dtypes_take_torch_topk() -> None:
    length = 1
    while row_fits(length * 2, torch.device("cuda")):
        length *= 2
    assert 32768 <= length  # the H200 holds 53,952 scores in a block (398,848 in a cluster of 8); 32k rows fit
    long = torch.randn(2, 1_000_000, device="cuda")
    assert not row_fits(long.shape[-1], long.device)
    with pytest.raises(ValueError, match="does not fit the shared memory of .* blocks; use unordered_top_k"):
        decode_topk(long, 16)
    _assert_top_k(long, unordered_top_k(long, 2048), 2048)
    half = torch.randn(3, 5000, device="cuda", dtype=torch.float16)
    _assert_top_k(half, unordered_top_k(half, 100), 100)


@on_gpu
def test_no_rows_and_a_wrong_out_tensor() -> None:
    assert decode_topk(torch.randn(0, 3, 100, device="cuda"), 5).shape == (0, 3, 5)
    with pytest.raises(ValueError, match=r"out must be a contiguous int64 tensor of shape \(2, 5\)"):
        decode_topk(torch.randn(2, 100, device="cuda"), 5, out=torch.empty(2, 5, dtype=torch.int32, device="cuda"))


def test_errors_name_what_the_kernel_takes() -> None:
    with pytest.raises(ValueError, match="fp32 CUDA scores, got torch.float16 on cpu"):
        decode_topk(torch.zeros(2, 8, dtype=torch.float16), 2)
    if cuda_topk_available():
        with pytest.raises(ValueError, match=r"k must be in \[1, 8\] \(the row length\), got 9"):
            decode_topk(torch.zeros(2, 8, device="cuda"), 9)


def test_fused_selection_falls_back_to_torch_topk_off_the_gpu() -> None:
    """On CPU (or in fp64) `fused=True` selects exactly what the PyTorch path does."""
    scores = torch.randn(2, 3, 300, dtype=torch.float64)
    for dtype in (torch.float32, torch.float64):
        fused, _ = top_k_positions(scores.to(dtype).clone(), None, 40, 299, 2, 8, fused=True)
        plain, _ = top_k_positions(scores.to(dtype).clone(), None, 40, 299, 2, 8)
        assert fused.shape == (2, 3, 40) and torch.equal(fused.sort(-1).values, plain.sort(-1).values)


@on_gpu
def test_a_kernel_that_cannot_be_built_leaves_torch_topk_in_charge(monkeypatch: pytest.MonkeyPatch) -> None:
    """If NVRTC or the driver refuses the kernel, decoding warns once and goes on with torch.topk."""
    from gsm_train.kernels import decode_topk as module

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("NVRTC compilation failed (test)")

    monkeypatch.setattr(module, "_launchers", {})
    monkeypatch.setattr(module, "_compile_failure", [])
    monkeypatch.setattr(torch.cuda, "_compile_kernel", refuse)
    scores = torch.randn(2, 1000, device="cuda")
    with pytest.warns(UserWarning, match=r"decode top-k kernel unavailable \(NVRTC compilation failed \(test\)\)"):
        _assert_top_k(scores, unordered_top_k(scores, 64), 64)
    assert not cuda_topk_available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second attempt, no second warning
        _assert_top_k(scores, unordered_top_k(scores, 64), 64)
