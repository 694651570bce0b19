"""Adapter export and loading: what users take away from a run (see docs/adapter-format.md).

An export folder holds `gsm_modules.safetensors` (the GSM tensors, full tensors gathered from FSDP
shards), the LoRA deltas (if any) as a PEFT adapter (`adapter_config.json` and
`adapter_model.safetensors`), the base weights (only for a base trained in full) in
`base_weights.safetensors`, `gsm_config.json` (the GSM settings, the base model's identity and every
file's tensors), a `README.md` model card and `training_args.json`. Rank 0 writes it beside the
destination and renames it into place (gsm_train/export/export_folder.py); nothing but a previous export is
ever replaced.

`load_gsm` is atomic: it reads the export once (`adapter_format.read_export`: config, tensors, finite
values) and checks it (the base model, every tensor's name and shape against the modules the config
builds on a meta-device skeleton) before it changes the model; a refused export leaves the model as it
was. It attaches modules and tensors only; generation over a GSM cache is `GSMModel`'s (or an explicit
`inference.engine.enable_gsm_generation`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM, PretrainedConfig

from gsm_train.attention import GSMSettings, configure_gsm, gsm_settings, gsm_state_dict, has_gsm, inject_gsm
from gsm_train.config.schema import GSMConfig, LoraSettings
from gsm_train.export.adapter_format import (
    ARGS_FILE,
    BASE_CHECKED,
    BASE_FILE,
    CARD_FILE,
    CONFIG_FILE,
    FORMAT,
    FORMAT_VERSION,
    GSM_FILE,
    GSM_SECTIONS,
    MERGED_FIELD,
    PEFT_FILE,
    Export,
    ExportError,
    ExportTensors,
    read_export,
)
from gsm_train.export.export_folder import export_destination, write_export_folder
from gsm_train.export.hub_download import resolve_export
from gsm_train.export.lora import inject_lora, lora_parameters, peft_base_name, peft_name, write_peft_config
from gsm_train.export.model_card import build_card
from gsm_train.export.published_bytes import redact_local_paths, save_reproducible
from gsm_train.models.fingerprint import FINGERPRINT_RULE, base_fingerprint
from gsm_train.models.hub_ids import base_identity
from gsm_train.models.model_zoo import builtin_weights
from gsm_train.modules import GSMError

__all__ = [
    "ExportError",
    "check_base",
    "export_adapter",
    "export_destination",
    "load_gsm",
    "load_tensors",
    "read_export",
]


@dataclass(frozen=True)
class AdapterNames:
    """The names (as the model's state dict has them) of a model's GSM tensors and LoRA deltas, found
    by module type (`modules.gsm_state_dict`, `lora.lora_parameters`)."""

    gsm: frozenset[str]
    lora: frozenset[str]

    @classmethod
    def of(cls, model: nn.Module) -> AdapterNames:
        return cls(frozenset(gsm_state_dict(model)), frozenset(name for name, _ in lora_parameters(model)))

    def __contains__(self, name: str) -> bool:
        """Whether `name` is an adapter tensor (GSM or LoRA): what an export always holds."""
        return name in self.gsm or name in self.lora


def base_description(model: nn.Module, fingerprint: str, name: str, revision: str | None) -> dict:
    """What a loader checks the base model against, and where the base comes from (its Hub id and
    license where they can be known: gsm_train/models/hub_ids.py; for a built-in whose weights differ from
    its Hub original, which weights they are: `model_zoo.builtin_weights`)."""
    cfg = model.config
    heads = cfg.num_attention_heads
    identity = base_identity(name, revision) if name else {"hub_id": None, "revision": revision, "license": None}
    weights = builtin_weights(name)
    return {
        "name_or_path": name,
        "revision": identity["revision"] or revision,
        "hub_id": identity["hub_id"],
        "license": identity["license"],
        **({"weights": weights} if weights else {}),
        "model_type": cfg.model_type,
        "architectures": list(getattr(cfg, "architectures", None) or [type(model).__name__]),
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "vocab_size": cfg.vocab_size,
        "fingerprint": fingerprint,
        "fingerprint_rule": FINGERPRINT_RULE,
    }


def _split_files(tensors: dict[str, Tensor], names: AdapterNames) -> dict[str, dict[str, Tensor]]:
    """The export's tensor files and their tensors under the names each file uses (PEFT's for
    LoRA)."""
    files = {
        GSM_FILE: {n: t for n, t in tensors.items() if n in names.gsm},
        PEFT_FILE: {peft_name(n): t for n, t in tensors.items() if n in names.lora},
        BASE_FILE: {n: t for n, t in tensors.items() if n not in names},
    }
    return {file: content for file, content in files.items() if content or file == GSM_FILE}


def _refuse_non_finite(tensors: dict[str, Tensor], out_dir: Path) -> None:
    bad = sorted(n for n, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all()))
    if bad:
        raise ExportError(
            f"{out_dir}: refusing to export {len(bad)} tensors holding NaN or infinite values "
            f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}); the run diverged: export an "
            "earlier checkpoint, or train again with a lower lr"
        )


def _export_config(
    gsm: dict, base: dict, lora: dict | None, include_base: bool, files: dict[str, dict[str, Tensor]]
) -> dict:
    """`gsm_config.json`'s content: the format, the GSM settings (`gsm`, as JSON), the base model's
    description, the LoRA settings, and each file's tensor names and shapes."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        **gsm,
        "base_model": base,
        "lora": lora,
        "includes_base_weights": include_base,
        "files": {
            file: {
                "names": "peft" if file == PEFT_FILE else "model",
                "tensors": {n: list(t.shape) for n, t in sorted(content.items())},
            }
            for file, content in files.items()
        },
    }


def export_adapter(
    model: nn.Module,
    out_dir: str | Path,
    *,
    base_name: str,
    base_revision: str | None = None,
    recipe: dict | None = None,
    metrics: dict | None = None,
    lora: dict | None = None,
    include_base: bool = False,
    is_main: bool = True,
    state: dict[str, Tensor] | None = None,
    base_model: dict | None = None,
) -> Path:
    """Write the export (collective under FSDP: every rank calls it; rank 0 writes). Returns the
    folder (resolved, on rank 0).

    The export holds the GSM tensors and LoRA deltas (`lora`: the LoRA settings, if the base was
    trained with LoRA); the base weights only with `include_base` (a base trained in full). `state`:
    the model's full state dict on rank 0 when the caller gathered it (the training backend);
    otherwise it is gathered here from FSDP2 shards. `base_model`: the base's description as an
    export recorded it (a model loaded from an export and saved again keeps it); by default it is
    described from the model, `base_name` and `base_revision`. Refuses (ExportError, nothing written) a
    destination that holds anything but a previous export, and tensors that are not finite.
    """
    if state is None:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_main:
        return Path(out_dir)
    destination = export_destination(out_dir)
    names = AdapterNames.of(model)
    tensors = {name: t.detach().contiguous() for name, t in state.items() if include_base or name in names}
    _refuse_non_finite(tensors, destination)
    settings = gsm_settings(model)
    files = _split_files(tensors, names)
    base = base_model or base_description(model, settings.base_fingerprint, base_name, base_revision)
    config = _export_config(settings.config.model_dump(mode="json"), base, lora, include_base, files)
    training_args = redact_local_paths(json.loads(json.dumps({"recipe": recipe, "metrics": metrics}, default=float)))

    def write(folder: Path) -> None:
        metadata = {"format": FORMAT, "format_version": str(FORMAT_VERSION)}
        for file, content in files.items():
            save_reproducible(content, folder / file, metadata)
        if lora:
            write_peft_config(
                folder,
                LoraSettings.model_validate(lora),
                peft_base_name(base),
                base["revision"],
            )
        (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
        (folder / ARGS_FILE).write_text(json.dumps(training_args, indent=2, sort_keys=True))
        (folder / CARD_FILE).write_text(build_card(config, training_args))

    return write_export_folder(destination, write)


def check_base(config: dict, model: nn.Module, adapter_dir: str | Path) -> None:
    """Refuse a fresh base model that differs from the one the export was trained on (by the
    fingerprint rule the export records)."""
    expected = config["base_model"]
    rule = expected.get("fingerprint_rule", FINGERPRINT_RULE)
    actual = base_description(model, base_fingerprint(model.state_dict(), rule), "", None)
    merged = expected.get(MERGED_FIELD) or {}
    mismatches = [
        f"{k}: adapter {expected.get(k)!r}, model {actual.get(k)!r}"
        + (f" (nor the merged base's {merged['fingerprint']!r})" if k == "fingerprint" and merged else "")
        for k in BASE_CHECKED
        if expected.get(k) != actual.get(k) and not (k == "fingerprint" and merged.get("fingerprint") == actual[k])
    ]
    if mismatches:
        raise ExportError(
            f"{adapter_dir} was trained on {expected['name_or_path']!r}, which differs from this "
            f"model: {'; '.join(mismatches)}. Load the adapter onto that base model"
            + (" (or onto that base with the export's LoRA deltas merged)" if merged else "")
        )


def build_settings(config: dict) -> tuple[GSMConfig, GSMConfig]:
    """(the GSM settings as trained, the same with gates built at random: their tensors come from
    the export)."""
    gsm = GSMConfig.model_validate({k: config[k] for k in GSM_SECTIONS if k in config})
    sparse = gsm.sparse_attention.model_copy(update={"gate_init": "random"})
    return gsm, gsm.model_copy(update={"sparse_attention": sparse})


def skeleton_state(
    model_config: PretrainedConfig, build: GSMConfig, lora: LoraSettings | None
) -> tuple[dict[str, Tensor], AdapterNames]:
    """The state dict (meta tensors: names, shapes, dtypes) a model of `model_config` would have
    after `build` and `lora` were attached, and its adapter tensors' names, computed on a skeleton
    of its architecture (no weights are loaded or allocated)."""
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(copy.deepcopy(model_config))
    inject_gsm(skeleton, build)
    if lora is not None:
        inject_lora(skeleton, lora)
    return skeleton.state_dict(), AdapterNames.of(skeleton)


def _check_fit(
    loaded: ExportTensors,
    planned: dict[str, Tensor],
    required: Callable[[str], bool],
    allow_unexpected: bool,
    folder: Path,
) -> None:
    """Every planned tensor `required` accepts is in the export, and every export tensor fits its
    planned place (shape and kind); unless `allow_unexpected`, every export tensor has one."""
    missing = [name for name in planned if required(name) and name not in loaded.tensors]
    if missing:
        raise ExportError(
            f"{folder}: lacks {len(missing)} tensors that the modules built from {CONFIG_FILE} "
            f"need ({', '.join(missing[:3])}); the export is damaged, re-export it"
        )
    for name, tensor in loaded.tensors.items():
        place = planned.get(name)
        if place is None:
            if allow_unexpected:
                continue
            raise ExportError(
                f"{loaded.files[name]}: tensor {name} has no place in the modules built from "
                f"{CONFIG_FILE}; the export is damaged, re-export it"
            )
        if tensor.shape != place.shape or tensor.is_floating_point() != place.is_floating_point():
            raise ExportError(
                f"{loaded.files[name]}: tensor {name} is {list(tensor.shape)} {tensor.dtype}, but "
                f"the modules built from {CONFIG_FILE} need {list(place.shape)} {place.dtype}; the "
                "export is damaged, re-export it"
            )


def load_tensors(
    model: nn.Module,
    export: Export,
    required: Callable[[str], bool],
    allow_unexpected: bool = False,
) -> list[str]:
    """Load `export`'s tensors (read by `read_export`) into `model`, which already has its modules;
    every model tensor `required` accepts must be in the export, every export tensor must fit the
    model's (and, unless `allow_unexpected`, exist in it). Checked before anything is copied. Returns
    the export tensors the model has no place for."""
    state = model.state_dict()
    _check_fit(export.tensors, state, required, allow_unexpected, export.folder)
    model.load_state_dict({n: t for n, t in export.tensors.tensors.items() if n in state}, strict=False)
    return [name for name in export.tensors.tensors if name not in state]


def load_gsm(
    model: nn.Module,
    adapter: str | Path | Export,
    mode: str = "sparse",
    revision: str | None = None,
) -> GSMSettings:
    """Attach an export's GSM modules (and LoRA deltas, and base weights if exported) to `model`, a
    fresh base, and load their tensors exactly. `adapter`: an `Export` already read (`read_export`),
    an export folder, or a Hub repo id (fetched at `revision`, see gsm_train/export/hub_download.py); the
    folder is read once.

    Only modules and tensors change: the model keeps its class's `forward` and `generate` (training
    stages start from exports this way). `GSMModel.from_pretrained` is what generates over a GSM
    cache; after `load_gsm`, `inference.engine.enable_gsm_generation(model)` does the same.

    Refuses a base that differs from the one the adapter was trained on (architecture, dims, weights
    fingerprint), and any damaged export, before changing `model`. `mode` sets how main attention
    runs (dense / sparse / oracle).
    """
    if has_gsm(model):
        raise GSMError("this model already has GSM modules; load the adapter onto a fresh base model")
    if isinstance(adapter, Export):
        if revision is not None:
            raise ExportError(f"{adapter.folder}: already read, but a revision ({revision!r}) was given; drop it")
        export = adapter
    else:
        export = read_export(resolve_export(adapter, revision))
    check_base(export.config, model, export.folder)
    gsm, build = build_settings(export.config)
    lora = LoraSettings.model_validate(export.config["lora"]) if export.config.get("lora") else None
    planned, names = skeleton_state(model.config, build, lora)
    _check_fit(export.tensors, planned, names.__contains__, False, export.folder)
    inject_gsm(model, build, mode=mode)
    settings = configure_gsm(model, config=gsm)
    if lora is not None:
        inject_lora(model, lora)
    model.load_state_dict(export.tensors.tensors, strict=False)
    refuse_plain_save(model)
    return settings


PLAIN_SAVE_REFUSED = (
    "this model carries GSM modules (and LoRA layers, if the adapter has them), which transformers' "
    "save_pretrained writes under names a plain reload drops: the folder would load with freshly "
    "initialised projections and no GSM. Fix: save the adapter with GSMModel.save_pretrained(FOLDER) "
    "(gsm_train.GSMModel), which GSMModel.from_pretrained(FOLDER) loads back"
)


def refuse_plain_save(model: nn.Module) -> None:
    """Make `model.save_pretrained` (and so transformers' `push_to_hub`) raise GSMError
    `PLAIN_SAVE_REFUSED` instead of writing a folder that reloads without the adapter."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise GSMError(PLAIN_SAVE_REFUSED)

    model.save_pretrained = refuse
