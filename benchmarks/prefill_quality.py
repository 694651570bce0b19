"""What the prefill mode does to quality: perplexity of a continuation scored through the GSM cache after
a dense prefill (the prompt attends as the base model; the cache is filled from its K/V) and after a sparse
one (the prompt attends as the teacher-forced GSM pass), beside the dense model.

Each window of held-out text is `--prompt` tokens of prompt and `--continuation` tokens scored:
- `dense_model`: the base with GSM off, one teacher-forced forward over the window;
- `gsm_dense_prefill`, `gsm_sparse_prefill`: the prompt into a `GSMCache` in that prefill mode, then the
  continuation fed one token per call through the cache (GSM's token steps), each token scored by the
  logits before it (the first by the prompt's last position);
- with `--chunk N`, also `gsm_dense_prefill_chunked` / `gsm_sparse_prefill_chunked`: the prompt in calls of
  N tokens (later chunks read the earlier ones as the cache holds them), and `dense_model_chunked`'s prefill
  time (transformers' cache, the same calls).
Each method also times its prefill of one window's prompt (`prefill_ms_batch1`, median of 3 after one, and
over the dense model's): on a CPU an indication of time to first token, not the GPU figure.

GSM modules: an export (`--export`), or the recipe's modules as injected, untrained (`--recipe`, default
recipes/joint.yaml; `--gsm gsm.KEY=VALUE` on top). CPU, fp32 unless a GPU is there (then bf16).

    python -m benchmarks.prefill_quality --data ../shared/data/wikitext-2/valid.txt --prompt 1024 \
        --continuation 64 --windows 4 --result benchmarks/results/prefill_quality.json
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DynamicCache

from benchmarks.common import REPO, add_gsm_argument, median_ms, write_result
from gsm_train.attention import gsm_disabled, inject_gsm
from gsm_train.config.schema import load_recipe
from gsm_train.data.text import load_text_dataset, pack_tokens
from gsm_train.export.save_load import load_gsm
from gsm_train.inference.cache import GSMCache, cache_kwargs
from gsm_train.models.model_zoo import load_model_and_tokenizer


@torch.no_grad()
def continuation_nll(model: nn.Module, windows: Tensor, prompt_len: int, prefill: str | None, chunk: int = 0) -> Tensor:
    """Per-token negative log-likelihood [N, C] (fp64) of each window's last C = len - `prompt_len` tokens.
    `prefill` None: the dense model (GSM off), one teacher-forced forward; `dense` / `sparse`: the prompt
    into a GSM cache in that prefill mode (in calls of `chunk` tokens; 0: one call), then one token per call
    through the cache."""
    targets = windows[:, prompt_len:]
    if prefill is None:
        with gsm_disabled(model):
            logits = model(windows, use_cache=False).logits[:, prompt_len - 1 : -1]
    else:
        cache = cache_kwargs(model, GSMCache(model, capacity=windows.shape[1], prefill=prefill))
        parts = [prefill_prompt(model, windows[:, :prompt_len], cache, chunk)]
        for position in range(prompt_len, windows.shape[1] - 1):
            parts.append(model(windows[:, position : position + 1], **cache, use_cache=True).logits)
        logits = torch.cat(parts, 1)
    return F.cross_entropy(logits.double().transpose(1, 2), targets, reduction="none")


def prefill_prompt(model: nn.Module, prompt: Tensor, cache: dict, chunk: int = 0) -> Tensor:
    """Feed `prompt` [N, P] into the cache (`cache_kwargs`) in calls of `chunk` tokens (0: one call); returns
    the logits of its last position [N, 1, V]."""
    step = chunk or prompt.shape[1]
    for start in range(0, prompt.shape[1], step):
        out = model(prompt[:, start : start + step], **cache, use_cache=True, logits_to_keep=1)
    return out.logits


@torch.no_grad()
def prefill_ms(model: nn.Module, prompt: Tensor, prefill: str | None, chunk: int = 0) -> float:
    """Median milliseconds (3 runs after one) of the prefill of `prompt` [N, P], the bulk of time to first
    token: the dense model's (GSM off, transformers' own cache) or GSM's into a fresh cache in that mode."""

    def run() -> None:
        if prefill is None:
            with gsm_disabled(model):
                prefill_prompt(model, prompt, cache_kwargs(model, DynamicCache()), chunk)
        else:
            cache = GSMCache(model, capacity=prompt.shape[1], prefill=prefill)
            prefill_prompt(model, prompt, cache_kwargs(model, cache), chunk)

    return median_ms(run, warmup=1, repeat=3)


def compare_prefills(model: nn.Module, windows: Tensor, prompt_len: int, chunk: int = 0) -> dict[str, dict]:
    """Continuation perplexity (and the mean NLL per window, seconds taken) of the dense model and of GSM
    after each prefill mode (and, with `chunk`, each mode fed in chunks of that many tokens)."""
    methods: dict[str, tuple[str | None, int]] = {
        "dense_model": (None, 0),
        "gsm_dense_prefill": ("dense", 0),
        "gsm_sparse_prefill": ("sparse", 0),
    }
    if chunk:
        methods |= {
            "dense_model_chunked": (None, chunk),
            "gsm_dense_prefill_chunked": ("dense", chunk),
            "gsm_sparse_prefill_chunked": ("sparse", chunk),
        }
    results = {}
    for name, (prefill, size) in methods.items():
        results[name] = {"prefill_ms_batch1": prefill_ms(model, windows[:1, :prompt_len], prefill, size)}
        if prefill is None and size:
            continue  # the dense model's scores do not depend on how its prompt is fed
        tic = time.perf_counter()
        nll = continuation_nll(model, windows, prompt_len, prefill, size)
        results[name] |= {
            "perplexity": math.exp(float(nll.mean())),
            "first_token_nll": float(nll[:, 0].mean()),
            "nll_per_window": [round(float(row.mean()), 5) for row in nll],
            "seconds": round(time.perf_counter() - tic, 2),
        }
        print(f"{name}: {results[name]}", flush=True)
    dense = results["dense_model"]
    for row in results.values():
        row["prefill_over_dense_model"] = row["prefill_ms_batch1"] / dense["prefill_ms_batch1"]
        if "perplexity" in row:
            row["over_dense_model"] = row["perplexity"] / dense["perplexity"]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="held-out text (file, folder, glob, embedded:NAME)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--export", default=None, help="a GSM export of --model (default: --recipe's modules)")
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "joint.yaml"))
    add_gsm_argument(parser, "GSM settings on top of --recipe's")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--continuation", type=int, default=64)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=0, help="also feed the prompt in calls of this many tokens")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1: a shared machine runs faster)")
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_model_and_tokenizer(args.model, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    model.to(device).eval()
    windows = pack_tokens(load_text_dataset(args.data), tokenizer, args.prompt + args.continuation)
    windows = windows[: args.windows].to(device)
    torch.manual_seed(0)
    if args.export:
        load_gsm(model, args.export, mode="sparse")
        modules = f"export {args.export}"
    else:
        inject_gsm(model, load_recipe(args.recipe, args.gsm).gsm, mode="sparse")
        modules = f"{Path(args.recipe).name} {' '.join(args.gsm)} (untrained)".replace("  ", " ")
    results = compare_prefills(model, windows, args.prompt, args.chunk)
    write_result(
        Path(args.result),
        {
            "model": args.model,
            "gsm_modules": modules,
            "data": args.data,
            "prompt_tokens": args.prompt,
            "continuation_tokens": args.continuation,
            "windows": len(windows),
            "chunk": args.chunk,
            "dtype": str(next(model.parameters()).dtype),
            "methods": results,
        },
    )


if __name__ == "__main__":
    main()
