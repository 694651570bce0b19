"""`gsm-train eval`: perplexity in non-overlapping windows with GSM active exactly as inference runs it
(gate-selected sparse attention, compressed K/V blocks, bridge), for the base model and each export,
with the KV bytes per token against bf16 and the gate's captured attention mass. Writes JSON and a
markdown table."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gsm_train.data import load_text_dataset, pack_tokens
from gsm_train.adapter_format import ExportError, read_config
from gsm_train.export import load_gsm
from gsm_train.hub_download import resolve_export
from gsm_train.hub_ids import base_to_load
from gsm_train.inspect_model import layer_reports
from gsm_train.model_zoo import load_model_and_tokenizer
from gsm_train.modules import GSMSettings, configure_gsm, gsm_collect

BASE = "base"


def _device_and_dtype() -> tuple[torch.device, torch.dtype]:
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


@torch.no_grad()
def perplexity_and_recall(model: nn.Module, rows: Tensor, batch_size: int,
                          recall: tuple[int, int] | None) -> dict[str, float]:
    """Perplexity over all predicted tokens of `rows`; with `recall` (k, min_keys) on a GSM model, the
    gate's and the oracle's captured attention mass too."""
    device = next(model.parameters()).device
    nll, tokens = 0.0, 0
    sums = torch.zeros(3, dtype=torch.float64)
    collect = (lambda: gsm_collect(model, recall=recall)) if recall is not None else contextlib.nullcontext
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    for start in range(0, len(rows), batch_size):
        batch = rows[start: start + batch_size].to(device)
        with autocast, collect() as records:
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        predicted = batch.shape[0] * (batch.shape[1] - 1)
        nll += float(loss) * predicted
        tokens += predicted
        mass = records.captured_mass_total() if records is not None else None
        if mass is not None:
            sums += torch.stack([mass[k] for k in ("gate", "oracle", "queries")]).cpu()
    result = {"ppl": math.exp(nll / tokens), "tokens": tokens}
    if recall is not None:
        if sums[2] > 0:
            result |= {"gate_mass": float(sums[0] / sums[2]), "oracle_mass": float(sums[1] / sums[2]),
                       "recall_ratio": float(sums[0] / sums[1])}
    return result


def kv_bytes_ratio(model: nn.Module, settings: GSMSettings, seq_len: int) -> dict[str, float]:
    """KV cache bytes per token with GSM, bf16 without, and their ratio (gate keys included)."""
    rows = layer_reports(model, settings.config, seq_len)
    base, gsm = sum(r.base_bytes for r in rows), sum(r.gsm_bytes for r in rows)
    return {"kv_bytes_per_token": gsm, "kv_bytes_per_token_bf16": base, "kv_bytes_ratio": gsm / base}


def evaluate_exports(model_name: str | None, exports: dict[str, str], data: str, seq_len: int,
                     windows: int, batch_size: int, mode: str, min_keys: int,
                     kv_baseline: str | None = None) -> dict[str, Any]:
    """Evaluate the base model and every export (name -> folder or Hub repo id) on the same windows.

    `model_name` None: the base the first export names (gsm_train/hub_ids.py, `base_to_load`); every
    export must have been trained on it. `kv_baseline` (`per_token` or `kivi`) replaces ASQ by plain
    quantization at ASQ's bits, with the same sparsity and bridge: the baseline ASQ must beat."""
    folders = {name: resolve_export(adapter) for name, adapter in exports.items()}
    configs = [read_config(folder) for folder in folders.values()]  # checked before a model loads
    revision = None
    if model_name is None:
        if not configs:
            raise ExportError("eval needs a model: give --export NAME=FOLDER (whose base it loads) "
                              "or --model")
        model_name, revision = base_to_load(configs[0]["base_model"])
    device, dtype = _device_and_dtype()
    model, tokenizer = load_model_and_tokenizer(model_name, revision=revision, dtype=dtype)
    rows = pack_tokens(load_text_dataset(data), tokenizer, seq_len)[:windows]
    results = {BASE: perplexity_and_recall(model.to(device), rows, batch_size, None)}
    for name, folder in folders.items():
        model, _ = load_model_and_tokenizer(model_name, revision=revision, dtype=dtype)
        load_gsm(model, folder, mode=mode)
        settings = configure_gsm(model, kv_baseline=kv_baseline)
        model.to(device).eval()
        if not settings.enabled:  # e.g. the dense control: the base model with its own weights
            results[name] = perplexity_and_recall(model, rows, batch_size, None) | {"export": exports[name]}
            continue
        k = settings.config.sparse_attention.top_k
        results[name] = (perplexity_and_recall(model, rows, batch_size, (k, min(min_keys, seq_len)))
                         | kv_bytes_ratio(model, settings, seq_len) | {"export": exports[name], "k": k})
    for name, result in results.items():
        result["ppl_vs_base"] = result["ppl"] / results[BASE]["ppl"]
    return {"model": model_name, "data": data, "seq_len": seq_len, "windows": len(rows), "mode": mode,
            "kv_baseline": kv_baseline, "results": results}


def markdown_table(report: dict[str, Any]) -> str:
    """The report as a markdown table, one row per model."""
    lines = [f"Perplexity on {report['windows']} windows of {report['seq_len']} tokens of `{report['data']}` "
             f"(GSM mode: {report['mode']})", "",
             "| model | PPL | vs base | KV bytes/token (ratio to bf16) | gate/oracle mass |", "|---|---|---|---|---|"]
    for name, r in report["results"].items():
        kv = f"{r['kv_bytes_per_token']:.0f} ({r['kv_bytes_ratio']:.3f})" if "kv_bytes_ratio" in r else "bf16"
        recall = f"{r['recall_ratio']:.3f} @k={r['k']}" if "recall_ratio" in r else "-"
        lines.append(f"| {name} | {r['ppl']:.3f} | {r['ppl_vs_base']:.3f}x | {kv} | {recall} |")
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out_dir: str | Path) -> Path:
    """Write `eval.json` and `eval.md` into `out_dir`; return the markdown path."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "eval.json").write_text(json.dumps(report, indent=2))
    table = folder / "eval.md"
    table.write_text(markdown_table(report))
    return table
