"""Why a gate's selection degrades past the length it was trained at: per query-position bucket
and per layer, on held-out windows, what the gate keeps against what the true top-k would, and the
same with each suspected cause taken away.

python -m benchmarks.long_context_probe --export RUN/gate_only/export --eval-data PATH/valid.txt \\
    --seq-len 8192 --windows 4 --result OUT.json

For every layer with a gate and every query with at least --min-keys keys (one forward per window,
main attention as --mode says), measured against the head-averaged attention target:

- captured mass at k of the oracle (the true top-k) and of the gate, their ratio, and the overlap
  of the gate's top-k with the oracle's;
- the gate's logits: their standard deviation over the visible keys, the entropy of their softmax
  and of the target (both over log of the visible keys), KL(target || gate): calibration by
  position (a top-k per query is unchanged by any rescaling of its logits, so these speak to
  training, not directly to selection);
- how far back each selection reaches: the share of selected keys at least --train-len behind the
  query, gate against oracle (rows past --train-len only);
- the causes, each taken away in turn, as the gate's mass ratio:
  - `bf16 keys`: gate keys scored in bf16 instead of as the export stores them (int8 with a scale
    per key where `gate_key_bits` is 8);
  - `RoPE interp.`: the gate's rotary pairs whose wavelength exceeds --train-len (which turn
    through angles at --seq-len that training never showed) rotated at frequency x train_len /
    seq_len, so their angles stay within the trained range ("YaRN by parts", for the gate only);
  - `k scaled`: gate and oracle at k_t = max(k, ceil(k / train_len x (t + 1))), the same share of
    the visible keys as at the training length (the `fraction` top-k schedule);
- per layer, the gate's rotary frequencies (`rope_freq_index`) as wavelengths, and how many
  exceed the training length and the window.

It prints a table per bucket (over layers), the layers whose ratio falls most, and how much of the
fall from the first bucket to the last each cause taken away gives back; all goes to the JSON.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from transformers import AttentionInterface

from benchmarks.common import git_commit, write_result
from gsm_train.attention.dispatch import ATTN_IMPLEMENTATION, gsm_attention_forward
from gsm_train.attention.forward_state import FORWARD_KWARG
from gsm_train.commands.evaluate import bucket_label, inference_autocast, position_buckets, prepare_evaluation
from gsm_train.data.text import load_text_dataset, pack_tokens
from gsm_train.functional.attention_targets import head_averaged_probs
from gsm_train.functional.gate_keys import decode_gate_keys, encode_gate_keys
from gsm_train.functional.top_k import select_top_k
from gsm_train.modules import SparseGateHead

REPO = Path(__file__).resolve().parents[1]
# the sums kept per layer and bucket (fp64); a figure is a sum over its rows divided by theirs
PER_ROW = (
    "oracle_mass",
    "gate_mass",
    "gate_mass_bf16_keys",
    "gate_mass_rope_interpolated",
    "oracle_mass_k_scaled",
    "gate_mass_k_scaled",
    "overlap",
    "gate_logit_std",
    "gate_entropy",
    "target_entropy",
    "kl",
)
FAR = ("gate_far_share", "oracle_far_share")
SUMS = ("rows", *PER_ROW, "far_rows", *FAR)
# the causes taken away, by the figure that measures the gate without them
CAUSES = {
    "bf16 keys": "bf16_keys_over_oracle",
    "RoPE interp.": "rope_interpolated_over_oracle",
    "k scaled": "k_scaled_over_oracle",
}


@dataclass(frozen=True)
class ProbeSettings:
    """What the probe measures: window `seq_len`, the length the gate was trained at `train_len`,
    the k of the captured mass, the queries counted (`min_keys` keys or more), query `chunk` rows at
    a time, the position buckets (starts), and the keys every selection keeps (the export's)."""

    seq_len: int
    train_len: int
    k: int
    min_keys: int
    chunk: int
    bucket_starts: tuple[int, ...]
    sink_tokens: int = 0
    recent_tokens: int = 0


def rope_frequencies(cos: Tensor, sin: Tensor) -> tuple[Tensor, float]:
    """The base's rotary frequencies theta [head_dim / 2] (fp64, to the precision of the model's
    cos/sin: bf16 on the GPU, 0.4%) and its attention scaling, from the cos/sin [B, T, head_dim] of
    positions 0, 1, ... (rotate-half layout: the first half)."""
    half = cos.shape[-1] // 2
    theta = torch.atan2(sin[0, 1, :half].double(), cos[0, 1, :half].double())
    return theta, float(cos[0, 0, 0])


def interpolated_rope(cos: Tensor, sin: Tensor, train_len: int, seq_len: int) -> tuple[Tensor, Tensor]:
    """The model's cos/sin, but every pair whose wavelength exceeds `train_len` rotated at its
    frequency x train_len / seq_len (its angles at seq_len stay within those of training); the
    other pairs keep the model's values exactly."""
    theta, scale = rope_frequencies(cos, sin)
    long_wave = 2 * math.pi / theta.abs() > train_len
    positions = torch.arange(cos.shape[1], dtype=torch.float64, device=theta.device)
    angles = positions[:, None] * (theta * train_len / seq_len)
    angles = torch.cat((angles, angles), dim=-1)[None].to(cos.device)
    keep = ~torch.cat((long_wave, long_wave)).to(cos.device)
    return (
        torch.where(keep, cos, (scale * angles.cos()).to(cos.dtype)),
        torch.where(keep, sin, (scale * angles.sin()).to(sin.dtype)),
    )


def gate_wavelengths(gate: SparseGateHead, theta: Tensor) -> list[list[float]]:
    """Per selector, the wavelengths (tokens) of the base frequencies its rotary pairs use: inf for a pair
    that is not rotated (its index one past the model's frequencies, `gate_rope.unrotated_index`)."""
    frequencies = torch.cat((theta.abs(), theta.new_zeros(1)))  # the unrotated pair: frequency 0
    return [(2 * math.pi / frequencies[index.cpu()]).tolist() for index in gate.rope_freq_index]


def true_top_k(target: Tensor, allowed: Tensor, k: Tensor) -> Tensor:
    """The oracle's selection [B, n, c, S]: each row's k[row] most attended allowed keys, nothing
    forced (the oracle of `gsm-train eval`'s captured mass)."""
    index = target.topk(min(int(k.max()), target.shape[-1]), dim=-1).indices
    keep = torch.arange(index.shape[-1], device=k.device)[None, :] < k[:, None]
    chosen = torch.zeros(target.shape, dtype=torch.bool, device=target.device)
    return chosen.scatter(-1, index, keep.expand(index.shape)) & allowed


def _selection_share(selection: Tensor, mask: Tensor) -> Tensor:
    """Share of each row's selected keys that `mask` marks [B, n, c]."""
    return (selection & mask).sum(-1).double() / selection.sum(-1).clamp_min(1).double()


class LongContextProbe:
    """Sums of every `SUMS` figure per gate layer and bucket [layers, buckets, sums] (fp64, host),
    filled by `observe` from each layer's pass."""

    def __init__(self, settings: ProbeSettings, num_layers: int) -> None:
        self.settings = settings
        self.sums = torch.zeros(num_layers, len(settings.bucket_starts), len(SUMS), dtype=torch.float64)
        self.wavelengths: dict[int, list[list[float]]] = {}

    @torch.no_grad()
    def observe(self, module: nn.Module, query: Tensor, key: Tensor, forward_state: Any) -> None:
        """One layer's pass: query [B, Hq, T, D] and key [B, Hkv, T, D] after RoPE; the gate's
        input from the forward's state (peeked at, not taken)."""
        gate = getattr(getattr(module, "gsm", None), "gate", None)
        if gate is None or forward_state is None or query.shape[2] != key.shape[2]:
            return
        cfg = self.settings
        hidden, cos, sin = forward_state.layer_inputs[module.layer_idx]
        theta, _ = rope_frequencies(cos, sin)
        self.wavelengths[module.layer_idx] = gate_wavelengths(gate, theta)
        gate_q, gate_k = gate(hidden, cos, sin)
        interp_q, interp_k = gate(hidden, *interpolated_rope(cos, sin, cfg.train_len, cfg.seq_len))
        keys = {
            "stored": gate.stored_keys(gate_k),
            "interp": gate.stored_keys(interp_k),
            "bf16": decode_gate_keys(*encode_gate_keys(gate_k, 16)),
        }
        length, device = query.shape[2], query.device
        positions = torch.arange(length, device=device)
        starts = torch.tensor(cfg.bucket_starts)
        bucket_of = (torch.searchsorted(starts, torch.arange(length), right=True) - 1).to(device)
        for start in range(0, length, cfg.chunk):
            stop = min(start + cfg.chunk, length)
            if stop < cfg.min_keys:
                continue
            rows = slice(start, stop)
            sums = self._chunk(gate, query, key, gate_q, interp_q, keys, module.scaling, rows, positions)
            self.sums[module.layer_idx].index_add_(0, bucket_of[rows].cpu(), sums.cpu())

    def _chunk(
        self,
        gate: SparseGateHead,
        query: Tensor,
        key: Tensor,
        gate_q: Tensor,
        interp_q: Tensor,
        keys: dict[str, Tensor],
        scaling: float,
        rows: slice,
        positions: Tensor,
    ) -> Tensor:
        """The `SUMS` of query rows `rows` [c, len(SUMS)] (summed over batch and selectors)."""
        cfg = self.settings
        stop = rows.stop
        q_pos, k_pos = positions[rows], positions[:stop]
        allowed = (k_pos[None, :] <= q_pos[:, None])[None, None]  # [1, 1, c, S]
        counted = ((q_pos + 1) >= cfg.min_keys).double()  # [c]
        far_rows = counted * (q_pos >= cfg.train_len).double()
        target = head_averaged_probs(
            query[:, :, rows], key[:, :, :stop], allowed, scaling, gate.num_selectors
        ).float()  # [B, n, c, S]
        k_const = torch.full_like(q_pos, cfg.k)
        k_scaled = torch.maximum(k_const, torch.ceil(cfg.k / cfg.train_len * (q_pos + 1)).long())

        def pick(scores: Tensor, k: Tensor) -> Tensor:
            return select_top_k(
                scores,
                allowed,
                k,
                q_pos,
                k_pos,
                cfg.sink_tokens,
                cfg.recent_tokens,
                k_max=int(k.max()),
                uniform_k=k is k_const,
            )

        def mass(selection: Tensor) -> Tensor:
            return (target * selection).sum(-1).double()

        queries = {"stored": gate_q, "bf16": gate_q, "interp": interp_q}
        scores = {
            name: gate.score_stored(queries[name][:, :, rows], stored[:, :, :stop]).float()
            for name, stored in keys.items()
        }
        oracle, chosen = true_top_k(target, allowed, k_const), pick(scores["stored"], k_const)
        log_gate = torch.log_softmax(scores["stored"].masked_fill(~allowed, float("-inf")), dim=-1)
        log_target = torch.log(target.clamp_min(1e-30))
        log_visible = torch.log((q_pos + 1).double()).clamp_min(1e-9)
        visible = allowed.expand_as(target)
        logits = scores["stored"].masked_fill(~visible, 0.0)
        count = (q_pos + 1).double()
        mean = logits.sum(-1).double() / count
        variance = (logits.double() ** 2).sum(-1) / count - mean**2
        far = (q_pos[:, None] - k_pos[None, :] >= cfg.train_len)[None, None]
        per_row = {
            "oracle_mass": mass(oracle),
            "gate_mass": mass(chosen),
            "gate_mass_bf16_keys": mass(pick(scores["bf16"], k_const)),
            "gate_mass_rope_interpolated": mass(pick(scores["interp"], k_const)),
            "oracle_mass_k_scaled": mass(true_top_k(target, allowed, k_scaled)),
            "gate_mass_k_scaled": mass(pick(scores["stored"], k_scaled)),
            "overlap": _selection_share(chosen, oracle),
            "gate_logit_std": variance.clamp_min(0).sqrt(),
            "gate_entropy": -(log_gate.exp() * log_gate.masked_fill(~visible, 0)).sum(-1).double() / log_visible,
            "target_entropy": -(target * log_target).sum(-1).double() / log_visible,
            "kl": torch.where(target > 0, target * (log_target - log_gate), 0.0).sum(-1).double(),
        }
        out = [counted.expand(*target.shape[:2], -1)]
        out += [per_row[name] * counted for name in PER_ROW]
        out += [far_rows.expand(*target.shape[:2], -1)]
        out += [_selection_share(selection, far) * far_rows for selection in (chosen, oracle)]
        return torch.stack([value.sum((0, 1)) for value in out], dim=-1)  # [c, len(SUMS)]

    def report(self) -> dict[str, Any]:
        """Per layer and bucket, and over layers per bucket: every figure per counted row (far
        shares per row past the training length), mass ratios, and the gate's wavelengths."""
        cfg = self.settings
        stops = [*cfg.bucket_starts[1:], cfg.seq_len]
        buckets = [[a, b] for a, b in zip(cfg.bucket_starts, stops, strict=True)]
        layers = {
            layer: {
                "buckets": [_figures(self.sums[layer, b]) for b in range(len(buckets))],
                "rope": _rope_summary(wavelengths, cfg),
            }
            for layer, wavelengths in sorted(self.wavelengths.items())
        }
        gate_layers = sorted(self.wavelengths)
        # over layers as `gsm-train eval` reports it: sums over the layers, then their ratios
        over_layers = [_figures(self.sums[gate_layers, b].sum(0)) for b in range(len(buckets))]
        return {"buckets": buckets, "over_layers": over_layers, "layers": layers, "recovery": _recovery(over_layers)}


def _figures(sums: Tensor) -> dict[str, float]:
    """A bucket's figures from its `SUMS` [len(SUMS)]."""
    named = dict(zip(SUMS, sums.tolist(), strict=True))
    rows, far_rows = named["rows"], named["far_rows"]
    if rows == 0:
        return {"rows": 0}
    figures = {"rows": int(rows)} | {name: named[name] / rows for name in PER_ROW}
    if far_rows:
        figures |= {"far_rows": int(far_rows)} | {name: named[name] / far_rows for name in FAR}
    oracle = figures["oracle_mass"]
    figures["gate_over_oracle"] = figures["gate_mass"] / oracle
    figures["bf16_keys_over_oracle"] = figures["gate_mass_bf16_keys"] / oracle
    figures["rope_interpolated_over_oracle"] = figures["gate_mass_rope_interpolated"] / oracle
    figures["k_scaled_over_oracle"] = figures["gate_mass_k_scaled"] / figures["oracle_mass_k_scaled"]
    return figures


def _rope_summary(wavelengths: list[list[float]], cfg: ProbeSettings) -> dict[str, Any]:
    """The gate's wavelengths ("none" for an unrotated pair, which JSON's numbers cannot say as inf) and
    how many of its rotated pairs turn less than once within the training length and the window."""
    flat = [w for selector in wavelengths for w in selector]
    return {
        "wavelengths": [[round(w, 1) if math.isfinite(w) else "none" for w in selector] for selector in wavelengths],
        "pairs": len(flat),
        "pairs_unrotated": sum(not math.isfinite(w) for w in flat),
        "pairs_beyond_train_len": sum(cfg.train_len < w < math.inf for w in flat),
        "pairs_beyond_seq_len": sum(cfg.seq_len < w < math.inf for w in flat),
    }


def _recovery(over_layers: list[dict[str, float]]) -> dict[str, float | None]:
    """How much of the gate/oracle ratio's fall from the first bucket to the last each cause taken
    away gives back in the last bucket (1: all of it; None where the ratio does not fall)."""
    first, last = over_layers[0], over_layers[-1]
    if "gate_over_oracle" not in first or "gate_over_oracle" not in last:
        return {}
    fall = first["gate_over_oracle"] - last["gate_over_oracle"]
    result: dict[str, float | None] = {"fall": fall}
    for cause, name in CAUSES.items():
        result[cause] = (last[name] - last["gate_over_oracle"]) / fall if fall > 1e-6 else None
    return result


class Observer(Protocol):
    """What `probing` feeds: each GSM attention call's module, query and key after RoPE, and forward state."""

    def observe(self, module: nn.Module, query: Tensor, key: Tensor, forward_state: Any) -> None: ...


@contextmanager
def probing(probe: Observer) -> Iterator[None]:
    """Within: every GSM attention call also feeds `probe` (the registered `gsm` function wrapped,
    restored on leaving)."""

    def attention(
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[Tensor, None]:
        probe.observe(module, query, key, kwargs.get(FORWARD_KWARG))
        return gsm_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)

    AttentionInterface.register(ATTN_IMPLEMENTATION, attention)
    try:
        yield
    finally:
        AttentionInterface.register(ATTN_IMPLEMENTATION, gsm_attention_forward)


def trained_length(training_args: dict[str, Any]) -> int | None:
    """The `data.seq_len` of the run that wrote an export (from its training_args.json), if it says."""
    recipe = training_args.get("recipe") or {}
    return (recipe.get("data") or {}).get("seq_len")


def run_probe(
    model_name: str | None,
    export: str,
    eval_data: str,
    seq_len: int,
    windows: int,
    train_len: int | None,
    k: int | None,
    min_keys: int,
    first_bucket: int,
    chunk: int,
    mode: str,
) -> dict[str, Any]:
    """Load the export (on the base it names, or `model_name`), run `windows` windows of
    `seq_len` tokens of `eval_data` through it while probing every gate layer; the report."""
    evaluation = prepare_evaluation(model_name, {"gate": export}, mode)
    train_len = train_len or trained_length(evaluation.read["gate"].training_args)
    if train_len is None:
        raise SystemExit(f"{export} does not record the length it was trained at; give --train-len")
    loaded = evaluation.load("gate")
    sparse = loaded.settings.config.sparse_attention
    starts = tuple(start for start, _ in position_buckets(seq_len, first_bucket))
    k = k or (sparse.k_min if sparse.top_k_schedule == "fraction" else sparse.top_k)
    settings = ProbeSettings(
        seq_len, train_len, k, min(min_keys, seq_len), chunk, starts, sparse.sink_tokens, sparse.recent_tokens
    )
    probe = LongContextProbe(settings, loaded.model.config.num_hidden_layers)
    rows = pack_tokens(load_text_dataset(eval_data), evaluation.tokenizer, seq_len)[:windows]
    device = next(loaded.model.parameters()).device
    with torch.no_grad(), probing(probe), inference_autocast(device):
        for row in rows:
            loaded.model(input_ids=row[None].to(device), use_cache=False, logits_to_keep=1)
    return {
        "model": evaluation.model_name,
        "export": export,
        "eval_data": eval_data,
        "mode": mode,
        "seq_len": seq_len,
        "windows": len(rows),
        "train_len": train_len,
        "k": settings.k,
        "min_keys": settings.min_keys,
        "gate_key_bits": sparse.gate_key_bits,
        "gate_head_dim": sparse.gate_head_dim,
    } | probe.report()


def _cells(values: list[float | None], width: int) -> str:
    return " ".join(f"{v:{width}.3f}" if v is not None else f"{'-':>{width}}" for v in values)


def print_tables(result: dict[str, Any]) -> None:
    """The findings as text: per bucket over layers, the layers that fall most, the recovery."""
    labels = [bucket_label(a, b) for a, b in result["buckets"]]
    print(
        f"gate {result['export']} at {result['seq_len']} (trained at {result['train_len']}), "
        f"k={result['k']}, {result['windows']} windows, main attention {result['mode']}"
    )
    columns = [
        ("oracle mass", "oracle_mass"),
        ("gate/oracle", "gate_over_oracle"),
        ("bf16 keys", "bf16_keys_over_oracle"),
        ("RoPE interp.", "rope_interpolated_over_oracle"),
        ("k scaled", "k_scaled_over_oracle"),
        ("overlap", "overlap"),
        ("logit std", "gate_logit_std"),
        ("H gate", "gate_entropy"),
        ("H target", "target_entropy"),
        ("KL", "kl"),
        ("far gate", "gate_far_share"),
        ("far oracle", "oracle_far_share"),
    ]
    print(f"{'bucket':>10} " + " ".join(f"{title:>12}" for title, _ in columns))
    for label, figures in zip(labels, result["over_layers"], strict=True):
        print(f"{label:>10} " + _cells([figures.get(key) for _, key in columns], 12))
    last = len(labels) - 1

    def fall(item: tuple[Any, dict[str, Any]]) -> float:
        parts = item[1]["buckets"]
        return parts[0].get("gate_over_oracle", 0) - parts[last].get("gate_over_oracle", 0)

    print(
        f"\nlayers by the fall of gate/oracle from {labels[0]} to {labels[last]} (ratios; "
        "then rotary pairs with wavelength beyond the training length, and the window):"
    )
    print(
        f"{'layer':>5} {labels[0]:>8} {labels[last]:>8} {'bf16':>8} {'interp':>8} "
        f"{'k scaled':>8} {'> train':>8} {'> window':>8}"
    )
    for layer, figures in sorted(result["layers"].items(), key=fall, reverse=True)[:8]:
        first, end, rope = figures["buckets"][0], figures["buckets"][last], figures["rope"]
        ratios = [
            first.get("gate_over_oracle"),
            end.get("gate_over_oracle"),
            end.get("bf16_keys_over_oracle"),
            end.get("rope_interpolated_over_oracle"),
            end.get("k_scaled_over_oracle"),
        ]
        pairs = f"{rope['pairs_beyond_train_len']}/{rope['pairs']}"
        print(f"{layer:>5} {_cells(ratios, 8)} {pairs:>8} {rope['pairs_beyond_seq_len']:>5}/{rope['pairs']:<2}")
    recovery = result["recovery"]
    if recovery:
        parts = ", ".join(
            f"{cause} {share:.0%}" if share is not None else f"{cause} -"
            for cause, share in recovery.items()
            if cause != "fall"
        )
        print(
            f"\ngate/oracle falls by {recovery['fall']:.3f} from {labels[0]} to {labels[last]}; "
            f"taking a cause away gives back: {parts}"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.long_context_probe",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--export", required=True, help="a gate export (gate_only or joint)")
    parser.add_argument("--model", default=None, help="the base (default: the one the export names)")
    parser.add_argument("--eval-data", required=True, help="held-out text (file, folder, glob, embedded:NAME)")
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens per window")
    parser.add_argument("--windows", type=int, default=4, help="held-out windows read")
    parser.add_argument(
        "--train-len",
        type=int,
        default=None,
        help="the length the gate was trained at (default: the export's training_args.json)",
    )
    parser.add_argument(
        "--k",
        type=int,
        default=None,
        help="captured mass at k (default: the export's top_k; its k_min, the k "
        "kept up to the training length, on the fraction schedule)",
    )
    parser.add_argument("--min-keys", type=int, default=512, help="count queries with at least this many keys")
    parser.add_argument("--first-bucket", type=int, default=2048, help="buckets [0, N), [N, 2N), [2N, 4N), ...")
    parser.add_argument("--chunk", type=int, default=512, help="query rows measured at a time (memory)")
    parser.add_argument(
        "--mode",
        choices=("dense", "sparse"),
        default="dense",
        help="main attention while probing: dense isolates each layer's gate from "
        "the others' selections; sparse runs as inference does",
    )
    parser.add_argument(
        "--result",
        default=str(REPO / "benchmarks" / "results" / "long_context_probe.json"),
        help="the result JSON (command, commit, device, every figure)",
    )
    args = parser.parse_args(argv)
    result = run_probe(
        args.model,
        args.export,
        args.eval_data,
        args.seq_len,
        args.windows,
        args.train_len,
        args.k,
        args.min_keys,
        args.first_bucket,
        args.chunk,
        args.mode,
    )
    result["commit"] = git_commit(REPO)
    print_tables(result)
    write_result(Path(args.result), result)
    return result


if __name__ == "__main__":
    main()
