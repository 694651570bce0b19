"""Adapter export and loading: what users take away from a run (see docs/adapter-format.md).

An export folder holds `adapter_model.safetensors` (GSM tensors only, full tensors gathered from
FSDP shards), `gsm_config.json` (the seed's schema plus the base model's identity and every tensor's
shape), a `README.md` model card and `training_args.json`. It is written to a temporary folder and
renamed into place, by rank 0 only. Loading refuses a base model that does not match.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from pydantic import ValidationError
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)

from gsm_train.config import GSMConfig, LoraSettings
from gsm_train.fingerprint import base_fingerprint
from gsm_train.lora import adapter_tensor_names, inject_lora
from gsm_train.modules import GSMSettings, configure_gsm, gsm_settings, inject_gsm

FORMAT = "gsm-train-adapter"
# 5: 4- and 8-bit ASQ residuals on the mid-rise grid (quant.code_center; before, a symmetric one);
# 4: per-layer ASQ residual widths (kv_compression.layer_bits); 3: ASQ residuals, and in later
# version-3 exports the prototypes too (the same up to fp16 rounding), in a rotated basis
# (kv_compression.rotate_residuals; docs/design-decisions.md, 'Rotated ASQ keeps its prototypes in
# the rotated basis'); 2: 2-bit ASQ residuals on the mid-rise grid; 1: on the symmetric one
FORMAT_VERSION = 5
ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "gsm_config.json"
CARD_FILE = "README.md"
ARGS_FILE = "training_args.json"
_GSM_SECTIONS = ("gsm_enabled", "sparse_attention", "kv_compression", "cross_layer_sharing")


class ExportError(ValueError):
    """An export that cannot be written, read or applied; the message names the problem and the fix."""


def base_description(model: nn.Module, fingerprint: str, name: str, revision: str | None) -> dict:
    """What a loader checks the base model against."""
    cfg = model.config
    heads = cfg.num_attention_heads
    return {
        "name_or_path": name, "revision": revision, "model_type": cfg.model_type,
        "architectures": list(getattr(cfg, "architectures", None) or [type(model).__name__]),
        "num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
        "num_attention_heads": heads, "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "vocab_size": cfg.vocab_size, "fingerprint": fingerprint,
    }


def _model_card(config: dict, recipe: dict | None, metrics: dict | None) -> str:
    base = config["base_model"]
    lines = [
        "---", "library_name: gsm-train", f"base_model: {base['name_or_path']}", "tags: [gsm, sparse-attention]",
        "---", "", f"# GSM adapter for {base['name_or_path']}", "",
        "Trained with gsm-train. Modules: "
        + ", ".join(s for s in ("sparse_attention", "kv_compression", "cross_layer_sharing")
                    if config[s].get("enabled")) + ".", "",
        (f"- base: `{base['name_or_path']}` ({base['model_type']}, {base['num_hidden_layers']} layers), "
         f"fingerprint `{base['fingerprint'][:16]}`"),
        f"- tensors: {len(config['tensors'])}",
    ]
    if recipe:
        lines += [f"- stage: `{recipe.get('stage')}`, steps: {recipe.get('train', {}).get('steps')}",
                  f"- data: `{recipe.get('data', {}).get('train', {}).get('path')}`"]
    if metrics:
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        lines += ["", "## Metrics", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v:.4g} |" for k, v in sorted(scalars.items())]
    lines += ["", "## Load", "", "```python", "from gsm_train.export import load_gsm",
              "from gsm_train.model_zoo import load_model_and_tokenizer",
              f"model, tokenizer = load_model_and_tokenizer({base['name_or_path']!r})",
              "load_gsm(model, 'PATH/TO/THIS/FOLDER')", "```", ""]
    return "\n".join(lines)


def export_adapter(model: nn.Module, out_dir: str | Path, *, base_name: str, base_revision: str | None = None,
                   recipe: dict | None = None, metrics: dict | None = None, lora: dict | None = None,
                   include_base: bool = False, is_main: bool = True, state: dict[str, Tensor] | None = None) -> Path:
    """Write the export (collective under FSDP: every rank calls it; rank 0 writes). Returns the folder.

    The export holds the GSM tensors and LoRA deltas (`lora`: the LoRA settings, if the base was
    trained with LoRA); the base weights only with `include_base` (a base trained in full). `state`:
    the model's full state dict on rank 0 when the caller gathered it (the training backend);
    otherwise it is gathered here from FSDP2 shards.
    """
    out_dir = Path(out_dir)
    if state is None:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_main:
        return out_dir
    adapter_names = adapter_tensor_names(model)
    tensors = {name: t.detach().contiguous() for name, t in state.items() if include_base or name in adapter_names}
    gsm = gsm_settings(model)
    settings = gsm.config.model_dump(mode="json")
    version = _format_version(settings)  # the lowest format that holds what the export needs, so that
    kv = settings["kv_compression"]      # earlier readers load what they can represent; likewise, fields
    if kv["value_quant_bits"] is None:   # added after format 1 are written only when they matter
        del kv["value_quant_bits"]
    if not _asq_setting(settings, "rotate_residuals"):  # nothing rotates (false, or ASQ off)
        del kv["rotate_residuals"]
    if not _asq_setting(settings, "layer_bits"):  # every layer at quant_bits / value_quant_bits
        del kv["layer_bits"]
    config = {"format": FORMAT, "format_version": version, **settings,
              "base_model": base_description(model, gsm.base_fingerprint, base_name, base_revision),
              "lora": lora, "includes_base_weights": include_base,
              "tensors": {name: list(t.shape) for name, t in sorted(tensors.items())}}
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / ADAPTER_FILE), metadata={"format": FORMAT, "format_version": str(version)})
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
    (tmp / ARGS_FILE).write_text(json.dumps({"recipe": recipe, "metrics": metrics}, indent=2, sort_keys=True,
                                            default=float))
    (tmp / CARD_FILE).write_text(_model_card(config, recipe, metrics))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


def _format_version(settings: dict) -> int:
    """The lowest format version that represents these (exported) GSM settings."""
    widths = _residual_widths(settings)
    if widths - {2}:
        return 5
    if _asq_setting(settings, "layer_bits"):
        return 4
    if _asq_setting(settings, "rotate_residuals"):
        return 3
    return 2 if 2 in widths else 1


def _asq_setting(settings: dict, name: str) -> object:
    """`kv_compression.<name>` of these (exported) GSM settings while ASQ is on; None while it is off."""
    kv = settings.get("kv_compression") or {}
    return kv.get(name) if kv.get("enabled") else None


def _residual_widths(settings: dict) -> set[int]:
    """The K and V residual widths ASQ stores under these (exported) GSM settings; empty while ASQ is off."""
    kv = settings.get("kv_compression") or {}
    if not kv.get("enabled"):
        return set()
    value_bits = kv.get("value_quant_bits") or kv.get("quant_bits")
    return {kv.get("quant_bits"), value_bits, *(b for pair in (kv.get("layer_bits") or {}).values() for b in pair)}


def validate_export(export_dir: str | Path) -> dict:
    """Check an export folder; return its parsed gsm_config.json or raise ExportError."""
    folder = Path(export_dir)
    missing = [f for f in (ADAPTER_FILE, CONFIG_FILE) if not (folder / f).is_file()]
    if missing:
        raise ExportError(f"{folder}: not a GSM export, missing {', '.join(missing)}; "
                          "give the folder written at the end of a stage (OUTPUT_DIR/export) or by gsm-train export")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except json.JSONDecodeError as err:
        raise ExportError(f"{folder / CONFIG_FILE}: not valid JSON ({err}); re-export the adapter") from None
    if config.get("format") != FORMAT or config.get("format_version") not in range(1, FORMAT_VERSION + 1):
        raise ExportError(f"{folder / CONFIG_FILE}: format {config.get('format')!r} version "
                          f"{config.get('format_version')!r}, expected {FORMAT!r} version 1 to {FORMAT_VERSION}")
    # the newest feature an older format cannot hold is named first: it is what the reader must update for
    if config["format_version"] < 5 and _residual_widths(config) - {2}:
        raise ExportError(f"{folder / CONFIG_FILE}: format {config['format_version']} with 4- or 8-bit ASQ residuals, "
                          "trained on the symmetric grid that format 5 replaced with the mid-rise one "
                          "(docs/adapter-format.md); train and export it again with this version")
    if config["format_version"] < 4 and _asq_setting(config, "layer_bits"):
        raise ExportError(f"{folder / CONFIG_FILE}: format {config['format_version']} with per-layer ASQ residual "
                          "widths (kv_compression.layer_bits), which only format 4 holds; re-export the adapter "
                          "with this version")
    if config["format_version"] < 3 and _asq_setting(config, "rotate_residuals"):
        raise ExportError(f"{folder / CONFIG_FILE}: format {config['format_version']} with rotated ASQ residuals, "
                          "which only format 3 and later hold; re-export the adapter with this version")
    if config["format_version"] == 1 and 2 in _residual_widths(config):
        raise ExportError(f"{folder / CONFIG_FILE}: format 1 with 2-bit ASQ residuals, trained on the three-level "
                          "2-bit grid that format 2 replaced with four levels (docs/adapter-format.md); train and "
                          "export it again with this version")
    try:
        GSMConfig.model_validate({k: config[k] for k in _GSM_SECTIONS if k in config})
    except ValidationError as err:
        raise ExportError(f"{folder / CONFIG_FILE}: invalid GSM settings: {err}") from None
    with safe_open(str(folder / ADAPTER_FILE), framework="pt") as handle:
        shapes = {name: list(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118 (not a dict)
    if shapes != config.get("tensors"):
        raise ExportError(f"{folder}: the tensors in {ADAPTER_FILE} do not match the list in {CONFIG_FILE}; "
                          "the export is damaged, re-export it")
    return config


def _base_mismatches(expected: dict, actual: dict) -> list[str]:
    keys = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "fingerprint")
    return [f"{k}: adapter {expected.get(k)!r}, model {actual.get(k)!r}" for k in keys if expected.get(k) != actual.get(k)]


def check_base(config: dict, model: nn.Module, adapter_dir: str | Path) -> None:
    """Refuse a fresh base model that differs from the one the export was trained on."""
    actual = base_description(model, base_fingerprint(model.state_dict()), "", None)
    mismatches = _base_mismatches(config["base_model"], actual)
    if mismatches:
        raise ExportError(f"{adapter_dir} was trained on {config['base_model']['name_or_path']!r}, which differs "
                          f"from this model: {'; '.join(mismatches)}. Load the adapter onto that base model")


def load_tensors(model: nn.Module, adapter_dir: str | Path, required: set[str],
                 allow_unexpected: bool = False) -> list[str]:
    """Load the export's tensors into `model`; every model tensor named in `required` must be in the
    export, and (unless `allow_unexpected`) every export tensor must exist in the model. Returns the
    export tensors the model has no place for."""
    result = model.load_state_dict(load_file(str(Path(adapter_dir) / ADAPTER_FILE)), strict=False)
    missing = [name for name in result.missing_keys if name in required]
    if missing or (result.unexpected_keys and not allow_unexpected):
        raise ExportError(f"{adapter_dir}: tensors do not fit the modules built from its gsm_config.json "
                          f"(missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}); re-export the adapter")
    return list(result.unexpected_keys)


def load_gsm(model: nn.Module, adapter_dir: str | Path, mode: str = "sparse") -> GSMSettings:
    """Attach the exported GSM modules (and LoRA deltas, and base weights if exported) to `model`, a
    fresh base, and load their tensors exactly.

    Refuses a base that differs from the one the adapter was trained on (architecture, dims,
    weights fingerprint). `mode` sets how main attention runs (dense / sparse / oracle).
    """
    config = validate_export(adapter_dir)
    check_base(config, model, adapter_dir)
    gsm = GSMConfig.model_validate({k: config[k] for k in _GSM_SECTIONS})
    build = gsm.model_copy(update={"sparse_attention": gsm.sparse_attention.model_copy(update={"gate_init": "random"})})
    inject_gsm(model, build, mode=mode)
    settings = configure_gsm(model, config=gsm)
    if config.get("lora"):
        inject_lora(model, LoraSettings.model_validate(config["lora"]))
    load_tensors(model, adapter_dir, adapter_tensor_names(model))
    return settings
