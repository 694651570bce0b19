"""Shared set-up of the training-free probes on SmolLM2-135M (`asq_grid.py`, `layer_sensitivity.py`,
`residual_quantizers.py`): their common arguments, the model with windows of the training prose, and the
model's loss with every attention layer's keys and values passed through a transform first."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import Tensor, nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from gsm_train.data.text import load_text_dataset, pack_tokens
from gsm_train.models.model_zoo import load_model_and_tokenizer

KVTransform = Callable[[nn.Module, Tensor, Tensor], tuple[Tensor, Tensor]]


def add_prose_arguments(parser: argparse.ArgumentParser) -> None:
    """--train-data, --result, --windows (default 2) and --seq-len (default 2048)."""
    parser.add_argument("--train-data", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)


def prose_model_and_windows(args: argparse.Namespace, device: str = "cpu") -> tuple[nn.Module, Tensor]:
    """SmolLM2-135M on `device` and the first `args.windows` windows of `args.seq_len` tokens of the prose."""
    model, tokenizer = load_model_and_tokenizer("smollm2-135m")
    rows = pack_tokens(load_text_dataset(args.train_data), tokenizer, args.seq_len)[: args.windows]
    return model.to(device), rows.to(device)


def kv_hooked_loss(model: nn.Module, rows: Tensor, name: str, transform: KVTransform) -> Callable[[], float]:
    """The mean loss over `rows`, with `transform(module, key, value)` applied in every attention layer
    before SDPA (registered as the attention implementation `name`)."""

    def attention(module, query, key, value, *rest, **kwargs):
        key, value = transform(module, key, value)
        return sdpa_attention_forward(module, query, key, value, *rest, **kwargs)

    ALL_ATTENTION_FUNCTIONS[name] = attention
    model.config._attn_implementation = name

    @torch.no_grad()
    def loss() -> float:
        return sum(model(row[None], labels=row[None]).loss.item() for row in rows) / len(rows)

    return loss
