"""`gsm-train eval`: perplexity in non-overlapping windows with GSM active exactly as inference runs it
(gate-selected sparse attention, compressed K/V blocks, bridge), for the base model and each export,
with the KV bytes per token against bf16 and the gate's captured attention mass. Writes JSON and a
markdown table."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import Tensor, nn
from tqdm.auto import tqdm

from gsm_train.attention import GSMSettings, configure_gsm, gsm_collect
from gsm_train.commands.inspect_model import layer_reports
from gsm_train.config.schema import (
    ConfigError,
    GSMConfig,
    Problem,
    SparseAttentionConfig,
    check_positions,
    format_problems,
    sparse_layer_problems,
)
from gsm_train.data.text import load_text_dataset, pack_tokens
from gsm_train.export.adapter_format import GSM_SECTIONS, Export, ExportError, read_export
from gsm_train.export.hub_download import resolve_export
from gsm_train.export.int4 import FULL, checked_group, group_size, quantize_base
from gsm_train.export.save_load import load_gsm
from gsm_train.functional.attention_targets import MASS_SUMS
from gsm_train.functional.top_k import forced_keys, scheduled_k
from gsm_train.models.families import attention_modules, config_dims
from gsm_train.models.hub_ids import base_to_load
from gsm_train.models.model_zoo import load_model_and_tokenizer, read_model_config
from gsm_train.training.distributed import cuda_wanted

BASE = "base"


def _device_and_dtype() -> tuple[torch.device, torch.dtype]:
    if cuda_wanted():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def inference_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA (the evaluation's models are bf16 there, their GSM modules may be
    fp32), nothing elsewhere."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def position_buckets(seq_len: int, first: int = 2048) -> list[tuple[int, int]]:
    """Query-position buckets [start, stop) of a window: [0, first), [first, 2 first),
    [2 first, 4 first), ..., the last one cut at `seq_len` (8192 from 2048: 0-2k, 2k-4k, 4k-8k)."""
    buckets, stop = [(0, min(first, seq_len))], first
    while stop < seq_len:
        buckets.append((stop, min(2 * stop, seq_len)))
        stop *= 2
    return buckets


def token_losses(model: nn.Module, batch: Tensor) -> Tensor:
    """Next-token NLL [B, T - 1] of `batch` [B, T] from the logits (fp32; fp64 for an fp64 model):
    entry t is the loss of token t + 1, predicted at position t. Their mean is the model's loss."""
    logits = model(input_ids=batch, use_cache=False).logits[:, :-1]
    logits = logits if logits.dtype == torch.float64 else logits.float()
    losses = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="none")
    return losses.view(batch.shape[0], -1)


@torch.no_grad()
def perplexity_and_recall(
    model: nn.Module,
    rows: Tensor,
    batch_size: int,
    recall: tuple[int | None, int] | None,
    buckets: list[tuple[int, int]] | None = None,
    label: str | None = None,
) -> dict[str, Any]:
    """Perplexity over all predicted tokens of `rows` [N, T] (with `label`, a progress bar of that name
    over the windows on stderr); with `recall` (k, min_keys) on a GSM
    model, the gate's and the oracle's captured attention mass too (k None: at each query's k of the
    top-k schedule).

    `buckets`: query-position buckets (`position_buckets`; default one for the whole window),
    each with the same figures over its queries and the tokens they predict (the token at t + 1
    belongs to position t's bucket). Sums are fp64, and the window's figures are the sums of the
    buckets', so the token-weighted bucket NLLs add up to the window's exactly."""
    device = next(model.parameters()).device
    buckets = buckets or [(0, rows.shape[1])]
    starts = [start for start, _ in buckets]
    positions = torch.arange(rows.shape[1] - 1)
    bucket_of = torch.searchsorted(torch.tensor(starts), positions, right=True) - 1
    nll = torch.zeros(len(buckets), dtype=torch.float64)
    tokens = torch.zeros(len(buckets), dtype=torch.float64)
    mass = torch.zeros(3, len(buckets), dtype=torch.float64)  # gate, oracle, queries
    autocast = inference_autocast(device)
    bar = tqdm(total=len(rows), desc=label, unit="window", disable=label is None, dynamic_ncols=True)
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size].to(device)
        bar.update(len(batch))
        collect = (
            gsm_collect(model, recall=recall, recall_buckets=starts) if recall is not None else contextlib.nullcontext()
        )
        with autocast, collect as records:
            losses = token_losses(model, batch).double().sum(0).cpu()  # per position, over rows
        nll.index_add_(0, bucket_of, losses)
        tokens.index_add_(0, bucket_of, torch.full_like(losses, batch.shape[0]))
        sums = records.captured_mass_total() if records is not None else None
        if sums is not None:
            mass += torch.stack([sums[f"{key}_by_bucket"] for key in MASS_SUMS]).cpu()
    bar.close()
    parts = [
        {
            "start": a,
            "stop": b,
            "tokens": int(tokens[i]),
            "nll": float(nll[i]),
            "ppl": math.exp(nll[i] / tokens[i]) if tokens[i] else float("nan"),
            **_mass_figures(mass[:, i], recall),
        }
        for i, (a, b) in enumerate(buckets)
    ]
    return {
        "ppl": math.exp(nll.sum() / tokens.sum()),
        "tokens": int(tokens.sum()),
        "nll": float(nll.sum()),
        **_mass_figures(mass.sum(1), recall),
        "buckets": parts,
    }


def _mass_figures(sums: Tensor, recall: tuple[int | None, int] | None) -> dict[str, float]:
    """The gate's and the oracle's captured mass per counted query and their ratio, from fp64 sums
    (gate, oracle, queries); nothing without recall or without counted queries."""
    if recall is None or sums[2] == 0:
        return {}
    return {
        "gate_mass": float(sums[0] / sums[2]),
        "oracle_mass": float(sums[1] / sums[2]),
        "recall_ratio": float(sums[0] / sums[1]),
        "queries": int(sums[2]),
    }


def kv_bytes_report(model: nn.Module, settings: GSMSettings, seq_len: int) -> dict[str, float]:
    """KV cache bytes per token with GSM, bf16 without, and their ratio (gate keys included)."""
    rows = layer_reports(model, settings.config, seq_len)
    base, gsm = sum(r.base_bytes for r in rows), sum(r.gsm_bytes for r in rows)
    return {"kv_bytes_per_token": gsm, "kv_bytes_per_token_bf16": base, "kv_bytes_ratio": gsm / base}


def keys_read_share(model: nn.Module, settings: GSMSettings | None, position: int) -> float:
    """The share of the keys visible at `position` that main attention reads there, over all layers: a layer
    that selects (sparse or oracle mode) reads its k there and every key it forces (`top_k.forced_keys`), at
    most all; a dense layer, a retrieval layer, a model in dense mode or without GSM (`settings` None or
    disabled) reads all of them. The cost of retrieval layers against the selection they replace."""
    visible = position + 1
    if settings is None or not settings.enabled:
        return 1.0
    sparse = settings.config.sparse_attention
    at = torch.tensor([position])
    forced = int(forced_keys(at, torch.arange(visible), sparse.sink_tokens, sparse.recent_tokens).sum())
    selected = min(visible, max(int(scheduled_k(at, sparse)[0]), forced))
    layers = attention_modules(model)
    read = sum(
        visible if getattr(layer, "gsm", None) is None or layer.gsm.attention_mode(settings) == "dense" else selected
        for layer in layers
    )
    return read / (len(layers) * visible)


# the sparse_attention fields an evaluation may change on an export: which keys are kept, nothing
# that was trained
SELECTION_FIELDS = (
    "top_k_schedule",
    "top_k",
    "k_min",
    "decay_rate",
    "top_k_fraction",
    "sink_tokens",
    "recent_tokens",
    "query_chunk",
    "retrieval_layers",
)


def with_selection(config: GSMConfig, changes: dict[str, Any], source: str) -> GSMConfig:
    """`config` with the `SELECTION_FIELDS` in `changes` replaced (e.g. a wider top-k for long
    texts), checked as a recipe's; raises ConfigError from `source` naming field, value and fix."""
    other = sorted(set(changes) - set(SELECTION_FIELDS))
    if other:
        raise ConfigError(
            source,
            [
                Problem(
                    f"gsm.sparse_attention.{other[0]}",
                    changes[other[0]],
                    "evaluation can change only the selection of a trained export",
                    f"change one of {', '.join(SELECTION_FIELDS)}",
                )
            ],
        )
    try:
        sparse = SparseAttentionConfig.model_validate({**config.sparse_attention.model_dump(), **changes})
    except ValidationError as err:
        problems = [
            Problem("gsm.sparse_attention" + ("" if p.path == "<recipe>" else f".{p.path}"), p.value, p.message, p.fix)
            for p in format_problems(err)
        ]
        raise ConfigError(source, problems) from None
    return config.model_copy(update={"sparse_attention": sparse})


def _gsm_config(export_config: dict[str, Any]) -> GSMConfig:
    """The GSM block of an export's checked `gsm_config.json`."""
    return GSMConfig.model_validate({key: export_config[key] for key in GSM_SECTIONS if key in export_config})


@dataclass
class Evaluated:
    """One model of an evaluation: the base (`settings` None) or an export's GSM model as inference
    runs it (`settings.enabled` False for a dense control), on the evaluation device."""

    name: str
    model: nn.Module
    settings: GSMSettings | None
    export: str | None


@dataclass
class Evaluation:
    """The models an evaluation compares, loaded one at a time (`models`); the base's tokenizer."""

    model_name: str
    revision: str | None
    read: dict[str, Export]  # each export, read once (`read_export`) before any model loads
    exports: dict[str, str]
    changed: dict[str, GSMConfig]
    mode: str
    kv_baseline: str | None
    tokenizer: Any = None
    weights: str = FULL  # the base's weights in every model: as loaded, or 4-bit (gsm_train/export/int4.py)
    calibrate: Callable[[nn.Module], None] | None = None  # 4-bit: AWQ's calibration forwards (`quantize_base`)

    def check_positions(self, source: str, option: str, tokens: int) -> None:
        """Refuse sequences of `tokens` beyond the base model's positions (ConfigError naming
        `option`), from its config, before any model loads."""
        model_config = read_model_config(self.model_name, revision=self.revision)
        check_positions(source, option, tokens, tokens, config_dims(model_config)["context"])

    def models(self) -> Iterator[Evaluated]:
        """The base, then each export on a fresh copy of it, each loaded when asked for."""
        for name in (BASE, *self.read):
            yield self.load(name)

    def load(self, name: str) -> Evaluated:
        """The base (`BASE`) or the export `name` on a fresh base, on the evaluation device (its
        linears quantized after the adapter is attached where `weights` says so)."""
        device, dtype = _device_and_dtype()
        model, self.tokenizer = load_model_and_tokenizer(self.model_name, revision=self.revision, dtype=dtype)
        settings = None
        if name != BASE:
            load_gsm(model, self.read[name], mode=self.mode)
            changes = {"config": self.changed[name]} if name in self.changed else {}
            settings = configure_gsm(model, kv_baseline=self.kv_baseline, **changes)
        model.to(device).eval()
        group = group_size(self.weights)
        if group is not None:
            quantize_base(model, group, self.calibrate)
        return Evaluated(name, model, settings, self.exports.get(name))


def prepare_evaluation(
    model_name: str | None,
    exports: dict[str, str],
    mode: str,
    kv_baseline: str | None = None,
    selection: dict[str, Any] | None = None,
    selections: dict[str, dict[str, Any]] | None = None,
    weights: str = FULL,
    calibrate: Callable[[nn.Module], None] | None = None,
) -> Evaluation:
    """Read and check every export in full (name -> folder or Hub repo id; each read once, here) and
    the selection changes before any model loads: `selection` for every export, `selections` per
    export name (over `selection`).
    `model_name` None: the base the first export names (gsm_train/models/hub_ids.py, `base_to_load`);
    every export must have been trained on it. `weights`: the base's weights (gsm_train/export/int4.py), a
    4-bit base refused here where it cannot run; `calibrate`: AWQ's calibration forwards for it."""
    checked_group(weights, *_device_and_dtype())
    unknown = sorted(set(selections or {}) - set(exports))
    if unknown:
        raise ExportError(
            f"--select {unknown[0]}.FIELD=VALUE names no export (the exports: {', '.join(exports) or 'none'}); "
            "give the NAME of an --export NAME=FOLDER, or FIELD=VALUE for every export"
        )
    read = {name: read_export(resolve_export(adapter)) for name, adapter in exports.items()}
    changes = {name: (selection or {}) | (selections or {}).get(name, {}) for name in exports}
    changed = {
        name: with_selection(_gsm_config(read[name].config), change, f"--export {name}")
        for name, change in changes.items()
        if change
    }
    revision = None
    if model_name is None:
        if not read:
            raise ExportError("eval needs a model: give --export NAME=FOLDER (whose base it loads) or --model")
        model_name, revision = base_to_load(next(iter(read.values())).config["base_model"])
    _check_layers(changed, model_name, revision)
    return Evaluation(
        model_name, revision, read, dict(exports), changed, mode, kv_baseline, weights=weights, calibrate=calibrate
    )


def _check_layers(changed: dict[str, GSMConfig], model_name: str, revision: str | None) -> None:
    """Refuse changed selections naming layers the base does not have (ConfigError), from its config alone."""
    if not any(config.sparse_attention.retrieval_layers for config in changed.values()):
        return
    layers = config_dims(read_model_config(model_name, revision=revision))["layers"]
    for name, config in changed.items():
        problems = sparse_layer_problems(config.sparse_attention, layers)
        if problems:
            raise ConfigError(f"--export {name}", problems)


def evaluate_exports(
    model_name: str | None,
    exports: dict[str, str],
    data: str,
    seq_len: int,
    windows: int,
    batch_size: int,
    mode: str,
    min_keys: int,
    kv_baseline: str | None = None,
    first_bucket: int = 2048,
    selection: dict[str, Any] | None = None,
    selections: dict[str, dict[str, Any]] | None = None,
    weights: str = FULL,
    calibrate: Callable[[nn.Module], None] | None = None,
) -> dict[str, Any]:
    """Evaluate the base model and every export (name -> folder or Hub repo id) on the same windows.

    `model_name` None: the base the first export names (`prepare_evaluation`). `kv_baseline`
    (`per_token` or `kivi`) replaces ASQ by plain quantization at ASQ's bits, with the same sparsity
    and bridge: the baseline ASQ must beat. Every figure is reported for the window and per
    query-position bucket (`position_buckets` from `first_bucket`); the captured mass is taken at
    `top_k` on a constant schedule, at each query's k on another. `selection`: sparse_attention
    fields the exports run with instead of their own (`with_selection`), e.g. {"top_k": 1024};
    `selections`: the same per export name. `weights`: every model's base weights, as loaded or
    4-bit (gsm_train/export/int4.py), with AWQ scales from `calibrate(model)`'s forwards where it is given."""
    if seq_len < 2:
        raise ConfigError(
            "eval", [Problem("--seq-len", seq_len, "a window of one token predicts nothing", "use --seq-len 2 or more")]
        )
    evaluation = prepare_evaluation(model_name, exports, mode, kv_baseline, selection, selections, weights, calibrate)
    evaluation.check_positions("eval", "--seq-len", seq_len)
    buckets = position_buckets(seq_len, first_bucket)
    results: dict[str, dict[str, Any]] = {}
    rows = None
    for item in evaluation.models():
        if rows is None:
            rows = pack_tokens(load_text_dataset(data), evaluation.tokenizer, seq_len)[:windows]
        if item.settings is None or not item.settings.enabled:  # the base, or a dense control
            results[item.name] = perplexity_and_recall(item.model, rows, batch_size, None, buckets, item.name)
        else:
            sparse = item.settings.config.sparse_attention
            k = sparse.top_k if sparse.top_k_schedule == "constant" else None  # None: scheduled
            recall = (k, min(min_keys, seq_len))
            measured = perplexity_and_recall(item.model, rows, batch_size, recall, buckets, item.name)
            kv_bytes = kv_bytes_report(item.model, item.settings, seq_len)
            results[item.name] = measured | kv_bytes | {"k": k or sparse.top_k_schedule}
        if item.export is not None:
            results[item.name]["export"] = item.export
    for result in results.values():
        result["ppl_vs_base"] = result["ppl"] / results[BASE]["ppl"]
        for part, base_part in zip(result["buckets"], results[BASE]["buckets"], strict=True):
            part["ppl_vs_base"] = part["ppl"] / base_part["ppl"]
    return {
        "model": evaluation.model_name,
        "data": data,
        "seq_len": seq_len,
        "windows": len(rows),
        "mode": mode,
        "kv_baseline": kv_baseline,
        "selection": selection or None,
        "selections": selections or None,
        "weights": weights,
        "buckets": buckets,
        "results": results,
    }


def bucket_label(start: int, stop: int) -> str:
    """`0-2k` for positions [0, 2048); plain numbers where they are not whole multiples of 1024."""

    def short(n: int) -> str:
        return f"{n // 1024}k" if n and n % 1024 == 0 else str(n)

    return f"{short(start)}-{short(stop)}"


def markdown_table(report: dict[str, Any]) -> str:
    """The report as markdown: a row per model for the window, then a row per model by bucket."""
    lines = [
        f"Perplexity on {report['windows']} windows of {report['seq_len']} tokens of "
        f"`{report['data']}` (GSM mode: {report['mode']})",
        "",
        "| model | PPL | vs base | KV bytes/token (ratio to bf16) | gate/oracle mass |",
        "|---|---|---|---|---|",
    ]
    for name, r in report["results"].items():
        kv = f"{r['kv_bytes_per_token']:.0f} ({r['kv_bytes_ratio']:.3f})" if "kv_bytes_ratio" in r else "bf16"
        recall = f"{r['recall_ratio']:.3f} @k={r['k']}" if "recall_ratio" in r else "-"
        lines.append(f"| {name} | {r['ppl']:.3f} | {r['ppl_vs_base']:.3f}x | {kv} | {recall} |")
    labels = [bucket_label(start, stop) for start, stop in report["buckets"]]
    lines += [
        "",
        "By query position (PPL of the tokens predicted there; gate/oracle mass):",
        "",
        "| model | "
        + " | ".join(f"PPL {label}" for label in labels)
        + " | "
        + " | ".join(f"gate/oracle {label}" for label in labels)
        + " |",
        "|---|" + "---|" * (2 * len(labels)),
    ]
    for name, r in report["results"].items():
        ppl = [f"{p['ppl']:.3f}" for p in r["buckets"]]
        mass = [f"{p['recall_ratio']:.3f}" if "recall_ratio" in p else "-" for p in r["buckets"]]
        lines.append(f"| {name} | " + " | ".join(ppl + mass) + " |")
    return "\n".join(lines) + "\n"


def check_report_folder(out_dir: str | Path, option: str = "--out") -> None:
    """Refuse an `--out` that names a file or lies below one, before anything runs (ConfigError)."""
    path = Path(out_dir)
    blocking = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        where = "names a file" if blocking == path else f"lies below the file {blocking}"
        raise ConfigError(
            option.lstrip("-"),
            [Problem(option, str(out_dir), f"{where}, not a folder", "give a folder for the report (new or existing)")],
        )


def write_report(
    report: dict[str, Any], out_dir: str | Path, name: str = "eval", table: Callable[[dict], str] = markdown_table
) -> Path:
    """Write `NAME.json` (the report) and `NAME.md` (`table(report)`) into `out_dir`; return the markdown
    path. `gsm-train passkey` writes its own with `passkey.markdown_table`."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(report, indent=2))
    markdown = folder / f"{name}.md"
    markdown.write_text(table(report))
    return markdown
