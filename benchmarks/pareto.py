"""The tuning knobs' trade-off over one export: quality against speed, one knob at a time, and a table of
workload scenarios.

Sweep: for each knob of the recipe's `tuning` block (`tuning.top_k_base`, `tuning.kv_compression_ratio`,
`tuning.bridge_alpha`) and each of its values, the export on a fresh base with that knob applied as the
recipe would set it (`apply_knob`: the selection's top_k, with k_min lowered to it where the export's is
above, as the recipe's check asks; ASQ's residual bits and the gate keys' bits the
budget picks, `gsm_train.tuning.kv_budget.fit_kv_budget`; the bridges' alpha), the others as exported.
Per point: perplexity on held-out windows (teacher forcing, which the sparse prefill equals) and end-to-end
generation tokens/s (`model.generate` over the GSM cache with the default dense prefill, batch 1, all new
tokens over the whole call, prefill included; after one warm-up call). A knob the export cannot take (a
bridge alpha without a bridge) is recorded with the reason. `pareto.png`: perplexity against tokens/s.

Scenarios (the export as trained), each over `--scenario-prompts` held-out prompts (100 on a GPU;
windows are reused when the text holds fewer): general, long text over 4k tokens, low latency (short
prompt, few new tokens); tokens/s, perplexity at the scenario's prompt length, and the P95 per-token
latency (the time between consecutive new tokens, every prompt's steps together).

Resumable: the JSON is written atomically after every point and scenario; with the same settings a run
skips what is there (other settings start over). Progress lines give the seconds since the start.

    python -m benchmarks.pareto --export EXPORT --eval-data DATA/wikitext-2/valid.txt \\
        --result benchmarks/results/pareto.json --plot benchmarks/results/pareto.png
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.common import write_result
from benchmarks.generate import generate_timed
from gsm_train.attention import gsm_adapters, gsm_settings
from gsm_train.attention.settings import configure_gsm
from gsm_train.commands.evaluate import perplexity_and_recall, with_selection
from gsm_train.config.schema import ConfigError, GSMConfig
from gsm_train.data.text import load_text_dataset, pack_tokens
from gsm_train.export.save_load import load_gsm, read_export, resolve_export
from gsm_train.inference.engine import enable_gsm_generation
from gsm_train.models.families import model_dims
from gsm_train.models.hub_ids import base_to_load
from gsm_train.models.model_zoo import load_model_and_tokenizer
from gsm_train.plots import plot_pareto
from gsm_train.tuning.kv_budget import budget_choice, fit_kv_budget

KNOBS = {  # the values swept, within each knob's range in the recipe's tuning block
    "top_k_base": [32, 64, 128, 256],
    "kv_compression_ratio": [0.3, 0.4, 0.55, 0.8],
    "bridge_alpha": [0.1, 0.3, 0.5],
}
SCENARIOS = "general:1024:128,long_text_over_4k:4608:64,low_latency:256:16"  # name:prompt tokens:new tokens
STARTED = time.perf_counter()


def say(message: str) -> None:
    print(f"[{time.perf_counter() - STARTED:7.1f} s] {message}", flush=True)


class NotApplicable(Exception):
    """A knob this export cannot take (the reason is the message)."""


def apply_knob(model: nn.Module, knob: str, value: float, seq_len: int) -> str:
    """Set `knob` to `value` on a model carrying an export's GSM modules, as the recipe's tuning block would
    set the field it names; returns what was set, in words. Raises NotApplicable where the export cannot."""
    config = gsm_settings(model).config.model_copy(deep=True)
    if knob == "top_k_base":
        return _set_top_k(model, config, int(value))
    if knob == "kv_compression_ratio":
        if not config.kv_compression.enabled:
            raise NotApplicable("the export has no KV compression")
        if config.kv_compression.value_quant_bits is not None or config.kv_compression.layer_bits:
            raise NotApplicable("the export sets its bits per layer or for V apart; one budget cannot")
        try:
            config = fit_kv_budget(config, value, model_dims(model), seq_len)
        except ConfigError as err:
            raise NotApplicable(str(err)) from None
        for _, adapter in gsm_adapters(model):
            for asq in (adapter.asq_k, adapter.asq_v):
                if asq is not None:
                    asq.quant_bits = config.kv_compression.quant_bits
            if adapter.gate is not None:
                adapter.gate.key_bits = config.sparse_attention.gate_key_bits
        configure_gsm(model, config=config)
        return budget_choice(config, value, model_dims(model), seq_len)
    if knob == "bridge_alpha":
        bridges = [adapter.bridge for _, adapter in gsm_adapters(model) if adapter.bridge is not None]
        if not bridges:
            raise NotApplicable("the export has no cache bridge (cross_layer_sharing off)")
        with torch.no_grad():
            for bridge in bridges:
                bridge.alpha.fill_(value)
        return f"alpha={value} in {len(bridges)} bridges"
    raise ValueError(f"unknown knob {knob!r}; one of {', '.join(KNOBS)}")


def timed_generation(model: nn.Module, prompts: torch.Tensor, new_tokens: int) -> dict[str, float]:
    """`model.generate` of `new_tokens` greedy tokens after each prompt [N, T] at batch 1, after one warm-up
    call: end-to-end tokens/s (every new token over the calls' whole time), decode tokens/s, and the P95
    and median time between consecutive new tokens."""
    device = next(model.parameters()).device
    generate_timed(model, prompts[:1].to(device), new_tokens)  # warm-up: kernels, captured steps
    total_time, gaps = 0.0, []
    for prompt in prompts:
        _, timer = generate_timed(model, prompt[None].to(device), new_tokens)
        total_time += timer.times[-1]
        gaps += [later - earlier for earlier, later in zip(timer.times, timer.times[1:], strict=False)]
    count = len(prompts) * new_tokens
    return {
        "tokens_per_s": count / total_time,
        "decode_tokens_per_s": len(gaps) / sum(gaps) if gaps else float("nan"),
        "p95_token_latency_ms": _percentile(gaps, 0.95) * 1e3 if gaps else float("nan"),
        "median_token_latency_ms": statistics.median(gaps) * 1e3 if gaps else float("nan"),
        "prompts": len(prompts),
        "prompt_tokens": prompts.shape[1],
        "new_tokens": new_tokens,
    }


def _percentile(values: list[float], q: float) -> float:
    """The `q` quantile of `values` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class Sweep:
    """The export, its base, the held-out text and the run's sizes: loads a fresh model per point."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.export = read_export(resolve_export(args.export))  # read once, loaded onto each point's model
        self.base, self.revision = base_to_load(self.export.config["base_model"])
        self.device = torch.device(args.device)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.text = load_text_dataset(args.eval_data)
        self.tokenizer = None

    def model(self) -> nn.Module:
        model, self.tokenizer = load_model_and_tokenizer(self.base, revision=self.revision, dtype=self.dtype)
        load_gsm(model, self.export)
        enable_gsm_generation(model)  # tokens/s: model.generate over the GSM cache, as GSMModel has it
        return model.to(self.device).eval()

    def windows(self, length: int, count: int) -> torch.Tensor:
        """`count` held-out windows of `length` tokens (reused in turn when the text holds fewer)."""
        rows = pack_tokens(self.text, self.tokenizer, length)
        if len(rows) == 0:
            raise SystemExit(f"error: --eval-data {self.args.eval_data} holds no window of {length} tokens")
        return rows.repeat(-(-count // len(rows)), 1)[:count]

    def perplexity(self, model: nn.Module, length: int) -> float:
        rows = self.windows(length, self.args.ppl_windows)
        return perplexity_and_recall(model, rows, self.args.batch_size, None)["ppl"]

    def point(self, knob: str | None, value: float | None) -> dict[str, Any]:
        """One sweep point: the knob applied, perplexity at --seq-len, generation speed."""
        model = self.model()
        args = self.args
        row: dict[str, Any] = {"knob": knob, "value": value}
        if knob is not None:
            try:
                row["set"] = apply_knob(model, knob, value, args.seq_len)
            except NotApplicable as reason:
                return row | {"not_applicable": str(reason)}
        row["ppl"] = self.perplexity(model, args.seq_len)
        prompts = self.windows(args.sweep_prompt_tokens, args.sweep_prompts)
        return row | timed_generation(model, prompts, args.new_tokens)

    def scenario(self, prompt_tokens: int, new_tokens: int) -> dict[str, Any]:
        model = self.model()
        row = {"ppl": self.perplexity(model, prompt_tokens)}
        prompts = self.windows(prompt_tokens, self.args.scenario_prompts)
        return row | timed_generation(model, prompts, new_tokens)


def parse_scenarios(text: str) -> dict[str, tuple[int, int]]:
    """`name:prompt:new,...` -> {name: (prompt tokens, new tokens)}."""
    scenarios = {}
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            raise SystemExit(f"error: --scenarios takes name:prompt_tokens:new_tokens items, got {item!r}")
        scenarios[parts[0]] = (int(parts[1]), int(parts[2]))
    return scenarios


def _set_top_k(model: nn.Module, config: GSMConfig, top_k: int) -> str:
    """`tuning.top_k_base` as a recipe sets it: the selection's top_k; an export whose k_min is above it (a
    long-context export's floor) gets k_min = top_k, the fix the recipe's check names. NotApplicable where the
    selection refuses the value."""
    changes = {"top_k": top_k}
    floor = config.sparse_attention.k_min
    if floor > top_k:
        changes["k_min"] = top_k
    try:
        config = with_selection(config, changes, f"tuning.top_k_base={top_k}")
    except ConfigError as err:
        raise NotApplicable(str(err)) from None
    configure_gsm(model, config=config)
    lowered = f", k_min={top_k} (the export's {floor} is above it)" if floor > top_k else ""
    return f"sparse_attention.top_k={top_k}{lowered}"


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export", required=True)
    parser.add_argument("--eval-data", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--plot", default=None, help="the PNG (default: beside --result, pareto.png)")
    parser.add_argument("--seq-len", type=int, default=2048, help="perplexity windows of the sweep")
    parser.add_argument("--ppl-windows", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--sweep-prompts", type=int, default=10)
    parser.add_argument("--sweep-prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--scenarios", default=SCENARIOS, help="name:prompt_tokens:new_tokens, comma-separated")
    parser.add_argument("--scenario-prompts", type=int, default=100 if gpu else 4)
    parser.add_argument("--knobs", default=",".join(KNOBS), help="which knobs to sweep")
    parser.add_argument("--values", default=None, help="knob=v1/v2,... instead of the default values")
    parser.add_argument("--device", default="cuda" if gpu else "cpu")
    return parser.parse_args(argv)


def _knob_values(args: argparse.Namespace) -> dict[str, list[float]]:
    values = {knob: KNOBS[knob] for knob in args.knobs.split(",") if knob}
    for item in (args.values or "").split(","):
        if item:
            knob, _, listed = item.partition("=")
            if knob not in KNOBS:
                raise SystemExit(f"error: --values names {knob!r}; one of {', '.join(KNOBS)}")
            values[knob] = [float(v) for v in listed.split("/")]
    return values


def main(argv: list[str] | None = None) -> dict:
    args = _arguments(argv)
    knobs = _knob_values(args)
    scenarios = parse_scenarios(args.scenarios)
    path = Path(args.result)
    settings = {
        "export": str(args.export),
        "seq_len": args.seq_len,
        "ppl_windows": args.ppl_windows,
        "sweep_prompts": args.sweep_prompts,
        "sweep_prompt_tokens": args.sweep_prompt_tokens,
        "new_tokens": args.new_tokens,
        "scenario_prompts": args.scenario_prompts,
        "device": args.device,
    }
    result = json.loads(path.read_text()) if path.exists() else {}
    if result.get("settings") != settings:
        result = {"settings": settings}
    result.setdefault("points", {})
    result.setdefault("scenarios", {})
    sweep = Sweep(args)
    wanted = [(None, None)] + [(knob, value) for knob, values in knobs.items() for value in values]
    for knob, value in wanted:
        key = "as_exported" if knob is None else f"{knob}={value:g}"
        if key in result["points"]:
            say(f"{key}: measured by an earlier run")
            continue
        say(f"{key}: perplexity and generation")
        result["points"][key] = sweep.point(knob, value)
        write_result(path, result)
    for name, (prompt_tokens, new_tokens) in scenarios.items():
        wanted_row = {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens}
        if {k: result["scenarios"].get(name, {}).get(k) for k in wanted_row} == wanted_row:
            say(f"scenario {name}: measured by an earlier run")
            continue
        say(f"scenario {name}: {args.scenario_prompts} prompts of {prompt_tokens} tokens, {new_tokens} new")
        result["scenarios"][name] = sweep.scenario(prompt_tokens, new_tokens)
        write_result(path, result)
    points = [p for p in result["points"].values() if "ppl" in p]
    plot_pareto(points, Path(args.plot) if args.plot else path.with_name("pareto.png"))
    _print_tables(result)
    return result


def _print_tables(result: dict) -> None:
    print(f"{'point':>28} {'ppl':>9} {'tokens/s':>10} {'P95 ms':>8}")
    for key, point in result["points"].items():
        if "ppl" not in point:
            print(f"{key:>28} (not applicable: {point['not_applicable']})")
            continue
        print(f"{key:>28} {point['ppl']:9.3f} {point['tokens_per_s']:10.1f} {point['p95_token_latency_ms']:8.2f}")
    print(f"\n{'scenario':>20} {'prompt':>7} {'new':>5} {'tokens/s':>10} {'ppl':>9} {'P95 ms':>8} {'prompts':>8}")
    for name, row in result["scenarios"].items():
        print(
            f"{name:>20} {row['prompt_tokens']:7d} {row['new_tokens']:5d} {row['tokens_per_s']:10.1f} "
            f"{row['ppl']:9.3f} {row['p95_token_latency_ms']:8.2f} {row['prompts']:8d}"
        )


if __name__ == "__main__":
    main()
