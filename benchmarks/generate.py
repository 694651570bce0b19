"""End-to-end generation as users run it, on one GPU: `model.generate` over the GSM cache (after
`enable_gsm_generation`, as `GSMModel.from_pretrained` calls it: chunked prefill, token steps replayed
from CUDA graphs) against the dense base with transformers' static cache, whose decode step transformers
compiles (what a user would pick), with its default dynamic cache (eager), and through our own dense
engine (`dense_engine`: `gsm_train.inference.dense_engine`, a preallocated bf16 cache, the token step
captured in a CUDA graph, SDPA / flash decode over the valid prefix): what a serving engine gives the dense model.

Rows (`--rows`, default all):
- `8b_32k_bs1`, `8b_32k_bs16`, `8b_128k_bs1`, `8b_128k_bs16`: a Llama-3-8B-shaped model (32 layers, 32 / 8
  heads, head_dim 128, hidden 4096, vocab 128256) with random bf16 weights built from a config, the GSM
  modules as recipes/joint.yaml sets them (its layer_bits name SmolLM2's layers: none here; gates at
  random, since speed does not depend on their values); random prompt tokens. At 128k and batch 16 the
  dense cache does not fit one H200: the row says what does.
- `smollm2_8k_bs1`, `smollm2_8k_bs16`: SmolLM2-135M with `--smollm2-export` (or the recipe's modules,
  untrained) on held-out text (`--eval-data`), plus token agreement with teacher forcing (bf16), the
  captured step against the eager one, and (batch 1) the step KL of GSM and the dense model.

Per row and method: decode tokens/s over the new tokens after the second (the first comes from the prompt; the
second's step is where a graph is captured or a step compiled), time to first token (batch-1 rows, after a
warm-up call that compiles the kernels; `FIRST_TOKEN_CALLS`: at SmolLM2's batch-1 row the median of
first-token calls made after the timed one, with the allocator as a serving process has it from its second
request on, and apart the timed call's own, made after the allocator was emptied), peak device memory, the KV
bytes held, and the share of the bandwidth bound it runs at: the bytes one decode step must read
(`benchmarks.bandwidth`: weights plus the KV it reads, for GSM from the cache's own buffers) over the step's
time, against the peak a device-to-device copy reaches in the same run. Batch-16 GSM rows prefill one prompt
at batch 1 and copy the cache to every row (rows then decode alike; the time of a 16-row sparse prefill is not
what the row measures). `model.generate` decodes these greedy calls in GSM's own greedy loop
(`inference.greedy_loop`), not transformers' per-token loop, as the dense engine runs its own; each new token
is timed by a streamer. Batch-1 GSM rows also give `plain_loop_decode_tokens_per_s`: the same forward calls
driven by the dense engine's plain greedy loop (a check that `generate` adds nothing per token). The GSM rows
prefill with `--prefill` (default `dense`, the library's default: the prompt attends as the base model and
fills the GSM cache from its K/V; `sparse`: the teacher-forced GSM pass), and with `--prefill-chunk` prompt
tokens per forward (default the library's), recorded in the row settings. Token agreement and the step KL
compare cached decoding with GSM's own teacher-forced pass, so they prefill sparsely whatever `--prefill` says
(the same function on both sides). The summary: `e2e_speedup_<row>` (GSM over the fastest dense method of the
row), `bandwidth_share_<method>_<row>`, `ttft_ratio_<row>` (GSM's time to first token over the fastest dense
one; `ttft_cold_ratio_<row>` the same of the timed calls, where the row made warm calls), and from the SmolLM2
rows `step_kl_gsm_over_dense` (`benchmarks.step_kl`). Resumable: the JSON is written atomically after every
method; a row with the same settings is skipped when complete and keeps the methods it measured when cut
short; each row names the command, commit and device of the run that last wrote it (`measured`), since one
file gathers rows of several runs (progress lines give the seconds since the start).

python -m benchmarks.generate --eval-data DATA/wikitext-2/valid.txt [--smollm2-export EXPORT] --result OUT.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

from benchmarks import bandwidth
from benchmarks.agreement import agreement
from benchmarks.common import PROVENANCE_KEYS, provenance, write_result
from benchmarks.step_kl import step_kl
from gsm_train.attention import gsm_adapters, gsm_disabled, inject_gsm, set_gsm_mode
from gsm_train.config.schema import GSMConfig, load_recipe
from gsm_train.data.text import load_text_dataset, pack_tokens
from gsm_train.export.save_load import load_gsm
from gsm_train.inference.cache import DEFAULT_PREFILL, PREFILL_MODES, GSMCache, cache_kwargs
from gsm_train.inference.dense_engine import PREFILL_CHUNK as ENGINE_PREFILL_CHUNK
from gsm_train.inference.dense_engine import DenseEngine
from gsm_train.inference.engine import PREFILL_CHUNKS, enable_gsm_generation
from gsm_train.models.model_zoo import load_model_and_tokenizer, random_model

REPO = Path(__file__).resolve().parents[1]
DENSE_PREFILL_TOKENS = 4096  # the dense 8B rows' prompt tokens per prefill forward, all rows together (run_row)
DENSE_METHODS = ("dense_eager", "dense_static_compiled", "dense_engine")
ROW_VERSION = 4  # what a row holds (4: GSM's modules in eval mode, 16 step-KL rows); another version starts over
# First-token calls after each batch-1 method's timed call, by model family; their median is the method's
# `time_to_first_token_s`. The timed call runs after `free_memory` emptied the allocator, so its first token
# also waits for every allocation the prefill makes, which a serving process pays once, not per request
# (docs/generation-benchmarks.md). The 8B rows' prefills take seconds, where that is noise: their timed call's
# stands.
FIRST_TOKEN_CALLS = {"smollm2": 5, "8b": 0}
STEP_KL_ROWS = 16  # held-out windows the SmolLM2 row's step KL runs over (its interval is over them)
FIRST_TIMED = 2  # decode tokens/s from the third new token on (see the module docstring)
ROWS = {
    "8b_32k_bs1": ("8b", 32768, 1),
    "8b_32k_bs16": ("8b", 32768, 16),
    "8b_128k_bs1": ("8b", 131072, 1),
    "8b_128k_bs16": ("8b", 131072, 16),
    "smollm2_8k_bs1": ("smollm2", 8192, 1),
    "smollm2_8k_bs16": ("smollm2", 8192, 16),
}


STARTED = time.perf_counter()


def say(message: str) -> None:
    """A progress line with the seconds since the benchmark started (a run cut by a time limit still
    tells where its time went)."""
    print(f"[{time.perf_counter() - STARTED:7.1f} s] {message}", flush=True)


class StepTimes(BaseStreamer):
    """Records when each new token is ready: a streamer (`generate` puts the prompt, then each new token as
    it is made), so that a plain greedy call stays one that GSM's greedy loop decodes (a stopping criterion
    would leave it to transformers' loop, `inference.greedy_loop`)."""

    def __init__(self) -> None:
        self.start, self.times = time.perf_counter(), []
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.mark()
        self.prompt_seen = True

    def end(self) -> None:
        """Nothing: every token was marked as it came."""

    def mark(self) -> None:
        """A new token is ready (on CUDA once the device has computed it)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.start)

    def decode_tokens_per_s(self, batch: int) -> float:
        times = self.times[FIRST_TIMED:]
        return batch * (len(times) - 1) / (times[-1] - times[0])


def llama8b() -> torch.nn.Module:
    """`random-llama3-8b` (Llama-3-8B's shapes, random bf16 weights made on the GPU, seeded), with room for
    the longest prompt."""
    torch.manual_seed(0)
    return random_model("random-llama3-8b", torch.bfloat16, "cuda", max_position_embeddings=131072 + 1024)


def generate_timed(
    model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, **kwargs: Any
) -> tuple[torch.Tensor, StepTimes]:
    """Greedy `model.generate` of `new_tokens` after `ids` [B, T] (every position real: an explicit mask, so
    that token 0 in a prompt is not taken for padding), timed per step."""
    timer = StepTimes()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            streamer=timer,
            **kwargs,
        )
    return out, timer


def _measure(
    model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, warm: bool, first_token_calls: int = 0, **kwargs: Any
) -> dict:
    """One method's figures on `ids` [B, T]: with `warm`, a short call first (compiles, autotunes), then
    time to first token and decode tokens/s of the main call, its peak memory; `first_token_calls` first-token
    calls after it (`first_token_figures`)."""
    if warm:  # as long as the timed call: a static cache of another length would compile again
        generate_timed(model, ids, new_tokens, **kwargs)
    _fresh_peak()
    out, timer = generate_timed(model, ids, new_tokens, **kwargs)
    figures = {
        "decode_tokens_per_s": timer.decode_tokens_per_s(ids.shape[0]),
        "time_to_first_token_s": timer.times[0] if warm else None,
        "first_call_time_to_first_token_s": None if warm else timer.times[0],
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "tokens": out,
    }
    return figures | first_token_figures(
        figures["time_to_first_token_s"], first_token_calls, lambda: generate_timed(model, ids, 1, **kwargs)[1].times[0]
    )


def first_token_figures(timed: float | None, calls: int, first_token: Callable[[], float]) -> dict:
    """`first_token()` (a call's seconds to its first token) `calls` times, with the allocator left warm by the
    calls before: `time_to_first_token_s` their median, `time_to_first_token_cold_s` the `timed` call's (after
    the warm-up, with the allocator emptied; not `first_call_time_to_first_token_s`, a call with no warm-up
    before it), `time_to_first_token_samples_s` every one; with no calls, nothing (the timed call's stands)."""
    if not calls or timed is None:
        return {}
    samples = [first_token() for _ in range(calls)]
    return {
        "time_to_first_token_s": statistics.median(samples),
        "time_to_first_token_cold_s": timed,
        "time_to_first_token_samples_s": samples,
    }


def _copy_rows(prefilled: GSMCache, model: torch.nn.Module, batch: int) -> GSMCache:
    """A cache of `batch` rows, each holding what the batch-1 `prefilled` cache holds."""
    cache = GSMCache(model, capacity=prefilled.capacity)
    for source, layer in zip(prefilled.layers, cache.layers, strict=True):
        template = source.k_store.tail
        probe = template.new_zeros(batch, *template.shape[1:2], 1, template.shape[3])
        layer.lazy_initialization(probe, probe)
        for src, dst in ((source.k_store, layer.k_store), (source.v_store, layer.v_store)):
            dst.tail.copy_(src.tail.expand_as(dst.tail))
            for name, field in (src.fields or {}).items():
                dst.fields[name].copy_(field.expand_as(dst.fields[name]))
        for name in ("gate_keys", "gate_key_scales"):
            if getattr(source, name) is not None:
                getattr(layer, name).copy_(getattr(source, name).expand_as(getattr(layer, name)))
    cache.lengths.restore(prefilled.lengths.snapshot())
    return cache


def gsm_row(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, first_token_calls: int = 0) -> dict:
    """The GSM method's figures; batch > 1: one prompt prefilled at batch 1, its cache copied to every row.
    `step_bytes`: what the last token step read (weights and `bandwidth.gsm_kv_read_bytes`); `first_token_calls`
    first-token calls at batch 1 (`first_token_figures`), each into a cache of its own made before it."""
    batch = ids.shape[0]
    if batch == 1:
        say(f"gsm warm-up: prefill of {ids.shape[1]} tokens and 3 new")
        # warm-up: kernels compiled and autotuned; over a cache of its own, so that `model.generate` keeps none
        # beside the timed call's (`enable_gsm_generation`'s reuse_cache)
        generate_timed(model, ids, 3, **cache_kwargs(model, GSMCache(model, capacity=ids.shape[1] + 3)))
        say("gsm warm-up done; the timed call")
        cache = GSMCache(model, capacity=ids.shape[1] + new_tokens)
        result = _measure(model, ids, new_tokens, warm=False, **cache_kwargs(model, cache))
        result["time_to_first_token_s"] = result.pop("first_call_time_to_first_token_s")

        def first_token() -> float:
            fresh = GSMCache(model, capacity=ids.shape[1] + 1)  # made before the call, as the timed call's
            return generate_timed(model, ids, 1, **cache_kwargs(model, fresh))[1].times[0]

        result |= first_token_figures(result["time_to_first_token_s"], first_token_calls, first_token)
        say("gsm: the same cache driven by a plain greedy loop instead of transformers' generate")
        loop_tokens, result["plain_loop_decode_tokens_per_s"] = plain_loop_generate(model, ids, new_tokens)
        # generate passes an all-ones mask and bars EOS until the last token (min_new_tokens): equal in
        # fp64 (a test), a bf16 row may part ways on a near tie
        result["plain_loop_tokens_equal"] = bool(torch.equal(loop_tokens, result["tokens"]))
    else:
        prompt = ids[:1]
        prefilled = GSMCache(model, capacity=ids.shape[1] + new_tokens)
        say(f"gsm: prefill of {ids.shape[1]} tokens at batch 1")
        with torch.no_grad():
            model(input_ids=prompt[:, :-1], use_cache=True, logits_to_keep=1, **cache_kwargs(model, prefilled))
        say(f"gsm: prefill done; the cache copied to {batch} rows and the timed call")
        _fresh_peak()
        cache = _copy_rows(prefilled, model, batch)
        del prefilled
        out, timer = generate_timed(model, prompt.expand(batch, -1), new_tokens, **cache_kwargs(model, cache))
        result = {
            "decode_tokens_per_s": timer.decode_tokens_per_s(batch),
            "time_to_first_token_s": None,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
            "tokens": out,
        }
    step_bytes = bandwidth.weight_bytes(model) + bandwidth.gsm_kv_read_bytes(model, cache)
    return result | {"kv_bytes": cache.nbytes(), "step_bytes": step_bytes}


def plain_loop_generate(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, float]:
    """`ids` [B, T] and `new_tokens` greedy tokens [B, T + new_tokens], and the decode tokens/s of GSM's
    token steps: the same `model.forward` calls `model.generate` makes (chunked prefill, captured steps),
    driven by the dense engine's loop (argmax, one forward per token) instead of transformers' `generate`;
    the difference to the `gsm` figure is what transformers' loop costs a token. Timed like every method:
    the device synchronized after each token."""
    cache, timer = GSMCache(model, capacity=ids.shape[1] + new_tokens), StepTimes()
    kwargs = cache_kwargs(model, cache) | {"use_cache": True, "logits_to_keep": 1}
    with torch.no_grad():
        tokens = [model(input_ids=ids, **kwargs).logits[:, -1:].argmax(-1)]
        timer.mark()
        for _ in range(new_tokens - 1):
            tokens.append(model(input_ids=tokens[-1], **kwargs).logits[:, -1:].argmax(-1))
            timer.mark()
    return torch.cat([ids, *tokens], 1), timer.decode_tokens_per_s(ids.shape[0])


def _fresh_peak() -> None:
    free_memory()
    torch.cuda.reset_peak_memory_stats()


def dense_engine_row(
    model: torch.nn.Module,
    ids: torch.Tensor,
    new_tokens: int,
    prefill_chunk: int,
    fused_decode: bool = False,
    first_token_calls: int = 0,
) -> dict:
    """The dense engine's figures: at batch 1 a warm-up call first (library handles, autotuning), then the
    timed call's time to first token and decode tokens/s, and `first_token_calls` first-token calls
    (`first_token_figures`). `fused_decode`: its token steps with the fused RMSNorm / RoPE / SwiGLU kernels, as
    GSM's with `--fused-decode`."""
    engine = DenseEngine(model, prefill_chunk=prefill_chunk, fused_decode=fused_decode)
    if ids.shape[0] == 1:
        say(f"dense_engine warm-up ({engine.decode_path} decode)")
        engine.generate(ids, 3)
    _fresh_peak()
    timer = StepTimes()
    out = engine.generate(ids, new_tokens, on_token=timer.mark)
    figures = {
        "decode_tokens_per_s": timer.decode_tokens_per_s(ids.shape[0]),
        "time_to_first_token_s": timer.times[0] if ids.shape[0] == 1 else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "decode_path": engine.decode_path,
        "tokens": out,
    }

    def first_token() -> float:
        first = StepTimes()
        engine.generate(ids, 1, on_token=first.mark)
        return first.times[0]

    return figures | first_token_figures(figures["time_to_first_token_s"], first_token_calls, first_token)


def fits_dense(model: torch.nn.Module, context: int, batch: int) -> tuple[bool, int]:
    """Whether a dense bf16 cache of `batch` rows of `context` fits beside the weights (10% headroom), and
    the most rows that would."""
    free = torch.cuda.get_device_properties(0).total_memory * 0.9 - bandwidth.weight_bytes(model)
    per_row = bandwidth.dense_kv_bytes(model, context, 1)
    return per_row * batch <= free, int(free // per_row)


def settings_for(name: str, settings: dict) -> dict:
    """Row `name`'s settings: the run's, and the first-token calls it makes after each method's timed call
    (`FIRST_TOKEN_CALLS`, batch 1 only) where it makes any (rows measured before there were any keep theirs)."""
    family, _, batch = ROWS[name]
    calls = FIRST_TOKEN_CALLS[family] if batch == 1 else 0
    return settings | {"first_token_calls": calls} if calls else settings


def _dense_method(
    name: str,
    model: torch.nn.Module,
    ids: torch.Tensor,
    new_tokens: int,
    method: str,
    fused_decode: bool,
    first_token_calls: int = 0,
) -> dict:
    """One dense method's figures (with its tokens); `fused_decode` applies to our dense engine (HF's paths
    are HF's own); `first_token_calls` at batch 1 (`first_token_figures`)."""
    # per row: the forward's activations (at 8B some 6 GB for 16 rows x 4096) must fit beside a cache that fills
    # most of the GPU (a 4-bit base's 16 x 32k row: 69 of 80 GB)
    chunk = max(256, DENSE_PREFILL_TOKENS // ids.shape[0]) if ROWS[name][0] == "8b" else None
    if method == "dense_engine":  # its flash prefill holds no [T, T] mask: larger chunks at batch 1
        engine_chunk = chunk if chunk and ids.shape[0] > 1 else ENGINE_PREFILL_CHUNK
        return dense_engine_row(
            model, ids, new_tokens, min(engine_chunk, ids.shape[1]), fused_decode, first_token_calls
        )
    # the 8B model's prompt in one forward of 16 x 32k does not fit beside its cache: prefill in chunks, as
    # transformers offers (`prefill_chunk_size`)
    options = {"cache_implementation": "static"} if method == "dense_static_compiled" else {}
    if chunk:
        options["prefill_chunk_size"] = chunk
    result = _measure(model, ids, new_tokens, warm=ids.shape[0] == 1, first_token_calls=first_token_calls, **options)
    torch._dynamo.reset()
    return result


def run_row(
    name: str,
    model: torch.nn.Module,
    prompts: torch.Tensor,
    new_tokens: int,
    gsm_model: Callable[[torch.nn.Module], torch.nn.Module],
    measured: dict,
    save: Callable[[dict], None],
    peak: tuple[float, str],
    settings: dict,
    methods: tuple[str, ...] = DENSE_METHODS,
) -> dict:
    """The dense `methods` (default `DENSE_METHODS`) on `model`, then GSM on `gsm_model(model)`: the same model
    with GSM's modules attached, or another (int4_hybrid: GSM attaches to the 16-bit base before it is
    quantized); a method already in `measured` (a cut run's row of the same settings) is not measured again.
    `save(row)` after each. Every method's `bandwidth_share` against `peak` (bytes/s, its source).
    `settings`: the row's (`settings_for` of the run's `row_settings`: the GSM method's prefill, which
    `gsm_model` set on its model, `methods`, the first-token calls each batch-1 method makes), stored with
    the row."""
    _, context, batch = ROWS[name]
    first_token_calls = settings.get("first_token_calls", 0)
    ids = prompts[:batch, : context - new_tokens].cuda()
    peak, peak_source = peak
    row: dict[str, Any] = measured | {
        "settings": settings,
        "context": context,
        "batch": batch,
        "new_tokens": new_tokens,
        "prompt_tokens": ids.shape[1],
        "weight_bytes": bandwidth.weight_bytes(model),
        "peak_bytes_per_s": peak,
        "peak_source": peak_source,
    }
    fits, most = fits_dense(model, context, batch)
    # the last token step reads the K/V of every token held before it: context - 1
    row["dense_step_bytes"] = row["weight_bytes"] + bandwidth.dense_kv_bytes(model, context - 1, batch)
    row["bound_tokens_per_s_dense"] = batch * peak / row["dense_step_bytes"]
    if fits:
        for method in methods:
            if method in row:
                say(f"{name} {method}: measured by an earlier run")
                continue
            say(f"{name} {method}")
            try:
                result = _dense_method(
                    name, model, ids, new_tokens, method, settings.get("fused_decode", False), first_token_calls
                )
            except torch.OutOfMemoryError as error:  # recorded, and the row goes on (a larger GPU measures it)
                row.setdefault("dense_errors", {})[method] = _out_of_memory(error)
                say(f"{name} {method}: {row['dense_errors'][method]}")
                save(row)
                free_memory()
                continue
            row.get("dense_errors", {}).pop(method, None)  # an earlier run's failure, measured now
            if method == "dense_static_compiled":
                row["dense_tokens"] = result["tokens"]
            row[method] = {k: v for k, v in result.items() if k != "tokens"} | {
                "kv_bytes": bandwidth.dense_kv_bytes(model, context - 1, batch),
                "bandwidth_share": bandwidth.share(result["decode_tokens_per_s"], batch, row["dense_step_bytes"], peak),
            }
            say(f"{name} {method}: {row[method]['decode_tokens_per_s']:.1f} tokens/s")
            save(row)
            free_memory()
    else:
        row["dense_fits"] = (
            f"no: {bandwidth.dense_kv_bytes(model, context, batch) / 1e9:.0f} GB of bf16 KV; at most {most} rows fit"
        )
    result = gsm_row(gsm_model(model), ids, new_tokens, first_token_calls)
    row["gsm_tokens"] = result.pop("tokens")
    row["bound_tokens_per_s_gsm"] = batch * peak / result["step_bytes"]
    row["gsm"] = result | {
        "bandwidth_share": bandwidth.share(result["decode_tokens_per_s"], batch, result["step_bytes"], peak)
    }
    say(f"{name} gsm: {result['decode_tokens_per_s']:.1f} tokens/s")
    for method in DENSE_METHODS:
        if method in row:
            row[f"speedup_vs_{method}"] = result["decode_tokens_per_s"] / row[method]["decode_tokens_per_s"]
    return row


def _out_of_memory(error: torch.OutOfMemoryError) -> str:
    """What a method that ran out of device memory records: the error's first sentence and the peak."""
    first = str(error).split(". ")[0]
    return f"out of memory ({first}; peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB allocated)"


def free_memory() -> None:
    """What a finished (or failed) method held, returned to the device before the next."""
    gc.collect()
    torch.cuda.empty_cache()


def row_settings(
    new_tokens: int,
    prefill: str = DEFAULT_PREFILL,
    prefill_chunk: int | None = None,
    methods: tuple[str, ...] = DENSE_METHODS,
    fused_decode: bool = False,
    dense_block_kernel: bool = True,
) -> dict:
    """What a row's figures depend on besides its name: a stored row of other settings is measured again.
    `prefill`: the GSM method's prefill mode (`--prefill`); `prefill_chunk` its prompt tokens per forward
    (`--prefill-chunk`, named only when it is set: None runs the library's default for the mode); `methods`:
    the dense methods measured; `fused_decode`: GSM's and the dense engine's token steps fused (named only
    when set); `dense_block_kernel`: whether GSM's dense layers read a block a tile (always named: rows from
    before it was the default, which lack it, are measured again)."""
    chunk = {} if prefill_chunk is None else {"gsm_prefill_chunk": prefill_chunk}
    kernels = {"fused_decode": True} if fused_decode else {}
    kernels |= {"dense_block_kernel": dense_block_kernel}
    return {
        "version": ROW_VERSION,
        "new_tokens": new_tokens,
        "methods": [*methods, "gsm"],
        "gsm_prefill": prefill,
        **chunk,
        **kernels,
    }


def smollm2_extras(model: torch.nn.Module, row: dict, new_tokens: int, prompts: torch.Tensor, prefill: str) -> dict:
    """Token agreement of GSM's generation with the teacher-forced GSM model (bf16), the same for the dense
    static-cache generation against the dense model (how far bf16 alone moves the tokens), and at batch 1
    whether the captured token steps give the eager steps' tokens and the step KL (`benchmarks.step_kl`)
    of `STEP_KL_ROWS` held-out windows, their last `new_tokens` fed one per step. The agreement and the step KL prefill
    sparsely (the teacher-forced GSM pass: the module docstring); with `prefill` "dense" (the timed row's
    mode) the agreement's tokens are generated again with a sparse-prefilled cache."""
    generated = row.pop("gsm_tokens")[:4]
    prompt = generated[:, : generated.shape[1] - new_tokens]
    teacher_forced = generated
    if prefill != "sparse":
        cache = GSMCache(model, capacity=generated.shape[1], prefill="sparse")
        teacher_forced, _ = generate_timed(model, prompt, new_tokens, **cache_kwargs(model, cache))
    agree, outside_ties = agreement(model, teacher_forced, new_tokens)
    extras = {"token_agreement": agree, "token_agreement_outside_near_ties": outside_ties}
    dense = row.pop("dense_tokens", None)
    if dense is not None:
        with gsm_disabled(model):
            extras["dense_token_agreement"], _ = agreement(model, dense[:4], new_tokens)
    if row["batch"] == 1:
        ran = ("prefill_chunk", "fused_decode", "dense_block_kernel")
        options = {key: model.gsm_generation[key] for key in ran}  # as the row ran
        enable_gsm_generation(model, cuda_graphs=False, prefill=prefill, **options)
        eager, _ = generate_timed(model, prompt, new_tokens)
        enable_gsm_generation(model, cuda_graphs=True, prefill=prefill, **options)
        extras["captured_step_tokens_equal_eager"] = bool(torch.equal(eager, generated[:1]))
        say("step KL of GSM and the dense model against teacher forcing")
        extras["step_kl"] = step_kl(model, prompts[:STEP_KL_ROWS].to(generated.device), new_tokens)
    return extras


def joint_gsm_config(*overrides: str) -> GSMConfig:
    """recipes/joint.yaml's GSM modules for a model that is not SmolLM2 (no layer_bits), gates at random;
    `overrides`: further `key=value` settings of the recipe (e.g. sizes for a tiny model)."""
    return load_recipe(
        str(REPO / "recipes" / "joint.yaml"),
        ["gsm.kv_compression.layer_bits={}", "gsm.sparse_attention.gate_init=random", *overrides],
    ).gsm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eval-data", required=True)
    parser.add_argument("--smollm2-export", default=None)
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument(
        "--prefill",
        choices=PREFILL_MODES,
        default=DEFAULT_PREFILL,
        help="the GSM rows' prefill (dense: as the base model; sparse: the teacher-forced GSM pass)",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help=f"the GSM rows' prompt tokens per forward (default: the library's for the prefill mode, {PREFILL_CHUNKS})",
    )
    parser.add_argument(
        "--methods",
        default=",".join(DENSE_METHODS),
        help="the dense methods measured beside GSM, comma-separated (default: all of %(default)s)",
    )
    parser.add_argument(
        "--fused-decode",
        action="store_true",
        help="GSM's and the dense engine's token steps with the fused RMSNorm / RoPE / SwiGLU kernels",
    )
    parser.add_argument(
        "--dense-block-kernel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="GSM's layers that read every key decode a compressor block a tile (kernels.dense_decode; "
        "--no-dense-block-kernel: the selection kernel over every position)",
    )
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    methods = tuple(method for method in args.methods.split(",") if method)
    unknown = [method for method in methods if method not in DENSE_METHODS]
    if unknown:
        parser.error(f"--methods: {unknown} are not dense methods; choose from {','.join(DENSE_METHODS)}")
    result_path = Path(args.result)
    result = json.loads(result_path.read_text()) if result_path.exists() else {"rows": {}}
    settings = row_settings(
        args.new_tokens, args.prefill, args.prefill_chunk, methods, args.fused_decode, args.dense_block_kernel
    )
    wanted = [
        name
        for name in args.rows.split(",")
        if not row_complete(result["rows"].get(name, {}), settings_for(name, settings))
    ]
    peak = bandwidth.peak_bandwidth()
    measured_by = provenance()
    say(f"peak bandwidth {peak[0] / 1e12:.2f} TB/s ({peak[1]})")

    def save(name: str, row: dict) -> None:
        kept = {k: v for k, v in row.items() if k not in ("gsm_tokens", "dense_tokens")}
        result["rows"][name] = {**kept, "measured": measured_by}  # rows of earlier runs keep their own
        write_result(result_path, {k: v for k, v in result.items() if k not in PROVENANCE_KEYS})

    for family in ("smollm2", "8b"):
        names = [name for name in wanted if ROWS[name][0] == family]
        if not names:
            continue
        model, prompts, ready = _family(family, args)
        for name in names:
            own = settings_for(name, settings)
            measured = result["rows"].get(name, {})
            if measured.get("settings") != own:  # a cut row of other settings starts over
                measured = {}
            row = run_row(
                name,
                model,
                prompts,
                args.new_tokens,
                ready,
                measured,
                lambda row, name=name: save(name, row),
                peak,
                own,
                methods,
            )
            if family == "smollm2":
                row |= smollm2_extras(model, row, args.new_tokens, prompts, args.prefill)
            save(name, row)
            model = _fresh(model, family)
        del model
        free_memory()
    _summary(result, result_path)


def row_complete(row: dict, settings: dict) -> bool:
    return row.get("settings") == settings and "gsm" in row


def _enable_generation(model: torch.nn.Module, args: argparse.Namespace) -> None:
    """GSM's generation on `model` with the command's prefill and kernel options (as GSMModel enables it)."""
    enable_gsm_generation(
        model,
        prefill=args.prefill,
        prefill_chunk=args.prefill_chunk,
        fused_decode=args.fused_decode,
        dense_block_kernel=args.dense_block_kernel,
    )


def _family(family: str, args: argparse.Namespace) -> tuple[torch.nn.Module, torch.Tensor, Callable]:
    """The dense model of `family`, its 16 prompts, and the function that attaches GSM's modules to it (and
    returns it)."""
    if family == "8b":
        prompts = torch.randint(0, 128256, (16, 131072), generator=torch.Generator().manual_seed(1))

        def ready(m: torch.nn.Module) -> torch.nn.Module:
            torch.manual_seed(0)
            if not gsm_adapters(m):
                inject_gsm(m, joint_gsm_config(), mode="sparse")
                _enable_generation(m, args)
            return m

        return llama8b(), prompts, ready
    model, tokenizer = load_model_and_tokenizer("smollm2-135m", dtype=torch.bfloat16)
    model.cuda()
    prompts = pack_tokens(load_text_dataset(args.eval_data), tokenizer, 8192)[:16]
    if len(prompts) < 16:
        prompts = prompts.repeat(-(-16 // len(prompts)), 1)[:16]

    def ready(m: torch.nn.Module) -> torch.nn.Module:
        if not any(True for _ in gsm_adapters(m)):
            if args.smollm2_export:
                load_gsm(m, args.smollm2_export)
            else:
                torch.manual_seed(0)
                inject_gsm(m, load_recipe(str(REPO / "recipes" / "joint.yaml")).gsm, mode="sparse")
            # generation is enabled explicitly, as GSMModel does
            _enable_generation(m, args)
            set_gsm_mode(m, "sparse")
        return m

    return model, prompts, ready


def _fresh(model: torch.nn.Module, family: str) -> torch.nn.Module:
    """The next row starts from the dense base again (GSM modules come off by rebuilding the model)."""
    del model
    free_memory()
    if family == "8b":
        return llama8b()
    model, _ = load_model_and_tokenizer("smollm2-135m", dtype=torch.bfloat16)
    return model.cuda()


def summarize(rows: dict[str, dict]) -> dict[str, float | tuple[float, float] | None]:
    """The summary of complete rows: `e2e_speedup_<row>` (GSM's decode tokens/s over the fastest dense
    method's), `bandwidth_share_<method>_<row>`, `ttft_ratio_<row>` (GSM's time to first token over the
    fastest dense one, where both were timed), `ttft_cold_ratio_<row>` (the same of the timed calls, where
    every method of the row made first-token calls after it: `first_token_figures`) and
    `step_kl_gsm_over_dense` with its 95% interval over the rows (the first SmolLM2 row's)."""
    summary: dict[str, float | tuple[float, float] | None] = {}
    for name, row in rows.items():
        if "gsm" not in row:
            continue
        dense = [method for method in DENSE_METHODS if method in row]
        for method in [*dense, "gsm"]:
            summary[f"bandwidth_share_{method}_{name}"] = row[method]["bandwidth_share"]
        if dense:
            fastest = max(row[method]["decode_tokens_per_s"] for method in dense)
            summary[f"e2e_speedup_{name}"] = row["gsm"]["decode_tokens_per_s"] / fastest
        ttfts = [row[method]["time_to_first_token_s"] for method in dense]
        ttfts = [ttft for ttft in ttfts if ttft is not None]
        if ttfts and row["gsm"]["time_to_first_token_s"] is not None:
            summary[f"ttft_ratio_{name}"] = row["gsm"]["time_to_first_token_s"] / min(ttfts)
        colds = [row[method].get("time_to_first_token_cold_s") for method in [*dense, "gsm"]]
        if all(cold is not None for cold in colds) and len(colds) > 1:
            summary[f"ttft_cold_ratio_{name}"] = colds[-1] / min(colds[:-1])
        if "step_kl" in row and "step_kl_gsm_over_dense" not in summary:
            summary["step_kl_gsm_over_dense"] = row["step_kl"]["gsm_over_dense"]
            summary["step_kl_gsm_over_dense_interval"] = row["step_kl"].get("gsm_over_dense_interval")
    return summary


def _summary(result: dict, path: Path) -> None:
    """Print the rows' table and write the result with its summary (keys of an earlier summary dropped)."""
    rows = result["rows"]
    methods = [*DENSE_METHODS, "gsm"]
    print(f"{'row':>16} " + " ".join(f"{method:>22}" for method in methods) + f" {'GSM / fastest':>14}")
    summary = summarize(rows)
    for name, row in rows.items():
        if "gsm" not in row:  # a row cut short: its dense methods are kept for the next run
            kept = [method for method in DENSE_METHODS if method in row]
            print(f"{name:>16} (incomplete; measured: {', '.join(kept) or 'nothing'})")
            continue
        cells = [
            f"{row[m]['decode_tokens_per_s']:9.1f} ({row[m]['bandwidth_share']:.2f} bw)" if m in row else "-"
            for m in methods
        ]
        speedup = summary.get(f"e2e_speedup_{name}", float("nan"))
        print(f"{name:>16} " + " ".join(f"{cell:>22}" for cell in cells) + f" {speedup:14.2f}")
    write_result(path, {"rows": rows, **summary})


if __name__ == "__main__":
    main()
