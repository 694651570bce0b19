"""Which 4-bit group size keeps a base's perplexity, measured on the CPU in minutes: the base's linears quantized
as `weights="int4-g<N>"` quantizes them (`gsm_train.export.int4.quantize_base`, torchao's CPU int4 tensor), then
each 4-bit layer's weight read back through its own kernel (the layer applied to the identity: the weight the
kernel multiplies with) into a float32 layer, and perplexity taken in float32 on held-out windows. The 4-bit
kernel itself takes minutes a window of 2048 tokens on the CPU; the weights it multiplies with are the same,
only the products' summation order differs. A choice made here is then measured on the GPU with the real
kernels (`benchmarks.int4_hybrid --smollm2-weights int4-g<N>`), on other windows.

With `--export`, the export is loaded onto the base first (`load_gsm`; LoRA deltas merged into their layers
before quantizing, as `quantize_base` does) and the GSM model's perplexity is taken in `--mode`.

SmolLM2-135M here is the Q4_1 GGUF (gsm_train/models): each run of 32 weights along a row is already an
affine 4-bit grid from its min to its max, which groups of 32 reproduce and groups of 64 re-grid
(docs/int4.md, 'SmolLM2's weights are 4-bit already').

    python -m benchmarks.int4_groups --eval-data DATA/wikitext-2/valid.txt --result OUT.json
        [--model smollm2-135m] [--export FOLDER] [--mode sparse] [--groups 32 64] [--seq-len 2048]
        [--windows 8] [--first-window 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

from benchmarks.common import provenance, write_result
from benchmarks.generate import say
from gsm_train.commands.evaluate import perplexity_and_recall
from gsm_train.data.text import load_text_dataset, pack_tokens
from gsm_train.export.int4 import GROUP_SIZES, check_int4, quantize_base
from gsm_train.export.save_load import load_gsm
from gsm_train.models.model_zoo import load_model_and_tokenizer


@torch.no_grad()
def expand_to_float(model: nn.Module, names: list[str]) -> None:
    """Replace each named 4-bit linear's weight [out, in] by the float32 weight its kernel multiplies with:
    the layer applied to the identity [in, in] gives that weight's transpose, each entry one product with 1."""
    modules = dict(model.named_modules())
    for name in names:
        linear = modules[name]
        identity = torch.eye(linear.in_features, dtype=torch.float32)
        weight = nn.functional.linear(identity, linear.weight).T.contiguous()
        linear.weight = nn.Parameter(weight, requires_grad=False)


def load(args: argparse.Namespace) -> tuple[nn.Module, object]:
    """The float32 base on the CPU, with the export's GSM modules in `--mode` when `--export` is given."""
    model, tokenizer = load_model_and_tokenizer(args.model)
    if args.export:
        load_gsm(model, args.export, mode=args.mode)
    return model.eval(), tokenizer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eval-data", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--export", default=None)
    parser.add_argument("--mode", default="sparse", choices=["sparse", "dense"])
    parser.add_argument("--groups", type=int, nargs="+", default=[32, 64], choices=sorted(set(GROUP_SIZES.values())))
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--first-window", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("seq_len", "windows"):
        if getattr(args, name) < 2:
            parser.error(f"--{name.replace('_', '-')} must be at least 2, got {getattr(args, name)}")
    if args.first_window < 0:
        parser.error(f"--first-window must be at least 0, got {args.first_window}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_int4("cpu", torch.float32)
    model, tokenizer = load(args)
    rows = pack_tokens(load_text_dataset(args.eval_data), tokenizer, args.seq_len)
    windows = rows[args.first_window : args.first_window + args.windows]
    if len(windows) < args.windows:
        raise SystemExit(f"--eval-data has {len(rows)} windows of {args.seq_len} tokens; asked for {args.windows}")
    say(f"full weights: {len(windows)} windows of {args.seq_len} tokens")
    full = perplexity_and_recall(model, windows, 1, None)["ppl"]  # as `gsm-train eval` takes it
    result = {
        **provenance(),
        "settings": {k: getattr(args, k) for k in ("model", "export", "mode", "seq_len", "windows", "first_window")},
        "ppl_full": full,
        "groups": {},
    }
    print(f"\n| weights | perplexity | over full |\n|---|---|---|\n| full (float32) | {full:.4f} | 1.0000 |")
    for group in args.groups:
        model, _ = load(args)
        names = quantize_base(model, group)
        expand_to_float(model, names)
        ppl = perplexity_and_recall(model, windows, 1, None)["ppl"]
        result["groups"][str(group)] = {"ppl": ppl, "over_full": ppl / full, "layers": len(names)}
        print(f"| int4, groups of {group} | {ppl:.4f} | {ppl / full:.4f} |", flush=True)
    write_result(Path(args.result), result)


if __name__ == "__main__":
    main()
