"""`GSMModel`, the PEFT-like face of an export: `from_pretrained(export_or_repo_id)` gives the base
model an export names, with the export's GSM modules (and LoRA deltas) loaded and checked, and its
tokenizer; `save_pretrained` writes the model as it is in memory in the export format (it round-trips
through `from_pretrained`); `push_to_hub` publishes what `save_pretrained` writes; `merge_and_unload`
merges the LoRA deltas into the base weights."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gsm_train.attention import GSMSettings
from gsm_train.export.adapter_format import MERGED_FIELD, read_export
from gsm_train.export.hub import publish_export
from gsm_train.export.hub_download import resolve_export
from gsm_train.export.int4 import FULL, checked_group, quantize_base
from gsm_train.export.lora import merge_lora
from gsm_train.export.save_load import AdapterNames, export_adapter, load_gsm
from gsm_train.inference.cache import DEFAULT_PREFILL, check_prefill
from gsm_train.inference.engine import enable_gsm_generation
from gsm_train.models.fingerprint import base_fingerprint
from gsm_train.models.hub_ids import base_to_load
from gsm_train.models.model_zoo import load_model_and_tokenizer
from gsm_train.modules import GSMError


@dataclass
class GSMModel:
    """A base model with an export's GSM modules attached, its `generate` over a GSM cache, its
    tokenizer, where the export is, which base was loaded, and what the export records (`config`,
    `training_args`), which saving writes again."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    settings: GSMSettings
    folder: Path  # the export folder (a snapshot folder of the Hub cache for a repo id)
    config: dict[str, Any]  # its gsm_config.json, in the current format (updated by merge_and_unload)
    base_name: str  # the base model loaded (`hub_ids.base_to_load` of the config's, or the one given)
    base_revision: str | None  # and its revision
    training_args: dict[str, Any] = field(default_factory=dict)  # its training_args.json (recipe, metrics)
    weights: str = FULL  # the base's weights: as loaded, or 4-bit (gsm_train/export/int4.py)

    @classmethod
    def from_pretrained(
        cls,
        adapter: str | Path,
        *,
        revision: str | None = None,
        base: str | None = None,
        base_revision: str | None = None,
        mode: str = "sparse",
        prefill: str = DEFAULT_PREFILL,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
        weights: str = FULL,
        fused_decode: bool = False,
    ) -> GSMModel:
        """Load the export at `adapter` (a folder, or a Hub repo id at `revision`), the base model
        it names (`gsm_config.json`'s base_model: the built-in or folder it was trained with when
        this machine has it, else its Hub id at its recorded revision; `base` / `base_revision`
        override), and attach the adapter. A base that differs from the one the adapter was trained
        on is refused (ExportError) as by `load_gsm`. `mode`: dense / sparse / oracle main
        attention; `prefill`: how a prompt attends in generation, dense / sparse (`GSMCache`).
        `weights`: `full` (the base as loaded, in `dtype`) or `int4` / `int4-g64` / `int4-g32`: the
        base's linear layers quantized to 4 bits after the adapter is attached and checked, the GSM
        modules (fp32 on any base), embeddings and output head not quantized (gsm_train/export/int4.py; refused before
        anything loads where it cannot run); such a model is not saved. `fused_decode`: on a GPU with
        Triton, each token step runs the layers' RMSNorms, RoPE and SwiGLU as one Triton kernel each
        (`enable_gsm_generation`'s option; off by default).

        The export is read once, in full, before the base loads (`read_export`: a damaged export is
        refused first). The returned model's `generate` decodes over a GSM cache: GSMModel owns
        generation (`inference.engine.enable_gsm_generation`); `load_gsm` alone attaches modules."""
        check_prefill(prefill)
        group = checked_group(weights, device or "cpu", dtype)
        export = read_export(resolve_export(adapter, revision))
        name, recorded_revision = (
            (base, base_revision) if base is not None else base_to_load(export.config["base_model"])
        )
        model, tokenizer = load_model_and_tokenizer(name, revision=recorded_revision, dtype=dtype)
        if device is not None:
            model.to(device)  # before the modules attach: they are built on the model's device
        settings = load_gsm(model, export, mode=mode)
        if group is not None:
            quantize_base(model, group)
        enable_gsm_generation(model, prefill=prefill, fused_decode=fused_decode)  # model.generate: the GSM cache
        return cls(
            model,
            tokenizer,
            settings,
            export.folder,
            export.config,
            name,
            recorded_revision,
            export.training_args,
            weights,
        )

    def save_pretrained(self, save_directory: str | Path) -> Path:
        """Write the model as it is in memory (its GSM tensors, LoRA deltas and, after
        `merge_and_unload`, the merged weights) as an export folder (docs/adapter-format.md), with
        the base description, recipe and metrics of the export it was loaded from; returns the
        folder. `GSMModel.from_pretrained` of it gives the same logits. The folder must be new,
        empty or a previous export (`export.export_destination`). Refused for a 4-bit base."""
        self._refuse_quantized("save_pretrained")
        base = self.config["base_model"]
        state = self._saved_state()
        names = AdapterNames.of(self.model)
        return export_adapter(
            self.model,
            save_directory,
            base_name=base["name_or_path"],
            base_revision=base.get("revision"),
            recipe=self.training_args.get("recipe"),
            metrics=self.training_args.get("metrics"),
            lora=self.config.get("lora"),
            include_base=any(name not in names for name in state),
            state=state,
            base_model=base,
        )

    def _saved_state(self) -> dict[str, torch.Tensor]:
        """The tensors an export of the model holds: its GSM tensors and LoRA deltas, the base
        tensors the export it came from held (all of them for a base trained in full) and the
        weights `merge_and_unload` merged."""
        state = self.model.state_dict()
        names = AdapterNames.of(self.model)
        listed = {name for entry in self.config["files"].values() for name in entry["tensors"]}
        merged = self.config["base_model"].get(MERGED_FIELD) or {}
        wanted = names.gsm | names.lora | ((listed | set(merged.get("weights", ()))) & state.keys())
        return {name: tensor for name, tensor in state.items() if name in wanted}

    def _refuse_quantized(self, action: str) -> None:
        """GSMError where the base is quantized: an export holds the adapter over the base as trained,
        never a quantized copy of the base (nor LoRA deltas merged into one)."""
        if self.weights != FULL:
            raise GSMError(
                f"{action}: this model's base is quantized (weights={self.weights!r}) and its LoRA deltas, if "
                "any, are merged into it; an export holds the adapter over the base as trained, never a "
                f"quantized base. Fix: GSMModel.from_pretrained({str(self.folder)!r}) (weights='full'), then {action}"
            )

    def merge_and_unload(self) -> GSMModel:
        """Merge the LoRA deltas into the base's weights and remove the LoRA layers (as peft's
        `merge_and_unload`), in place; returns this GSMModel. The model computes what it computed, up
        to rounding in the weights' dtype. Its `config` then records the merge (`base_model.merged_lora`:
        the LoRA settings, the merged weights' names and the merged base's fingerprint) and no LoRA:
        `save_pretrained` writes the merged weights to base_weights.safetensors, and loading accepts
        either the base as trained or a base with these deltas merged. Raises GSMError for an adapter
        without LoRA deltas, and for a 4-bit base."""
        self._refuse_quantized("merge_and_unload")
        lora = self.config.get("lora")
        if not lora:
            raise GSMError(
                f"{self.folder}: this adapter has no LoRA deltas to merge (its gsm_config.json lora is null)"
            )
        weights = merge_lora(self.model)
        names = AdapterNames.of(self.model)
        base = self.config["base_model"]
        merged_state = {name: t for name, t in self.model.state_dict().items() if name not in names}
        record = {
            "lora": lora,
            "weights": sorted(weights),
            "fingerprint": base_fingerprint(merged_state, base["fingerprint_rule"]),
        }
        self.config = {**self.config, "lora": None, "base_model": {**base, MERGED_FIELD: record}}
        return self

    def push_to_hub(
        self,
        repo_id: str,
        *,
        revision: str | None = None,
        private: bool = False,
        token: str | None = None,
        endpoint: str | None = None,
        commit_message: str | None = None,
        base_model_id: str | None = None,
    ) -> str:
        """Publish the model as it is in memory to `repo_id` in one commit (gsm_train/export/hub.py): it is
        saved with `save_pretrained` to a temporary folder, which is uploaded and removed. Returns
        the commit URL."""
        with tempfile.TemporaryDirectory(prefix="gsm-push-") as tmp:
            return publish_export(
                self.save_pretrained(Path(tmp) / "export"),
                repo_id,
                private=private,
                revision=revision,
                token=token,
                endpoint=endpoint,
                commit_message=commit_message,
                base_model_id=base_model_id,
            )
