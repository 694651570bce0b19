"""The export format (docs/adapter-format.md): its file names, and reading an export folder of any
format version into what the current code applies.

Reading never trusts the folder: `read_config` decodes and checks `gsm_config.json` and migrates an
older format forward (in `migrate_config`, the one place that knows earlier versions);
`read_tensors` checks every listed safetensors file against the config (names, shapes, finite
values) and returns the tensors under the model's own names; `read_export` reads a whole folder
once into an `Export`, which loading is handed. Every problem is an `ExportError`
naming the file and the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import Tensor

from gsm_train.config.schema import GSMConfig, LoraSettings
from gsm_train.errors import GSMError
from gsm_train.export.lora import model_name

FORMAT = "gsm-train-adapter"
# 6: the GSM tensors in gsm_modules.safetensors, LoRA as a PEFT adapter (adapter_config.json +
# adapter_model.safetensors), base weights in base_weights.safetensors, fingerprint rule 2, the
# base's Hub id, K/V compressors other than ASQ (kv_compression.method); 5: 4- and 8-bit ASQ
# residuals on the mid-rise grid (before, a symmetric one); 4: per-layer ASQ residual widths
# (kv_compression.layer_bits); 3: ASQ residuals and prototypes in a rotated basis
# (kv_compression.rotate_residuals); 2: 2-bit ASQ residuals on the mid-rise grid; 1: on the
# symmetric one
FORMAT_VERSION = 6
CONFIG_FILE = "gsm_config.json"
GSM_FILE = "gsm_modules.safetensors"
PEFT_FILE = "adapter_model.safetensors"  # formats 1-5: every exported tensor, under the model's names
PEFT_CONFIG_FILE = "adapter_config.json"
BASE_FILE = "base_weights.safetensors"
CARD_FILE = "README.md"
ARGS_FILE = "training_args.json"
EXPORT_FILES = (CONFIG_FILE, GSM_FILE, PEFT_CONFIG_FILE, PEFT_FILE, BASE_FILE, CARD_FILE, ARGS_FILE)
TENSOR_FILES = (GSM_FILE, PEFT_FILE, BASE_FILE)
NAMINGS = (
    "model",
    "peft",
)  # a file's tensor names: the model's state_dict keys, or PEFT's adapter-file keys
# base_model.merged_lora: the LoRA deltas were merged into the base; the export holds the merged
# weights in base_weights.safetensors and records the merged base's fingerprint (the loader accepts
# the base as trained or the merged base)
MERGED_FIELD = "merged_lora"
GSM_SECTIONS = ("gsm_enabled", "sparse_attention", "kv_compression", "cross_layer_sharing")
BASE_CHECKED = (
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "fingerprint",
)
_RE_EXPORT = "re-export the adapter with this version (gsm-train export RUN/checkpoints/step_N OUT)"


class ExportError(ValueError, GSMError):
    """An export that cannot be written, read or applied; the message names the problem and the
    fix."""


@dataclass
class ExportTensors:
    """The tensors of an export under the model's names, and the file each came from."""

    tensors: dict[str, Tensor]
    files: dict[str, Path]


def read_config(folder: str | Path) -> dict[str, Any]:
    """`gsm_config.json` of an export folder, checked and migrated to the current format."""
    folder = Path(folder)
    path = folder / CONFIG_FILE
    if folder.is_dir() and not path.is_file() and (folder / PEFT_CONFIG_FILE).is_file():
        raise ExportError(
            f"{folder}: a PEFT adapter ({PEFT_CONFIG_FILE}) without {CONFIG_FILE} or {GSM_FILE}: "
            "the LoRA deltas alone, as PeftModel.save_pretrained writes them, which drops the GSM "
            "modules. Fix: load the export it came from (gsm-train export, or GSMModel.save_pretrained "
            "of a GSMModel), or apply this folder with PeftModel.from_pretrained for a dense model"
        )
    if not folder.is_dir() or not path.is_file():
        raise ExportError(
            f"{folder}: not a GSM export, missing {CONFIG_FILE}; give the folder written at the "
            "end of a stage (OUTPUT_DIR/export) or by gsm-train export"
        )
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ExportError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start}); {_RE_EXPORT}") from None
    except json.JSONDecodeError as err:
        raise ExportError(f"{path}: not valid JSON ({err}); {_RE_EXPORT}") from None
    except RecursionError:
        raise ExportError(f"{path}: JSON nested too deeply to be a GSM export's config; {_RE_EXPORT}") from None
    if not isinstance(config, dict):
        raise ExportError(f"{path}: holds a JSON {type(config).__name__}, not an object; {_RE_EXPORT}")
    version = config.get("format_version")
    if config.get("format") != FORMAT or type(version) is not int or not 1 <= version <= FORMAT_VERSION:
        raise ExportError(
            f"{path}: format {config.get('format')!r} version {version!r}, expected {FORMAT!r} "
            f"version 1 to {FORMAT_VERSION}; give a gsm-train export (a newer one needs a newer "
            "gsm-train: pip install -U gsm-train)"
        )
    config = migrate_config(config, path)
    _check_fields(config, path)
    return config


def migrate_config(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """`config` of any format version as the current format says it (a new dict). Exports of a
    retired ASQ grid are refused: their weights were trained for codes this version decodes
    differently."""
    version = config["format_version"]
    if version == FORMAT_VERSION:
        return dict(config)
    _refuse_retired_grids(config, version, path)
    base, tensors = config.get("base_model"), config.get("tensors")
    if not isinstance(base, dict) or not isinstance(tensors, dict):
        missing = "base_model" if not isinstance(base, dict) else "tensors"
        raise ExportError(f"{path}: format {version} without a '{missing}' object; {_RE_EXPORT}")
    migrated = {key: value for key, value in config.items() if key != "tensors"}
    migrated["format_version"] = FORMAT_VERSION
    # formats 1-5 keep every tensor, under the model's names, in adapter_model.safetensors, and
    # fingerprint the base by rule 1; they record no Hub id or license
    migrated["files"] = {PEFT_FILE: {"names": "model", "tensors": tensors}}
    migrated["base_model"] = {"hub_id": None, "license": None, **base, "fingerprint_rule": 1}
    return migrated


def _refuse_retired_grids(config: dict[str, Any], version: int, path: Path) -> None:
    # the newest feature an older format cannot hold is named first: it is what the reader must
    # update for
    if version < 5 and _residual_widths(config) - {2}:
        raise ExportError(
            f"{path}: format {version} with 4- or 8-bit ASQ residuals, trained on the symmetric "
            "grid that format 5 replaced with the mid-rise one (docs/adapter-format.md); train and "
            "export it again with this version"
        )
    if version < 4 and _asq_setting(config, "layer_bits"):
        raise ExportError(
            f"{path}: format {version} with per-layer ASQ residual widths "
            f"(kv_compression.layer_bits), which only format 4 and later hold; {_RE_EXPORT}"
        )
    if version < 3 and _asq_setting(config, "rotate_residuals"):
        raise ExportError(
            f"{path}: format {version} with rotated ASQ residuals, which only format 3 and later hold; {_RE_EXPORT}"
        )
    if version == 1 and 2 in _residual_widths(config):
        raise ExportError(
            f"{path}: format 1 with 2-bit ASQ residuals, trained on the three-level 2-bit grid "
            "that format 2 replaced with four levels (docs/adapter-format.md); train and export it "
            "again with this version"
        )


def _asq_setting(config: dict, name: str) -> object:
    """`kv_compression.<name>` of an exported config while ASQ is on; None while it is off."""
    kv = config.get("kv_compression")
    return kv.get(name) if isinstance(kv, dict) and kv.get("enabled") else None


def _residual_widths(config: dict) -> set:
    """The K and V residual widths ASQ stores under an exported config; empty while ASQ is off."""
    kv = config.get("kv_compression")
    if not isinstance(kv, dict) or not kv.get("enabled"):
        return set()
    layers = kv.get("layer_bits") if isinstance(kv.get("layer_bits"), dict) else {}
    pairs = [pair for pair in layers.values() if isinstance(pair, list)]
    return {
        kv.get("quant_bits"),
        kv.get("value_quant_bits") or kv.get("quant_bits"),
        *(b for p in pairs for b in p),
    }


def _check_fields(config: dict[str, Any], path: Path) -> None:
    """Every field the loader reads, in the current format."""
    try:
        GSMConfig.model_validate({key: config[key] for key in GSM_SECTIONS if key in config})
    except ValidationError as err:
        raise ExportError(f"{path}: invalid GSM settings: {_first_error(err)}; {_RE_EXPORT}") from None
    base = config.get("base_model")
    if not isinstance(base, dict):
        raise ExportError(f"{path}: no 'base_model' object (the base the adapter was trained on); {_RE_EXPORT}")
    absent = [key for key in (*BASE_CHECKED, "name_or_path", "fingerprint_rule") if key not in base]
    if absent:
        raise ExportError(f"{path}: base_model lacks {', '.join(absent)}; {_RE_EXPORT}")
    if base["fingerprint_rule"] not in (1, 2) or not isinstance(base["fingerprint"], str):
        raise ExportError(
            f"{path}: base_model.fingerprint_rule {base['fingerprint_rule']!r} with fingerprint "
            f"{base['fingerprint']!r}; rules 1 and 2 exist; {_RE_EXPORT}"
        )
    merged = base.get(MERGED_FIELD)
    if merged is not None and not (isinstance(merged, dict) and isinstance(merged.get("fingerprint"), str)):
        raise ExportError(
            f"{path}: base_model.{MERGED_FIELD} is {merged!r}, not an object with the merged base's "
            f"fingerprint; {_RE_EXPORT}"
        )
    lora = config.get("lora")
    if lora is not None:
        try:
            LoraSettings.model_validate(lora)
        except ValidationError as err:
            raise ExportError(f"{path}: invalid lora block: {_first_error(err, 'lora')}; {_RE_EXPORT}") from None
    if not isinstance(config.get("includes_base_weights", False), bool):
        raise ExportError(
            f"{path}: includes_base_weights is {config['includes_base_weights']!r}, not true or false; {_RE_EXPORT}"
        )
    files = config.get("files")
    if not isinstance(files, dict) or not files:
        raise ExportError(f"{path}: no 'files' object listing the tensor files; {_RE_EXPORT}")
    for name, entry in files.items():
        if name not in TENSOR_FILES:
            raise ExportError(
                f"{path}: files lists {name!r}; an export's tensor files are {', '.join(TENSOR_FILES)}; {_RE_EXPORT}"
            )
        tensors = entry.get("tensors") if isinstance(entry, dict) else None
        well_formed = isinstance(tensors, dict) and all(
            isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape) for shape in tensors.values()
        )
        if not well_formed or entry.get("names") not in NAMINGS:
            raise ExportError(
                f'{path}: files.{name} must be {{"names": "model" or "peft", "tensors": '
                f"{{name: [dims]}}}}; {_RE_EXPORT}"
            )


def _first_error(err: ValidationError, prefix: str = "") -> str:
    first = err.errors()[0]
    where = ".".join(str(part) for part in (prefix, *first["loc"]) if part != "")
    return f"{where}: {first['msg']} (got {first.get('input')!r})"


def read_tensors(folder: str | Path, config: dict[str, Any]) -> ExportTensors:
    """Every tensor file `config` lists, checked against it (names, shapes, finite values), under
    the model's own names."""
    folder = Path(folder)
    result = ExportTensors({}, {})
    for file, entry in sorted(config["files"].items()):
        path = folder / file
        if not path.is_file():
            raise ExportError(
                f"{path}: missing, but {CONFIG_FILE} lists it; the export is incomplete, copy it again or re-export it"
            )
        try:
            with safe_open(str(path), framework="pt") as handle:
                names = handle.keys()  # not a dict
                shapes = {name: list(handle.get_slice(name).get_shape()) for name in names}
            tensors = load_file(str(path))
        except (SafetensorError, OSError) as err:
            raise ExportError(
                f"{path}: not a readable safetensors file ({err}); the file is damaged or "
                "truncated, copy it again or re-export the adapter"
            ) from None
        if shapes != entry["tensors"]:
            differ = sorted(set(shapes) ^ set(entry["tensors"])) or [
                n for n in shapes if shapes[n] != entry["tensors"][n]
            ]
            raise ExportError(
                f"{path}: its tensors do not match the list in {CONFIG_FILE} (first: "
                f"{differ[0]}); the export is damaged, re-export it"
            )
        for name, tensor in tensors.items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise ExportError(
                    f"{path}: tensor {name} holds NaN or infinite values; the run that wrote it "
                    "diverged: export an earlier checkpoint, or train again with a lower lr"
                )
            own = model_name(name) if entry["names"] == "peft" else name
            result.tensors[own] = tensor
            result.files[own] = path
    return result


def read_training_args(folder: str | Path) -> dict[str, Any]:
    """`training_args.json` of an export (`{"recipe": ..., "metrics": ...}`); {} when it has none."""
    path = Path(folder) / ARGS_FILE
    if not path.is_file():
        return {}
    try:
        args = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ExportError(f"{path}: not UTF-8 JSON ({err}); {_RE_EXPORT}") from None
    return args if isinstance(args, dict) else {}


@dataclass(frozen=True)
class Export:
    """An export folder read once (`read_export`): its checked config in the current format, every
    tensor it lists (checked against the config), and its training_args.json ({} without one).
    What loads an export takes this instead of reading the folder again."""

    folder: Path
    config: dict[str, Any]
    tensors: ExportTensors
    training_args: dict[str, Any]


def read_export(folder: str | Path) -> Export:
    """Read and check a local export folder in full (`read_config`, `read_tensors`,
    `read_training_args`), each file once; raises ExportError naming the file and the fix."""
    folder = Path(folder)
    config = read_config(folder)
    return Export(folder, config, read_tensors(folder, config), read_training_args(folder))
