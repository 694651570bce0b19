"""Plain `model.generate(...)` over a GSM cache: what `GSMModel.from_pretrained` sets up on its model
(generation's one owner; `load_gsm` attaches modules only, so call this after it to generate).

`enable_gsm_generation(model)` wraps the model's `generate` and `forward` (on the instance; the class is
untouched):
- `generate` gives transformers' generation a `GSMCache` sized for the prompt and the new tokens (unless
  the call passes a cache), so greedy and sampled decoding, left-padded batches with an attention mask,
  EOS and stop strings, and streamers all run over it; a plain greedy call (`_greedy_loop_call`) is
  decoded by `inference.greedy_loop`'s loop instead of transformers' per-token loop, the same tokens;
- `forward` feeds a long prompt in chunks (no [T, T] selection of the whole prompt: `prefill`), and on
  CUDA replays each token step from a CUDA graph (`decode_graph`) instead of running it layer by layer.
The prompt attends as the base model (`prefill="dense"`: causal SDPA, flash kernels on a GPU) or as the
teacher-forced GSM pass (`"sparse"`); either way the cache is filled from its K/V alike.
Everything else goes to the model's own forward.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import Tensor, nn
from transformers.generation.configuration_utils import GenerationMode
from transformers.modeling_outputs import CausalLMOutputWithPast

from gsm_train.attention.forward_state import CACHE_KWARGS
from gsm_train.attention.settings import gsm_settings
from gsm_train.inference.cache import DEFAULT_PREFILL, GSMCache, cache_kwargs, check_prefill
from gsm_train.inference.decode_fusion import fused_decode
from gsm_train.inference.decode_graph import StepGraphs, graphs_supported
from gsm_train.inference.dense_engine import PREFILL_CHUNK as DENSE_ENGINE_CHUNK
from gsm_train.inference.greedy_loop import EOS_CHECK_EVERY, greedy_decoding
from gsm_train.modules.errors import GSMError

# prompt tokens per row and forward by the cache's prefill mode, where `enable_gsm_generation` sets none: a
# dense prefill's chunk is the dense engine's (its memory per layer is O(chunk) with flash attention, and a
# prompt in one chunk is the base model's prefill exactly); a sparse one's first chunk selects over [T, T]
# pairs per layer, so its chunk stays smaller (docs/design-decisions.md, "Prefill: where the time to first
# token goes")
PREFILL_CHUNKS = {"dense": DENSE_ENGINE_CHUNK, "sparse": 4096}


def enable_gsm_generation(
    model: nn.Module,
    cuda_graphs: bool = True,
    prefill_chunk: int | None = None,
    prefill: str = DEFAULT_PREFILL,
    fused_decode: bool = False,
    greedy_loop: bool = True,
    reuse_cache: bool = True,
    dense_block_kernel: bool = True,
    overlap_selection: bool = True,
) -> None:
    """Make `model.generate` and `model.forward` use GSM's cache as the module docstring says (idempotent).
    `cuda_graphs`: replay token steps from CUDA graphs where they can be captured (`graphs_supported`).
    `prefill_chunk`: prompt tokens per row and forward (None: `PREFILL_CHUNKS` of the cache's prefill mode).
    `prefill`: how prompts attend, `dense` or `sparse` (the default of every `GSMCache` of this model).
    `fused_decode`: token steps run the layers' RMSNorms, RoPE and SwiGLU as one Triton kernel each
    (`inference.decode_fusion`; where the kernels run: CUDA, or Triton's interpreter).
    `greedy_loop`: a plain greedy call decodes in `inference.greedy_loop`'s loop (False: transformers' loop
    decodes every call; the tokens are the same).
    `reuse_cache`: a `generate` call without a cache of its own reuses the previous call's, reset, where its
    rows and capacity fit (`_generation_cache`: no new capture of its token steps); the cache a call returned
    is then emptied by the next call. Calling this again drops the kept cache.
    `dense_block_kernel`: on the fused path a layer that reads every key (dense and retrieval layers) decodes
    over its packed store a compressor block a tile (`kernels.dense_decode`; False: the selection kernel over
    every position).
    `overlap_selection`: on the fused path each layer's gate and key selection of a token step start before the
    layer's projections, on a side CUDA stream (`GSMCacheLayer.select_ahead`; False: inside the attention)."""
    check_prefill(prefill)
    if prefill_chunk is not None and prefill_chunk < 1:
        raise GSMError(
            f"prefill_chunk {prefill_chunk} is not a number of prompt tokens; pass at least 1, or None for the "
            f"prefill mode's default {PREFILL_CHUNKS}"
        )
    if not hasattr(model, "gsm_base_forward"):
        model.gsm_base_forward = model.forward
        model.forward = _bound(_forward, model, model.gsm_base_forward)
        model.generate = _bound(_generate, model, model.generate)
    model.gsm_generation = {
        "cuda_graphs": cuda_graphs,
        "prefill_chunk": prefill_chunk,
        "prefill": prefill,
        "fused_decode": fused_decode,
        "greedy_loop": greedy_loop,
        "reuse_cache": reuse_cache,
        "dense_block_kernel": dense_block_kernel,
        "overlap_selection": overlap_selection,
        "kept_cache": None,  # the last generate call's cache, for the next (`_generation_cache`)
    }


def _bound(wrapper: Any, model: nn.Module, original: Any) -> Any:
    """`wrapper(model, ...)` as an instance attribute with `original`'s signature (transformers reads the
    forward's parameters to decide what to pass, e.g. `logits_to_keep`)."""
    bound = functools.partial(wrapper, model)
    bound.__signature__ = inspect.signature(original)
    bound.__doc__ = original.__doc__
    return bound


def _given_cache(kwargs: dict[str, Any]) -> Any:
    return next((kwargs[name] for name in CACHE_KWARGS if kwargs.get(name) is not None), None)


def _generate(model: nn.Module, inputs: Tensor | None = None, **kwargs: Any) -> Any:
    """transformers' generate, with a GSM cache of the prompt's length plus the new tokens; a plain greedy
    call decoded by `greedy_loop` instead of transformers' per-token loop (`_greedy_loop_call`)."""
    settings = gsm_settings(model)
    prompt = inputs if inputs is not None else kwargs.get("input_ids")
    if not (settings.enabled and prompt is not None and kwargs.get("use_cache", True)):
        return type(model).generate(model, inputs, **kwargs)
    given = _given_cache(kwargs) is not None
    if not given:
        config = kwargs.get("generation_config") or model.generation_config
        if kwargs.get("num_beams", getattr(config, "num_beams", 1) or 1) > 1:
            raise GSMError("a GSM cache does not support beam search; generate with num_beams=1")
        new = kwargs.get("max_new_tokens") or getattr(config, "max_new_tokens", None)
        total = prompt.shape[1] + new if new is not None else kwargs.get("max_length") or config.max_length
        kwargs |= cache_kwargs(model, _generation_cache(model, prompt.shape[0], total))
    if _greedy_loop_call(model, kwargs):
        streamer = kwargs.pop("streamer", None)
        # a cache the caller keeps, or a streamer, sees no step past the last EOS: check every token
        check_every = 1 if given or streamer is not None else EOS_CHECK_EVERY
        kwargs["custom_generate"] = greedy_decoding(streamer, check_every)
    return type(model).generate(model, inputs, **kwargs)


# `generate` arguments that transformers' own greedy loop serves (a call with any of them set is left to it)
NOT_GREEDY_LOOP = (
    "custom_generate",
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "assistant_model",
    "assistant_tokenizer",
    "tokenizer",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "synced_gpus",
    "inputs_embeds",
)


# a generation's cache, where it keeps one for the next call, holds up to this many slots more than the call needs
# (the new capacity rounded up to them): prompts within one band reuse it; slots past the length are never read
REUSE_ROUND = 512


def _generation_cache(model: nn.Module, batch: int, tokens: int) -> GSMCache:
    """The cache for a `generate` call of `batch` rows and `tokens` in all: with `reuse_cache` on, the one the
    previous call used, reset, where it was made for as many rows and the same capacity (`tokens` rounded up
    to `REUSE_ROUND`), so its captured token steps replay instead of being captured again (a capture costs
    about as much as hundreds of token steps); else a new one, kept for the next call in its place (its
    memory stays allocated until then, as transformers' static cache does)."""
    if not model.gsm_generation["reuse_cache"]:
        return GSMCache(model, capacity=tokens)
    capacity = -(-tokens // REUSE_ROUND) * REUSE_ROUND
    kept = model.gsm_generation["kept_cache"]
    if kept is not None and kept.capacity == capacity and kept.serves(model, batch):
        kept.reset()
        return kept
    model.gsm_generation["kept_cache"] = None  # the old cache's memory free before the new one takes its own
    cache = GSMCache(model, capacity=capacity)
    model.gsm_generation["kept_cache"] = cache
    return cache


def _greedy_loop_call(model: nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether `model.generate(**kwargs)` goes to `greedy_loop` (which decodes it where what transformers
    prepares is plain greedy decoding, and runs transformers' `_sample` otherwise): `greedy_loop` is on, the
    merged generation config's mode is greedy search, none of `NOT_GREEDY_LOOP` is given, and one process
    generates (synced GPUs need transformers' loop)."""
    if not model.gsm_generation["greedy_loop"] or any(kwargs.get(name) is not None for name in NOT_GREEDY_LOOP):
        return False
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_world_size() > 1:
            return False
    rest = {name: value for name, value in kwargs.items() if name != "generation_config"}
    config, _ = model._prepare_generation_config(kwargs.get("generation_config"), **rest)
    return config.get_generation_mode() == GenerationMode.GREEDY_SEARCH


def _forward(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The model's forward, with a long prompt fed in chunks and token steps replayed from CUDA graphs."""
    cache = _given_cache(kwargs)
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(cache, GSMCache) or input_ids is None or args:
        return model.gsm_base_forward(*args, **kwargs)
    options = model.gsm_generation
    tokens = input_ids.shape[1]
    token_step = tokens == 1 and cache.lengths.seq_len > 0
    if token_step and options["cuda_graphs"] and _plain_step(kwargs):
        graphs = _step_graphs(model, cache)
        if graphs is not None:
            positions = kwargs.get("position_ids")
            if positions is None:
                positions = torch.full_like(input_ids, cache.lengths.seq_len)
            logits = graphs(input_ids, positions).clone()  # the graph's buffer: the next replay overwrites it
            return CausalLMOutputWithPast(logits=logits, **{_output_cache_name(): cache})
    chunk = options["prefill_chunk"] or PREFILL_CHUNKS[cache.prefill]
    if tokens > chunk and not gsm_settings(model).config.cross_layer_sharing.enabled:
        return _chunked_prefill(model, kwargs, input_ids, chunk)
    with fused_decode(model, token_step and options["fused_decode"]):
        return model.gsm_base_forward(**kwargs)


def _keep_logits(kwargs: dict[str, Any]) -> int:
    """How many final positions' logits the caller asked for (0: all)."""
    keep = kwargs.get("logits_to_keep", 0)
    return keep if isinstance(keep, int) else 0


def _plain_step(kwargs: dict[str, Any]) -> bool:
    """Whether a token step asks for nothing a captured step does not give (hidden states, attentions,
    embeddings instead of ids, labels)."""
    asks = ("output_hidden_states", "output_attentions", "inputs_embeds", "labels")
    return not any(kwargs.get(name) for name in asks)


def _output_cache_name() -> str:
    """The field under which transformers' model outputs carry the cache (renamed in 5.24)."""
    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _step_graphs(model: nn.Module, cache: GSMCache) -> StepGraphs | None:
    """The cache's captured token steps, made at its first token step; None where they cannot be."""
    graphs = cache.step_graphs
    if graphs is None and graphs_supported(model, cache) is None:
        graphs = cache.step_graphs = StepGraphs(model, cache, model.gsm_generation["fused_decode"])
    return graphs


def _chunked_prefill(model: nn.Module, kwargs: dict[str, Any], input_ids: Tensor, chunk: int) -> Any:
    """The prompt in forwards of `chunk` tokens: the last one's output, its logits those the caller asked
    for (`logits_to_keep`; all of them are joined from the chunks when it asked for every position). A 2-D
    mask without padding is read once, here, and the chunks run without it (what it says: every key
    visible), instead of each chunk's forward reading its slice on the host."""
    mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
    if mask is not None and mask.dim() == 2 and bool(mask.all()):
        kwargs, mask = {**kwargs, "attention_mask": None}, None
    done = _given_cache(kwargs).lengths.seq_len
    total, keep = input_ids.shape[1], _keep_logits(kwargs)
    out, logits = None, []
    for start in range(0, total, chunk):
        end = min(start + chunk, total)
        part = {**kwargs, "input_ids": input_ids[:, start:end]}
        if mask is not None and mask.dim() == 2:
            part["attention_mask"] = mask[:, : done + end]
        if positions is not None:
            part["position_ids"] = positions[..., start:end]
        part["logits_to_keep"] = min(keep, end - start)  # 0: every position of the chunk
        out = model.gsm_base_forward(**part)
        logits.append(out.logits)
    joined = torch.cat(logits, 1)
    out.logits = joined[:, -keep:] if keep else joined
    return out
