"""The model card (README.md) of an export, built with huggingface_hub's ModelCard / ModelCardData
so that its metadata is what the Hub validates: `base_model` (the base's Hub id),
`base_model_relation`, `library_name`, `license` (the base's), `pipeline_tag`, tags, datasets and
the measured metrics as a `model-index`. The card is a pure function of the export's gsm_config.json
and training_args.json (and the repo id, once published), so that publishing can write it again with
the repo id in its snippet.
"""

from __future__ import annotations

import math
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from gsm_train.config import HUB_PREFIX
from gsm_train.hub_ids import BUILTIN_BASES
from gsm_train.published_bytes import redact_path

LIBRARY = "gsm-train"
_MODULES = ("sparse_attention", "kv_compression", "cross_layer_sharing")
_METRIC_IDS = {"ppl": "perplexity"}  # the Hub's metric id where one exists; other names are gsm-train's own


def _hub_dataset(path: str | None) -> tuple[str, str | None] | None:
    """(dataset id, config) of an `hf://NAME[:CONFIG][@SPLIT]` data path, else None."""
    if not path or not path.startswith(HUB_PREFIX):
        return None
    name, _, config = path.removeprefix(HUB_PREFIX).split("@")[0].partition(":")
    return name, config or None


def _eval_source(recipe: dict[str, Any]) -> str | None:
    data = recipe.get("data") or {}
    source = data.get("eval") or data.get("train") or {}
    return source.get("path")


def _eval_results(recipe: dict[str, Any] | None, metrics: dict[str, Any] | None) -> list[EvalResult]:
    """The finite scalar metrics of the run's final evaluation, on its evaluation text."""
    if not recipe or not metrics:
        return []
    path = _eval_source(recipe) or "unknown"
    dataset, config = _hub_dataset(path) or ("text", None)
    split = "eval" if (recipe.get("data") or {}).get("eval") else "train-held-out"
    return [
        EvalResult(
            task_type="text-generation",
            dataset_type=dataset,
            dataset_name=path,
            dataset_config=config,
            dataset_split=split,
            metric_type=_METRIC_IDS.get(name, name),
            metric_name=name,
            metric_value=float(value),
        )
        for name, value in sorted(metrics.items())
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ]


def card_data(config: dict[str, Any], training_args: dict[str, Any], repo_id: str | None) -> ModelCardData:
    """The card's metadata."""
    base = config["base_model"]
    recipe, metrics = training_args.get("recipe"), training_args.get("metrics")
    results = _eval_results(recipe, metrics)
    data = (recipe or {}).get("data") or {}
    datasets = sorted({d[0] for part in ("train", "eval") if (d := _hub_dataset((data.get(part) or {}).get("path")))})
    tags = ["gsm", "sparse-attention", "kv-cache-compression", LIBRARY] + (
        ["lora", "peft"] if config.get("lora") else []
    )
    return ModelCardData(
        base_model=base.get("hub_id"),
        base_model_relation="adapter" if base.get("hub_id") else None,
        library_name=LIBRARY,
        license=base.get("license"),
        pipeline_tag="text-generation",
        tags=tags,
        datasets=datasets or None,
        model_name=(repo_id or f"GSM adapter for {redact_path(base['name_or_path'])}") if results else None,
        eval_results=results or None,
    )


def _body(config: dict[str, Any], training_args: dict[str, Any], repo_id: str | None) -> list[str]:
    base = config["base_model"]
    name, hub_id = redact_path(base["name_or_path"]), base.get("hub_id")
    recipe, metrics = training_args.get("recipe") or {}, training_args.get("metrics") or {}
    modules = [section for section in _MODULES if config[section].get("enabled")] if config.get("gsm_enabled") else []
    files = config["files"]
    lines = [
        f"# GSM adapter for {hub_id or name}",
        "",
        f"Trained with gsm-train. GSM modules: {', '.join(modules) or 'none (the dense control)'}.",
        "",
        f"- base: `{name}`"
        + (f" (Hub: `{hub_id}`)" if hub_id and hub_id != name else "")
        + f", {base['model_type']}, {base['num_hidden_layers']} layers, weights fingerprint "
        f"`{base['fingerprint'][:16]}` (rule {base['fingerprint_rule']})",
        f"- tensors: {sum(len(entry['tensors']) for entry in files.values())} in {', '.join(sorted(files))}",
    ]
    if name in BUILTIN_BASES:
        lines.append(
            f"- `{name}` is gsm-train's built-in copy of `{hub_id}` (its Q4_1 GGUF, de-quantized); "
            "the "
            "loader below loads that copy, whose weights the fingerprint names"
        )
    if recipe:
        data = (recipe.get("data") or {}).get("train") or {}
        lines += [
            f"- stage: `{recipe.get('stage')}`, steps: {(recipe.get('train') or {}).get('steps')}",
            f"- data: `{data.get('path')}`",
        ]
    scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if scalars:
        lines += ["", "## Metrics", ""]
        lines += [f"On `{_eval_source(recipe)}` at the end of the run.", ""] if recipe else []
        lines += ["| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v:.4g} |" for k, v in sorted(scalars.items())]
    where = repo_id or "PATH/TO/THIS/FOLDER"
    lines += [
        "",
        "## Load",
        "",
        "```python",
        "# pip install gsm-train",
        "from gsm_train import GSMModel",
        "",
        f'gsm = GSMModel.from_pretrained("{where}")  # + the base gsm_config.json names, checked',
        "model, tokenizer = gsm.model, gsm.tokenizer",
        "```",
    ]
    if config.get("lora"):
        lines += [
            "",
            "The LoRA deltas alone are a PEFT adapter (`adapter_config.json`, "
            "`adapter_model.safetensors`): "
            f'`PeftModel.from_pretrained(base, "{where}")` applies them to the base without GSM.',
        ]
    return [*lines, ""]


def build_card(config: dict[str, Any], training_args: dict[str, Any], repo_id: str | None = None) -> str:
    """README.md of an export: metadata front matter, then what it is, its metrics and how to load
    it."""
    text = f"---\n{card_data(config, training_args, repo_id).to_yaml()}\n---\n\n" + "\n".join(
        _body(config, training_args, repo_id)
    )
    ModelCard(text, ignore_metadata_errors=False)  # parses as the Hub's client does, or raises
    return text
