"""Shared test fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Dorothy lived in the midst of the great Kansas prairies.",
    "Natalia sold clips to 48 of her friends in April. #### 72",
]


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`-n N`) each worker gives torch's CPU threads, and the processes it starts
    (`OMP_NUM_THREADS`, unless set), its share of the cores this process may run on: with every worker
    taking all of them, 8 workers on 16 cores ran a CPU-bound test 165 s that takes 1 s alone."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // workers)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def token_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Token rows are cached for this test session (and the runs it starts), not in ~/.cache."""
    os.environ["GSM_TOKEN_CACHE"] = str(tmp_path_factory.mktemp("token_cache"))


@pytest.fixture(scope="session")
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (any text encodes, no network) with eos `<|endoftext|>`."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")


@pytest.fixture(scope="session", autouse=True)
def _runs_on_the_cpu() -> Iterator[None]:
    """Training runs, evaluations and generations the tests start, their module-scoped fixtures' included,
    go to the CPU on every machine (as in CI), so their figures compare with CPU-built references on a GPU
    machine too. Tests of GPU code paths use CUDA tensors themselves; those that train on the GPU are marked
    `gpu_training` (see `_gpu_training_on_the_gpu`)."""
    with pytest.MonkeyPatch.context() as session_patch:
        session_patch.setenv("ACCELERATE_USE_CPU", "1")
        yield


@pytest.fixture(autouse=True)
def _gpu_training_on_the_gpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test marked `gpu_training` trains where the trainer would put it (the GPU when there is one)."""
    if request.node.get_closest_marker("gpu_training") is not None:
        monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)


@pytest.fixture(autouse=True)
def _no_cuda_capture_left_behind() -> Iterator[None]:
    """A test that leaves a CUDA graph capture open, another stream current or CUDA's random generator in
    capture mode fails in its teardown, naming itself: otherwise every later test of its process fails
    instead, far from the cause (on an H100 one pytest-xdist worker's tests all failed after one capture's
    warm-up met "a previous error during capture", then "Offset increment outside graph capture" on their
    first random numbers; docs/results.md)."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        capturing = torch.cuda.is_current_stream_capturing()
        other_stream = torch.cuda.current_stream() != torch.cuda.default_stream()
        if capturing or other_stream:
            left = "a CUDA graph capture open" if capturing else "a side stream current"
            torch.cuda.set_stream(torch.cuda.default_stream())  # the tests after it are not charged with it
            pytest.fail(f"this test left {left}: the tests after it in this process would fail for it")
        try:  # a capture that failed to end leaves the generator in capture mode: the next draw says so
            torch.empty(1, device="cuda").uniform_()
        except RuntimeError as error:
            pytest.fail(f"this test left CUDA's random generator unusable ({error}): a capture did not end")
