"""Where a gate loses the passkey's needle: per layer, at the queries that predict the answer, how much
of the dense attention falls on the needle's key digits, and how much of that the gate's top-k keeps
against the oracle's (the true top-k of the same size, with the same forced sinks and recent keys).

python -m benchmarks.passkey_probe --export RUN/gate_only/export --length 2048 --cases 40 --seed 0 \\
    --select top_k=512 --select sink_tokens=4 --select recent_tokens=128 --result OUT.json

The cases are the passkey test's (`gsm_train.commands.passkey`: the same seed gives the same cases), one
forward each (main attention as --mode says: `dense` isolates each layer's gate from the others'
selections). In every layer with a gate, at the answer queries (the prompt's last token and the answer's
tokens but the last: the positions whose next token is an answer token), averaged over those rows
and the cases:

- `needle_mass`: the head-averaged attention on the needle's key-digit tokens (both mentions of the key),
  and `needle_mass_top_head`: the most any one head of the layer puts there (per query; retrieval heads);
- `gate_kept` / `oracle_kept`: the share of those digit tokens each selection keeps;
- `gate_needle_mass` / `oracle_needle_mass`: the needle's attention mass each selection keeps, and their
  difference, `needle_mass_lost`: what the gate loses of the needle in that layer;
- `gate_mass` / `oracle_mass`: the captured attention mass (all keys) of each selection.

The attention is the layer's over its raw keys (an ASQ export's oracle in `gsm-train passkey --mode oracle`
ranks the keys as stored; for a gate-only export the two are the same). The selection is the one the
export runs with after `--select` (k from its top-k schedule at the answer positions). It prints the
table per layer, then the layers ranked by `needle_mass_lost` (those to run with all keys first:
`sparse_attention.retrieval_layers`); writes the JSON, and with --plot a PNG.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks.common import REPO, write_result
from benchmarks.long_context_probe import probing
from gsm_train.cli import add_select_argument, parse_selection
from gsm_train.commands.evaluate import inference_autocast, prepare_evaluation
from gsm_train.commands.passkey import PasskeyCase, filler_tokens, needle_key_positions, passkey_cases
from gsm_train.functional.attention_targets import head_averaged_probs
from gsm_train.functional.top_k import scheduled_k, select_top_k
from gsm_train.plots import plot_needle_per_layer

# the figures kept per layer and case (means over the answer queries and the selectors)
FIGURES = (
    "needle_mass",
    "needle_mass_top_head",
    "gate_kept",
    "oracle_kept",
    "gate_needle_mass",
    "oracle_needle_mass",
    "gate_mass",
    "oracle_mass",
)


def answer_queries(case: PasskeyCase) -> Tensor:
    """The positions whose next token is an answer token [A]: the prompt's last and the answer's but the last."""
    prompt = len(case.prompt)
    return torch.arange(prompt - 1, prompt + len(case.answer) - 1)


class NeedleProbe:
    """Per layer with a gate, one dict of `FIGURES` per case observed (`start_case` names the case's
    answer queries and needle digits before its forward)."""

    def __init__(self) -> None:
        self.rows: Tensor | None = None
        self.needle: Tensor | None = None
        self.cases: dict[int, list[dict[str, float]]] = {}

    def start_case(self, rows: Tensor, needle: Tensor) -> None:
        """The next forward's answer query positions [r] and needle key-digit positions [m]."""
        self.rows, self.needle = rows, needle

    @torch.no_grad()
    def observe(self, module: nn.Module, query: Tensor, key: Tensor, forward_state: Any) -> None:
        """One layer's pass of a whole case (batch 1): query [1, Hq, T, D] and key [1, Hkv, T, D] after
        RoPE; the gate's input and the selection config from the forward's state (peeked at)."""
        gate = getattr(getattr(module, "gsm", None), "gate", None)
        if gate is None or forward_state is None or query.shape[2] != key.shape[2] or self.rows is None:
            return
        cfg = forward_state.settings.config.sparse_attention
        hidden, cos, sin = forward_state.layer_inputs[module.layer_idx]
        device = query.device
        rows, needle = self.rows.to(device), self.needle.to(device)
        positions = torch.arange(key.shape[2], device=device)
        allowed = (positions[None, :] <= rows[:, None])[None, None]  # [1, 1, r, S]
        per_head = head_averaged_probs(query[:, :, rows], key, allowed, module.scaling, query.shape[1]).float()
        heads = per_head.shape[1]
        target = per_head.view(1, gate.num_selectors, heads // gate.num_selectors, *per_head.shape[2:]).mean(2)
        gate_q, gate_k = gate(hidden, cos, sin)
        scores = gate.score_stored(gate_q[:, :, rows], gate.stored_keys(gate_k)).float()
        k = scheduled_k(rows, cfg)

        def pick(ranking: Tensor) -> Tensor:
            return select_top_k(ranking, allowed, k, rows, positions, cfg.sink_tokens, cfg.recent_tokens)

        chosen, oracle = pick(scores), pick(target)
        on_needle = target[..., needle]
        figures = {
            "needle_mass": on_needle.sum(-1),
            "needle_mass_top_head": per_head[..., needle].sum(-1).amax(1, keepdim=True),
            "gate_kept": chosen[..., needle].float().mean(-1),
            "oracle_kept": oracle[..., needle].float().mean(-1),
            "gate_needle_mass": (on_needle * chosen[..., needle]).sum(-1),
            "oracle_needle_mass": (on_needle * oracle[..., needle]).sum(-1),
            "gate_mass": (target * chosen).sum(-1),
            "oracle_mass": (target * oracle).sum(-1),
        }
        record = {name: float(value.double().mean()) for name, value in figures.items()}
        self.cases.setdefault(module.layer_idx, []).append(record)

    def report(self) -> dict[int, dict[str, float]]:
        """Per layer, each figure's mean over the cases, and `needle_mass_lost` (oracle's needle mass - gate's)."""
        layers = {}
        for layer, records in sorted(self.cases.items()):
            means = {name: sum(r[name] for r in records) / len(records) for name in FIGURES}
            layers[layer] = means | {"needle_mass_lost": means["oracle_needle_mass"] - means["gate_needle_mass"]}
        return layers


def run_probe(
    model_name: str | None,
    export: str,
    prose: str,
    length: int,
    count: int,
    seed: int,
    mode: str,
    selection: dict[str, Any],
) -> dict[str, Any]:
    """Load the export (with `selection`'s sparse_attention fields), run each passkey case through it while
    probing every gate layer; the report, with whether each case's answer is the argmax (in `mode`)."""
    evaluation = prepare_evaluation(model_name, {"gate": export}, mode, selection=selection)
    evaluation.check_positions("passkey probe", "--length", length)
    loaded = evaluation.load("gate")
    tokenizer = evaluation.tokenizer
    cases = passkey_cases(tokenizer, filler_tokens(tokenizer, prose, length), length, count, seed)
    probe = NeedleProbe()
    device = next(loaded.model.parameters()).device
    retrieved = []
    with torch.no_grad(), probing(probe), inference_autocast(device):
        for case in cases:
            probe.start_case(answer_queries(case), needle_key_positions(tokenizer, case))
            kept = len(case.answer) + 1  # the logits of the answer queries, and the last position's
            logits = loaded.model(input_ids=case.ids[None].to(device), use_cache=False, logits_to_keep=kept).logits
            retrieved.append(bool((logits[0, :-1].argmax(-1).cpu() == case.answer).all()))
    sparse = loaded.settings.config.sparse_attention
    return {
        "model": evaluation.model_name,
        "export": export,
        "prose": prose,
        "length": length,
        "cases": count,
        "seed": seed,
        "mode": mode,
        "selection": sparse.model_dump(),
        "accuracy": sum(retrieved) / len(retrieved),
        "layers": probe.report(),
    }


def ranked_layers(layers: dict[int, dict[str, float]]) -> list[int]:
    """Gate layers by the needle mass the gate loses there, most first."""
    return sorted(layers, key=lambda layer: layers[layer]["needle_mass_lost"], reverse=True)


def print_table(result: dict[str, Any]) -> None:
    """The per-layer table, then the layers ranked by the needle mass the gate loses."""
    sparse, layers = result["selection"], result["layers"]
    print(
        f"needle probe of {result['export']}: {result['cases']} passkey cases of {result['length']} tokens "
        f"(seed {result['seed']}), main attention {result['mode']} (accuracy {result['accuracy']:.2f}); "
        f"top_k {sparse['top_k']} ({sparse['top_k_schedule']}), sinks {sparse['sink_tokens']}, "
        f"recent {sparse['recent_tokens']}"
    )
    columns = (*FIGURES, "needle_mass_lost")
    titles = ("needle", "top head", "gate kept", "oracle kept", "gate needle", "oracle needle", "gate mass")
    titles += ("oracle mass", "needle lost")
    print(f"{'layer':>5} " + " ".join(f"{title:>13}" for title in titles))
    for layer, figures in layers.items():
        print(f"{layer:>5} " + " ".join(f"{figures[name]:13.4f}" for name in columns))
    ranked = ranked_layers(layers)
    lost = sum(figures["needle_mass_lost"] for figures in layers.values())
    print("\nlayers by the needle mass the gate loses (share of the loss over all layers, cumulative):")
    running = 0.0
    for layer in ranked[:10]:
        running += layers[layer]["needle_mass_lost"]
        print(f"{layer:>5} {layers[layer]['needle_mass_lost']:8.4f} {running / lost if lost > 0 else 0:8.1%}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.passkey_probe",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--export", required=True, help="a gate export (gate_only or joint)")
    parser.add_argument("--model", default=None, help="the base (default: the one the export names)")
    parser.add_argument("--filler", default="embedded:sample_prose", help="the prose the needle hides in")
    parser.add_argument("--length", type=int, default=2048, help="tokens per case")
    parser.add_argument("--cases", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0, help="draws the cases (as gsm-train passkey --seed)")
    parser.add_argument(
        "--mode",
        choices=("dense", "sparse", "oracle"),
        default="dense",
        help="main attention while probing: dense isolates each layer's gate from the others' selections",
    )
    add_select_argument(parser)
    parser.add_argument(
        "--result", default=str(REPO / "benchmarks" / "results" / "passkey_probe.json"), help="the result JSON"
    )
    parser.add_argument("--plot", default=None, help="a PNG of the per-layer figures")
    args = parser.parse_args(argv)
    selection, selections = parse_selection(args.select)
    if selections:
        parser.error(f"--select {next(iter(selections))}.FIELD: the probe runs one export; give FIELD=VALUE")
    result = run_probe(args.model, args.export, args.filler, args.length, args.cases, args.seed, args.mode, selection)
    result["ranked_layers"] = ranked_layers(result["layers"])
    print_table(result)
    write_result(Path(args.result), result)
    if args.plot:
        layers = list(result["layers"])
        figures = {name: [result["layers"][layer][name] for layer in layers] for name in FIGURES}
        print(f"wrote {plot_needle_per_layer(layers, figures, Path(args.plot))}")
    return result


if __name__ == "__main__":
    main()
