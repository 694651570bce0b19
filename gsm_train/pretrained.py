"""`GSMModel.from_pretrained(export_or_repo_id)`: the base model an export names, with the export's
GSM modules (and LoRA deltas) loaded and checked, and its tokenizer; `push_to_hub` publishes the
export it came from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gsm_train.adapter_format import read_config
from gsm_train.attention import GSMSettings
from gsm_train.export import load_gsm
from gsm_train.hub import publish_export
from gsm_train.hub_download import resolve_export
from gsm_train.hub_ids import base_to_load
from gsm_train.inference.cache import DEFAULT_PREFILL
from gsm_train.model_zoo import load_model_and_tokenizer


@dataclass
class GSMModel:
    """A base model with an export's GSM modules attached, its tokenizer, and where the export
    is."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    settings: GSMSettings
    folder: Path  # the export folder (a snapshot folder of the Hub cache for a repo id)
    config: dict[str, Any]  # its gsm_config.json, in the current format

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
    ) -> GSMModel:
        """Load the export at `adapter` (a folder, or a Hub repo id at `revision`), the base model
        it names (`gsm_config.json`'s base_model: the built-in or folder it was trained with when
        this machine has it, else its Hub id at its recorded revision; `base` / `base_revision`
        override), and attach the adapter. A base that differs from the one the adapter was trained
        on is refused (ExportError) as by `load_gsm`. `mode`: dense / sparse / oracle main
        attention; `prefill`: how a prompt attends in generation, dense / sparse (`load_gsm`)."""
        folder = resolve_export(adapter, revision)
        config = read_config(folder)
        name, recorded_revision = (base, base_revision) if base is not None else base_to_load(config["base_model"])
        model, tokenizer = load_model_and_tokenizer(name, revision=recorded_revision, dtype=dtype)
        if device is not None:
            model.to(device)  # before the modules attach: they are built on the model's device
        settings = load_gsm(model, folder, mode=mode, prefill=prefill)
        return cls(model, tokenizer, settings, folder, config)

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
        """Publish the export this model was loaded from to `repo_id` (gsm_train/hub.py); returns
        the commit URL."""
        return publish_export(
            self.folder,
            repo_id,
            private=private,
            revision=revision,
            token=token,
            endpoint=endpoint,
            commit_message=commit_message,
            base_model_id=base_model_id,
        )
