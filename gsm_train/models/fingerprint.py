"""A fingerprint of a base model's weights, so an adapter is only applied to the base it was trained
on.

Two rules exist (docs/adapter-format.md, "Base fingerprint"): rule 2, which exports of format 6
record, samples rows of every tensor; rule 1, recorded by formats 1 to 5, sampled three tensors only
and is kept to check those exports.
"""

from __future__ import annotations

import hashlib

import torch

from gsm_train.errors import GSMError

FINGERPRINT_RULE = 2
SAMPLED_ROWS = 16
_RULE_1_TENSORS = (
    "model.embed_tokens.weight",
    "model.norm.weight",
    "model.layers.0.self_attn.q_proj.weight",
)


def _bf16_bytes(rows: torch.Tensor) -> bytes:
    """`rows` rounded to bf16 and written as fp32 bytes: one set of weights hashes the same whether
    it is loaded in fp32 or bf16."""
    return rows.detach().to(torch.bfloat16).to(torch.float32).cpu().contiguous().numpy().tobytes()


def sampled_rows(tensor: torch.Tensor) -> torch.Tensor:
    """`SAMPLED_ROWS` evenly spaced rows of `tensor` viewed as [rows, -1] (a 1-d tensor is one row):
    row `i * (R - 1) // (S - 1)` for i in 0..S-1, where R is the row count and S = min(R,
    SAMPLED_ROWS); the first and last rows are always in."""
    matrix = tensor.reshape(1, -1) if tensor.dim() < 2 else tensor.reshape(tensor.shape[0], -1)
    count = min(matrix.shape[0], SAMPLED_ROWS)
    if count <= 1:
        return matrix[:count]
    index = [i * (matrix.shape[0] - 1) // (count - 1) for i in range(count)]
    return matrix[torch.tensor(index, device=matrix.device)]


def _refuse_quantized(state: dict[str, torch.Tensor]) -> None:
    """GSMError for a state holding a quantized weight (a tensor subclass such as torchao's 4-bit tensors):
    its values are not the 16-bit weights a fingerprint is taken of."""
    quantized = [name for name, tensor in state.items() if type(tensor) not in (torch.Tensor, torch.nn.Parameter)]
    if quantized:
        raise GSMError(
            f"{quantized[0]} is a {type(state[quantized[0]]).__name__} ({len(quantized)} quantized tensors): GSM's "
            "modules attach to the 16-bit base, whose fingerprint an adapter records; attach them first "
            "(inject_gsm or load_gsm), then quantize the base (gsm_train.export.int4.quantize_base, or "
            "GSMModel.from_pretrained(..., weights='int4'))"
        )


def base_fingerprint(state: dict[str, torch.Tensor], rule: int = FINGERPRINT_RULE) -> str:
    """sha256 over a base model's tensor names and shapes and bf16-rounded values of sampled rows.

    Rule 2: for every tensor, sorted by name, `"{name}:{shape};"` and then its `sampled_rows`. Rule
    1 (formats 1-5): every `"{name}:{shape};"`, then the first 16 rows of three tensors. Take it
    before GSM or LoRA modules are attached, and before the base is quantized (GSMError for a quantized
    tensor). Tensors on the meta device (a model's skeleton) have no values; their rows are left out."""
    if rule not in (1, 2):
        raise ValueError(f"unknown fingerprint rule {rule!r}; rules 1 and 2 exist")
    _refuse_quantized(state)
    digest = hashlib.sha256()
    names = sorted(state)
    if rule == 1:
        for name in names:
            digest.update(f"{name}:{tuple(state[name].shape)};".encode())
        for name in _RULE_1_TENSORS:
            if name in state and not state[name].is_meta:
                digest.update(_bf16_bytes(state[name][:16]))
        return digest.hexdigest()
    for name in names:
        tensor = state[name]
        digest.update(f"{name}:{tuple(tensor.shape)};".encode())
        if not tensor.is_meta:
            digest.update(_bf16_bytes(sampled_rows(tensor)))
    return digest.hexdigest()
