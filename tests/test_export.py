"""Adapter export and loading: exact round trip, base checks, damaged exports, checkpoint export, math_gate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gsm_train.cli import main as cli_main
from gsm_train.config import GSMConfig
from gsm_train.export import ADAPTER_FILE, CONFIG_FILE, ExportError, export_adapter, load_gsm, validate_export
from gsm_train.model_zoo import tiny_model
from gsm_train.modules import gsm_state_dict, inject_gsm
from gsm_train.train import main as train_main
from gsm_train.train import train_recipe

REPO = Path(__file__).resolve().parents[1]
ALL_ON = {"sparse_attention": {"top_k": 4, "k_min": 4, "gate_init": "random"},
          "kv_compression": {"enabled": True, "block_size": 8, "cluster_num": 4},
          "cross_layer_sharing": {"enabled": True, "bridge_from": 1, "bridge_to_start": 2, "mode": "share"}}
TINY = ["model.name_or_path=tiny-llama", "data.seq_len=64", "logging.recall_min_keys=16", "logging.recall_k=8",
        "gsm.sparse_attention.top_k=8", "gsm.sparse_attention.k_min=8", "logging.progress_bar=false",
        "train.steps=2", "logging.eval_every=2"]


@pytest.fixture
def exported(tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    model = tiny_model("llama")
    inject_gsm(model, GSMConfig.model_validate(ALL_ON), mode="sparse")
    with torch.no_grad():  # make every GSM tensor differ from a fresh injection
        for name, tensor in gsm_state_dict(model).items():
            if tensor.is_floating_point():
                tensor.add_(0.01 * torch.randn_like(tensor))
    return model, export_adapter(model, tmp_path / "export", base_name="tiny-llama", metrics={"kl": 0.5})


def test_export_then_load_is_exact(exported: tuple[torch.nn.Module, Path]) -> None:
    model, folder = exported
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", ADAPTER_FILE, CONFIG_FILE, "training_args.json"]
    loaded = tiny_model("llama")
    load_gsm(loaded, folder, mode="sparse")
    original, restored = gsm_state_dict(model), gsm_state_dict(loaded)
    assert original.keys() == restored.keys()
    assert all(torch.equal(original[n], restored[n]) for n in original)
    ids = torch.randint(0, 256, (2, 40))
    model.eval(), loaded.eval()
    assert torch.equal(model(ids).logits, loaded(ids).logits)
    config = json.loads((folder / CONFIG_FILE).read_text())
    assert {"gsm_enabled", "sparse_attention", "kv_compression", "cross_layer_sharing", "base_model"} <= set(config)
    assert config["sparse_attention"]["gate_init"] == "random", "the config is exported as trained"
    assert "kl" in (folder / "README.md").read_text()


@pytest.mark.parametrize("value_bits", [None, 2])
def test_value_bits_are_written_only_when_set_and_load_back(value_bits: int | None, tmp_path: Path) -> None:
    """`kv_compression.value_quant_bits` came after format 1: an export without it reads as before (so
    earlier readers still load it), and one with it restores each compressor's width."""
    model = tiny_model("llama")
    asq = {**ALL_ON["kv_compression"], **({"value_quant_bits": value_bits} if value_bits else {})}
    inject_gsm(model, GSMConfig.model_validate({**ALL_ON, "kv_compression": asq}), mode="sparse")
    folder = export_adapter(model, tmp_path / "export", base_name="tiny-llama")
    written = json.loads((folder / CONFIG_FILE).read_text())["kv_compression"]
    assert ("value_quant_bits" in written) == (value_bits is not None)
    assert json.loads((folder / CONFIG_FILE).read_text())["format_version"] == 5  # 4-bit K on the mid-rise grid
    loaded = tiny_model("llama")
    load_gsm(loaded, folder, mode="sparse")
    adapter = loaded.model.layers[0].self_attn.gsm
    assert (adapter.asq_k.quant_bits, adapter.asq_v.quant_bits) == (4, value_bits or 4)


def test_a_format_1_export_with_two_bit_residuals_is_refused(tmp_path: Path) -> None:
    """Format 1 held 2-bit residuals on a three-level grid; its ASQ weights were trained for that grid."""
    model = tiny_model("llama")
    inject_gsm(model, GSMConfig.model_validate({**ALL_ON, "kv_compression": {**ALL_ON["kv_compression"],
                                                                             "quant_bits": 2}}), mode="sparse")
    folder = export_adapter(model, tmp_path / "export", base_name="tiny-llama")
    config = json.loads((folder / CONFIG_FILE).read_text())
    assert config["format_version"] == 2
    _claims_format(folder, config, 1)
    with pytest.raises(ExportError, match="format 1 with 2-bit ASQ residuals"):
        load_gsm(tiny_model("llama"), folder, mode="sparse")


def _reloaded_export(tmp_path: Path, asq_fields: dict) -> tuple[Path, dict, torch.nn.Module]:
    """(export folder, its gsm_config.json, a fresh model loaded from it) of the ALL_ON modules with
    `asq_fields` added to kv_compression; the loaded model computes the same logits as the exported one."""
    model = tiny_model("llama")
    asq = {**ALL_ON["kv_compression"], **asq_fields}
    inject_gsm(model, GSMConfig.model_validate({**ALL_ON, "kv_compression": asq}), mode="sparse")
    folder = export_adapter(model, tmp_path / "export", base_name="tiny-llama")
    loaded = tiny_model("llama")
    load_gsm(loaded, folder, mode="sparse")
    ids = torch.randint(0, 256, (2, 40))
    model.eval(), loaded.eval()
    assert torch.equal(model(ids).logits, loaded(ids).logits)
    return folder, json.loads((folder / CONFIG_FILE).read_text()), loaded


def _claims_format(folder: Path, config: dict, version: int) -> None:
    """Rewrite the export's gsm_config.json as if it were format `version`."""
    (folder / CONFIG_FILE).write_text(json.dumps({**config, "format_version": version}))


def test_rotated_residuals_are_format_3_load_back_rotated_and_older_formats_are_refused(tmp_path: Path) -> None:
    """`kv_compression.rotate_residuals` came with format 3: written only when true, and an export that
    claims an earlier format with it is refused (an earlier reader would decode the codes unrotated)."""
    folder, config, loaded = _reloaded_export(tmp_path, {"rotate_residuals": True, "quant_bits": 2})
    assert config["format_version"] == 3 and config["kv_compression"]["rotate_residuals"] is True
    assert loaded.model.layers[0].self_attn.gsm.asq_k.rotation is not None
    _claims_format(folder, config, 2)
    with pytest.raises(ExportError, match="format 2 with rotated ASQ residuals"):
        load_gsm(tiny_model("llama"), folder, mode="sparse")


def test_layer_bits_are_format_4_load_back_per_layer_and_older_formats_are_refused(tmp_path: Path) -> None:
    """`kv_compression.layer_bits` came with format 4: written only when set, each layer's compressors load
    back at their widths, and an export that claims an earlier format with it is refused (an earlier reader
    would unpack those layers' codes at quant_bits). Its 8-bit layer makes the export format 5."""
    folder, config, loaded = _reloaded_export(tmp_path, {"layer_bits": {2: (2, 8)}, "quant_bits": 2})
    assert config["format_version"] == 5 and config["kv_compression"]["layer_bits"] == {"2": [2, 8]}
    widths = [(layer.self_attn.gsm.asq_k.quant_bits, layer.self_attn.gsm.asq_v.quant_bits)
              for layer in loaded.model.layers]
    assert widths == [(2, 2), (2, 2), (2, 8), (2, 2)]
    two_bit_folder, two_bit_config, _ = _reloaded_export(tmp_path / "2bit", {"layer_bits": {2: (2, 2)},
                                                                             "quant_bits": 2})
    assert two_bit_config["format_version"] == 4
    _claims_format(two_bit_folder, two_bit_config, 3)
    with pytest.raises(ExportError, match="format 3 with per-layer ASQ residual widths"):
        load_gsm(tiny_model("llama"), two_bit_folder, mode="sparse")


@pytest.mark.parametrize("asq_fields", [{}, {"quant_bits": 2, "value_quant_bits": 8}, {"layer_bits": {1: (2, 2)}}])
def test_wide_residuals_are_format_5_and_earlier_formats_with_them_are_refused(asq_fields: dict,
                                                                             tmp_path: Path) -> None:
    """Format 5 moved 4- and 8-bit residuals to the mid-rise grid: any export that stores some at those
    widths is format 5, and one that claims an earlier format was trained on the symmetric grid."""
    folder, config, _ = _reloaded_export(tmp_path, asq_fields)
    assert config["format_version"] == 5
    _claims_format(folder, config, 4)
    with pytest.raises(ExportError, match="format 4 with 4- or 8-bit ASQ residuals, trained on the symmetric grid"):
        load_gsm(tiny_model("llama"), folder, mode="sparse")


def test_a_switched_off_compressor_exports_no_rotation(tmp_path: Path) -> None:
    """`rotate_residuals` with ASQ off rotates nothing: the export leaves the field out (format 1, so
    earlier readers load it) and loads back."""
    model = tiny_model("llama")
    off = {"enabled": False, "rotate_residuals": True}
    inject_gsm(model, GSMConfig.model_validate({**ALL_ON, "kv_compression": off}), mode="sparse")
    folder = export_adapter(model, tmp_path / "export", base_name="tiny-llama")
    config = json.loads((folder / CONFIG_FILE).read_text())
    assert config["format_version"] == 1 and "rotate_residuals" not in config["kv_compression"]
    load_gsm(tiny_model("llama"), folder, mode="sparse")


@pytest.mark.parametrize("other", [lambda: tiny_model("llama", seed=1), lambda: tiny_model("qwen2"),
                                   lambda: tiny_model("llama", num_layers=3)])
def test_a_different_base_is_refused(exported: tuple[torch.nn.Module, Path], other) -> None:
    with pytest.raises(ExportError, match="differs from this model"):
        load_gsm(other(), exported[1])


def test_same_weights_in_bf16_are_accepted(exported: tuple[torch.nn.Module, Path]) -> None:
    load_gsm(tiny_model("llama").to(torch.bfloat16), exported[1])


@pytest.mark.parametrize("damage, message", [
    (lambda f: (f / CONFIG_FILE).unlink(), "missing gsm_config.json"),
    (lambda f: (f / CONFIG_FILE).write_text("{"), "not valid JSON"),
    (lambda f: (f / CONFIG_FILE).write_text(json.dumps({**json.loads((f / CONFIG_FILE).read_text()),
                                                        "tensors": {}})), "do not match"),
])
def test_damaged_exports_are_refused(exported: tuple[torch.nn.Module, Path], damage, message: str) -> None:
    damage(exported[1])
    with pytest.raises(ExportError, match=message):
        validate_export(exported[1])


def test_stage_exports_and_cli_export_of_a_checkpoint_agree(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train_recipe(str(REPO / "recipes" / "gate_only.yaml"), [*TINY, f"output.dir={run}"])
    validate_export(run / "export")
    assert cli_main(["export", str(run / "checkpoints" / "step_00000002"), str(tmp_path / "again")]) == 0
    first, second = load_file(str(run / "export" / ADAPTER_FILE)), load_file(str(tmp_path / "again" / ADAPTER_FILE))
    assert first.keys() == second.keys() and all(torch.equal(first[n], second[n]) for n in first)
    assert cli_main(["export", str(tmp_path), str(tmp_path / "bad")]) == 2


def test_math_gate_trains_only_the_gates_of_an_export(exported: tuple[torch.nn.Module, Path], tmp_path: Path) -> None:
    _, folder = exported
    result = train_recipe(str(REPO / "recipes" / "math_gate.yaml"),
                          [*TINY, f"init_from={folder}", f"output.dir={tmp_path / 'math'}", "optim.lr=0.05"])
    before, after = load_file(str(folder / ADAPTER_FILE)), gsm_state_dict(result.model)
    changed = {n for n in before if not torch.equal(before[n], after[n].cpu())}
    assert changed and all(".gate." in n for n in changed)
    assert all(n in changed for n in before if ".gate." in n and n.endswith("weight"))


def test_math_gate_without_an_export_is_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    status = train_main(["--recipe", str(REPO / "recipes" / "math_gate.yaml"), *TINY,
                         f"init_from={tmp_path / 'none'}", f"output.dir={tmp_path / 'run'}"])
    assert status == 2 and "not a GSM export" in capsys.readouterr().err
