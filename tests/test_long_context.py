"""The long-context benchmark and probe (benchmarks/long_context.py, long_context_probe.py) on
tiny-llama with tiny windows: the probe agrees with the evaluation's captured mass, its RoPE
interpolation touches only the pairs it should, and the benchmark evaluates, trains and resumes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks import long_context, long_context_probe
from benchmarks.long_context_probe import interpolated_rope, rope_frequencies
from gsm_train.attention import inject_gsm
from gsm_train.commands.evaluate import perplexity_and_recall, position_buckets, prepare_evaluation
from gsm_train.config.schema import GSMConfig
from gsm_train.data.text import load_text_dataset, pack_tokens
from gsm_train.export.save_load import export_adapter
from gsm_train.models.model_zoo import byte_tokenizer, tiny_model

PROSE = "embedded:sample_prose"
GATE = {"top_k": 8, "k_min": 8, "gate_head_dim": 8, "gate_key_bits": 8, "dense_layers": [0]}
ASQ = {"enabled": True, "block_size": 16, "cluster_num": 2, "quant_bits": 4, "value_quant_bits": 2}


def _export(folder: Path, gsm: dict) -> str:
    model = tiny_model("llama")
    inject_gsm(model, GSMConfig.model_validate(gsm))
    return str(export_adapter(model, folder, base_name="tiny-llama"))


def _probe(tmp_path: Path, export: str, *more: str) -> dict:
    return long_context_probe.main(
        [
            "--export",
            export,
            "--eval-data",
            PROSE,
            "--seq-len",
            "96",
            "--windows",
            "2",
            "--train-len",
            "24",
            "--first-bucket",
            "24",
            "--min-keys",
            "12",
            "--chunk",
            "40",
            "--result",
            str(tmp_path / "probe.json"),
            *more,
        ]
    )


@pytest.mark.parametrize("rotated_pairs", [None, 1])
def test_probe_reports_every_gate_layer_and_agrees_with_the_evaluations_mass(
    tmp_path: Path, rotated_pairs: int | None
) -> None:
    """Also for a gate with 3 of its 4 pairs unrotated: their wavelengths are "none" (strict JSON)."""
    export = _export(tmp_path / "gate", {"sparse_attention": {**GATE, "gate_rotated_pairs": rotated_pairs}})
    result = _probe(tmp_path, export)
    written = json.loads((tmp_path / "probe.json").read_text(), parse_constant=pytest.fail)
    assert written["buckets"] == [[0, 24], [24, 48], [48, 96]] and "command" in written
    assert sorted(result["layers"]) == [1, 2, 3]  # layer 0 is dense: no gate
    unrotated = 0 if rotated_pairs is None else 4 - rotated_pairs
    for layer in written["layers"].values():
        [wavelengths] = layer["rope"]["wavelengths"]
        assert len(wavelengths) == 4 and wavelengths.count("none") == layer["rope"]["pairs_unrotated"] == unrotated
    # the same target, selection rule and queries as `gsm-train eval` in dense mode
    loaded = prepare_evaluation("tiny-llama", {"gate": export}, "dense").load("gate")
    rows = pack_tokens(load_text_dataset(PROSE), byte_tokenizer(), 96)[:2]
    evaluated = perplexity_and_recall(loaded.model, rows, 1, (8, 12), position_buckets(96, 24))
    for probed, part in zip(result["over_layers"], evaluated["buckets"], strict=True):
        assert probed["rows"] == part["queries"]
        assert probed["gate_mass"] == pytest.approx(part["gate_mass"], rel=1e-5)
        assert probed["oracle_mass"] == pytest.approx(part["oracle_mass"], rel=1e-5)
        assert probed["gate_mass"] <= probed["oracle_mass"] + 1e-6
        assert probed["oracle_mass"] <= probed["oracle_mass_k_scaled"] + 1e-6  # k only grows
    assert "far_rows" not in result["over_layers"][0]  # no query there is past the training length
    assert result["over_layers"][2]["far_rows"] == result["over_layers"][2]["rows"]
    assert set(result["recovery"]) in ({"fall", "bf16 keys", "RoPE interp.", "k scaled"}, set())


def test_probe_at_its_training_length_takes_nothing_away(tmp_path: Path) -> None:
    """With the training length as long as the window no pair is interpolated and k is not scaled:
    those variants equal the gate as it is (the bf16 keys of a bf16-key gate too)."""
    export = _export(tmp_path / "gate", {"sparse_attention": {**GATE, "gate_key_bits": 16}})
    result = _probe(tmp_path, export, "--train-len", "96")
    for figures in result["over_layers"]:
        for variant in ("gate_mass_bf16_keys", "gate_mass_rope_interpolated", "gate_mass_k_scaled"):
            assert figures[variant] == figures["gate_mass"]


def test_rope_interpolation_slows_only_the_pairs_longer_than_the_training_length() -> None:
    model = tiny_model("llama")
    positions = torch.arange(64)[None]
    cos, sin = model.model.rotary_emb(torch.zeros(1, 64, 16), positions)
    theta, scale = rope_frequencies(cos, sin)
    torch.testing.assert_close(theta.float(), model.model.rotary_emb.inv_freq, rtol=1e-5, atol=0)
    assert scale == 1.0
    long_wave = 2 * math.pi / theta > 20
    assert 0 < int(long_wave.sum()) < len(theta)
    new_cos, new_sin = interpolated_rope(cos, sin, train_len=20, seq_len=64)
    half = len(theta)
    for table, new, fn in ((cos, new_cos, torch.cos), (sin, new_sin, torch.sin)):
        for part in (slice(0, half), slice(half, 2 * half)):
            assert torch.equal(new[..., part][..., ~long_wave], table[..., part][..., ~long_wave])
            expected = fn(positions[0, :, None].double() * theta[long_wave] * 20 / 64)
            torch.testing.assert_close(new[0][:, part][:, long_wave].double(), expected, rtol=0, atol=1e-6)
    same = interpolated_rope(cos, sin, train_len=64, seq_len=64)
    torch.testing.assert_close(same, (cos, sin), rtol=0, atol=1e-6)


def _base_args(tmp_path: Path, *more: str) -> list[str]:
    return [
        "--model",
        "tiny-llama",
        "--eval-data",
        PROSE,
        "--out",
        str(tmp_path / "out"),
        "--result",
        str(tmp_path / "long_context.json"),
        "--min-keys",
        "16",
        "--passkey-cases",
        "1",
        *more,
    ]


def test_benchmark_measures_given_exports_and_their_other_schedules_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    exports = {
        "joint": {"sparse_attention": {**GATE, "mode": "sparse"}, "kv_compression": ASQ},
        "control": {"gsm_enabled": False},
        "joint_long": {
            "sparse_attention": {
                **GATE,
                "mode": "sparse",
                "top_k_schedule": "fraction",
                "top_k_fraction": 0.25,
                "top_k": 32,
            },
            "kv_compression": ASQ,
        },
        "control_long": {"gsm_enabled": False},
    }
    given = [f"--export={name}={_export(tmp_path / name, gsm)}" for name, gsm in exports.items()]
    argv = _base_args(
        tmp_path,
        *given,
        "--lengths",
        "64",
        "160",
        "--windows",
        "1",
        "1",
        "--first-bucket",
        "64",
        "--passkey-length",
        "280",
        "--probe",
        "joint",
    )
    result = long_context.main(argv)
    assert result["selections"] == {
        "joint_fraction": {"top_k_schedule": "fraction", "top_k_fraction": 8 / 64, "k_min": 8, "top_k": 20},
        "joint_long_constant": {"top_k_schedule": "constant", "top_k_fraction": None, "top_k": 8},
    }
    short, full = result["evals"]["64"], result["evals"]["160"]
    assert full["buckets"] == [[0, 64], [64, 128], [128, 160]] and short["buckets"] == [[0, 64]]
    assert set(full["results"]) == {"base", *exports, "joint_fraction", "joint_long_constant"}
    assert set(result["passkey"]["results"]) == {
        "base",
        "joint",
        "control",
        "joint_long",
        "control_long",
        "joint_fraction",
        "joint_long_constant",
    }
    models = result["summary"]["models"]
    assert models["joint"]["160"]["ppl_over_control"] == pytest.approx(
        full["results"]["joint"]["ppl"] / full["results"]["control"]["ppl"]
    )
    assert len(models["joint_long"]["160"]["gate_over_oracle_by_bucket"]) == 3
    targets = result["summary"]["targets"]
    assert set(targets) == {"joint", "joint_fraction", "joint_long", "joint_long_constant"}
    assert {
        "ppl_over_control_160",
        "max_bucket_ppl_over_control_160",
        "kv_bytes_ratio_160",
        "passkey_points_below_control",
    } <= set(targets["joint_long"])
    by_bucket = [
        mine["ppl"] / theirs["ppl"]
        for mine, theirs in zip(full["results"]["joint_long"]["buckets"], full["results"]["control_long"]["buckets"])
    ]
    assert targets["joint_long"]["max_bucket_ppl_over_control_160"]["value"] == pytest.approx(max(by_bucket))
    headline = result["summary"]["headline"]
    assert headline["ppl_gsm_over_control_160_64-128"] == pytest.approx(by_bucket[1])
    assert headline["ppl_gsm_over_control_64_2k_recipe"] == pytest.approx(models["joint"]["64"]["ppl_over_control"])
    assert headline["passkey_gsm_160"] == result["passkey"]["results"]["joint_long"]["accuracy"]
    assert headline["passkey_control_160_2k_recipe"] == result["passkey"]["results"]["control"]["accuracy"]
    assert headline["all_targets_met"] == all(c["met"] for c in targets["joint_long"].values())
    assert result["probes"]["joint"]["train_len"] == 64
    written = json.loads((tmp_path / "long_context.json").read_text())
    assert {"command", "commit", "device"} <= set(written)
    # again with the same arguments: every stage is done; without one stage's output, only it runs
    capsys.readouterr()
    assert long_context.main(argv)["summary"] == result["summary"]
    out = capsys.readouterr().out
    assert out.count("done before") == 4 and "running" not in out
    (tmp_path / "out" / "stages" / "probe_joint.json").unlink()
    long_context.main(argv)
    out = capsys.readouterr().out
    assert "stage probe_joint: running" in out and out.count("done before") == 3


TINY_TRAINING = [
    "train.steps=1",
    "optim.warmup_steps=0",
    "logging.recall_min_keys=16",
    "data.seq_len=64",
    "gsm.kv_compression.layer_bits={}",
    "gsm.sparse_attention.k_min=8",
]
# retrieval layers set on the long runs travel into the joint export (the tiny model has 4 layers)
TINY_LONG = [
    "gsm.sparse_attention.top_k=16",
    "gsm.kv_compression.block_size=16",
    "gsm.sparse_attention.retrieval_layers=[2]",
]


def test_benchmark_trains_the_full_context_runs_from_the_long_recipes(tmp_path: Path) -> None:
    argv = _base_args(
        tmp_path,
        "--train",
        "joint_long",
        "control_long",
        "--train-data",
        PROSE,
        "--lengths",
        "32",
        "64",
        "--windows",
        "1",
        "1",
        "--first-bucket",
        "32",
        "--passkey-cases",
        "0",
        "--override",
        *TINY_TRAINING,
        "--long-override",
        *TINY_LONG,
    )
    trained = long_context.main([*argv, "--train-only"])  # as a call that trains beside another would
    assert set(trained) == {"exports", "training"}
    assert not list((tmp_path / "out" / "stages").glob("eval_*")) and not (tmp_path / "long_context.json").exists()
    result = long_context.main(argv)  # measures what the first call trained, training nothing again
    assert result["training"] == trained["training"]
    runs = tmp_path / "out" / "runs"
    assert sorted(result["exports"]) == ["control_long", "gate_only_long", "joint_long"]
    for name in ("gate_only_long", "joint_long", "control_long"):
        assert (runs / name / "export" / "gsm_config.json").is_file()
        assert result["training"][name]["recipe"] == long_context.RUNS[name][0]
    control = json.loads((runs / "control_long" / "export" / "gsm_config.json").read_text())
    assert control["gsm_enabled"] is False
    joint = json.loads((runs / "joint_long" / "export" / "gsm_config.json").read_text())
    assert joint["sparse_attention"]["top_k_schedule"] == "fraction"  # recipes/joint_long.yaml
    assert joint["sparse_attention"]["retrieval_layers"] == [2]  # the export runs as it trained
    assert "joint_long_constant" in result["evals"]["64"]["results"]
    assert result["passkey"] is None  # --passkey-cases 0


def test_train_names_the_runs_and_brings_the_runs_they_start_from() -> None:
    assert long_context.to_train(None) == set()
    assert long_context.to_train([]) == set(long_context.RUNS)
    assert long_context.to_train(["control_long"]) == {"control_long", "gate_only_long"}
    assert long_context.to_train(["joint", "gate_only_long"]) == {"joint", "gate_only", "gate_only_long"}


@pytest.mark.parametrize(
    ("more", "message"),
    [
        (["--train"], "--train needs --train-data"),
        (["--train", "joint_longer", "--train-data", PROSE], "invalid choice: 'joint_longer'"),
        (["--lengths", "32", "64", "--windows", "1"], "--windows gives 1 counts for 2 --lengths"),
    ],
)
def test_benchmark_refuses_inconsistent_arguments(
    tmp_path: Path, more: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as info:
        long_context.main(_base_args(tmp_path, *more))
    assert info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the CPU has one device")
def test_rope_interpolation_stays_on_the_device_of_the_models_tables() -> None:
    """The interpolated tables are built where the model's are (the first GPU run mixed CPU and GPU
    tensors here)."""
    positions = torch.arange(64, dtype=torch.float64)[None, :, None]
    theta = 10000.0 ** (-torch.arange(4, dtype=torch.float64) / 4)
    angles = torch.cat((positions * theta, positions * theta), -1)
    cos, sin = angles.cos().float().cuda(), angles.sin().float().cuda()
    new_cos, new_sin = interpolated_rope(cos, sin, train_len=20, seq_len=64)
    assert new_cos.is_cuda and new_sin.is_cuda and new_cos.shape == cos.shape
