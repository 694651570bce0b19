"""`model.generate` over a GSM cache decodes a plain greedy call in `inference.greedy_loop`'s loop, bit for bit
as transformers' loop over the same cache (`enable_gsm_generation(greedy_loop=False)` runs that one), and
leaves every other call to transformers (CPU, tiny random Llama with GSM modules)."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from transformers import LogitsProcessorList, TopKLogitsWarper
from transformers.generation.streamers import BaseStreamer

from gsm_train.attention import inject_gsm
from gsm_train.config.schema import GSMConfig
from gsm_train.inference.cache import GSMCache, cache_kwargs
from gsm_train.inference.engine import enable_gsm_generation
from gsm_train.inference.greedy_loop import EOS_CHECK_EVERY
from gsm_train.models.model_zoo import tiny_model

PROMPT = 21
NEW = 12  # new tokens per call
GSM = {
    "sparse_attention": {"top_k": 6, "k_min": 2, "gate_head_dim": 16, "dense_layers": [0], "mode": "sparse"},
    "kv_compression": {"enabled": True, "block_size": 8, "cluster_num": 4, "hidden_dim": 8},
}


def _gsm_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    model = tiny_model("llama")
    torch.manual_seed(1)
    inject_gsm(model, GSMConfig.model_validate(GSM), mode="sparse")
    return model.to(dtype)


@pytest.fixture(scope="module")
def model() -> nn.Module:
    return _gsm_model()


class SampleCalls:
    """Counts the calls of transformers' decoding loop (`_sample`) on a model's class."""

    def __init__(self, model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = type(model)._sample

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(type(model), "_sample", counted)


@pytest.fixture
def sample_calls(model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> Iterator[SampleCalls]:
    yield SampleCalls(model, monkeypatch)


def _prompt(batch: int, padded: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    ids = torch.randint(0, 256, (batch, PROMPT), generator=torch.Generator().manual_seed(batch))
    if not padded:
        return ids, None
    mask = torch.ones_like(ids)
    ids[-1, :5], mask[-1, :5] = 256, 0
    return ids, mask


def _both(model: nn.Module, ids: torch.Tensor, counter: SampleCalls, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens of `model.generate(ids, **kwargs)` by the greedy loop (which must not call `_sample`) and by
    transformers' loop (which must)."""
    outs = []
    for fast in (True, False):
        enable_gsm_generation(model, greedy_loop=fast)
        before = counter.calls
        with torch.no_grad():
            outs.append(model.generate(ids, do_sample=False, **kwargs))
        assert counter.calls == before + (0 if fast else 1)
    return outs[0], outs[1]


def _free_tokens(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The new tokens [B, NEW] with no EOS, by transformers' loop."""
    enable_gsm_generation(model, greedy_loop=False)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, pad_token_id=256)
    return out[:, PROMPT:]


@pytest.mark.parametrize(("batch", "padded"), [(1, False), (3, False), (3, True)], ids=["1", "3", "3-left-padded"])
def test_the_greedy_loop_equals_transformers_loop(
    model: nn.Module, sample_calls: SampleCalls, batch: int, padded: bool
) -> None:
    """No EOS, one EOS some rows reach (they are padded after it), EOS tokens every row reaches early (the
    output ends at the last one, before `EOS_CHECK_EVERY` tokens), EOS barred by `min_new_tokens` /
    `min_length`, and `max_length` instead of `max_new_tokens`."""
    ids, mask = _prompt(batch, padded)
    free = _free_tokens(model, ids, mask)
    early = sorted({int(row[at]) for row, at in zip(free, (3, 1, 2), strict=False)})
    cases = [
        {},
        {"eos_token_id": int(free[0, 7])},
        {"eos_token_id": early},
        {"eos_token_id": early, "min_new_tokens": 5},
        {"eos_token_id": early, "min_length": PROMPT + 4, "max_length": PROMPT + 11},
        {"max_length": PROMPT + 9},
    ]
    lengths = []
    for case in cases:
        options = case if "max_length" in case else {"max_new_tokens": NEW} | case
        fast, slow = _both(model, ids, sample_calls, attention_mask=mask, pad_token_id=256, **options)
        assert torch.equal(fast, slow), case
        lengths.append(fast.shape[1] - PROMPT)
    assert lengths[0] == NEW and lengths[-1] == 9
    assert lengths[2] < EOS_CHECK_EVERY  # every row finished early: the output stops at the last one's EOS


def test_generation_config_defaults_of_a_model_with_eos_and_pad(model: nn.Module, sample_calls: SampleCalls) -> None:
    """EOS and padding from the model's generation config (no arguments but the prompt and the length)."""
    ids, mask = _prompt(3, True)
    eos = int(_free_tokens(model, ids, mask)[1, 4])
    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = eos, 256
    try:
        fast, slow = _both(model, ids, sample_calls, attention_mask=mask, max_new_tokens=NEW)
    finally:
        model.generation_config = saved
    assert torch.equal(fast, slow) and (fast[1, PROMPT + 5 :] == 256).all()


def test_a_bf16_model(sample_calls: SampleCalls, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _gsm_model(torch.bfloat16)
    counter = SampleCalls(model, monkeypatch)
    ids, mask = _prompt(3, True)
    fast, slow = _both(model, ids, counter, attention_mask=mask, max_new_tokens=16, pad_token_id=256)
    assert torch.equal(fast, slow)


def test_a_cache_the_caller_passes_and_a_streamer(model: nn.Module, sample_calls: SampleCalls) -> None:
    """The caller's cache ends holding what transformers' loop leaves in it (no step past the stop), and a
    streamer is given what transformers gives it: the prompt, then each new token."""
    ids, _ = _prompt(1, False)
    eos = int(_free_tokens(model, ids, None)[0, 6])

    class Recorder(BaseStreamer):
        def __init__(self) -> None:
            self.puts: list[list[int]] = []
            self.ended = False

        def put(self, value: torch.Tensor) -> None:
            self.puts.append(value.flatten().tolist())

        def end(self) -> None:
            self.ended = True

    runs, before = [], sample_calls.calls
    for fast in (True, False):
        enable_gsm_generation(model, greedy_loop=fast)
        cache, recorder = GSMCache(model, capacity=PROMPT + NEW), Recorder()
        with torch.no_grad():
            out = model.generate(
                ids,
                do_sample=False,
                max_new_tokens=NEW,
                eos_token_id=eos,
                pad_token_id=256,
                streamer=recorder,
                **cache_kwargs(model, cache),
            )
        runs.append((out, cache.lengths.seq_len, recorder.puts, recorder.ended))
    assert sample_calls.calls == before + 1  # transformers' loop ran once: for greedy_loop=False
    assert runs[0][0].shape[1] == PROMPT + 7
    for got, expected in zip(runs[0], runs[1], strict=True):
        assert torch.equal(got, expected) if isinstance(got, torch.Tensor) else got == expected


@pytest.mark.parametrize(
    "options",
    [
        {"do_sample": True, "top_k": 5},
        {"logits_processor": LogitsProcessorList([TopKLogitsWarper(3)])},
        {"repetition_penalty": 1.3},
        {"no_repeat_ngram_size": 2},
        {"return_dict_in_generate": True},
    ],
    ids=["sampling", "logits-processor", "repetition-penalty", "no-repeat-ngram", "dict-output"],
)
def test_every_other_call_is_transformers_loop(model: nn.Module, sample_calls: SampleCalls, options: dict) -> None:
    """Sampling, a processor the caller passes or one a generation config field makes, asking for scores or
    a dict: transformers' loop decodes, as with `greedy_loop=False`."""
    ids, mask = _prompt(3, True)
    outs = []
    for fast in (True, False):
        enable_gsm_generation(model, greedy_loop=fast)
        torch.manual_seed(0)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=256, **options)
        outs.append(out.sequences if options.get("return_dict_in_generate") else out)
    assert sample_calls.calls == 2 and torch.equal(outs[0], outs[1])


def test_the_benchmark_and_the_cli_decode_in_the_greedy_loop(model: nn.Module, sample_calls: SampleCalls) -> None:
    """`benchmarks.generate`'s timed call (EOS barred by `min_new_tokens`, its cache, a timing streamer) and
    `gsm-train generate`'s greedy run (a text streamer, its cache) run the greedy loop, not `_sample`, with
    the tokens transformers' loop gives and a time for every new token."""
    from benchmarks.generate import generate_timed
    from gsm_train.commands.generate import Sampling, _run
    from gsm_train.models.model_zoo import byte_tokenizer

    ids, _ = _prompt(1, False)
    enable_gsm_generation(model)
    fast, timer = generate_timed(model, ids, NEW, **cache_kwargs(model, GSMCache(model, capacity=PROMPT + NEW)))
    text = _run("gsm", model, byte_tokenizer(), ids, NEW, False, GSMCache(model, capacity=PROMPT + NEW), Sampling())
    assert sample_calls.calls == 0 and len(timer.times) == NEW and len(text.token_times) == text.new_tokens > 0
    enable_gsm_generation(model, greedy_loop=False)
    slow, _ = generate_timed(model, ids, NEW, **cache_kwargs(model, GSMCache(model, capacity=PROMPT + NEW)))
    assert sample_calls.calls == 1 and torch.equal(fast, slow)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a GPU (the CPU tests check the eager steps)"
)
def test_the_greedy_loop_over_captured_steps_equals_transformers_loop_on_the_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA both loops replay captured token steps: the same tokens, a left-padded batch whose rows reach
    EOS at different steps (finished rows padded), and without EOS."""
    model = _gsm_model().cuda()
    counter = SampleCalls(model, monkeypatch)
    ids, mask = (t.cuda() for t in _prompt(3, True))
    free = _free_tokens(model, ids, mask)
    eos = sorted({int(free[0, 2]), int(free[1, 6])})
    for options in ({}, {"eos_token_id": eos}):
        fast, slow = _both(model, ids, counter, attention_mask=mask, max_new_tokens=NEW, pad_token_id=256, **options)
        assert torch.equal(fast, slow), options
    assert model.gsm_generation["cuda_graphs"]
