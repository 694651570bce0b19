"""A fingerprint of a base model's weights, so an adapter is only applied to the base it was trained on."""

from __future__ import annotations

import hashlib

import torch

_FINGERPRINT_TENSORS = ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight")


def base_fingerprint(state: dict[str, torch.Tensor]) -> str:
    """sha256 over a base model's tensor names and shapes and the bf16-rounded values of a few of them
    (so the same weights loaded in fp32 or bf16 give the same fingerprint). Take it before GSM or
    LoRA modules are attached."""
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(f"{name}:{tuple(state[name].shape)};".encode())
    for name in _FINGERPRINT_TENSORS:
        if name in state:
            rows = state[name].detach()[:16].to(torch.bfloat16).to(torch.float32).cpu().contiguous()
            digest.update(rows.numpy().tobytes())
    return digest.hexdigest()
