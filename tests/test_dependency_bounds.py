"""The dependency bounds of pyproject.toml let only a working transformers / peft pair install: transformers'
adapter API (`load_adapter`, `active_adapters`, `disable_adapters`) works on a LoRA export with the peft
installed beside it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from gsm_train.attention import inject_gsm
from gsm_train.config.schema import GSMConfig, LoraSettings
from gsm_train.export.lora import inject_lora
from gsm_train.export.save_load import export_adapter
from gsm_train.models.model_zoo import tiny_model

peft = pytest.importorskip("peft")
REPO = Path(__file__).resolve().parents[1]


def _extra(name: str) -> list[Requirement]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [Requirement(text) for text in project["optional-dependencies"][name]]


def test_the_installed_pair_is_one_the_bounds_allow_and_load_adapter_accepts() -> None:
    import transformers
    from transformers.integrations.peft import MIN_PEFT_VERSION

    installed = {"peft": Version(peft.__version__), "transformers": Version(transformers.__version__)}
    for requirement in _extra("lora"):
        assert installed[requirement.name] in requirement.specifier, f"{requirement} vs {installed}"
    assert installed["peft"] >= Version(MIN_PEFT_VERSION), "pip install -e '.[dev]' again: the bounds changed"


def test_load_adapter_loads_a_lora_export(tmp_path: Path) -> None:
    model = tiny_model("llama")
    inject_gsm(model, GSMConfig.model_validate({"sparse_attention": {"top_k": 8, "k_min": 8}}))
    settings = LoraSettings(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    inject_lora(model, settings)
    for name, param in model.named_parameters():  # B starts at zero: give the deltas an effect
        if ".lora_B." in name:
            torch.nn.init.normal_(param.data, std=0.5)
    folder = export_adapter(model, tmp_path / "export", base_name="tiny-llama", lora=settings.model_dump())
    base, ids = tiny_model("llama"), torch.randint(0, 256, (1, 8))
    plain = base(ids).logits
    base.load_adapter(str(folder))  # transformers' adapter API, which checks peft's version (but here)
    assert base.active_adapters() == ["default"]
    adapted = base(ids).logits
    base.disable_adapters()
    assert torch.equal(base(ids).logits, plain) and not torch.equal(adapted, plain)
