"""`gsm-train inspect` on tiny-llama (4 layers, 2 KV heads of 16 dims): table, byte account and CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

from gsm_train.attention import gsm_parameters, inject_gsm
from gsm_train.cli import main
from gsm_train.commands.inspect_model import default_gsm_config, inspect_model, layer_reports
from gsm_train.models.model_zoo import tiny_model
from gsm_train.quant import asq_bytes

JOINT_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "joint.yaml"  # bridge (when enabled): 8 -> 24
SEQ_LEN = 2048
BASE = 2 * 2 * 2 * 16  # K and V, bf16, 2 KV heads of 16 dims
ASQ_HEAD = 2 * asq_bytes(SEQ_LEN, 1, 16, cluster_num=32, quant_bits=4, block_size=128)["bytes_per_token"]  # K + V
GATE_KEYS = 2 * 64  # bf16 gate keys of the default gate_head_dim, one selector

CASES = {
    "defaults": (
        [],
        ["gate asq", "gate asq bridge-source"] + ["gate asq bridge-target(mix)"] * 2,
        [2 * ASQ_HEAD + GATE_KEYS] * 4,
    ),
    "asq_only": (
        ["gsm.sparse_attention.enabled=false", "gsm.cross_layer_sharing.enabled=false"],
        ["asq"] * 4,
        [2 * ASQ_HEAD] * 4,
    ),
    "share_kv_gates": (
        [
            "gsm.cross_layer_sharing.mode=share",
            "gsm.sparse_attention.heads=kv",
            "gsm.sparse_attention.dense_layers=[0]",
            "gsm.sparse_attention.retrieval_layers=[3]",
            "gsm.kv_compression.enabled=false",
        ],
        ["dense-layer", "gate bridge-source", "gate bridge-target(share)", "gate bridge-target(share) retrieval-layer"],
        [BASE, BASE + 2 * GATE_KEYS, BASE // 2 + 2 * GATE_KEYS, BASE // 2 + 2 * GATE_KEYS],
    ),
}


def _numbers(line: str, count: int) -> list[float]:
    return [float(word.replace(",", "")) for word in line.split()[-count:]]


def _parse(table: str) -> tuple[dict[int, tuple[str, list[float]]], list[float], float]:
    """Rows {layer: (modules, [params, base, gsm])}, totals [params, base, gsm] and the printed ratio."""
    lines = table.splitlines()
    rows = {
        int(line.split()[0]): (" ".join(line.split()[1:-3]), _numbers(line, 3))
        for line in lines
        if line.split() and line.split()[0].isdigit()
    }
    totals = _numbers(next(line for line in lines if line.startswith("total")), 3)
    ratio = float(lines[-1].rsplit(":", 1)[1])
    return rows, totals, ratio


@pytest.mark.parametrize("case", CASES)
def test_table_per_layer_and_totals(case: str) -> None:
    overrides, modules, gsm_bytes = CASES[case]
    rows, totals, ratio = _parse(inspect_model("tiny-llama", None, SEQ_LEN, overrides))
    assert sorted(rows) == [0, 1, 2, 3]
    assert [rows[i][0] for i in range(4)] == modules
    for index, expected in enumerate(gsm_bytes):  # the table prints one decimal
        assert rows[index][1][1:] == pytest.approx([BASE, expected], abs=0.051)
    assert totals == pytest.approx([sum(row[1][column] for row in rows.values()) for column in range(3)], abs=0.21)
    assert ratio == pytest.approx(totals[2] / totals[1], abs=1e-4)


def test_asq_lowers_the_ratio() -> None:
    _, _, ratio = _parse(inspect_model("tiny-llama", None, SEQ_LEN, CASES["asq_only"][0]))
    assert ratio < 1


def test_parameter_counts_match_the_injected_modules() -> None:
    model, config = tiny_model("llama"), default_gsm_config(4)
    inject_gsm(model, config)
    assert sum(row.params for row in layer_reports(model, config, SEQ_LEN)) == sum(
        param.numel() for _, param in gsm_parameters(model)
    )


@pytest.mark.parametrize(("layers", "bridge"), [(4, (True, 1, 2)), (32, (True, 8, 24)), (1, (False, 0, 1))])
def test_default_bridge_is_clamped_into_the_model(layers: int, bridge: tuple[bool, int, int]) -> None:
    config = default_gsm_config(layers)
    sharing = config.cross_layer_sharing
    assert (sharing.enabled, sharing.bridge_from, sharing.bridge_to_start) == bridge
    assert config.sparse_attention.enabled and config.kv_compression.enabled


def test_cli_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--model", "tiny-llama"]) == 0
    out = capsys.readouterr().out
    assert out == inspect_model("tiny-llama", None, SEQ_LEN, []) + "\n"
    assert "KV bytes ratio" in out


def test_cli_inspects_the_shipped_joint_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    """The joint recipe names SmolLM2's layers 8 and 18 in its per-layer widths: on a 4-layer model each is
    one clear problem with its fix; without them the recipe fits (its bridge, off, is not checked)."""
    assert main(["inspect", "--model", "tiny-llama", "--recipe", str(JOINT_RECIPE)]) == 2
    err = capsys.readouterr().err
    assert "gsm.kv_compression.layer_bits.18 = [4, 4]: layer index outside the model's 0..3" in err
    assert "gsm.kv_compression.layer_bits.8" in err and "gsm.kv_compression.layer_bits.3" not in err
    assert (
        main(
            [
                "inspect",
                "--model",
                "tiny-llama",
                "--recipe",
                str(JOINT_RECIPE),
                "gsm.kv_compression.layer_bits={0: [4, 4]}",
            ]
        )
        == 0
    )
    assert "KV bytes ratio" in capsys.readouterr().out


def test_cli_reports_a_recipe_that_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            ["inspect", "--model", "tiny-llama", "--recipe", str(JOINT_RECIPE), "gsm.cross_layer_sharing.enabled=true"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "gsm.cross_layer_sharing.bridge_to_start" in err and "use a value below 4" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "--model", "tiny-llama", "--seq-len", "0"],
        ["eval", "--data", "embedded:sample_prose", "--windows", "0"],
        ["eval", "--data", "embedded:sample_prose", "--batch-size", "-2"],
        ["generate", "--model", "tiny-llama", "--prompt", "hi", "--max-new-tokens", "zero"],
    ],
)
def test_cli_counts_must_be_positive(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """A count of 0 or less (or not a number) stops at the command line, naming the option and the value."""
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    option, value = argv[-2], argv[-1]
    assert stopped.value.code == 2
    assert f"argument {option}: must be a whole number of at least 1, got '{value}'" in capsys.readouterr().err
