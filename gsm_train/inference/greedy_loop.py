"""Plain greedy decoding over a GSM cache without transformers' per-token loop.

`model.generate` (`inference.engine`) hands a plain greedy call to transformers with `greedy_decoding(...)` as
its decoding method (`custom_generate`): transformers prepares the call as for any greedy call (the generation
config merged from the model's and the call's, special tokens, the attention mask and position ids, the
length limits, its logits processors and stopping criteria) and this loop replaces `_sample`'s. The loop
runs where what transformers prepared is plain greedy decoding (`plain_greedy`): no logits processor but the
minimum-length ones (`min_length`, `min_new_tokens`: EOS barred while the sequence is shorter), no stopping
criterion but the maximum length and EOS, no scores, attentions or hidden states asked for, model inputs
token ids with an optional 2-D mask and 2-D positions. Anything else runs transformers' own `_sample`, as before.

Per new token the loop runs the model's forward of one token (a captured replay on CUDA), an argmax, while
EOS is barred an `index_fill`, where EOS is set the finished rows' padding (3 ops) and, every `check_every`
tokens, the host's read of whether a row is unfinished (2 ops); transformers' loop runs ~34 ops and its
Python per token. The output equals transformers' bit for bit (tests/test_greedy_loop.py): the prompt and the new
tokens, finished rows padded with `pad_token_id` after their EOS, generation stopping when every row has
finished or at the maximum length. Whether every row has finished is read on the host every
`check_every` tokens; where that is more than 1 (a cache the call made, no streamer) up to
`check_every - 1` steps past the last row's EOS may run, and their tokens are cut from the output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import GenerationConfig
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.logits_process import MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from gsm_train.attention.forward_state import CACHE_KWARGS

EOS_CHECK_EVERY = 8  # new tokens between host reads of "has every row finished" (see the module docstring)
# what transformers may pass a plain greedy loop besides the cache: the model inputs it prepares
PLAIN_MODEL_KWARGS = frozenset({"attention_mask", "position_ids", "use_cache", "logits_to_keep"})


def greedy_decoding(streamer: Any, check_every: int) -> Callable[..., Tensor]:
    """A decoding method for transformers' `generate(custom_generate=...)`: this module's loop where the call
    is plain greedy decoding, transformers' `_sample` otherwise. `streamer`: the call's streamer (pass
    `generate` none: transformers hands a callable decoding method no streamer), given the prompt and each
    new token as transformers gives it them. `check_every`: new tokens between host reads of EOS."""

    def decode(
        model: nn.Module,
        input_ids: Tensor,
        logits_processor: list,
        stopping_criteria: list,
        generation_config: GenerationConfig,
        **model_kwargs: Any,
    ) -> Tensor:
        if streamer is not None:
            streamer.put(input_ids.cpu())
        call = Prepared(input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs)
        if plain_greedy(model, call):
            return _greedy(model, call, streamer, check_every)
        return type(model)._sample(
            model,
            input_ids,
            logits_processor=logits_processor,
            stopping_criteria=stopping_criteria,
            generation_config=generation_config,
            streamer=streamer,
            **model_kwargs,
        )

    return decode


@dataclass(frozen=True)
class Prepared:
    """What transformers' `generate` hands its decoding method: the prompt ids [B, T], its logits processors
    and stopping criteria, the merged generation config and the model's inputs besides the ids."""

    input_ids: Tensor
    logits_processor: list
    stopping_criteria: list
    config: GenerationConfig
    model_kwargs: dict[str, Any]


def plain_greedy(model: nn.Module, call: Prepared) -> bool:
    """Whether what transformers prepared for a call is what this module's loop decodes (the module
    docstring): the processors and criteria by their exact types, the model inputs by name."""
    config, model_kwargs = call.config, call.model_kwargs
    processors = (MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor)
    criteria = (MaxLengthCriteria, EosTokenCriteria)
    inputs = set(model_kwargs) <= PLAIN_MODEL_KWARGS | set(CACHE_KWARGS) and model_kwargs.get("use_cache", True)
    compiled = getattr(model, "_valid_auto_compile_criteria", lambda *_: False)(model_kwargs, config)
    mask, positions = model_kwargs.get("attention_mask"), model_kwargs.get("position_ids")
    return (
        config.get_generation_mode() == GenerationMode.GREEDY_SEARCH
        and all(type(p) in processors for p in call.logits_processor)
        and all(type(c) in criteria for c in call.stopping_criteria)
        and bool(inputs)
        and not (config.return_dict_in_generate or getattr(config, "is_assistant", False))
        and not compiled
        and call.input_ids.device == next(model.parameters()).device
        and (mask is None or mask.dim() == 2)
        and (positions is None or positions.dim() == 2)  # not the 3-D positions of multimodal RoPE
        and any(model_kwargs.get(name) is not None for name in CACHE_KWARGS)
    )


def _greedy(model: nn.Module, call: Prepared, streamer: Any, check_every: int) -> Tensor:
    """The loop (the module docstring): the prompt through transformers' `_prefill`, then one forward of one
    token per new token with the inputs transformers' loop would give it (`_step_inputs`)."""
    input_ids, criteria = call.input_ids, call.stopping_criteria
    batch, prompt = input_ids.shape
    new = max(1, criteria.max_length - prompt)
    eos = next((c.eos_token_id.to(input_ids.device) for c in criteria if isinstance(c, EosTokenCriteria)), None)
    barred, pad = _eos_barred_below(call.logits_processor), call.config._pad_token_tensor
    unfinished = torch.ones(batch, dtype=torch.bool, device=input_ids.device) if eos is not None else None
    outputs = model._prefill(input_ids, call.config, call.model_kwargs, is_first_iteration=True)
    step_inputs, tokens = _step_inputs(call.model_kwargs, prompt, new), []
    with getattr(model, "_optimize_model_for_decode", contextlib.nullcontext)():
        for i in range(new):
            logits = outputs.logits[:, -1]
            if prompt + i < barred:
                logits = logits.index_fill(-1, eos, float("-inf"))
            token = logits.argmax(-1)
            if unfinished is not None:
                token = torch.where(unfinished, token, pad)
                unfinished.logical_and_(torch.isin(token, eos, invert=True))
            tokens.append(token)
            if streamer is not None:
                streamer.put(token.cpu())
            if i == new - 1 or (unfinished is not None and (i + 1) % check_every == 0 and not unfinished.any()):
                break
            outputs = model(**step_inputs(i, token))
    if streamer is not None:
        streamer.end()
    generated = torch.stack(tokens, 1)
    if eos is not None and check_every > 1:
        generated = generated[:, : _finished_at(generated, eos)]
    return torch.cat([input_ids, generated], 1)


def _step_inputs(model_kwargs: dict[str, Any], prompt: int, new: int) -> Callable[[int, Tensor], dict[str, Any]]:
    """`inputs(i, token)`: the forward's inputs that feed new token i [B] (its positions and the mask over
    the prompt and the tokens so far, as transformers' loop makes them), from views of tensors made once."""
    fixed = {k: v for k, v in model_kwargs.items() if k not in ("attention_mask", "position_ids")}
    fixed["return_dict"] = True
    positions, mask = model_kwargs.get("position_ids"), model_kwargs.get("attention_mask")
    if positions is not None:  # [new - 1, B, 1]: token i's positions
        ahead = torch.arange(1, new, dtype=positions.dtype, device=positions.device)
        positions = (positions[:, -1] + ahead[:, None])[..., None]
    if mask is not None:
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], new)], 1)

    def inputs(i: int, token: Tensor) -> dict[str, Any]:
        step = {"input_ids": token[:, None], **fixed}
        if positions is not None:
            step["position_ids"] = positions[i]
        if mask is not None:
            step["attention_mask"] = mask[:, : prompt + i + 1]
        return step

    return inputs


def _eos_barred_below(logits_processor: list) -> int:
    """The sequence length below which the minimum-length processors bar EOS (0: never)."""
    barred = 0
    for processor in logits_processor:
        if isinstance(processor, MinLengthLogitsProcessor):
            barred = max(barred, processor.min_length)
        else:
            barred = max(barred, processor.prompt_length_to_skip + processor.min_new_tokens)
    return barred


def _finished_at(generated: Tensor, eos: Tensor) -> int:
    """How many of the new tokens [B, n] transformers' loop makes: up to the step where the last row reached
    its EOS (a row's first one), or all of them if a row never did."""
    hit = torch.isin(generated, eos)
    if not bool(hit.any(1).all()):
        return generated.shape[1]
    return int(hit.int().argmax(1).max()) + 1
