"""The local deployment the seed describes, measured on one GPU in one run: a base with 4-bit weights
(torchao's int4 weight-only path, gsm_train/export/int4.py) under GSM's compressed cache, against the same 4-bit
base decoding densely.

Parts (`--parts`, default both):
- `ppl`: perplexity on held-out text (`--eval-data`, WikiText-2 validation) of SmolLM2-135M with the
  joint export `--smollm2-export`: the bf16 base, bf16 + GSM, the 4-bit base dense, 4-bit + GSM, on the
  same windows (`gsm_train.commands.evaluate.evaluate_exports`, once with full weights, once 4-bit; with
  `--calibration-data`, WikiText-2's train split, once more 4-bit with AWQ scales: `int4awq`). SmolLM2's
  linears are 576 wide, which groups of 128 do not divide: its 4-bit weights take groups of 64
  (`--smollm2-weights`, recorded); the 8B rows use groups of 128.
- `8b`: end-to-end greedy decode of `random-llama3-8b` (Llama-3-8B's shapes, random bf16 weights, then
  4-bit in groups of 128) at 32k batch 1, 128k batch 1 and 32k batch 16: the 4-bit model dense through
  our dense engine (preallocated bf16 cache, captured steps) and through transformers' static cache with
  its compiled step (where that runs over torchao's tensors: checked once on a short prompt, the error
  recorded otherwise; `--methods dense_engine` leaves it out, slow as it is), then GSM's modules
  (recipes/joint.yaml, gates at random) attached to the same seeded 16-bit base before it is quantized as the
  dense model was (`_gsm_model`, `benchmarks.generate.run_row`). Each method's bandwidth bound: the bytes
  one step reads (the weights as stored, 4-bit values with their scales and zero points; the dense bf16 K/V,
  or what GSM's cache step reads: `benchmarks.bandwidth`) over the peak a device copy reaches.

The summary: `ppl_int4_gsm_over_bf16_gsm`, `ppl_int4_dense_over_bf16_dense` (and `ppl_int4awq_...`),
`e2e_speedup_int4_<row>`
(GSM over the fastest 4-bit dense method of the row), `bound_speedup_int4_<row>` (GSM's bandwidth bound
over the dense one), `bandwidth_share_<method>_int4_<row>`, `ttft_ratio_int4_<row>`. Resumable as
benchmarks/generate.py: the JSON is written after every method and part; a complete row (or part) of the
same settings is skipped.

python -m benchmarks.int4_hybrid --eval-data DATA/wikitext-2/valid.txt --smollm2-export EXPORT \\
    [--calibration-data 'DATA/prose/*.txt.xz'] --result benchmarks/results/int4_hybrid.json

On the device machine (torch 2.11, no torchao): copy the torchao 0.18 wheel, WikiText-2's valid.txt, some
prose for AWQ and the export into a folder of the repo that .git/info/exclude ignores, name it in `carry`,
and run `pip install --no-deps FOLDER/torchao-*.whl && timeout 560 python -m benchmarks.int4_hybrid ...
--result benchmarks/results/int4_hybrid.json; cp benchmarks/results/int4_hybrid.json $OUT/`: a call cut by
the 10-minute limit keeps every finished method, and the next call (with the JSON copied back) resumes.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks import bandwidth
from benchmarks.common import PROVENANCE_KEYS, provenance, write_result
from benchmarks.generate import (
    free_memory,
    generate_timed,
    joint_gsm_config,
    llama8b,
    row_complete,
    row_settings,
    run_row,
    say,
    settings_for,
    summarize,
)
from gsm_train.attention import inject_gsm
from gsm_train.commands.evaluate import BASE, evaluate_exports, inference_autocast
from gsm_train.data.text import load_text_dataset, pack_tokens
from gsm_train.export.adapter_format import read_config
from gsm_train.export.hub_download import resolve_export
from gsm_train.export.int4 import WEIGHT_CHOICES, base_linears, group_size, quantize_base
from gsm_train.inference.cache import DEFAULT_PREFILL, PREFILL_MODES
from gsm_train.inference.engine import enable_gsm_generation
from gsm_train.models.hub_ids import base_to_load
from gsm_train.models.model_zoo import load_model_and_tokenizer

ROWS = ("8b_32k_bs1", "8b_128k_bs1", "8b_32k_bs16")  # benchmarks.generate's rows of these names
METHODS = ("dense_engine", "dense_static_compiled")  # the 4-bit dense methods (eager is slower than both)
STATIC = "dense_static_compiled"
WEIGHTS_8B = "int4"  # groups of 128
GSM_EXPORT = "gsm"  # the export's name in the perplexity reports


def awq_calibration(data: str, tokenizer: Any, windows: int, seq_len: int) -> Callable[[nn.Module], None]:
    """AWQ's calibration forwards (`gsm_train.export.int4.quantize_base`): `windows` windows of `seq_len` tokens
    of `data` (text apart from the evaluation's: WikiText-2's train split), one forward each."""
    rows = pack_tokens(load_text_dataset(data), tokenizer, seq_len)[:windows]

    def calibrate(model: nn.Module) -> None:
        device = model.get_input_embeddings().weight.device
        with inference_autocast(device):
            for row in rows:
                model(row[None].to(device), use_cache=False, logits_to_keep=1)

    return calibrate


def perplexity(
    export: str,
    data: str,
    seq_len: int,
    windows: int,
    weights: str,
    calibration: tuple[str, int, int] | None = None,
) -> dict[str, Any]:
    """Perplexity of the base `export` names and of `export` over it, with full weights and with `weights`
    (4-bit, data-free scales), and with `calibration` (text, windows, tokens per window) also 4-bit with
    AWQ scales (`int4awq`), on the same `windows` windows of `seq_len` tokens of `data`; and the ratios."""
    runs: dict[str, dict] = {}
    settings = {"export": export, "data": data, "seq_len": seq_len, "windows": windows, "weights": weights}
    chosen: list[tuple[str, str, Any]] = [("bf16", "full", None), ("int4", weights, None)]
    if calibration is not None:
        _, tokenizer = load_model_and_tokenizer(*base_to_load(read_config(resolve_export(export))["base_model"]))
        text, count, length = calibration
        chosen.append(("int4awq", weights, awq_calibration(text, tokenizer, count, length)))
        settings["calibration"] = list(calibration)
    for label, format_, calibrate in chosen:
        say(f"perplexity: weights {format_}{' with AWQ scales' if calibrate else ''}")
        runs[label] = evaluate_exports(
            None,
            {GSM_EXPORT: export},
            data,
            seq_len,
            windows,
            1,
            "sparse",
            min(512, seq_len),
            weights=format_,
            calibrate=calibrate,
        )
    ppl = {
        f"ppl_{label}_{part}": runs[label]["results"][name]["ppl"]
        for label in runs
        for part, name in (("dense", BASE), ("gsm", GSM_EXPORT))
    }
    ratios = {
        f"ppl_{label}_{part}_over_bf16_{part}": ppl[f"ppl_{label}_{part}"] / ppl[f"ppl_bf16_{part}"]
        for label in runs
        if label != "bf16"
        for part in ("gsm", "dense")
    }
    return {
        "settings": settings,
        "model": runs["bf16"]["model"],
        "windows_evaluated": runs["bf16"]["windows"],
        **ppl,
        **ratios,
        "ppl_int4_gsm_over_int4_dense": ppl["ppl_int4_gsm"] / ppl["ppl_int4_dense"],
    }


def int4_llama8b() -> torch.nn.Module:
    """`random-llama3-8b` with its base linears 4-bit in groups of 128 (on the GPU)."""
    model = llama8b()
    quantize_base(model, group_size(WEIGHTS_8B))
    free_memory()
    return model


def static_compiled_error(model: torch.nn.Module) -> str | None:
    """None where transformers' static cache with its compiled step runs the 4-bit model (a 256-token
    prompt, 4 new tokens), else the error's text."""
    ids = torch.randint(0, model.config.vocab_size, (1, 256), device="cuda")
    try:
        generate_timed(model, ids, 4, cache_implementation="static")
        return None
    except Exception as err:  # noqa: BLE001 (any failure of the compiled path is the finding)
        return f"{type(err).__name__}: {str(err)[:400]}"
    finally:
        torch._dynamo.reset()


def int4_summary(result: dict) -> dict[str, float]:
    """The summary keys (module docstring) of the parts measured so far."""
    summary: dict[str, float] = {}
    ppl = result.get("perplexity")
    if ppl:
        summary.update({key: value for key, value in ppl.items() if key.startswith("ppl_") and "_over_" in key})
    for key, value in summarize(result["rows"]).items():
        summary[key.replace("_8b_", "_int4_8b_")] = value
    for name, row in result["rows"].items():
        if "gsm" in row:
            summary[f"bound_speedup_int4_{name}"] = row["bound_tokens_per_s_gsm"] / row["bound_tokens_per_s_dense"]
    return summary


def _gsm_model(prefill: str) -> Callable[[nn.Module], nn.Module]:
    """The function that builds the GSM method's model of a row: `random-llama3-8b` (the same seeded weights as
    the dense row's), GSM's modules attached to its 16-bit base, then its base linears 4-bit (the order
    gsm_train/export/int4.py's contract asks for), with generation over the modules. The dense model it is
    handed is not changed."""

    def build(dense: nn.Module) -> nn.Module:
        model = llama8b()
        torch.manual_seed(0)
        inject_gsm(model, joint_gsm_config(), mode="sparse")
        quantize_base(model, group_size(WEIGHTS_8B))
        enable_gsm_generation(model, prefill=prefill)
        free_memory()
        return model

    return build


def _rows(args: argparse.Namespace, result: dict, save: Any) -> None:
    """The 8B rows not yet complete, each on a fresh 4-bit model."""
    names = [name for name in args.rows.split(",") if name]
    peak = bandwidth.peak_bandwidth()
    say(f"peak bandwidth {peak[0] / 1e12:.2f} TB/s ({peak[1]})")
    prompts = torch.randint(0, 128256, (16, 131072), generator=torch.Generator().manual_seed(1))
    for name in names:
        checked = "static_compiled" in result or STATIC not in args.methods
        if checked and row_complete(result["rows"].get(name, {}), settings_for(name, _settings(args, result))):
            say(f"{name}: measured by an earlier run")
            continue
        model = int4_llama8b()
        if STATIC in args.methods and "static_compiled" not in result:
            say("does transformers' static cache with its compiled step run the 4-bit model?")
            result["static_compiled"] = {"error": static_compiled_error(model)}
            save(None, None)
        settings = settings_for(name, _settings(args, result))
        measured = result["rows"].get(name, {})
        measured = measured if measured.get("settings") == settings else {}  # a cut row of other settings
        weights = {
            "weights": WEIGHTS_8B,
            "group_size": group_size(WEIGHTS_8B),
            "linears_4bit": len(base_linears(model)),
        }

        def save_row(row: dict, name: str = name, settings: dict = settings, weights: dict = weights) -> None:
            save(name, row | {"settings": settings, "weight_format": weights})

        methods = tuple(settings["methods"][:-1])
        gsm_model = _gsm_model(args.prefill)
        row = run_row(name, model, prompts, args.new_tokens, gsm_model, measured, save_row, peak, settings, methods)
        save_row(row)
        del model, row
        free_memory()


def _settings(args: argparse.Namespace, result: dict) -> dict:
    """An 8B row's settings: benchmarks.generate's, with the 4-bit dense methods of `--methods` that run here
    (HF's static cache only where its compiled step ran the 4-bit model)."""
    static_runs = result.get("static_compiled", {}).get("error") is None
    methods = tuple(method for method in args.methods if method != STATIC or static_runs)
    return row_settings(args.new_tokens, args.prefill, methods=methods) | {"weights": WEIGHTS_8B}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eval-data", default=None, help="held-out text for the perplexity part")
    parser.add_argument("--smollm2-export", default=None, help="a joint SmolLM2 export for the perplexity part")
    parser.add_argument("--smollm2-weights", choices=WEIGHT_CHOICES[1:], default="int4-g64")
    parser.add_argument(
        "--calibration-data", default=None, help="text for AWQ scales (e.g. WikiText-2 train): adds an int4awq run"
    )
    parser.add_argument("--calibration-windows", type=int, default=16)
    parser.add_argument("--calibration-len", type=int, default=512)
    parser.add_argument("--parts", default="ppl,8b")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--windows", type=int, default=40)
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help="the 4-bit dense methods measured beside GSM in the 8B rows, comma-separated (default: %(default)s)",
    )
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--prefill", choices=PREFILL_MODES, default=DEFAULT_PREFILL)
    parser.add_argument("--result", default="benchmarks/results/int4_hybrid.json")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if "ppl" in parts and not (args.eval_data and args.smollm2_export):
        parser.error("the ppl part needs --eval-data and --smollm2-export (or --parts 8b)")
    unknown_rows = [name for name in args.rows.split(",") if name and name not in ROWS]
    if unknown_rows:
        parser.error(f"--rows: unknown {', '.join(unknown_rows)}; use some of {', '.join(ROWS)}")
    args.methods = tuple(method for method in args.methods.split(",") if method)
    if not args.methods or set(args.methods) - set(METHODS):
        parser.error(f"--methods: {args.methods} are not all 4-bit dense methods; choose from {','.join(METHODS)}")
    path = Path(args.result)
    result = json.loads(path.read_text()) if path.exists() else {"rows": {}}
    measured_by = provenance()

    def save(name: str | None, row: dict | None) -> None:
        if name is not None:
            kept = {k: v for k, v in row.items() if k not in ("gsm_tokens", "dense_tokens")}
            result["rows"][name] = {**kept, "measured": measured_by}
        kept = {k: v for k, v in result.items() if k not in PROVENANCE_KEYS}
        write_result(path, kept | int4_summary(result))

    if "ppl" in parts:
        wanted = {
            "export": args.smollm2_export,
            "data": args.eval_data,
            "seq_len": args.seq_len,
            "windows": args.windows,
            "weights": args.smollm2_weights,
        }
        calibration = None
        if args.calibration_data:
            calibration = (args.calibration_data, args.calibration_windows, args.calibration_len)
            wanted["calibration"] = list(calibration)
        if result.get("perplexity", {}).get("settings") != wanted:
            say("perplexity: bf16 and 4-bit SmolLM2, dense and with GSM")
            ppl = perplexity(
                args.smollm2_export, args.eval_data, args.seq_len, args.windows, args.smollm2_weights, calibration
            )
            result["perplexity"] = ppl | {"measured": measured_by}
            save(None, None)
        say(f"ppl int4+GSM / bf16+GSM: {result['perplexity']['ppl_int4_gsm_over_bf16_gsm']:.4f}")
    if "8b" in parts:
        _rows(args, result, save)
    save(None, None)
    for key, value in int4_summary(result).items():
        print(f"{key:>48} {value:.4f}")


if __name__ == "__main__":
    main()
