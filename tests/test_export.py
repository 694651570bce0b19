"""Adapter export and loading: exact round trip, base checks, earlier formats, damaged exports (each
one clear error, the model untouched), where exports may be written, checkpoint export, math_gate.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from run_helpers import TINY_MODEL
from safetensors.torch import load_file, save_file

from gsm_train.attention import gsm_disabled, gsm_state_dict, has_gsm, inject_gsm
from gsm_train.cli import main as cli_main
from gsm_train.config.schema import GSMConfig, LoraSettings
from gsm_train.export.adapter_format import (
    BASE_FILE,
    CARD_FILE,
    CONFIG_FILE,
    GSM_FILE,
    PEFT_CONFIG_FILE,
    PEFT_FILE,
    ExportError,
    read_config,
)
from gsm_train.export.lora import inject_lora
from gsm_train.export.save_load import export_adapter, load_gsm, read_export
from gsm_train.models.fingerprint import base_fingerprint
from gsm_train.models.model_zoo import tiny_model
from gsm_train.train import main as train_main
from gsm_train.train import train_recipe

REPO = Path(__file__).resolve().parents[1]
ALL_ON = {
    "sparse_attention": {"top_k": 4, "k_min": 4, "gate_init": "random"},
    "kv_compression": {"enabled": True, "block_size": 8, "cluster_num": 4},
    "cross_layer_sharing": {
        "enabled": True,
        "bridge_from": 1,
        "bridge_to_start": 2,
        "mode": "share",
    },
}
TINY = [
    *TINY_MODEL,
    "logging.progress_bar=false",
    "train.steps=2",
    "logging.eval_every=2",
]
EXPORT_NAMES = [CARD_FILE, CONFIG_FILE, GSM_FILE, "training_args.json"]


def _perturbed(model: torch.nn.Module, marker: str = ".gsm.") -> None:
    """Move every floating tensor whose name holds `marker` off its initial value."""
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if marker in name and tensor.is_floating_point():
                tensor.add_(0.01 * torch.randn_like(tensor))


@pytest.fixture
def exported(tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    model = tiny_model("llama")
    inject_gsm(model, GSMConfig.model_validate(ALL_ON), mode="sparse")
    _perturbed(model)  # make every GSM tensor differ from a fresh injection
    return model, export_adapter(model, tmp_path / "export", base_name="tiny-llama", metrics={"kl": 0.5})


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(ids).logits


def test_export_then_load_is_exact(exported: tuple[torch.nn.Module, Path]) -> None:
    model, folder = exported
    assert sorted(p.name for p in folder.iterdir()) == EXPORT_NAMES
    loaded = tiny_model("llama")
    load_gsm(loaded, folder, mode="sparse")
    original, restored = gsm_state_dict(model), gsm_state_dict(loaded)
    assert original.keys() == restored.keys()
    assert all(torch.equal(original[n], restored[n]) for n in original)
    ids = torch.randint(0, 256, (2, 40))
    assert torch.equal(_logits(model, ids), _logits(loaded, ids))
    config = json.loads((folder / CONFIG_FILE).read_text())
    assert {
        "gsm_enabled",
        "sparse_attention",
        "kv_compression",
        "cross_layer_sharing",
        "base_model",
    } <= set(config)
    assert config["format_version"] == 6 and set(config["files"]) == {GSM_FILE}
    assert config["sparse_attention"]["gate_init"] == "random", "the config is exported as trained"
    assert config["base_model"]["fingerprint_rule"] == 2
    assert "kl" in (folder / CARD_FILE).read_text()


def test_a_lora_export_is_a_peft_adapter(tmp_path: Path) -> None:
    """The LoRA deltas are written as PEFT writes them: PeftModel.from_pretrained on a plain base
    computes what the trained model computes with GSM switched off; load_gsm restores the whole
    model."""
    from peft import PeftModel

    model = tiny_model("llama")
    inject_gsm(model, GSMConfig.model_validate(ALL_ON), mode="sparse")
    settings = LoraSettings(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    inject_lora(model, settings)
    _perturbed(model, ".lora_B.")  # B starts at zero: give the deltas an effect
    folder = export_adapter(model, tmp_path / "export", base_name="tiny-llama", lora=settings.model_dump())
    assert sorted(p.name for p in folder.iterdir()) == sorted([*EXPORT_NAMES, PEFT_CONFIG_FILE, PEFT_FILE])
    assert all(
        name.startswith("base_model.model.") and ".default." not in name for name in load_file(str(folder / PEFT_FILE))
    )

    ids = torch.randint(0, 256, (2, 40))
    with gsm_disabled(model):
        lora_only = _logits(model, ids)
    peft_model = PeftModel.from_pretrained(tiny_model("llama"), str(folder))
    assert torch.equal(_logits(peft_model, ids), lora_only)
    assert not torch.equal(lora_only, _logits(tiny_model("llama"), ids))
    loaded = tiny_model("llama")
    load_gsm(loaded, folder, mode="sparse")
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))


def test_a_loaded_model_infers_in_eval_mode_without_being_told(tmp_path: Path) -> None:
    """An export loaded onto a base in eval mode (as loaded bases are) gives a model whose every module is in
    eval mode, LoRA layers and GSM modules included: its LoRA dropout (0.5 here) does not run, and two
    forwards without `model.eval()` give the same logits. Before, both kinds were attached in training mode.
    Every parameter requires gradients, as in a plain model and after a load without LoRA."""
    model = tiny_model("llama")
    inject_gsm(model, GSMConfig.model_validate(ALL_ON), mode="sparse")
    settings = LoraSettings(r=4, alpha=8, dropout=0.5, target_modules=["q_proj", "v_proj"])
    inject_lora(model, settings)
    _perturbed(model, ".lora_B.")
    folder = export_adapter(model, tmp_path / "export", base_name="tiny-llama", lora=settings.model_dump())
    loaded = tiny_model("llama")
    load_gsm(loaded, folder, mode="sparse")
    assert not any(module.training for module in loaded.modules())
    assert all(param.requires_grad for param in loaded.parameters()), "as in a plain model: peft's injection froze them"
    ids = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        first, second = loaded(ids).logits, loaded(ids).logits
    assert torch.equal(first, second)
    assert torch.equal(first, _logits(model, ids))


def test_base_weights_go_to_their_own_file(tmp_path: Path) -> None:
    model = tiny_model("llama")
    inject_gsm(model, GSMConfig.model_validate(ALL_ON), mode="sparse")
    _perturbed(model, "model.layers.1.mlp")  # a base trained in full
    folder = export_adapter(model, tmp_path / "export", base_name="tiny-llama", include_base=True)
    assert not any(".gsm." in name for name in load_file(str(folder / BASE_FILE)))
    loaded = tiny_model("llama")
    load_gsm(loaded, folder, mode="sparse")
    ids = torch.randint(0, 256, (2, 40))
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))


@pytest.mark.parametrize("value_bits", [None, 2])
def test_value_bits_load_back(value_bits: int | None, tmp_path: Path) -> None:
    model = tiny_model("llama")
    asq = {**ALL_ON["kv_compression"], **({"value_quant_bits": value_bits} if value_bits else {})}
    inject_gsm(model, GSMConfig.model_validate({**ALL_ON, "kv_compression": asq}), mode="sparse")
    folder = export_adapter(model, tmp_path / "export", base_name="tiny-llama")
    loaded = tiny_model("llama")
    load_gsm(loaded, folder, mode="sparse")
    adapter = loaded.model.layers[0].self_attn.gsm
    assert (adapter.asq_k.quant_bits, adapter.asq_v.quant_bits) == (4, value_bits or 4)


# ---- earlier formats -----------------------------------------------------------------------------


def _as_format(folder: Path, version: int) -> dict:
    """Rewrite a format-6 export in the layout formats 1-5 had (docs/adapter-format.md): one file,
    adapter_model.safetensors, of every tensor under the model's names, listed in `tensors`; the
    rule-1 fingerprint of the base; fields added after format 1 written only when they matter.
    Returns the config."""
    config = json.loads((folder / CONFIG_FILE).read_text())
    tensors: dict[str, torch.Tensor] = {}
    for file in config.pop("files"):
        tensors |= load_file(str(folder / file))
        (folder / file).unlink()
    save_file(
        tensors,
        str(folder / PEFT_FILE),
        metadata={"format": "gsm-train-adapter", "format_version": str(version)},
    )
    base = config["base_model"]
    for key in ("hub_id", "license", "fingerprint_rule"):
        base.pop(key)
    base["fingerprint"] = base_fingerprint(tiny_model("llama").state_dict(), rule=1)
    kv = config["kv_compression"]
    for key, unused in (
        ("value_quant_bits", None),
        ("rotate_residuals", False),
        ("layer_bits", {}),
    ):
        if kv[key] == unused:
            del kv[key]
    config |= {
        "format_version": version,
        "tensors": {n: list(t.shape) for n, t in sorted(tensors.items())},
    }
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    return config


def _reloaded(tmp_path: Path, asq_fields: dict, version: int) -> tuple[Path, torch.nn.Module]:
    """(an export of the ALL_ON modules with `asq_fields` in kv_compression, rewritten as format
    `version`, a fresh model loaded from it); the loaded model computes the same logits as the
    exported one."""
    model = tiny_model("llama")
    asq = {**ALL_ON["kv_compression"], **asq_fields}
    inject_gsm(model, GSMConfig.model_validate({**ALL_ON, "kv_compression": asq}), mode="sparse")
    _perturbed(model)
    folder = export_adapter(model, tmp_path / "export", base_name="tiny-llama")
    _as_format(folder, version)
    loaded = tiny_model("llama")
    load_gsm(loaded, folder, mode="sparse")
    ids = torch.randint(0, 256, (2, 40))
    assert torch.equal(_logits(model, ids), _logits(loaded, ids))
    return folder, loaded


@pytest.mark.parametrize(
    ("version", "asq_fields"),
    [
        (5, {}),
        (5, {"layer_bits": {2: (2, 8)}, "quant_bits": 2}),
        (4, {"layer_bits": {2: (2, 2)}, "quant_bits": 2}),
        (3, {"rotate_residuals": True, "quant_bits": 2}),
        (2, {"quant_bits": 2}),
        (1, {"enabled": False}),
    ],
)
def test_earlier_formats_still_load(tmp_path: Path, version: int, asq_fields: dict) -> None:
    folder, loaded = _reloaded(tmp_path, asq_fields, version)
    config = read_config(folder)
    assert config["format_version"] == 6 and config["base_model"]["fingerprint_rule"] == 1
    assert config["files"] == {
        PEFT_FILE: {
            "names": "model",
            "tensors": json.loads((folder / CONFIG_FILE).read_text())["tensors"],
        }
    }
    if "layer_bits" in asq_fields:
        widths = {layer.self_attn.gsm.asq_v.quant_bits for layer in loaded.model.layers}
        assert widths == {2, asq_fields["layer_bits"][2][1]}


def test_an_earlier_format_still_refuses_a_different_base(tmp_path: Path) -> None:
    folder, _ = _reloaded(tmp_path, {}, 5)
    with pytest.raises(ExportError, match="differs from this model: fingerprint"):
        load_gsm(tiny_model("llama", seed=1), folder)


def _claim(folder: Path, version: int) -> None:
    config = json.loads((folder / CONFIG_FILE).read_text())
    (folder / CONFIG_FILE).write_text(json.dumps({**config, "format_version": version}))


@pytest.mark.parametrize(
    ("claimed", "asq_fields", "message"),
    [
        (1, {"quant_bits": 2}, "format 1 with 2-bit ASQ residuals"),
        (2, {"rotate_residuals": True, "quant_bits": 2}, "format 2 with rotated ASQ residuals"),
        (
            3,
            {"layer_bits": {2: (2, 2)}, "quant_bits": 2},
            "format 3 with per-layer ASQ residual widths",
        ),
        (4, {}, "format 4 with 4- or 8-bit ASQ residuals, trained on the symmetric grid"),
        (4, {"quant_bits": 2, "value_quant_bits": 8}, "format 4 with 4- or 8-bit ASQ residuals"),
    ],
)
def test_earlier_formats_with_what_they_could_not_hold_are_refused(
    tmp_path: Path, claimed: int, asq_fields: dict, message: str
) -> None:
    """Each format change retired a way of decoding ASQ codes; an export claiming an earlier format
    with settings only a later one holds was trained for the other decoding."""
    folder, _ = _reloaded(tmp_path, asq_fields, claimed + 1)
    _claim(folder, claimed)
    with pytest.raises(ExportError, match=message):
        load_gsm(tiny_model("llama"), folder, mode="sparse")


# ---- the base ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "other",
    [
        lambda: tiny_model("llama", seed=1),
        lambda: tiny_model("qwen2"),
        lambda: tiny_model("llama", num_layers=3),
    ],
)
def test_a_different_base_is_refused(exported: tuple[torch.nn.Module, Path], other) -> None:
    with pytest.raises(ExportError, match="differs from this model"):
        load_gsm(other(), exported[1])


@pytest.mark.parametrize(
    "tensor",
    [
        "model.layers.2.mlp.down_proj.weight",
        "model.layers.3.input_layernorm.weight",
        "lm_head.weight",
    ],
)
def test_weights_changed_in_any_tensor_are_refused(exported: tuple[torch.nn.Module, Path], tensor: str) -> None:
    """Rule 2 samples rows of every tensor (rule 1 sampled three): a base changed in one tensor
    only, in its first row, is another base."""
    base = tiny_model("llama")
    with torch.no_grad():
        base.state_dict()[tensor][0] += 0.05
    with pytest.raises(ExportError, match="differs from this model: fingerprint"):
        load_gsm(base, exported[1])


def test_same_weights_in_bf16_are_accepted(exported: tuple[torch.nn.Module, Path]) -> None:
    load_gsm(tiny_model("llama").to(torch.bfloat16), exported[1])


# ---- damaged exports: one clear error naming the file, the model untouched -----------------------


def _edit_config(folder: Path, change) -> None:
    config = json.loads((folder / CONFIG_FILE).read_text())
    (folder / CONFIG_FILE).write_text(json.dumps(change(config)))


def _reshape_gate(folder: Path) -> None:
    """Shapes tampered in both files: a gate weight cut to half its rows, and the config's list to
    match."""
    tensors = load_file(str(folder / GSM_FILE))
    name = "model.layers.0.self_attn.gsm.gate.q_proj.weight"
    tensors[name] = tensors[name][: tensors[name].shape[0] // 2].contiguous()
    save_file(tensors, str(folder / GSM_FILE))

    def listed(config: dict) -> dict:
        config["files"][GSM_FILE]["tensors"][name] = list(tensors[name].shape)
        return config

    _edit_config(folder, listed)


def _nan_tensors(folder: Path) -> None:
    tensors = {
        n: torch.full_like(t, float("nan")) if t.is_floating_point() else t
        for n, t in load_file(str(folder / GSM_FILE)).items()
    }
    save_file(tensors, str(folder / GSM_FILE))


DAMAGES = {
    "missing config": (
        lambda f: (f / CONFIG_FILE).unlink(),
        CONFIG_FILE,
        "missing gsm_config.json",
    ),
    "config not JSON": (lambda f: (f / CONFIG_FILE).write_text("{"), CONFIG_FILE, "not valid JSON"),
    "config not UTF-8": (
        lambda f: (f / CONFIG_FILE).write_bytes(b'{"format": "\xff\xfe"}'),
        CONFIG_FILE,
        "not UTF-8 text",
    ),
    "config a list": (
        lambda f: (f / CONFIG_FILE).write_text("[1, 2]"),
        CONFIG_FILE,
        "a JSON list, not an object",
    ),
    "no base_model": (
        lambda f: _edit_config(f, lambda c: {k: v for k, v in c.items() if k != "base_model"}),
        CONFIG_FILE,
        "no 'base_model' object",
    ),
    "base_model lacks fields": (
        lambda f: _edit_config(f, lambda c: {**c, "base_model": {"name_or_path": "x"}}),
        CONFIG_FILE,
        "base_model lacks model_type",
    ),
    "bad lora block": (
        lambda f: _edit_config(f, lambda c: {**c, "lora": {"r": "four"}}),
        CONFIG_FILE,
        r"invalid lora block: lora\.r",
    ),
    "bad GSM settings": (
        lambda f: _edit_config(f, lambda c: {**c, "sparse_attention": {"top_k": -1}}),
        CONFIG_FILE,
        "invalid GSM settings",
    ),
    "boolean version": (
        lambda f: _edit_config(f, lambda c: {**c, "format_version": True}),
        CONFIG_FILE,
        "version True",
    ),
    "newer version": (
        lambda f: _edit_config(f, lambda c: {**c, "format_version": 7}),
        CONFIG_FILE,
        "needs a newer gsm-train",
    ),
    "tensor list emptied": (
        lambda f: _edit_config(f, lambda c: {**c, "files": {GSM_FILE: {"names": "model", "tensors": {}}}}),
        GSM_FILE,
        "do not match the list",
    ),
    "tensor file missing": (
        lambda f: (f / GSM_FILE).unlink(),
        GSM_FILE,
        "missing, but gsm_config.json lists it",
    ),
    "truncated safetensors": (
        lambda f: os.truncate(f / GSM_FILE, (f / GSM_FILE).stat().st_size // 2),
        GSM_FILE,
        "not a readable safetensors file",
    ),
    "garbage safetensors": (
        lambda f: (f / GSM_FILE).write_bytes(b"\x00" * 64),
        GSM_FILE,
        "not a readable safetensors file",
    ),
    "shapes tampered in both files": (
        _reshape_gate,
        GSM_FILE,
        r"gate.q_proj.weight is \[8, 64\].*need \[16, 64\]",
    ),
    "all NaN": (_nan_tensors, GSM_FILE, "holds NaN or infinite values"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_export_is_refused_and_the_model_is_untouched(tmp_path: Path, damage: str) -> None:
    model = tiny_model("llama")
    inject_gsm(
        model,
        GSMConfig.model_validate({**ALL_ON, "sparse_attention": {"top_k": 4, "k_min": 4, "gate_head_dim": 16}}),
    )
    folder = export_adapter(model, tmp_path / "export", base_name="tiny-llama")
    change, file, message = DAMAGES[damage]
    change(folder)
    fresh = tiny_model("llama")
    before = {name: tensor.clone() for name, tensor in fresh.state_dict().items()}
    with pytest.raises(ExportError, match=message) as info:
        load_gsm(fresh, folder)
    assert str(folder / file) in str(info.value) or (file == CONFIG_FILE and str(folder) in str(info.value))
    after = fresh.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)
    assert fresh.config._attn_implementation == "sdpa" and not has_gsm(fresh)
    assert not any(
        hasattr(layer.self_attn, "gsm") or layer.self_attn._forward_pre_hooks for layer in fresh.model.layers
    )


@pytest.mark.parametrize("damage", ["config a list", "truncated safetensors", "all NaN"])
def test_the_cli_refuses_a_damaged_export_with_exit_2(
    tmp_path: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_model("llama")
    inject_gsm(model, GSMConfig.model_validate(ALL_ON))
    folder = export_adapter(model, tmp_path / "export", base_name="tiny-llama")
    change, file, message = DAMAGES[damage]
    change(folder)
    status = cli_main(
        [
            "generate",
            "--model",
            "tiny-llama",
            "--adapter",
            str(folder),
            "--prompt",
            "Once",
            "--max-new-tokens",
            "2",
        ]
    )
    err = capsys.readouterr().err
    assert status == 2 and str(folder / file) in err and "Traceback" not in err


def test_read_export_checks_every_tensor(exported: tuple[torch.nn.Module, Path]) -> None:
    _nan_tensors(exported[1])
    with pytest.raises(ExportError, match="holds NaN"):
        read_export(exported[1])


def test_non_finite_tensors_are_never_exported(tmp_path: Path) -> None:
    model = tiny_model("llama")
    inject_gsm(model, GSMConfig.model_validate(ALL_ON))
    with torch.no_grad():
        model.model.layers[1].self_attn.gsm.asq_k.w1[0, 0, 0] = float("inf")
    with pytest.raises(ExportError, match=r"refusing to export 1 tensors holding NaN.*asq_k\.w1"):
        export_adapter(model, tmp_path / "export", base_name="tiny-llama")
    assert list(tmp_path.iterdir()) == []


# ---- where an export may be written --------------------------------------------------------------


def _export(model: torch.nn.Module, out: Path | str) -> Path:
    return export_adapter(model, out, base_name="tiny-llama")


def test_export_refuses_a_folder_that_is_not_an_export(exported: tuple[torch.nn.Module, Path], tmp_path: Path) -> None:
    model = exported[0]
    out = tmp_path / "x"
    out.mkdir()
    (out / "f").write_text("keep")
    with pytest.raises(ExportError, match=r"not empty and not a previous gsm-train export \(it holds f\)"):
        _export(model, out)
    assert (out / "f").read_text() == "keep" and sorted(p.name for p in out.iterdir()) == ["f"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "x"], "nothing written beside it"


def test_dot_dot_is_resolved_before_anything_is_removed(exported: tuple[torch.nn.Module, Path], tmp_path: Path) -> None:
    """OUT=/tmp/sb/a/.. is /tmp/sb: it holds a canary, so it is refused (it was emptied before)."""
    sandbox = tmp_path / "sb"
    (sandbox / "a").mkdir(parents=True)
    (sandbox / "canary").write_text("keep")
    with pytest.raises(ExportError, match=f"that is {sandbox}"):
        _export(exported[0], f"{sandbox}/a/..")
    assert (sandbox / "canary").read_text() == "keep" and sorted(p.name for p in sandbox.iterdir()) == ["a", "canary"]


def test_a_previous_export_is_replaced_and_nothing_beside_it_is_touched(
    exported: tuple[torch.nn.Module, Path], tmp_path: Path
) -> None:
    model, first = exported
    (tmp_path / "canary").write_text("keep")
    stale = load_file(str(first / GSM_FILE))
    _perturbed(model)
    again = _export(model, first)
    assert again == first.resolve()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["canary", "export"], "no temporary or old folder left"
    assert (tmp_path / "canary").read_text() == "keep"
    fresh = load_file(str(first / GSM_FILE))
    assert any(not torch.equal(fresh[n], stale[n]) for n in fresh)
    (first / "notes.txt").write_text("mine")  # an export with a file gsm-train did not write
    with pytest.raises(ExportError, match=r"it holds notes.txt"):
        _export(model, first)
    assert (first / "notes.txt").read_text() == "mine"


def test_a_failed_write_leaves_the_previous_export(
    exported: tuple[torch.nn.Module, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, folder = exported
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def full_disk(*args, **kwargs) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("gsm_train.export.save_load.build_card", full_disk)
    with pytest.raises(OSError, match="No space left"):
        _export(model, folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_an_export_through_a_link_writes_where_it_points(
    exported: tuple[torch.nn.Module, Path], tmp_path: Path
) -> None:
    target = tmp_path / "real"
    (tmp_path / "link").symlink_to(target, target_is_directory=True)
    assert _export(exported[0], tmp_path / "link") == target
    assert (tmp_path / "link").is_symlink() and sorted(p.name for p in target.iterdir()) == EXPORT_NAMES


# ---- runs, checkpoints, math_gate ----------------------------------------------------------------


@pytest.fixture(scope="module")
def gate_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("gate") / "run"
    train_recipe(str(REPO / "recipes" / "gate_only.yaml"), [*TINY, f"output.dir={run}"])
    return run


def test_stage_exports_and_cli_export_of_a_checkpoint_agree(gate_run: Path, tmp_path: Path) -> None:
    read_export(gate_run / "export")
    assert cli_main(["export", str(gate_run / "checkpoints" / "step_00000002"), str(tmp_path / "again")]) == 0
    first, second = (
        load_file(str(gate_run / "export" / GSM_FILE)),
        load_file(str(tmp_path / "again" / GSM_FILE)),
    )
    assert first.keys() == second.keys() and all(torch.equal(first[n], second[n]) for n in first)
    assert cli_main(["export", str(tmp_path), str(tmp_path / "bad")]) == 2


def test_cli_export_refuses_a_folder_with_other_files_before_loading(
    gate_run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "x"
    out.mkdir()
    (out / "f").write_text("keep")
    (tmp_path / "beside").write_text("keep")
    monkeypatch.setattr(
        "gsm_train.training.checkpoint_export.load_model_and_tokenizer",
        lambda *a, **k: pytest.fail("the model loaded before the destination was checked"),
    )
    checkpoint = str(gate_run / "checkpoints" / "step_00000002")
    assert cli_main(["export", checkpoint, str(out)]) == 2
    assert cli_main(["export", checkpoint, f"{out}/.."]) == 2
    err = capsys.readouterr().err
    assert err.count("not a previous gsm-train export") == 2 and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["beside", "x"]
    assert [p.name for p in out.iterdir()] == ["f"] and (out / "f").read_text() == "keep"


def test_math_gate_trains_only_the_gates_of_an_export(exported: tuple[torch.nn.Module, Path], tmp_path: Path) -> None:
    _, folder = exported
    result = train_recipe(
        str(REPO / "recipes" / "math_gate.yaml"),
        [*TINY, f"init_from={folder}", f"output.dir={tmp_path / 'math'}", "optim.lr=0.05"],
    )
    before, after = load_file(str(folder / GSM_FILE)), gsm_state_dict(result.model)
    changed = {n for n in before if not torch.equal(before[n], after[n].cpu())}
    assert changed and all(".gate." in n for n in changed)
    assert all(n in changed for n in before if ".gate." in n and n.endswith("weight"))


def test_math_gate_without_an_export_is_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    status = train_main(
        [
            "--recipe",
            str(REPO / "recipes" / "math_gate.yaml"),
            *TINY,
            f"init_from={tmp_path / 'none'}",
            f"output.dir={tmp_path / 'run'}",
        ]
    )
    assert status == 2 and "not a GSM export" in capsys.readouterr().err
