"""The model card (README.md) of an export, built with huggingface_hub's ModelCard / ModelCardData
so that its metadata is what the Hub validates: `base_model` (the base's Hub id),
`base_model_relation`, `library_name`, `license` (the base's), `pipeline_tag`, tags, datasets and
the measured metrics as a `model-index`. Its text says what the adapter is, how to use it (the
snippet of `usage_snippet`, which the README's Python example shows too), the base it was trained
on, the KV cache it saves and its speed where measured, its metrics with their meaning, its intended
use and its limitations. The card is a pure function of the export's gsm_config.json and
training_args.json (and the repo id, once published), so that publishing can write it again with
the repo id in its snippet. It names no folder of the machine that made it: absolute and `~` paths
(a base loaded from a folder, the data) are written as `<local>/NAME` (`published_bytes.redact_path`).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from gsm_train.config.schema import HUB_PREFIX, GSMConfig
from gsm_train.export.adapter_format import FORMAT_VERSION, GSM_SECTIONS, MERGED_FIELD
from gsm_train.export.lora import PEFT_NOTE_KEY
from gsm_train.export.published_bytes import redact_local_paths, redact_path
from gsm_train.models.model_zoo import builtin_weights
from gsm_train.tuning.kv_budget import kv_bytes_ratio

LIBRARY = "gsm-train"
PLACEHOLDER = "PATH/TO/THIS/FOLDER"  # where the snippet loads from before the export has a repo id
_MODULES = {
    "sparse_attention": "a sparse gate head per layer, which picks the keys each query attends to",
    "kv_compression": "a KV cache compressor, which stores past keys and values in fewer bits",
    "cross_layer_sharing": "a cross-layer cache bridge, which derives some layers' K/V from an earlier layer",
}
_METRIC_IDS = {"ppl": "perplexity"}  # the Hub's metric id where one exists; other names are gsm-train's own
# (pattern of a metric name, its label, what it measures); K is the number of keys a query keeps
_METRIC_MEANINGS = (
    (r"ppl", "Perplexity", "perplexity on held-out text with GSM on, as inference runs it (lower is better)"),
    (r"kl", "Gate KL", "KL divergence between the base's attention and the gate's key scores (lower is better)"),
    (
        r"gate_mass_k(\d+)",
        "Gate captured mass",
        "share of the base's attention weight on the K keys the gate keeps (1 = nothing lost)",
    ),
    (
        r"oracle_mass_k(\d+)",
        "Oracle captured mass",
        "the same share for the K keys of highest true attention: the best any choice of K keys gets",
    ),
    (r"recall_ratio_k(\d+)", "Recall ratio", "gate captured mass / oracle captured mass (1 = as good as the best)"),
    (r"eval_tokens", "Evaluation tokens", "tokens the metrics were measured on"),
    (
        r"asq_recon_rel_error",
        "KV reconstruction error",
        "relative error of the compressed K/V blocks (lower is better)",
    ),
    (r"asq_cluster_usage", "Cluster usage", "share of the compressor's prototypes in use"),
    (r"asq_dead_clusters", "Dead clusters", "mean number of prototypes a block does not use"),
    (r"bridge_alpha_mean", "Bridge scale", "mean scale of the cache bridges' contribution"),
    (r"decode_tokens_per_s", "Decode speed", "tokens per second while decoding"),
    (r"decode_speedup", "Decode speed-up", "decode tokens/s over the dense base's on the same machine"),
)
_SPEED_METRICS = ("decode_tokens_per_s", "decode_speedup")
_KV_SEQ_LEN = 4096  # the context the card's KV figure is given at when the recipe names none


def usage_snippet(where: str) -> str:
    """Python that loads the adapter at `where` (a Hub repo id or an export folder) with its base and
    generates with it: the card's usage section and the README's Python example."""
    return "\n".join(
        [
            "# pip install gsm-train",
            "from gsm_train import GSMModel",
            "",
            f'gsm = GSMModel.from_pretrained("{where}")  # the adapter and the base it names, checked',
            "model, tokenizer = gsm.model, gsm.tokenizer",
            'inputs = tokenizer("The capital of France is", return_tensors="pt")',
            "output = model.generate(**inputs, max_new_tokens=20)  # decodes over the GSM cache",
            "print(tokenizer.decode(output[0], skip_special_tokens=True))",
        ]
    )


def metric_meaning(name: str) -> tuple[str, str] | None:
    """(label, what it measures) of a metric gsm-train reports, or None for a name it does not know."""
    for pattern, label, meaning in _METRIC_MEANINGS:
        found = re.fullmatch(pattern, name)
        if found:
            k = f" (K = {found[1]})" if found.groups() else ""
            return label + k, meaning
    return None


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
            metric_name=(metric_meaning(name) or (name, ""))[0],
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
        model_name=(repo_id or f"GSM adapter for {base['name_or_path']}") if results else None,
        eval_results=results or None,
    )


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {
        k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def _about(config: dict[str, Any], base_name: str) -> list[str]:
    on = [section for section in _MODULES if config[section].get("enabled")] if config.get("gsm_enabled") else []
    holds = (
        "It holds the base weights it changed too (`base_weights.safetensors`): loading fetches the base, "
        "checks its weights and replaces those."
        if config.get("includes_base_weights")
        else "It does not hold the base model: loading fetches the base and checks its weights."
    )
    lines = [
        f"A GSM adapter for `{base_name}`, trained with gsm-train: small modules attached to the attention "
        f"layers of the base model. {holds}"
    ]
    lines += (
        ["", *(f"- `{section}`: {_MODULES[section]}" for section in on)]
        if on
        else [
            "",
            "- no GSM module is on: this is the dense control run",
        ]
    )
    if config.get("lora"):
        targets = "`, `".join(config["lora"]["target_modules"])
        lines.append(f"- LoRA deltas (rank {config['lora']['r']}) on the base's `{targets}`")
    return lines


def _usage(config: dict[str, Any], where: str) -> list[str]:
    lines = ["", "## Usage", "", "```python", usage_snippet(where), "```"]
    if config.get("lora"):
        lines += [
            "",
            "The LoRA deltas alone are a PEFT adapter (`adapter_config.json`, `adapter_model.safetensors`): "
            f'`PeftModel.from_pretrained(base, "{where}")` applies them **without the GSM modules** (a dense '
            f"model; PEFT warns of an unexpected key `{PEFT_NOTE_KEY}`), and "
            "`PeftModel.save_pretrained` then writes a copy without them.",
        ]
    return lines


def _base_lines(base: dict[str, Any]) -> list[str]:
    name, hub_id = base["name_or_path"], base.get("hub_id")
    weights = base.get("weights") or builtin_weights(name)  # exports before the field: the built-in's
    lines = [
        "",
        "## Base model",
        "",
        f"- trained on `{name}`"
        + (f" (Hub: `{hub_id}`)" if hub_id and hub_id != name else "")
        + f", {base['model_type']}, {base['num_hidden_layers']} layers",
    ]
    if weights:
        lines.append(
            f"- its weights are **not** the Hub's: they are `{weights['file']}` ({weights['quantization']}, sha256 "
            f"`{weights['sha256'][:16]}...`, from {weights['fetched_from']}) de-quantized to "
            f"{weights['dequantized_to']}; gsm-train loads that copy, and refuses the Hub weights"
        )
    lines.append(
        f"- weights fingerprint `{base['fingerprint'][:16]}` (rule {base['fingerprint_rule']}): loading refuses "
        "a base whose weights differ"
    )
    merged = base.get(MERGED_FIELD)
    if merged:
        lines.append(
            f"- the LoRA deltas (rank {merged['lora']['r']}) are merged into the base weights this export holds; "
            f"the merged base's fingerprint `{merged['fingerprint'][:16]}` is accepted too"
        )
    return lines


def _kv_line(ratio: float, seq_len: int) -> str:
    if ratio == 1:
        change = "the same size: no GSM module changes it"
    elif ratio < 1:
        change = f"{(1 - ratio) * 100:.1f}% smaller"
    else:
        change = f"{(ratio - 1) * 100:.1f}% larger: the gate's keys are cached besides K and V"
    return (
        f"- KV cache: {ratio:.3f} of the base's bf16 cache at {seq_len} tokens of context ({change}), from the settings"
    )


def _kv_and_speed(config: dict[str, Any], recipe: dict[str, Any], metrics: dict[str, float], where: str) -> list[str]:
    base = config["base_model"]
    seq_len = (recipe.get("data") or {}).get("seq_len") or _KV_SEQ_LEN
    dims = {"layers": base["num_hidden_layers"], "kv_heads": base["num_key_value_heads"], "head_dim": base["head_dim"]}
    gsm = GSMConfig.model_validate({key: config[key] for key in GSM_SECTIONS if key in config})
    ratio = kv_bytes_ratio(gsm, dims, seq_len) if gsm.gsm_enabled else 1.0
    lines = [
        "",
        "## KV cache and speed",
        "",
        _kv_line(ratio, seq_len),
    ]
    speed = {name: metrics[name] for name in _SPEED_METRICS if name in metrics}
    if speed:
        lines += [f"- {metric_meaning(name)[0]}: {value:.4g}" for name, value in speed.items()]
    else:
        lines.append(
            "- speed: not measured for this export; `gsm-train generate --adapter "
            f"{where} --compare-dense` measures decode tokens/s against the dense base"
        )
    return lines


def _metric_lines(recipe: dict[str, Any], metrics: dict[str, float]) -> list[str]:
    shown = {k: v for k, v in metrics.items() if k not in _SPEED_METRICS}
    if not shown:
        return []
    lines = ["", "## Metrics", ""]
    lines += [f"On `{_eval_source(recipe)}` at the end of the run.", ""] if recipe else []
    lines += ["| metric | value | meaning |", "|---|---|---|"]
    for name, value in sorted(shown.items()):
        label, meaning = metric_meaning(name) or (name, "")
        lines.append(f"| {label} (`{name}`) | {value:.4g} | {meaning} |")
    return lines


def _training_lines(recipe: dict[str, Any]) -> list[str]:
    if not recipe:
        return []
    data = (recipe.get("data") or {}).get("train") or {}
    return [
        "",
        "## Training",
        "",
        f"- stage: `{recipe.get('stage')}`, steps: {(recipe.get('train') or {}).get('steps')}",
        f"- data: `{data.get('path')}`",
    ]


_USE_AND_LIMITS = [
    "",
    "## Intended use",
    "",
    "Research and evaluation of sparse attention and KV cache compression on this base model: generating "
    "with less KV memory, and measuring what that costs in quality. It inherits the base model's intended "
    "uses, license and risks; it adds no safety tuning.",
    "",
    "## Limitations",
    "",
    "- It applies only to the base named above (the fingerprint check refuses any other weights).",
    "- It needs gsm-train to run: transformers, PEFT and other engines do not apply the GSM modules "
    "(docs/adapter-format.md in gsm-train describes them for other engines).",
    "- The metrics are from the run's own held-out text; quality on other text, longer contexts or "
    "tasks can differ. Beam search is not supported with the GSM cache.",
]


def _title(base: dict[str, Any]) -> str:
    weights = base.get("weights") or builtin_weights(base["name_or_path"])
    copy = f" (de-quantized {weights['quantization']} GGUF)" if weights else ""
    return f"# GSM adapter for {base.get('hub_id') or base['name_or_path']}{copy}"


def _body(config: dict[str, Any], training_args: dict[str, Any], repo_id: str | None) -> list[str]:
    base = config["base_model"]
    recipe, metrics = training_args.get("recipe") or {}, _scalars(training_args.get("metrics") or {})
    where = repo_id or PLACEHOLDER
    files = config["files"]
    lines = [
        _title(base),
        "",
        *_about(config, base["name_or_path"]),
        *_usage(config, where),
        *_base_lines(base),
        *_kv_and_speed(config, recipe, metrics, where),
        *_metric_lines(recipe, metrics),
        *_training_lines(recipe),
        *_USE_AND_LIMITS,
        "",
        "## Files",
        "",
        f"{sum(len(entry['tensors']) for entry in files.values())} tensors in {', '.join(sorted(files))}; "
        "the format: docs/adapter-format.md in gsm-train.",
    ]
    return [*lines, ""]


def build_card(config: dict[str, Any], training_args: dict[str, Any], repo_id: str | None = None) -> str:
    """README.md of an export: metadata front matter, then what it is, its metrics and how to load
    it. It names no local folder: the base's `name_or_path` and every path in `training_args` are
    written as `published_bytes.redact_path` gives them (an absolute or `~` path as `<local>/NAME`)."""
    base = config["base_model"]
    config = {**config, "base_model": {**base, "name_or_path": redact_path(base["name_or_path"])}}
    training_args = redact_local_paths(training_args)
    text = f"---\n{card_data(config, training_args, repo_id).to_yaml()}\n---\n\n" + "\n".join(
        _body(config, training_args, repo_id)
    )
    ModelCard(text, ignore_metadata_errors=False)  # parses as the Hub's client does, or raises
    return text


def card_is_users(card: Path, stored_config: dict[str, Any], training_args: dict[str, Any]) -> bool:
    """Whether an export's README.md `card` was edited after gsm-train wrote it, and so is the user's:
    it exists and differs from the card `build_card` makes of the export's gsm_config.json as stored
    (`stored_config`) and its training_args.json. The card of an export of an earlier format version
    cannot be told apart and counts as gsm-train's; a config the card cannot be built from, as the
    user's."""
    version = stored_config.get("format_version")
    if not card.is_file() or not isinstance(version, int) or version < FORMAT_VERSION:
        return False
    try:
        built = build_card(stored_config, training_args).encode()
    except (KeyError, TypeError, ValueError, AttributeError):
        return True
    return card.read_bytes() != built
