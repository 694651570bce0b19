"""A synthetic passkey test of long-range retrieval, which perplexity hides: a random 5-digit key is
hidden at a random depth in filler prose, and asked for at the end.

    {INTRO}{filler ...}{NEEDLE with the key}{... filler}{QUESTION}{ANSWER: " 12345"}

Each case is exactly `length` tokens with its answer (the pieces are tokenized apart and joined, so
the needle and the question are the same tokens in every case). Cases come from a seeded generator
(`passkey_cases`): the same seed and prose give the same cases on every machine.

Scoring (`score_passkey`): teacher forcing over prompt and answer, a case counting as retrieved when
every answer token is the model's argmax there, which is exactly when greedy generation writes the
answer (cached GSM decoding equals teacher forcing: tests/test_decode.py), in one forward per case;
optionally also greedy generation through the generation cache, its first run of digits compared
with the key (`passkey_in`).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from gsm_train.attention import gsm_settings, has_gsm
from gsm_train.commands.evaluate import BASE, inference_autocast, keys_read_share, prepare_evaluation
from gsm_train.data.text import DataError, load_text_dataset
from gsm_train.inference.cache import GSMCache, cache_kwargs

INTRO = (
    "There is important information hidden inside a lot of irrelevant text. Find it and "
    "memorize it. I will quiz you about the important information there.\n"
)
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"
ANSWER = " {key}"
KEY_RANGE = (10000, 99999)  # 5 digits, uniform
DEPTH_BINS = 4  # retrieval is reported per quarter of the filler before the needle
FILLER_CHARS_PER_TOKEN = 64  # the filler pool: this many characters of prose per token of a case


@dataclass(frozen=True)
class PasskeyCase:
    """One case: `key` (5 digits) hidden after a `depth` share of the filler, its needle starting at
    token `needle_start`; `prompt` [P] and `answer` [A] int64 tokens, P + A = the case's length."""

    key: str
    depth: float
    needle_start: int
    prompt: Tensor
    answer: Tensor

    @property
    def ids(self) -> Tensor:
        """Prompt and answer [P + A], as teacher forcing reads them."""
        return torch.cat((self.prompt, self.answer))


def _tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> Tensor:
    return torch.tensor(tokenizer(text, add_special_tokens=False).input_ids, dtype=torch.long)


def filler_tokens(tokenizer: PreTrainedTokenizerBase, prose: str, length: int) -> Tensor:
    """The filler pool: the tokens of the first `FILLER_CHARS_PER_TOKEN * length` characters of the
    prose (a file, folder or glob of text, or `embedded:NAME`, as `load_text_dataset` reads it)."""
    text, budget = "", FILLER_CHARS_PER_TOKEN * length
    for document in load_text_dataset(prose)["text"]:
        text += ("\n\n" if text else "") + document
        if len(text) >= budget:
            break
    return _tokens(tokenizer, text[:budget])


def passkey_cases(
    tokenizer: PreTrainedTokenizerBase, filler: Tensor, length: int, count: int, seed: int
) -> list[PasskeyCase]:
    """`count` cases of `length` tokens each, drawn from `random.Random(seed)`: per case the key
    (uniform over 10000-99999), the depth (uniform in [0, 1): the share of the case's filler before
    the needle, rounded to whole tokens) and where in the `filler` pool [N] the case's filler
    starts. Raises DataError when the pieces leave no room for filler or the pool is too short."""
    rng = random.Random(seed)
    intro, question = _tokens(tokenizer, INTRO), _tokens(tokenizer, QUESTION)
    cases = []
    for _ in range(count):
        key = str(rng.randint(*KEY_RANGE))
        needle = _tokens(tokenizer, NEEDLE.format(key=key))
        answer = _tokens(tokenizer, ANSWER.format(key=key))
        room = length - len(intro) - len(needle) - len(question) - len(answer)
        if room < 1:
            raise DataError(
                f"passkey cases of {length} tokens",
                f"the question and the needle alone fill {length - room} tokens",
                f"use a length above {length - room}",
            )
        if len(filler) < room:
            raise DataError(
                "the passkey filler",
                f"{len(filler)} tokens of prose, fewer than a case's {room}",
                "give more prose (a longer file or a folder)",
            )
        depth = rng.random()
        start = rng.randrange(len(filler) - room + 1)
        split = round(depth * room)
        text = filler[start : start + room]
        prompt = torch.cat((intro, text[:split], needle, text[split:], question))
        cases.append(PasskeyCase(key, depth, len(intro) + split, prompt, answer))
    return cases


def needle_key_positions(tokenizer: PreTrainedTokenizerBase, case: PasskeyCase) -> Tensor:
    """The positions [m] of the needle's tokens that hold the key's digits (both mentions of the key), in
    the case's prompt: the tokens of `NEEDLE` whose text has a digit (the needle is tokenized apart)."""
    needle = _tokens(tokenizer, NEEDLE.format(key=case.key))
    digits = [index for index, token in enumerate(needle.tolist()) if re.search(r"\d", tokenizer.decode([token]))]
    return torch.tensor(digits, dtype=torch.long) + case.needle_start


def passkey_in(text: str) -> str | None:
    """The first run of digits in a generated continuation (None without digits)."""
    found = re.search(r"\d+", text)
    return found.group(0) if found else None


@torch.no_grad()
def teacher_forced(model: nn.Module, cases: Sequence[PasskeyCase], batch_size: int) -> list[dict[str, Any]]:
    """Per case: `retrieved` (every answer token is the argmax where it is predicted), the share of
    answer tokens that are, and the answer's NLL in nats (summed over its tokens). Cases of one
    batch have the same length."""
    device = next(model.parameters()).device
    results = []
    for start in range(0, len(cases), batch_size):
        batch = cases[start : start + batch_size]
        ids = torch.stack([case.ids for case in batch]).to(device)
        kept = max(len(case.answer) for case in batch) + 1  # the positions predicting answers
        with inference_autocast(device):
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=kept).logits.float()
        for row, case in enumerate(batch):
            answer_logits = logits[row, kept - 1 - len(case.answer) : kept - 1]
            target = case.answer.to(device)
            hits = answer_logits.argmax(-1) == target
            nll = F.cross_entropy(answer_logits, target, reduction="sum")
            results.append(
                {
                    "retrieved": bool(hits.all()),
                    "answer_token_accuracy": float(hits.float().mean()),
                    "answer_nll": float(nll),
                }
            )
    return results


@torch.no_grad()
def greedy(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, cases: Sequence[PasskeyCase], batch_size: int
) -> list[str]:
    """Per case, the greedy continuation of its prompt (as many tokens as its answer has), through
    the GSM cache on a model whose GSM is on, else the model's own cache."""
    device = next(model.parameters()).device
    texts = []
    for start in range(0, len(cases), batch_size):
        batch = cases[start : start + batch_size]
        prompts = torch.stack([case.prompt for case in batch]).to(device)
        gsm_on = has_gsm(model) and gsm_settings(model).enabled
        cache = cache_kwargs(model, GSMCache(model)) if gsm_on else {}
        out = model.generate(
            prompts,
            max_new_tokens=max(len(case.answer) for case in batch),
            do_sample=False,
            attention_mask=torch.ones_like(prompts),
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            **cache,
        )
        texts += tokenizer.batch_decode(out[:, prompts.shape[1] :], skip_special_tokens=True)
    return texts


def score_passkey(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    cases: Sequence[PasskeyCase],
    batch_size: int = 1,
    generate: bool = False,
) -> dict[str, Any]:
    """Retrieval accuracy over `cases` by teacher forcing (`teacher_forced`) and, with `generate`,
    by greedy generation (`greedy`, exact match of the first digits it writes); per depth quarter
    too, and per case."""
    scored = teacher_forced(model, cases, batch_size)
    per_case = [
        {"key": case.key, "depth": case.depth, "needle_start": case.needle_start} | record
        for case, record in zip(cases, scored, strict=True)
    ]
    if generate:
        for record, text in zip(per_case, greedy(model, tokenizer, cases, batch_size), strict=True):
            record |= {"generated": text, "generated_retrieved": passkey_in(text) == record["key"]}
    result = _accuracies(per_case) | {"cases": len(per_case)}
    result["by_depth"] = []
    for index in range(DEPTH_BINS):
        low, high = index / DEPTH_BINS, (index + 1) / DEPTH_BINS
        in_bin = [r for r in per_case if low <= r["depth"] < high]
        result["by_depth"].append({"depth": [low, high], "cases": len(in_bin)} | _accuracies(in_bin))
    return result | {"per_case": per_case}


def _accuracies(records: list[dict[str, Any]]) -> dict[str, float]:
    """Shares of `records` retrieved (teacher-forced; generated where scored); mean answer NLL."""
    if not records:
        return {}
    result = {
        "accuracy": sum(r["retrieved"] for r in records) / len(records),
        "answer_nll": sum(r["answer_nll"] for r in records) / len(records),
    }
    if "generated_retrieved" in records[0]:
        result["generated_accuracy"] = sum(r["generated_retrieved"] for r in records) / len(records)
    return result


def evaluate_passkey(
    model_name: str | None,
    exports: dict[str, str],
    prose: str,
    length: int,
    count: int,
    seed: int,
    batch_size: int = 1,
    generate: bool = False,
    mode: str = "sparse",
    selections: dict[str, dict[str, Any]] | None = None,
    selection: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The passkey test for the base and every export (name -> folder or Hub repo id), on the same
    cases (`passkey_cases` from `seed`, filler from `prose`). Exports are checked before a model
    loads; `model_name` None: the base the first export names; `mode`: main attention of the
    exports (`sparse`, `oracle`, `dense`); `selection`: sparse_attention fields every export runs
    with instead of its own (`evaluate.with_selection`), `selections`: the same by export name. Each model's
    result has `keys_read`, the share of the keys its main attention reads at a case's last position
    (`evaluate.keys_read_share`: the cost of its selection)."""
    evaluation = prepare_evaluation(model_name, exports, mode, selection=selection, selections=selections)
    evaluation.check_positions("passkey", "--length", length)
    results: dict[str, dict[str, Any]] = {}
    cases = None
    for item in evaluation.models():
        if cases is None:
            pool = filler_tokens(evaluation.tokenizer, prose, length)
            cases = passkey_cases(evaluation.tokenizer, pool, length, count, seed)
        results[item.name] = score_passkey(item.model, evaluation.tokenizer, cases, batch_size, generate)
        results[item.name]["keys_read"] = keys_read_share(item.model, item.settings, length - 1)
        if item.export is not None:
            results[item.name]["export"] = item.export
    return {
        "model": evaluation.model_name,
        "prose": prose,
        "length": length,
        "cases": count,
        "seed": seed,
        "mode": mode,
        "generate": generate,
        "selection": selection or None,
        "selections": selections or None,
        "results": results,
    }


def markdown_table(report: dict[str, Any]) -> str:
    """The passkey report as markdown: accuracy per model, overall and per depth quarter, and the share of
    the keys its main attention reads at a case's last position (`keys_read`)."""
    quarters = [
        f"depth {low:.2f}-{high:.2f}" for low, high in (r["depth"] for r in report["results"][BASE]["by_depth"])
    ]
    generated = " | greedy" if report["generate"] else ""
    lines = [
        f"Passkey retrieval: {report['cases']} cases of {report['length']} tokens (seed "
        f"{report['seed']}, filler `{report['prose']}`); teacher-forced accuracy",
        "",
        "| model | accuracy" + generated + " | answer NLL | keys read | " + " | ".join(quarters) + " |",
        "|---|---|" + ("---|" if generated else "") + "---|---|" + "---|" * len(quarters),
    ]
    for name, r in report["results"].items():
        cells = [f"{r['accuracy']:.2f}"]
        cells += [f"{r['generated_accuracy']:.2f}"] if generated else []
        cells += [f"{r['answer_nll']:.3f}", f"{r['keys_read']:.1%}" if "keys_read" in r else "-"]
        cells += [f"{q['accuracy']:.2f} ({q['cases']})" if q["cases"] else "-" for q in r["by_depth"]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
