"""The dense engine (`inference.dense_engine`): its greedy tokens are transformers' own greedy tokens for
the same dense model (fp32, tiny models), on the host path and on the masked path a captured step takes."""

from __future__ import annotations

import pytest
import torch

from gsm_train.attention import inject_gsm
from gsm_train.config.schema import GSMConfig
from gsm_train.inference.dense_engine import DenseEngine
from gsm_train.models.families import model_dims
from gsm_train.models.model_zoo import tiny_model
from gsm_train.modules import GSMError


def _hf_greedy(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("decode_path", ["host", "masked"])
def test_dense_engine_tokens_equal_transformers_greedy(family: str, decode_path: str) -> None:
    model = tiny_model(family)
    ids = torch.randint(0, 256, (2, 29), generator=torch.Generator().manual_seed(0))
    engine = DenseEngine(model, prefill_chunk=8, decode_path=decode_path)  # 29 prompt tokens in 4 chunks
    out = engine.generate(ids, 12)
    assert torch.equal(out, _hf_greedy(model, ids, 12))
    assert model.config._attn_implementation == "sdpa"  # restored after the engine's calls


@pytest.mark.parametrize("decode_path", ["host", "masked"])
def test_dense_engine_logits_match_a_full_forward(decode_path: str) -> None:
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(1))
    engine = DenseEngine(model, prefill_chunk=7, decode_path=decode_path)
    cache = engine.new_cache(1, 24)
    for layer in cache.layers:  # what uninitialised memory may hold: the masked path must not read it
        layer.keys.fill_(float("nan"))
        layer.values.fill_(float("nan"))
    engine.prefill(cache, ids[:, :16])
    step = engine.token_step(cache)
    stepped = torch.cat([step(ids[:, i : i + 1]) for i in range(16, 20)], 1)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits[:, 16:20]
    torch.testing.assert_close(stepped, full, atol=1e-5, rtol=1e-5)
    dims = model_dims(model)
    assert cache.nbytes() == 2 * dims["layers"] * 20 * dims["kv_heads"] * dims["head_dim"] * 4  # K and V, fp32


def test_dense_engine_refuses_a_gsm_model_and_a_full_cache() -> None:
    model = tiny_model("llama")
    engine = DenseEngine(model)
    cache = engine.new_cache(1, 4)
    with pytest.raises(GSMError, match="holds 4 tokens"):
        engine.prefill(cache, torch.zeros(1, 5, dtype=torch.long))
    inject_gsm(
        model,
        GSMConfig.model_validate({"sparse_attention": {"top_k": 6, "k_min": 2, "gate_head_dim": 16}}),
        mode="sparse",
    )
    with pytest.raises(GSMError, match="without GSM modules"):
        DenseEngine(model)
