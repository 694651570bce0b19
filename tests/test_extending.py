"""docs/extending.md: the code it quotes is the code in the repository, and its worked example (the
per_token K/V compressor) runs through a joint training run, the export and loading it back."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from run_helpers import TINY_MODEL

from gsm_train.attention import gsm_adapters
from gsm_train.config.schema import KV_METHOD_CONFIGS
from gsm_train.export.save_load import load_gsm
from gsm_train.models.model_zoo import tiny_model
from gsm_train.modules.kv_registry import KV_COMPRESSORS
from gsm_train.modules.per_token_kv import PerTokenCompressor
from gsm_train.train import train_recipe

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "extending.md"
QUOTE = re.compile(r"```python\n# (\S+)\n(.*?)```", re.S)


def test_every_quoted_block_is_the_repositorys_code() -> None:
    quotes = QUOTE.findall(DOC.read_text())
    assert len(quotes) >= 4
    for path, code in quotes:
        assert code in (REPO / path).read_text(), f"docs/extending.md quotes {path} as it no longer is"


def test_every_kv_method_has_a_config_and_a_compressor() -> None:
    assert set(KV_METHOD_CONFIGS) == set(KV_COMPRESSORS)


def test_the_worked_example_trains_exports_and_loads(tmp_path: Path) -> None:
    kv = "{method: per_token, enabled: true, block_size: 16, quant_bits: 4, value_quant_bits: 2}"
    result = train_recipe(
        str(REPO / "recipes" / "joint.yaml"),
        [
            *TINY_MODEL,
            "gsm.sparse_attention.dense_layers=[0]",
            f"gsm.kv_compression={kv}",
            "gsm.cross_layer_sharing.enabled=false",
            "logging.progress_bar=false",
            "optim.warmup_steps=1",
            "init_from=null",
            "logging.eval_every=100",
            "train.steps=2",
            "train.base=lora",
            f"output.dir={tmp_path / 'run'}",
        ],
    )
    compressors = [adapter.asq_k for _, adapter in gsm_adapters(result.model)]
    assert all(isinstance(c, PerTokenCompressor) and c.quant_bits == 4 for c in compressors)
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(0))
    result.model.eval()
    with torch.no_grad():
        trained = result.model(ids, use_cache=False).logits
    fresh = tiny_model("llama")
    load_gsm(fresh, tmp_path / "run" / "export")
    with torch.no_grad():
        assert torch.equal(fresh(ids, use_cache=False).logits, trained)
