"""`model.generate` reuses the previous call's GSM cache, reset, where its rows and capacity band fit
(`inference.engine._generation_cache`), so its captured token steps replay instead of being captured again:
a reset cache holds, after a prompt, bit for bit what a new cache holds, and the tokens are a new cache's
(CPU, fp32; on a GPU the captured steps too)."""

from __future__ import annotations

import pytest
import torch

from gsm_train.attention import inject_gsm, set_gsm_mode
from gsm_train.config.schema import GSMConfig
from gsm_train.inference.cache import GSMCache, cache_kwargs
from gsm_train.inference.engine import REUSE_ROUND, enable_gsm_generation
from gsm_train.models.model_zoo import tiny_model

BLOCK = 8
GSM = {
    "sparse_attention": {"top_k": 6, "k_min": 2, "gate_head_dim": 16, "dense_layers": [0], "mode": "sparse"},
    "kv_compression": {"enabled": True, "block_size": BLOCK, "cluster_num": 4, "hidden_dim": 8},
}


def _model(device: str = "cpu", reuse_cache: bool = True) -> torch.nn.Module:
    model = tiny_model("llama").to(device).eval()
    torch.manual_seed(1)
    inject_gsm(model, GSMConfig.model_validate(GSM), mode="sparse")
    enable_gsm_generation(model, prefill="sparse", reuse_cache=reuse_cache)
    return model


def _prompt(length: int, seed: int, batch: int = 1, device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed)).to(device)


def _generate(model: torch.nn.Module, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=256, **kwargs)


def _fill(cache: GSMCache, model: torch.nn.Module, ids: torch.Tensor) -> None:
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))


def test_a_reset_cache_holds_after_a_prompt_what_a_new_cache_holds() -> None:
    model = _model()
    reused, new = GSMCache(model, capacity=64), GSMCache(model, capacity=64)
    _fill(reused, model, _prompt(45, seed=1))  # five blocks packed, the sixth raw
    reused.reset()
    assert reused.lengths.seq_len == reused.lengths.packed_len == 0
    assert all(not t.any() for layer in reused.layers for t in layer.buffers)
    second = _prompt(29, seed=2)
    _fill(reused, model, second)
    _fill(new, model, second)
    assert torch.equal(reused.lengths.device, new.lengths.device) and reused.lengths.seq_len == 29
    for kept, fresh in zip(reused.layers, new.layers, strict=True):
        assert len(kept.buffers) == len(fresh.buffers) > 0
        assert all(torch.equal(a, b) for a, b in zip(kept.buffers, fresh.buffers, strict=True))


def test_generate_reuses_the_previous_calls_cache_and_gives_a_new_caches_tokens() -> None:
    model, without = _model(), _model(reuse_cache=False)
    first, second = _prompt(37, seed=3), _prompt(30, seed=4)  # both within one capacity band
    _generate(model, first)
    kept = model.gsm_generation["kept_cache"]
    assert kept.capacity == REUSE_ROUND and kept.lengths.seq_len > 0
    tokens = _generate(model, second)
    assert model.gsm_generation["kept_cache"] is kept  # the same cache, reset
    assert torch.equal(tokens, _generate(without, second))
    assert without.gsm_generation["kept_cache"] is None


def test_other_rows_or_a_longer_call_get_a_new_cache() -> None:
    model = _model()
    _generate(model, _prompt(30, seed=5))
    one_row = model.gsm_generation["kept_cache"]
    _generate(model, _prompt(30, seed=5, batch=2))
    two_rows = model.gsm_generation["kept_cache"]
    assert two_rows is not one_row and two_rows.serves(model, 2)
    _generate(model, _prompt(REUSE_ROUND, seed=6, batch=2))  # past the band: a larger cache
    longer = model.gsm_generation["kept_cache"]
    assert longer.capacity == 2 * REUSE_ROUND
    model.double()  # cast since: the kept buffers are of the old dtype
    _generate(model, _prompt(REUSE_ROUND, seed=6, batch=2))
    assert model.gsm_generation["kept_cache"] is not longer
    assert model.gsm_generation["kept_cache"].layers[0].dtype == torch.float64


def test_a_model_switched_to_another_mode_gets_a_new_cache() -> None:
    """Captured steps bake the attention mode in: a model switched from sparse to dense attention since the
    last call decodes over a new cache, as teacher forcing in dense mode does."""
    model, without = _model(), _model(reuse_cache=False)
    _generate(model, _prompt(30, seed=8))
    sparse_cache = model.gsm_generation["kept_cache"]
    for each in (model, without):
        set_gsm_mode(each, "dense")
    ids = _prompt(30, seed=9)
    assert torch.equal(_generate(model, ids), _generate(without, ids))
    assert model.gsm_generation["kept_cache"] is not sparse_cache


def test_a_padded_prompt_after_steps_captured_without_padding_drops_them() -> None:
    """Steps captured for a cache without a padding mask read none: a padded call on that cache gets steps
    captured again; the mask, once made, stays across resets (all valid), as the steps that read it do."""
    model = _model()
    cache = GSMCache(model, capacity=64)
    _fill(cache, model, _prompt(12, seed=7))
    cache.step_graphs = object()  # what the engine keeps once it has captured (the capture needs a GPU)
    cache.reset()
    assert cache.step_graphs is not None and cache.key_valid is None
    mask = torch.ones(1, 12, dtype=torch.long)
    mask[0, :3] = 0
    with torch.no_grad():
        model(input_ids=_prompt(12, seed=7), attention_mask=mask, use_cache=True, **cache_kwargs(model, cache))
    assert cache.step_graphs is None and not cache.key_valid[0, :3].any()
    cache.reset()
    assert cache.key_valid is not None and cache.key_valid.all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_reused_cache_replays_the_steps_captured_in_the_previous_call() -> None:
    model, without = _model("cuda"), _model("cuda", reuse_cache=False)
    _generate(model, _prompt(37, seed=3, device="cuda"))  # crosses block edges: the pack is captured too
    graphs = model.gsm_generation["kept_cache"].step_graphs
    assert graphs is not None and graphs.steps
    second = _prompt(30, seed=4, device="cuda")
    tokens = _generate(model, second)
    assert model.gsm_generation["kept_cache"].step_graphs is graphs  # replayed, not captured again
    assert torch.equal(tokens, _generate(without, second))
    # fewer tokens than the top-k before the first step: the step captured after 37 read no mask of held keys,
    # so this sequence gets its own
    short = _prompt(3, seed=5, device="cuda")
    assert torch.equal(_generate(model, short), _generate(without, short))
    assert model.gsm_generation["kept_cache"].step_graphs is graphs


def test_a_step_captured_with_every_pick_held_serves_only_sequences_past_the_top_k() -> None:
    from gsm_train.inference.decode_graph import _serves

    assert _serves(captured_held=40, held=10, k_static=8)  # past k at both: no mask either way
    assert _serves(captured_held=3, held=1, k_static=8)  # captured with its mask: serves any length
    assert _serves(captured_held=3, held=40, k_static=8)
    assert not _serves(captured_held=40, held=3, k_static=8)  # captured without it: not a sequence under k
