"""`model.generate` after `load_gsm` and `enable_gsm_generation` (what `GSMModel.from_pretrained` does),
as users call it: over a GSM cache without extra arguments, equal to generating with teacher-forced
passes (the same model without a cache) for greedy and seeded sampling, left-padded batches, EOS, stop
strings, streamers and prompts fed in chunks (CPU, fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

from gsm_train.attention import inject_gsm, set_gsm_mode
from gsm_train.config.schema import GSMConfig
from gsm_train.export.save_load import export_adapter, load_gsm
from gsm_train.inference.cache import GSMCache, cache_kwargs
from gsm_train.inference.engine import enable_gsm_generation
from gsm_train.models.model_zoo import byte_tokenizer, tiny_model
from gsm_train.modules import GSMError

BLOCK = 8
GSM = {
    "sparse_attention": {"top_k": 6, "k_min": 2, "gate_head_dim": 16, "dense_layers": [0], "mode": "sparse"},
    "kv_compression": {"enabled": True, "block_size": BLOCK, "cluster_num": 4, "hidden_dim": 8},
}


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tiny_model("llama")
    torch.manual_seed(1)
    inject_gsm(model, GSMConfig.model_validate(GSM), mode="sparse")
    return export_adapter(model, tmp_path_factory.mktemp("gsm") / "export", base_name="tiny-llama")


def _loaded(export: Path) -> torch.nn.Module:
    model = tiny_model("llama")
    load_gsm(model, export)
    enable_gsm_generation(model, prefill="sparse")  # the prompt attends as teacher forcing does
    return model


def _prompt(length: int = 21, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def _generate(model: torch.nn.Module, ids: torch.Tensor, seed: int = 0, **kwargs) -> torch.Tensor:
    torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=20, pad_token_id=256, **kwargs)


@pytest.mark.parametrize(
    "sampling",
    [{"do_sample": False}, {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 50}],
    ids=["greedy", "sampling"],
)
def test_generate_runs_over_a_gsm_cache_and_equals_teacher_forcing(export: Path, sampling: dict) -> None:
    model = _loaded(export)
    ids = _prompt()
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=20, pad_token_id=256, return_dict_in_generate=True, **sampling)
    cache = getattr(out, "cache", None) or out.past_key_values
    assert isinstance(cache, GSMCache) and cache.lengths.seq_len == 21 + 20 - 1
    assert torch.equal(out.sequences, _generate(model, ids, use_cache=False, **sampling))


def test_a_left_padded_batch_generates_as_teacher_forcing(export: Path) -> None:
    model = _loaded(export)
    ids, mask = _prompt(), torch.ones(2, 21, dtype=torch.long)
    ids[1, :5], mask[1, :5] = 256, 0
    assert torch.equal(
        _generate(model, ids, attention_mask=mask, do_sample=False),
        _generate(model, ids, attention_mask=mask, do_sample=False, use_cache=False),
    )


def test_a_long_prompt_is_fed_in_chunks_as_teacher_forcing(export: Path) -> None:
    model = _loaded(export)
    enable_gsm_generation(model, prefill_chunk=5, prefill="sparse")  # 37 prompt tokens in 8 forwards, not block-aligned
    ids = _prompt(37)
    assert torch.equal(_generate(model, ids, do_sample=False), _generate(model, ids, do_sample=False, use_cache=False))


def test_eos_stop_strings_and_streamers(export: Path) -> None:
    model, tokenizer = _loaded(export), byte_tokenizer()
    ids = _prompt(batch=1)
    free = _generate(model, ids, do_sample=False)[0, 21:]
    eos = int(free[6])
    stopped = _generate(model, ids, do_sample=False, eos_token_id=eos)[0, 21:]
    assert stopped[-1] == eos and len(stopped) == int((free == eos).nonzero()[0]) + 1
    stop_at = next(i for i, token in enumerate(free.tolist()) if tokenizer.decode([token]).isalnum())
    stop = tokenizer.decode([int(free[stop_at])])
    cut = _generate(model, ids, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)[0, 21:]
    first = next(i for i, token in enumerate(free.tolist()) if tokenizer.decode([token]) == stop)
    assert torch.equal(cut, free[: first + 1])

    class Recorder(BaseStreamer):
        def __init__(self) -> None:
            self.tokens: list[int] = []

        def put(self, value: torch.Tensor) -> None:
            self.tokens += value.flatten().tolist()

        def end(self) -> None:
            pass

    recorder = Recorder()
    streamed = _generate(model, ids, do_sample=False, streamer=recorder)
    assert recorder.tokens == streamed[0].tolist()


def test_capacity_and_beams_are_clear_errors(export: Path) -> None:
    model = _loaded(export)
    ids = _prompt()
    with torch.no_grad(), pytest.raises(GSMError, match="holds 24 tokens per row.*larger capacity"):
        model.generate(ids, max_new_tokens=20, pad_token_id=256, **cache_kwargs(model, GSMCache(model, capacity=24)))
    with pytest.raises(GSMError, match="num_beams=1"):
        model.generate(ids, max_new_tokens=2, num_beams=2, pad_token_id=256)


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="CUDA graphs and the fused kernels need a GPU (the "
    "CPU tests above check the same generation on the PyTorch path)",
)
@pytest.mark.parametrize("padded", [False, True])
def test_captured_token_steps_equal_eager_steps_on_the_gpu(export: Path, padded: bool) -> None:
    """On CUDA, token steps replay from a CUDA graph over the fused kernels: the same tokens as the eager
    steps, and as teacher forcing (fp32; block packing happens between replays)."""
    model = tiny_model("llama").cuda()
    load_gsm(model, export)
    enable_gsm_generation(model, prefill="sparse")
    ids, mask = _prompt(37).cuda(), torch.ones(2, 37, dtype=torch.long, device="cuda")
    if padded:
        ids[1, :5], mask[1, :5] = 256, 0
    captured = _generate(model, ids, attention_mask=mask, do_sample=False)
    assert model.gsm_generation["cuda_graphs"]
    enable_gsm_generation(model, cuda_graphs=False, prefill="sparse")
    eager = _generate(model, ids, attention_mask=mask, do_sample=False)
    teacher_forced = _generate(model, ids, attention_mask=mask, do_sample=False, use_cache=False)
    assert torch.equal(captured, eager) and torch.equal(captured, teacher_forced)


def _loaded_on_the_gpu(tmp_path: Path, sparse: dict) -> torch.nn.Module:
    """A tiny llama on CUDA with an export of GSM's settings but these `sparse_attention` ones, ready to generate."""
    model = tiny_model("llama")
    torch.manual_seed(1)
    inject_gsm(model, GSMConfig.model_validate({**GSM, "sparse_attention": sparse}), mode="sparse")
    export = export_adapter(model, tmp_path / "export", base_name="tiny-llama")
    model = tiny_model("llama").cuda()
    load_gsm(model, export)
    enable_gsm_generation(model, prefill="sparse")
    return model


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_token_steps_read_every_key_in_a_retrieval_layer(tmp_path: Path) -> None:
    """A retrieval layer (gate kept, every key read) beside selecting layers (k=6 of up to 57 keys): the
    captured token steps give teacher forcing's tokens."""
    sparse = {**GSM["sparse_attention"], "retrieval_layers": [2]}
    model = _loaded_on_the_gpu(tmp_path, sparse)
    ids = _prompt(37).cuda()
    captured = _generate(model, ids, do_sample=False)
    assert model.gsm_generation["cuda_graphs"]
    assert torch.equal(captured, _generate(model, ids, do_sample=False, use_cache=False))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_captured_steps_logits_are_not_overwritten_by_the_next_step(tmp_path: Path) -> None:
    """The logits a replayed token step returns are the caller's: a later step leaves them as they were
    (a caller that keeps each step's logits, as benchmarks.step_kl does, read the last step's everywhere)."""
    model = _loaded_on_the_gpu(tmp_path, GSM["sparse_attention"])
    ids = _prompt(37).cuda()
    cache = GSMCache(model, capacity=ids.shape[1])
    with torch.no_grad():
        model(input_ids=ids[:, :-3], use_cache=True, **cache_kwargs(model, cache))
        first = model(input_ids=ids[:, -3:-2], use_cache=True, **cache_kwargs(model, cache)).logits
        kept = first.clone()
        for at in (-2, -1):
            later = model(input_ids=ids[:, at:][:, :1], use_cache=True, **cache_kwargs(model, cache)).logits
    assert cache.step_graphs is not None and cache.step_graphs.steps  # the steps were replayed
    assert not torch.equal(later, kept)  # a different token's distribution
    assert torch.equal(first, kept)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_fraction_schedule_replays_one_captured_step_for_many_k(tmp_path: Path) -> None:
    """k grows by one every 4 tokens (a quarter of the keys held): the token steps replay one captured
    step built for the schedule's ceiling, reading each position's k on the device and ranking the picks,
    until k reached the ceiling, then one that keeps every pick unsorted (`ranks_picks`), and decode as
    teacher forcing does (a step captured per k made this path 30x slower than the dense base)."""
    sparse = {**GSM["sparse_attention"], "top_k_schedule": "fraction", "top_k_fraction": 0.25, "top_k": 12}
    model = _loaded_on_the_gpu(tmp_path, sparse)
    ids = _prompt(37).cuda()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=20, pad_token_id=256, do_sample=False, return_dict_in_generate=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    assert list(cache.step_graphs.steps) == [(12, True), (12, False)]  # k from 10 to 14, capped at 12: two steps
    assert torch.equal(out.sequences, _generate(model, ids, do_sample=False, use_cache=False))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_dense_mode_replays_one_captured_step_whatever_the_schedule_s_k(tmp_path: Path) -> None:
    """In dense mode a token step reads every key held, so one captured step (`DENSE_MODE_STEP`) serves every
    length and k, and decodes as dense-mode teacher forcing does."""
    from gsm_train.inference.decode_graph import DENSE_MODE_STEP

    sparse = {**GSM["sparse_attention"], "top_k_schedule": "fraction", "top_k_fraction": 0.25, "top_k": 12}
    model = _loaded_on_the_gpu(tmp_path, sparse)
    set_gsm_mode(model, "dense")
    ids = _prompt(37).cuda()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=20, pad_token_id=256, do_sample=False, return_dict_in_generate=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    assert list(cache.step_graphs.steps) == [(DENSE_MODE_STEP, False)]
    assert torch.equal(out.sequences, _generate(model, ids, do_sample=False, use_cache=False))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_captured_block_pack_leaves_the_cache_as_the_eager_pack_does(tmp_path: Path) -> None:
    """Token steps replayed from CUDA graphs across three full blocks: with each block packed by a replay of
    the captured pack (`CapturedPack`, what `StepGraphs` does) the cache holds, bit for bit, what the eager
    pack (`GSMCache.pack_full_tail`) leaves, and every step's logits are the same."""
    from gsm_train.inference.decode_graph import StepGraphs

    model = _loaded_on_the_gpu(tmp_path, GSM["sparse_attention"])
    ids = _prompt(37).cuda()

    def decode(captured: bool) -> tuple[GSMCache, torch.Tensor]:
        cache = GSMCache(model, capacity=ids.shape[1])
        graphs = cache.step_graphs = StepGraphs(model, cache)
        if not captured:
            graphs.pack = cache.pack_full_tail  # what the captured steps' driver did before
        with torch.no_grad():
            model(input_ids=ids[:, :13], use_cache=True, **cache_kwargs(model, cache))
            logits = [
                model(input_ids=ids[:, at : at + 1], use_cache=True, **cache_kwargs(model, cache)).logits
                for at in range(13, ids.shape[1])
            ]
        return cache, torch.cat(logits, 1)

    (replayed, replayed_logits), (eager, eager_logits) = decode(True), decode(False)
    assert replayed.step_graphs.captured_pack is not None and eager.step_graphs.captured_pack is None
    assert replayed.lengths.packed_len == eager.lengths.packed_len == 4 * BLOCK  # three packs after the prompt's
    assert torch.equal(replayed.lengths.device, eager.lengths.device)
    assert torch.equal(replayed_logits, eager_logits)
    assert any(layer.gate_keys is not None for layer in replayed.layers)  # the dense layer 0 stores none
    for ours, theirs in zip(replayed.layers, eager.layers, strict=True):
        for store, other in ((ours.k_store, theirs.k_store), (ours.v_store, theirs.v_store)):
            assert torch.equal(store.tail, other.tail)
            assert all(torch.equal(field, other.fields[name]) for name, field in store.fields.items())
        assert (ours.gate_keys is None and theirs.gate_keys is None) or torch.equal(ours.gate_keys, theirs.gate_keys)
