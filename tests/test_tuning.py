"""The three tuning knobs (`tuning.top_k_base`, `tuning.kv_compression_ratio`, `tuning.bridge_alpha`):
ranges, what each sets (resolved by `resolve_tuning` from the base's config alone, changing nothing it
is given), the KV budget's choice against the exact byte account, a budget no storage reaches refused
before any weights load, and a run that uses it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from run_helpers import TINY_LLAMA_64, records

from gsm_train import cli
from gsm_train.config.schema import ConfigError, load_recipe
from gsm_train.export.adapter_format import GSM_SECTIONS
from gsm_train.models.families import model_dims
from gsm_train.models.model_zoo import tiny_config, tiny_model
from gsm_train.train import train_recipe
from gsm_train.training import checkpoint_export, session
from gsm_train.tuning.kv_budget import BUDGET_LADDER, budget_choice, fit_kv_budget, kv_bytes_ratio
from gsm_train.tuning.resolved_recipe import resolve_tuning

REPO = Path(__file__).resolve().parents[1]
JOINT = str(REPO / "recipes" / "joint.yaml")
TINY = [
    *TINY_LLAMA_64,
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
BASE = tiny_config("llama")  # the base's config alone: what the knobs are resolved against


def _problem(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_recipe(JOINT, [*TINY, *overrides])
    return str(info.value)


def test_knobs_set_the_fields_they_name() -> None:
    wide = [*TINY, "data.seq_len=512"]  # a window that holds the top_k set here
    config = resolve_tuning(load_recipe(JOINT, [*wide, "tuning.top_k_base=128", "tuning.bridge_alpha=0.2"]), BASE)
    assert config.gsm.sparse_attention.top_k == 128 and config.gsm.cross_layer_sharing.alpha_init == 0.2
    plain = resolve_tuning(load_recipe(JOINT, [*wide, "gsm.sparse_attention.top_k=512"]), BASE)
    assert (plain.gsm.sparse_attention.top_k, plain.gsm.cross_layer_sharing.alpha_init) == (512, 0.3)


def test_resolving_changes_nothing_it_is_given_and_a_resolved_recipe_stays() -> None:
    """`resolve_tuning` returns a new recipe: the one given keeps the gsm block it was loaded with (which
    is the recipe's own, knobs unapplied), and resolving the result again gives it back unchanged."""
    knobs = ["data.seq_len=512", "tuning.top_k_base=128", "tuning.bridge_alpha=0.2", "tuning.kv_compression_ratio=0.45"]
    given = load_recipe(JOINT, [*TINY, *knobs])
    before = given.model_dump(mode="json")
    resolved = resolve_tuning(given, BASE)
    assert given.model_dump(mode="json") == before
    assert (given.gsm.sparse_attention.top_k, given.gsm.cross_layer_sharing.alpha_init) == (64, 0.3)
    gsm = resolved.gsm
    assert (gsm.sparse_attention.top_k, gsm.cross_layer_sharing.alpha_init) == (128, 0.2)
    assert (gsm.kv_compression.quant_bits, gsm.sparse_attention.gate_key_bits) == (2, 16)
    assert kv_bytes_ratio(gsm, DIMS, 512) <= 0.45 < kv_bytes_ratio(given.gsm, DIMS, 512)  # (4, 8) as given
    assert resolve_tuning(resolved, BASE) == resolved
    assert (
        resolved.gsm is not given.gsm
        and resolved.gsm.sparse_attention.dense_layers is not given.gsm.sparse_attention.dense_layers
    )


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
    config = fit_kv_budget(load_recipe(JOINT, TINY).gsm, budget, DIMS, 64)
    chosen = budget_choice(config, budget, DIMS, 64)
    pair = (config.kv_compression.quant_bits, config.sparse_attention.gate_key_bits)
    assert kv_bytes_ratio(config, DIMS, 64) <= budget and f"{pair[0]}-bit residuals, {pair[1]}-bit gate keys" in chosen
    for earlier in BUDGET_LADDER[: BUDGET_LADDER.index(pair)]:  # every more precise pair exceeds the budget
        config.kv_compression.quant_bits, config.sparse_attention.gate_key_bits = earlier
        assert kv_bytes_ratio(config, DIMS, 64) > budget


def test_unreachable_budget_names_the_smallest_ratio() -> None:
    config = load_recipe(JOINT, TINY).gsm
    with pytest.raises(ConfigError) as info:
        fit_kv_budget(config, 0.4, DIMS, 64)
    assert "tuning.kv_compression_ratio = 0.4" in str(info.value) and "is 0.4863" in str(info.value)
    assert "use at least 0.49" in str(info.value)  # rounded up, so that the suggestion fits


def _refuse_to_load(*args: object, **kwargs: object) -> None:
    raise AssertionError("the model's weights were loaded before the impossible budget was refused")


@pytest.mark.parametrize("command", ["train", "validate"])
def test_an_unreachable_budget_is_refused_before_any_weights_load(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """`gsm-train train` and `gsm-train validate` refuse a budget no storage reaches on the base from its
    config alone: exit 2, one line naming the field, its value, the smallest ratio reachable and the
    fix, no weights loaded and no run folder written."""
    for module in (session, checkpoint_export):
        monkeypatch.setattr(module, "load_model_and_tokenizer", _refuse_to_load)
    run = tmp_path / "run"
    argv = [command, JOINT, *TINY, "train.steps=1", "tuning.kv_compression_ratio=0.4", f"output.dir={run}"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and [line[:6] for line in err.splitlines()].count("error:") == 1, err
    assert "tuning.kv_compression_ratio = 0.4" in err and "reach on this model at seq_len 64 is 0.4863" in err
    assert "use at least 0.49" in err
    assert not run.exists()


def test_run_uses_the_budget_and_records_the_ratio(tmp_path: Path) -> None:
    train_recipe(JOINT, [*TINY, "train.steps=1", "tuning.kv_compression_ratio=0.56", f"output.dir={tmp_path}"])
    setup = next(r for r in records(tmp_path) if r["kind"] == "setup")
    assert setup["kv_bytes_ratio"] == pytest.approx(0.556640625)  # 4-bit residuals, 8-bit gate keys
    resolved = yaml.safe_load((tmp_path / "recipe.resolved.yaml").read_text())
    assert resolved["gsm"]["kv_compression"]["quant_bits"] == 4
    assert resolved["gsm"]["sparse_attention"]["gate_key_bits"] == 8
    exported = yaml.safe_load((tmp_path / "export" / "gsm_config.json").read_text())
    assert exported["kv_compression"]["quant_bits"] == 4 and "tuning" not in exported


def test_validate_prints_the_bits_the_budget_picks(capsys: pytest.CaptureFixture) -> None:
    """`gsm-train validate` resolves the knobs against the base's config: the recipe it prints holds the
    bits the budget picked (2-bit residuals and bf16 gate keys at 0.5, where the recipe gives 4 and 8)."""
    assert cli.main(["validate", JOINT, *TINY, "tuning.kv_compression_ratio=0.5"]) == 0
    gsm = yaml.safe_load(capsys.readouterr().out)["gsm"]
    assert (gsm["kv_compression"]["quant_bits"], gsm["sparse_attention"]["gate_key_bits"]) == (2, 16)


def test_a_checkpoint_exports_the_storage_its_run_trained_with(tmp_path: Path) -> None:
    """`gsm-train export` of a budgeted run's checkpoint rebuilds the modules with the bits the budget
    picked (2-bit residuals and bf16 gate keys at 0.5, where the recipe gives 4 and 8), as the run's
    own export has them."""
    run = tmp_path / "run"
    train_recipe(JOINT, [*TINY, "train.steps=1", "tuning.kv_compression_ratio=0.5", f"output.dir={run}"])
    assert cli.main(["export", str(run / "checkpoints" / "step_00000001"), str(tmp_path / "again")]) == 0
    ran, again = (
        json.loads((folder / "gsm_config.json").read_text()) for folder in (run / "export", tmp_path / "again")
    )
    assert (ran["kv_compression"]["quant_bits"], ran["sparse_attention"]["gate_key_bits"]) == (2, 16)
    assert {key: again[key] for key in GSM_SECTIONS} == {key: ran[key] for key in GSM_SECTIONS}


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
