"""The three tuning knobs (`tuning.top_k_base`, `tuning.kv_compression_ratio`, `tuning.bridge_alpha`):
ranges, what each sets, the KV budget's choice against the exact byte account, and a run that uses it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from run_helpers import records

from gsm_train.config import ConfigError, load_recipe
from gsm_train.families import model_dims
from gsm_train.kv_budget import BUDGET_LADDER, apply_kv_budget, kv_bytes_ratio
from gsm_train.model_zoo import tiny_model
from gsm_train.train import train_recipe

REPO = Path(__file__).resolve().parents[1]
JOINT = str(REPO / "recipes" / "joint.yaml")
TINY = [
    "model.name_or_path=tiny-llama",
    "data.seq_len=64",
    "logging.recall_min_keys=16",
    "logging.recall_k=8",
    "gsm.sparse_attention.top_k=64",  # the recipe's 512 is above the tiny window
    "gsm.sparse_attention.k_min=8",
    "gsm.sparse_attention.dense_layers=[0]",
    "gsm.sparse_attention.gate_head_dim=4",
    "gsm.kv_compression.block_size=16",
    "gsm.kv_compression.cluster_num=4",
    "gsm.cross_layer_sharing.enabled=true",
    "gsm.cross_layer_sharing.bridge_from=1",
    "gsm.cross_layer_sharing.bridge_to_start=2",
    "init_from=null",
    "logging.progress_bar=false",
    "optim.warmup_steps=1",
    "logging.eval_every=100",
    # one width for K and V everywhere, which the ratio knob sets (the recipe's are for SmolLM2's 30 layers)
    "gsm.kv_compression.value_quant_bits=null",
    "gsm.kv_compression.layer_bits={}",
]
DIMS = model_dims(tiny_model("llama"))


def _problem(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_recipe(JOINT, [*TINY, *overrides])
    return str(info.value)


def test_knobs_set_the_fields_they_name() -> None:
    wide = [*TINY, "data.seq_len=512"]  # a window that holds the top_k set here
    config = load_recipe(JOINT, [*wide, "tuning.top_k_base=128", "tuning.bridge_alpha=0.2"])
    assert config.gsm.sparse_attention.top_k == 128 and config.gsm.cross_layer_sharing.alpha_init == 0.2
    plain = load_recipe(JOINT, [*wide, "gsm.sparse_attention.top_k=512"])
    assert (plain.gsm.sparse_attention.top_k, plain.gsm.cross_layer_sharing.alpha_init) == (512, 0.3)


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("tuning.top_k_base=16", "tuning.top_k_base = 16: Input should be greater than or equal to 32"),
        ("tuning.top_k_base=512", "tuning.top_k_base = 512: Input should be less than or equal to 256"),
        ("tuning.kv_compression_ratio=0.9", "tuning.kv_compression_ratio = 0.9"),
        ("tuning.bridge_alpha=0.05", "tuning.bridge_alpha = 0.05"),
        ("tuning.depth=3", "tuning.depth = 3: unknown key"),
    ],
)
def test_knob_out_of_range_is_one_clear_error(override: str, words: str) -> None:
    assert words in _problem([override])


def test_knobs_that_contradict_the_gsm_block_are_errors() -> None:
    assert "set gsm.sparse_attention.k_min to at most 40" in _problem(
        ["tuning.top_k_base=40", "gsm.sparse_attention.k_min=48"]
    )
    assert "gsm.kv_compression.enabled is false" in _problem(
        ["tuning.kv_compression_ratio=0.5", "gsm.kv_compression.enabled=false"]
    )
    assert "set gsm.cross_layer_sharing.enabled: true, or drop bridge_alpha" in _problem(
        ["tuning.bridge_alpha=0.2", "gsm.cross_layer_sharing.enabled=false"]
    )
    assert "drop one of them: the ratio, or value_quant_bits" in _problem(
        ["tuning.kv_compression_ratio=0.5", "gsm.kv_compression.value_quant_bits=2"]
    )


@pytest.mark.parametrize("budget", [0.75, 0.7, 0.6, 0.56, 0.5, 0.49])
def test_budget_takes_the_most_precise_storage_that_fits(budget: float) -> None:
    config = load_recipe(JOINT, TINY).gsm
    chosen = apply_kv_budget(config, budget, DIMS, 64)
    pair = (config.kv_compression.quant_bits, config.sparse_attention.gate_key_bits)
    assert kv_bytes_ratio(config, DIMS, 64) <= budget and f"{pair[0]}-bit residuals, {pair[1]}-bit gate keys" in chosen
    for earlier in BUDGET_LADDER[: BUDGET_LADDER.index(pair)]:  # every more precise pair exceeds the budget
        config.kv_compression.quant_bits, config.sparse_attention.gate_key_bits = earlier
        assert kv_bytes_ratio(config, DIMS, 64) > budget


def test_unreachable_budget_names_the_smallest_ratio() -> None:
    config = load_recipe(JOINT, TINY).gsm
    with pytest.raises(ConfigError) as info:
        apply_kv_budget(config, 0.4, DIMS, 64)
    assert "tuning.kv_compression_ratio = 0.4" in str(info.value) and "is 0.4863" in str(info.value)
    assert "use at least 0.49" in str(info.value)  # rounded up, so that the suggestion fits
    assert apply_kv_budget(config, None, DIMS, 64) is None


def test_run_uses_the_budget_and_records_the_ratio(tmp_path: Path) -> None:
    train_recipe(JOINT, [*TINY, "train.steps=1", "tuning.kv_compression_ratio=0.56", f"output.dir={tmp_path}"])
    setup = next(r for r in records(tmp_path) if r["kind"] == "setup")
    assert setup["kv_bytes_ratio"] == pytest.approx(0.556640625)  # 4-bit residuals, 8-bit gate keys
    resolved = yaml.safe_load((tmp_path / "recipe.resolved.yaml").read_text())
    assert resolved["gsm"]["kv_compression"]["quant_bits"] == 4
    assert resolved["gsm"]["sparse_attention"]["gate_key_bits"] == 8
    exported = yaml.safe_load((tmp_path / "export" / "gsm_config.json").read_text())
    assert exported["kv_compression"]["quant_bits"] == 4 and "tuning" not in exported


def test_math_gate_takes_no_knobs() -> None:
    with pytest.raises(ConfigError) as info:
        load_recipe(str(REPO / "recipes" / "math_gate.yaml"), ["init_from=some/export", "tuning.bridge_alpha=0.2"])
    assert "tuning.bridge_alpha has nothing to set" in str(info.value)


def test_value_bits_apart_from_key_bits_count_in_the_account() -> None:
    """`value_quant_bits` narrows V's residuals alone: the account drops by exactly V's residual bytes saved,
    and a width ASQ does not pack is one clear error."""
    config = load_recipe(JOINT, TINY).gsm
    assert config.kv_compression.bits() == (4, 4)
    same = kv_bytes_ratio(config, DIMS, 64)
    config.kv_compression.value_quant_bits = 2
    assert config.kv_compression.bits() == (4, 2)
    cached_heads = sum(DIMS["kv_heads"] - (1 if layer >= 2 else 0) for layer in range(DIMS["layers"]))  # share mode
    packed = (64 - 16) / 64  # at seq_len 64 the newest of the 16-token blocks stays raw
    saved = cached_heads * DIMS["head_dim"] * (4 - 2) / 8 * packed  # V's residual bytes per token
    bf16 = DIMS["layers"] * 2 * 2 * DIMS["kv_heads"] * DIMS["head_dim"]
    assert kv_bytes_ratio(config, DIMS, 64) == pytest.approx(same - saved / bf16, rel=1e-12)
    assert "gsm.kv_compression.value_quant_bits = 3" in _problem(["gsm.kv_compression.value_quant_bits=3"])


def test_layer_bits_set_the_widths_of_the_layers_named_and_count_there_alone() -> None:
    """`layer_bits` gives the layers it names their own (K, V) widths: the account changes by exactly those
    layers' residual bytes, the others keep quant_bits; a width ASQ does not pack, a negative layer and the
    ratio knob beside it are each one clear error."""
    config = load_recipe(JOINT, TINY).gsm
    same = kv_bytes_ratio(config, DIMS, 64)
    config.kv_compression.layer_bits = {1: (2, 8), 3: (8, 2)}
    assert [config.kv_compression.bits(layer) for layer in range(4)] == [(4, 4), (2, 8), (4, 4), (8, 2)]
    packed = (64 - 16) / 64  # at seq_len 64 the newest of the 16-token blocks stays raw
    heads = {1: DIMS["kv_heads"], 3: DIMS["kv_heads"] - 1}  # share mode: layer 3 caches one head fewer
    changed = sum(
        heads[layer] * DIMS["head_dim"] * (k + v - 8) / 8 * packed
        for layer, (k, v) in config.kv_compression.layer_bits.items()
    )
    bf16 = DIMS["layers"] * 2 * 2 * DIMS["kv_heads"] * DIMS["head_dim"]
    assert kv_bytes_ratio(config, DIMS, 64) == pytest.approx(same + changed / bf16, rel=1e-12)
    assert "gsm.kv_compression.layer_bits.1.0 = 3" in _problem(["gsm.kv_compression.layer_bits={1: [3, 4]}"])
    assert "layer_bits names layer -2, but layers count from 0" in _problem(
        ["gsm.kv_compression.layer_bits={-2: [2, 4]}"]
    )
    assert "drop one of them: the ratio, or layer_bits" in _problem(
        ["tuning.kv_compression_ratio=0.5", "gsm.kv_compression.layer_bits={0: [8, 8]}"]
    )
