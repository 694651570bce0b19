"""The public names a user touches import from `gsm_train` itself, each the object its module defines, and
`import gsm_train` stays cheap (neither torch nor transformers)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import gsm_train

# what README.md, docs/cli.md and the other pages import
PUBLIC = (
    "GSMModel load_gsm export_adapter read_export Export enable_gsm_generation GSMCache cache_kwargs GSMConfig "
    "inject_gsm inject_sparse_gate gsm_collect gsm_disabled gsm_settings set_gsm_mode load_model_and_tokenizer "
    "train_recipe GSMError"
).split()


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_a_public_name_imports_from_the_package(name):
    namespace: dict = {}
    exec(f"from gsm_train import {name}", namespace)  # the statement a user writes
    value = namespace[name]
    assert value is getattr(importlib.import_module(value.__module__), name)  # the defining module's object
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
