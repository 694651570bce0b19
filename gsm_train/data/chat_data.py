"""Chat (instruction) data: conversations rendered with the tokenizer's chat template, the loss on the
assistant's tokens only, as torchtune's chat datasets train by default.

A record field holding a conversation, a list of `{"role": ..., "content": ...}` messages (e.g.
`fields: [messages]`), becomes the tokens of the whole conversation as the tokenizer's chat template
renders it (`tokenizer.apply_chat_template`, no extra special tokens, no EOS appended: the template
ends its turns itself). The loss counts the tokens of each assistant turn, from just after the
template's generation prompt (`add_generation_prompt=True` of the messages before it) to the end of
the turn as the template writes it (its end-of-turn token included); every other token (system,
user, tool, the template's headers) is context only.

Packed rows carry that as the sign of the token: a token outside the loss is stored as `-1 - id`
(`mark_context`), so that the rows stay one integer tensor through the token cache, the packed and
streamed batches and a captured step; `inputs_and_labels` turns a batch back into the model's
`input_ids` and `labels` (-100 outside the loss, the ignore index of transformers' loss). Rows of
plain text hold no negative value: their labels are their ids.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gsm_train.data.data_errors import DataError

IGNORE_INDEX = -100  # transformers' cross-entropy ignores labels of this value


def is_conversation(value: Any) -> bool:
    """Whether a record value is a conversation: a non-empty list of dicts with `role` and `content`."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


def _render(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    if not messages and not add_generation_prompt:
        return ""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer: Any, messages: list[dict[str, Any]], source: str) -> tuple[str, list[tuple[int, int]]]:
    """The conversation as the chat template renders it, and the [start, end) character spans of its
    assistant turns. DataError when the tokenizer has no chat template, or when the template does not
    render a conversation's beginning as the beginning of its rendering (the turns cannot be found)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            source,
            "the records hold conversations but the tokenizer has no chat template",
            "use a model whose tokenizer has a chat_template (an instruct model), or set fields to text fields",
        )
    text = _render(tokenizer, messages, False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:index], True)
        turn = _render(tokenizer, messages[: index + 1], False)
        if not (turn.startswith(prompt) and text.startswith(turn)):
            raise DataError(
                source,
                f"the chat template renders assistant turn {index} differently alone than within the "
                "conversation, so its tokens cannot be told apart",
                "use a chat template that renders a conversation's beginning as the beginning of its rendering",
            )
        spans.append((len(prompt), len(turn)))
    return text, spans


def encode_conversation(tokenizer: Any, messages: list[dict[str, Any]], source: str) -> list[int]:
    """The conversation's token ids in the chat template, those outside the loss marked
    (`mark_context`): a token is in the loss when it starts inside an assistant turn's span."""
    text, spans = assistant_spans(tokenizer, messages, source)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    return [
        token if any(start <= begin < end for start, end in spans) else mark_context(token)
        for token, (begin, _) in zip(encoding["input_ids"], encoding["offset_mapping"])
    ]


def mark_context(token: int) -> int:
    """A token id marked as context, outside the loss: `-1 - id` (negative, so no id collides)."""
    return -1 - token


def inputs_and_labels(batch: Tensor) -> tuple[Tensor, Tensor]:
    """A batch of packed rows as (`input_ids`, `labels`): marked tokens restored in the inputs and
    IGNORE_INDEX in the labels; other tokens are their own labels."""
    return input_ids(batch), torch.where(batch < 0, IGNORE_INDEX, batch)


def input_ids(batch: Tensor) -> Tensor:
    """A batch of packed rows as the model's `input_ids` (marked tokens restored)."""
    return torch.where(batch < 0, -1 - batch, batch)
