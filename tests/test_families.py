"""The family table (gsm_train/models/families.py): each row resolves on its tiny model, and anything else
is refused by name. A new row is picked up here and by every test parametrized over TINY_FAMILIES."""

from __future__ import annotations

import pytest
from transformers import GPT2Config, GPT2LMHeadModel

from gsm_train.models.families import (
    FAMILIES,
    UnsupportedModel,
    attention_modules,
    decoder_layers,
    decoder_stack,
    family_of,
    model_dims,
)
from gsm_train.models.model_zoo import TINY_FAMILIES, tiny_model


def test_the_model_zoo_offers_every_family() -> None:
    assert set(TINY_FAMILIES) == set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_rows_paths_resolve_on_its_tiny_model(family: str) -> None:
    model = tiny_model(family, num_layers=3)
    row = family_of(model)
    assert row.model_type == family and decoder_stack(model) is getattr(model, row.stack)
    assert len(decoder_layers(model)) == 3 == model_dims(model)["layers"]
    for attention in attention_modules(model):
        projections = [getattr(attention, name) for name in row.projections]
        dims = model_dims(model)
        assert projections[0].out_features == dims["heads"] * dims["head_dim"]
        assert projections[1].out_features == projections[2].out_features == dims["kv_heads"] * dims["head_dim"]


def test_an_unsupported_family_is_refused_by_name() -> None:
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16))
    with pytest.raises(UnsupportedModel, match="'gpt2' is not supported"):
        family_of(model)
