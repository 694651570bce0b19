"""The public names a user touches import from `gsm_train` itself, each the object its module defines, and
`import gsm_train` stays cheap (neither torch nor transformers)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import gsm_train

# what README.md, docs/cli.md and the other pages import, and where each lives
PUBLIC = {
    "GSMModel": "gsm_train.export.pretrained",
    "load_gsm": "gsm_train.export.save_load",
    "export_adapter": "gsm_train.export.save_load",
    "read_export": "gsm_train.export.adapter_format",
    "Export": "gsm_train.export.adapter_format",
    "enable_gsm_generation": "gsm_train.inference.engine",
    "GSMCache": "gsm_train.inference.cache",
    "cache_kwargs": "gsm_train.inference.cache",
    "GSMConfig": "gsm_train.config.schema",
    "inject_gsm": "gsm_train.attention",
    "inject_sparse_gate": "gsm_train.attention",
    "gsm_collect": "gsm_train.attention",
    "gsm_disabled": "gsm_train.attention",
    "gsm_settings": "gsm_train.attention",
    "set_gsm_mode": "gsm_train.attention",
    "load_model_and_tokenizer": "gsm_train.models.model_zoo",
    "train_recipe": "gsm_train.train",
    "GSMError": "gsm_train.errors",
}


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_a_public_name_imports_from_the_package(name):
    namespace: dict = {}
    exec(f"from gsm_train import {name}", namespace)  # the statement a user writes
    assert namespace[name] is getattr(importlib.import_module(PUBLIC[name]), name)
    assert name in gsm_train.__all__
    assert name in dir(gsm_train)


def test_all_lists_exactly_the_public_names():
    assert set(gsm_train.__all__) == set(PUBLIC) | {"__version__"}


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'load_gsmm'"):
        gsm_train.load_gsmm  # noqa: B018


def test_importing_the_package_loads_neither_torch_nor_transformers():
    code = "import sys, gsm_train; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
