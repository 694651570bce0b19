"""`gsm-train generate`: a prompt continued with a GSM adapter over the GSM cache (or by the dense base),
the text streamed as it is generated, and what it cost: time to first token, decode tokens/s, peak
device memory and KV bytes; with `--compare-dense`, the dense base on the same prompt beside it.

Greedy by default; `Sampling` turns sampling on (temperature, top-p, top-k, a seed set before each
run, so that the GSM run and the dense one draw from the same generator state). `chat=True` wraps the
prompt in the tokenizer's chat template as one user message, with the generation prompt added.

The adapter's model is `GSMModel.from_pretrained` (its `generate` runs over a GSM cache, token steps
replayed from CUDA graphs on a GPU: `inference.engine`). The dense base runs as a user would run it
instead: on a GPU with transformers' static cache, whose step transformers compiles.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import TextStreamer

from gsm_train.config.schema import check_positions
from gsm_train.data.text import DataError
from gsm_train.export.adapter_format import ExportError
from gsm_train.export.int4 import FULL, checked_group, quantize_base
from gsm_train.export.pretrained import GSMModel
from gsm_train.inference.cache import DEFAULT_PREFILL, GSMCache, cache_kwargs
from gsm_train.models.families import model_dims
from gsm_train.models.model_zoo import load_model_and_tokenizer
from gsm_train.training.distributed import cuda_wanted
from gsm_train.tuning.kv_budget import bf16_layer_kv_bytes

FIRST_TIMED_STEP = 2  # decode tokens/s from the third new token: the first is the prompt's, the second
# replays a step graph captured just before it (or, for the dense base, a step compiled just before it)


@dataclass
class Generation:
    """A generated text and what it cost. `token_times`: seconds since the call began at which each new
    token reached the streamer."""

    label: str
    text: str
    new_tokens: int
    seconds: float
    token_times: list[float] = field(default_factory=list)
    kv_bytes: int = 0
    dense_kv_bytes: int = 0
    peak_memory_bytes: int | None = None

    @property
    def time_to_first_token(self) -> float:
        return self.token_times[0] if self.token_times else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        """New tokens per second from the step after the first replayed one on (see FIRST_TIMED_STEP)."""
        times = self.token_times[FIRST_TIMED_STEP:]
        return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")

    def summary(self) -> str:
        memory = f", peak device memory {self.peak_memory_bytes / 2**30:.2f} GiB" if self.peak_memory_bytes else ""
        return (
            f"{self.label}: {self.new_tokens} tokens in {self.seconds:.2f} s; time to first token "
            f"{self.time_to_first_token * 1e3:.0f} ms; decode {self.decode_tokens_per_s:.1f} tokens/s "
            f"(from token {FIRST_TIMED_STEP + 1} on: graph capture and compilation excluded){memory}; "
            f"KV {self.kv_bytes:,} bytes (a bf16 dense cache: {self.dense_kv_bytes:,})"
        )


class TimedStreamer(TextStreamer):
    """Prints the new text as it comes (`echo`) and records when each new token arrived."""

    def __init__(self, tokenizer: Any, echo: bool) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.echo, self.start, self.times = echo, time.perf_counter(), []

    def put(self, value: torch.Tensor) -> None:
        if not self.next_tokens_are_prompt:
            self.times.extend([time.perf_counter() - self.start] * (value.shape[-1] if value.dim() > 1 else 1))
        super().put(value)

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if self.echo:
            super().on_finalized_text(text, stream_end)


@dataclass(frozen=True)
class Sampling:
    """How new tokens are chosen: greedy when no field is set, else sampled with the fields given
    (the others at transformers' defaults); `seed` seeds torch before each run (also when greedy)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None

    def generate_kwargs(self) -> dict[str, Any]:
        """`model.generate` keyword arguments for this choice."""
        chosen = (("temperature", self.temperature), ("top_p", self.top_p), ("top_k", self.top_k))
        given = {name: value for name, value in chosen if value is not None}
        return {"do_sample": True, **given} if given else {"do_sample": False}


def prompt_ids(tokenizer: Any, prompt: str, chat: bool) -> torch.Tensor:
    """[1, n] token ids of `prompt`: as text (with the tokenizer's special tokens), or with `chat` the
    tokenizer's chat template applied to it as one user message, generation prompt added (the
    template writes its special tokens itself); DataError if the tokenizer has no chat template."""
    if not chat:
        return tokenizer(prompt, return_tensors="pt").input_ids
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DataError(
            f"--chat with {name}",
            "the tokenizer has no chat template",
            "drop --chat to continue the prompt as plain text, or use a chat (instruct) model",
        )
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids


def dense_cache_bytes(model: nn.Module, tokens: int, batch: int = 1) -> int:
    """Bytes a bf16 K/V cache of `tokens` takes for this model."""
    dims = model_dims(model)
    return bf16_layer_kv_bytes(dims) * dims["layers"] * tokens * batch


def _device_and_dtype(device: str | None) -> tuple[str, torch.dtype]:
    device = device or ("cuda" if cuda_wanted() else "cpu")
    return device, torch.bfloat16 if device.startswith("cuda") else torch.float32


@torch.no_grad()
def _run(
    label: str,
    model: nn.Module,
    tokenizer: Any,
    ids: torch.Tensor,
    max_new_tokens: int,
    echo: bool,
    cache: GSMCache | None,
    sampling: Sampling,
    **options: Any,
) -> Generation:
    """Generation of `model` from the prompt's `ids` as `sampling` says, streamed and timed."""
    device = next(model.parameters()).device
    ids = ids.to(device)
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    streamer = TimedStreamer(tokenizer, echo)
    extra = cache_kwargs(model, cache) if cache is not None else {}
    out = model.generate(
        ids,
        max_new_tokens=max_new_tokens,
        streamer=streamer,
        pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id or 0,
        **extra,
        **sampling.generate_kwargs(),
        **options,
    )
    seconds = time.perf_counter() - streamer.start
    new = out[0, ids.shape[1] :]
    cached = out.shape[1] - 1  # the last token is never fed back
    dense = dense_cache_bytes(model, cached)
    return Generation(
        label,
        tokenizer.decode(new, skip_special_tokens=True),
        len(new),
        seconds,
        streamer.times,
        cache.nbytes() if cache is not None else dense,
        dense,
        torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    )


def _check_positions(model: nn.Module, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse a prompt and `max_new_tokens` beyond the model's positions (ConfigError), before a cache
    for them is allocated."""
    tokens = prompt_tokens + max_new_tokens
    check_positions("generate", "--max-new-tokens", max_new_tokens, tokens, model_dims(model)["context"])


def generate(
    model_name: str | None,
    adapter: str | Path | None,
    prompt: str,
    max_new_tokens: int,
    mode: str = "sparse",
    device: str | None = None,
    revision: str | None = None,
    compare_dense: bool = False,
    echo: bool = False,
    sampling: Sampling | None = None,
    chat: bool = False,
    prefill: str = DEFAULT_PREFILL,
    weights: str = FULL,
    fused_decode: bool = False,
) -> list[Generation]:
    """Continuation of `prompt` (greedy, or as `sampling` says; with `chat` in the tokenizer's chat
    template, `prompt_ids`): with `adapter` (an export folder or a Hub repo id at `revision`),
    GSM attention over the GSM cache on the base the export names (or `model_name`), and with
    `compare_dense` the dense base after it; without an adapter, the base `model_name`. `echo` streams
    the text to stdout; `prefill` how the adapter's prompt attends (dense / sparse: `GSMCache`);
    `weights` the base's weights in both runs, as loaded or 4-bit (gsm_train/export/int4.py); `fused_decode`
    the adapter's token steps with the fused elementwise kernels (`GSMModel.from_pretrained`)."""
    device, dtype = _device_and_dtype(device)
    group = checked_group(weights, device, dtype)
    sampling = sampling or Sampling()
    runs = []
    base_revision = None
    if adapter is not None:
        gsm = GSMModel.from_pretrained(
            adapter,
            revision=revision,
            base=model_name,
            mode=mode,
            prefill=prefill,
            dtype=dtype,
            device=device,
            weights=weights,
            fused_decode=fused_decode,
        )
        ids = prompt_ids(gsm.tokenizer, prompt, chat)
        _check_positions(gsm.model, ids.shape[1], max_new_tokens)
        cache = GSMCache(gsm.model, capacity=ids.shape[1] + max_new_tokens)
        label = "GSM cache" if mode == "sparse" else "GSM cache, every key (--mode dense)"
        runs.append(_run(label, gsm.model, gsm.tokenizer, ids, max_new_tokens, echo, cache, sampling))
        model_name, base_revision = gsm.base_name, gsm.base_revision  # the base GSM ran on, compared as it was
        del gsm
    elif model_name is None:
        raise ExportError("generate needs a model: give --adapter (an export, whose base it loads) or --model")
    if adapter is None or compare_dense:
        model, tokenizer = load_model_and_tokenizer(model_name, revision=base_revision, dtype=dtype)
        ids = prompt_ids(tokenizer, prompt, chat)
        _check_positions(model, ids.shape[1], max_new_tokens)
        model.to(device)
        if group is not None:
            quantize_base(model, group)
        options = {"cache_implementation": "static"} if device.startswith("cuda") else {}
        runs.append(
            _run(
                "dense base" + (", static cache" if options else ""),
                model,
                tokenizer,
                ids,
                max_new_tokens,
                echo and adapter is None,
                None,
                sampling,
                **options,
            )
        )
    return runs
