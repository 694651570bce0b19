"""`sparse_attention.retrieval_layers`: layers that keep their gate (built, trained, exported) but whose main
attention reads every key; given in a recipe or at evaluation (`--select retrieval_layers=[...]`), refused
with field, value and fix where it names a layer without a gate or outside the model. Decoding through
the cache with a retrieval layer equals teacher forcing: tests/test_decode.py (`gate_retrieval_layers`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch import Tensor

from gsm_train.attention import GSMSettings, configure_gsm, gsm_collect, gsm_settings, inject_gsm
from gsm_train.cli import main as cli_main
from gsm_train.commands.evaluate import keys_read_share
from gsm_train.config.schema import GSMConfig
from gsm_train.export.save_load import export_adapter
from gsm_train.models.model_zoo import tiny_model
from gsm_train.modules import GSMError

SPARSE = {"top_k": 4, "k_min": 2, "gate_head_dim": 16, "sink_tokens": 1, "recent_tokens": 2}


def _model(**sparse: object) -> torch.nn.Module:
    model = tiny_model("llama")
    inject_gsm(model, GSMConfig.model_validate({"sparse_attention": {**SPARSE, **sparse}}), mode="sparse")
    return model


def _with_retrieval(model: torch.nn.Module, layers: list[int]) -> None:
    config = gsm_settings(model).config
    sparse = config.sparse_attention.model_copy(update={"retrieval_layers": layers})
    configure_gsm(model, config=config.model_copy(update={"sparse_attention": sparse}))


@torch.no_grad()
def _hidden(model: torch.nn.Module, ids: Tensor) -> tuple[Tensor, ...]:
    return model(ids, use_cache=False, output_hidden_states=True).hidden_states


def test_a_retrieval_layer_reads_every_key_and_the_others_still_select() -> None:
    model, ids = _model(), torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    sparse = _hidden(model, ids)
    configure_gsm(model, mode="dense")
    dense = _hidden(model, ids)
    configure_gsm(model, mode="sparse")
    _with_retrieval(model, [0, 1, 2, 3])  # every gate layer: the dense model, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(_hidden(model, ids), dense, strict=True))
    _with_retrieval(model, [2])  # hidden_states[i] is the input of layer i
    mixed = _hidden(model, ids)
    assert all(torch.equal(mixed[i], sparse[i]) for i in range(3))  # layers 0 and 1 select as before
    assert not torch.allclose(mixed[3], sparse[3], atol=1e-4)  # layer 2 reads every key...
    assert not torch.allclose(mixed[3], dense[3], atol=1e-4)  # ...over inputs its sparse predecessors made


def test_a_retrieval_layer_keeps_training_its_gate() -> None:
    model, ids = _model(retrieval_layers=[1]), torch.randint(0, 256, (1, 24))
    with gsm_collect(model, distill=True) as records:
        model(ids, use_cache=False)
    assert sorted(layer for layer, r in records.layers.items() if r.gate_kl) == [0, 1, 2, 3]
    assert model.model.layers[1].self_attn.gsm.gate is not None


def test_retrieval_layers_name_gate_layers_only() -> None:
    with pytest.raises(ValidationError, match="in dense_layers .* and in retrieval_layers .*fix: name it in one"):
        GSMConfig.model_validate({"sparse_attention": {"dense_layers": [0, 1], "retrieval_layers": [1]}})
    model = _model(dense_layers=[0])
    with pytest.raises(GSMError, match="retrieval_layers names layer 0, which has no gate"):
        _with_retrieval(model, [0, 2])
    assert isinstance(gsm_settings(model), GSMSettings)


def test_evaluation_runs_an_export_with_retrieval_layers_and_refuses_layers_or_exports_it_lacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    export = str(export_adapter(_model(), tmp_path / "gate", base_name="tiny-llama"))
    common = ["passkey", "--export", f"g={export}", "--length", "300", "--cases", "2", "--out"]
    both = [*common[:3], "--export", f"r={export}", *common[3:], str(tmp_path / "out")]
    assert cli_main([*both, "--select", "top_k=8", "--select", "r.retrieval_layers=[1, 3]"]) == 0
    report = json.loads((tmp_path / "out" / "passkey.json").read_text())
    assert report["selection"] == {"top_k": 8} and report["selections"] == {"r": {"retrieval_layers": [1, 3]}}
    assert report["results"]["r"]["cases"] == 2
    # at the last of 300 positions: a selecting layer reads k = 8 (the 3 forced keys among them), 1 and 3 all
    assert report["results"]["g"]["keys_read"] == 8 / 300
    assert report["results"]["r"]["keys_read"] == (8 + 300 + 8 + 300) / (4 * 300)
    assert report["results"]["base"]["keys_read"] == 1.0
    capsys.readouterr()
    assert cli_main([*common, str(tmp_path / "x"), "--select", "x.top_k=8"]) == 2
    assert "--select x.FIELD=VALUE names no export (the exports: g)" in capsys.readouterr().err

    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model loaded before the selection was checked")

    monkeypatch.setattr("gsm_train.commands.evaluate.load_model_and_tokenizer", no_model)
    capsys.readouterr()
    assert cli_main([*common, str(tmp_path / "bad"), "--select", "retrieval_layers=[1, 4]"]) == 2
    err = capsys.readouterr().err
    assert "gsm.sparse_attention.retrieval_layers.1" in err and "4" in err and "0..3" in err
    assert "inside the model" in err


def test_keys_read_count_k_or_the_forced_keys_in_selecting_layers_and_every_key_in_the_others() -> None:
    model = _model(dense_layers=[0], top_k=2, k_min=2, sink_tokens=1, recent_tokens=4, retrieval_layers=[3])
    settings = gsm_settings(model)
    assert keys_read_share(model, settings, 39) == (40 + 5 + 5 + 40) / (4 * 40)  # 1 sink + 4 recent > k = 2
    assert keys_read_share(model, settings, 2) == 1.0  # 3 visible keys, all forced
    configure_gsm(model, mode="dense")
    assert keys_read_share(model, gsm_settings(model), 39) == keys_read_share(model, None, 39) == 1.0
