"""`gsm-train generate`: greedy generation with a GSM adapter over the GSM cache (or the dense base)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gsm_train.adapter_format import ExportError
from gsm_train.families import model_dims
from gsm_train.inference.cache import GSMCache, cache_kwargs
from gsm_train.kv_budget import bf16_layer_kv_bytes
from gsm_train.model_zoo import load_model_and_tokenizer
from gsm_train.pretrained import GSMModel


@dataclass
class Generation:
    """A generated text and what it cost."""

    text: str
    new_tokens: int
    seconds: float
    cache_bytes: int
    dense_cache_bytes: int


def dense_cache_bytes(model: torch.nn.Module, tokens: int, batch: int = 1) -> int:
    """Bytes a bf16 K/V cache of `tokens` takes for this model."""
    dims = model_dims(model)
    return bf16_layer_kv_bytes(dims) * dims["layers"] * tokens * batch


@torch.no_grad()
def generate(model_name: str | None, adapter: str | Path | None, prompt: str, max_new_tokens: int,
             mode: str = "sparse", device: str | None = None,
             revision: str | None = None) -> Generation:
    """Greedy continuation of `prompt`: with `adapter` (an export folder or a Hub repo id at
    `revision`), GSM attention over the GSM cache on the base the export names (or `model_name`);
    without, the base `model_name`."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    cache = None
    if adapter is not None:
        gsm = GSMModel.from_pretrained(adapter, revision=revision, base=model_name, mode=mode,
                                       dtype=dtype, device=device)
        model, tokenizer = gsm.model, gsm.tokenizer
        cache = GSMCache(model)
    elif model_name is None:
        raise ExportError("generate needs a model: give --adapter (an export, whose base it "
                          "loads) or --model")
    else:
        model, tokenizer = load_model_and_tokenizer(model_name, dtype=dtype)
        model.to(device)
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
    tic = time.perf_counter()
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, **cache_kwargs(model, cache),
                         pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id or 0)
    seconds = time.perf_counter() - tic
    new = out[0, ids.shape[1]:]
    cached = out.shape[1] - 1  # the last token is never fed back
    return Generation(tokenizer.decode(new, skip_special_tokens=True), len(new), seconds,
                      cache.nbytes() if cache is not None else dense_cache_bytes(model, cached),
                      dense_cache_bytes(model, cached))
