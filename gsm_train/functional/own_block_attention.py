"""Block-sparse attention for ASQ layers in training: earlier blocks as stored, the own block raw.

The masked SDPA (`attention.masked_sdpa`) runs over both versions of the keys side by side (stored
and uncompressed, 2S keys) with a boolean mask, so it computes all T x 2S products although a query
can see only earlier blocks' stored keys and its own block's raw ones: about a quarter of them at
T = 2048 and blocks of 128. FlexAttention skips the tiles no query of a tile can see, known from the
block structure alone (the stored half below the block diagonal, the raw half on it), and reads
the selection only inside the tiles it computes.

Used in training forwards on CUDA (FlexAttention's backward runs on GPUs only) when the sequence is
a whole number of flex tiles (`fits`), and either the step replays from a CUDA graph
(`GSMSettings.captured_steps`, set by the trainer on one GPU) or the call's attention is large
enough that its kernels, not the host, set the pace (`pays_off_eagerly`: 8B-sized layers at long
sequences, with or without activation checkpointing); the masked SDPA serves everywhere else
(evaluation, generation, CPU, small eager steps). Its kernels are faster than the masked SDPA's, but
called eagerly the compiled call and the block mask cost a few milliseconds of host time per layer:
more than the kernels save at SmolLM2's size, far less at 8B's (docs/design-decisions.md, 'From a
CUDA graph, ASQ layers attend block-sparsely with FlexAttention' and 'Large eager training steps
attend block-sparsely too').
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from gsm_train.compiled import compiled

TILE = 128  # FlexAttention's default tile: queries and keys per block of the block mask
FLEX_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # others (fp64 checks) take the masked SDPA
# Inductor's max-autotune choice for this attention on Hopper, by head size, in bf16/fp16 (`benchmarks/
# asq_attention.py`): heads of 64 measured on the H200 at SmolLM2's shapes (T 2048): 64 x 64 tiles, 3
# stages, 4 warps, forward and backward; heads of 128 on the H100 at Llama-3-8B's (T 8192): a 128 x 64
# forward tile with 8 warps, the backward's 32 x 64 and 64 x 32 tiles with 4, 3 stages each. Passed on
# Hopper GPUs, they give the autotuned kernels' speed without their ~20 s of autotuning per run; other
# GPUs, head sizes and dtypes keep Inductor's default configuration (docs/design-decisions.md,
# 'FlexAttention takes fixed kernel options on Hopper').
HOPPER_KERNEL_OPTIONS = {
    64: {
        "fwd_BLOCK_M": 64,
        "fwd_BLOCK_N": 64,
        "fwd_num_stages": 3,
        "fwd_num_warps": 4,
        "bwd_BLOCK_M1": 64,
        "bwd_BLOCK_N1": 64,
        "bwd_BLOCK_M2": 64,
        "bwd_BLOCK_N2": 64,
        "bwd_num_stages": 3,
        "bwd_num_warps": 4,
    },
    128: {
        "fwd_BLOCK_M": 128,
        "fwd_BLOCK_N": 64,
        "fwd_num_stages": 3,
        "fwd_num_warps": 8,
        "bwd_BLOCK_M1": 32,
        "bwd_BLOCK_N1": 64,
        "bwd_BLOCK_M2": 64,
        "bwd_BLOCK_N2": 32,
        "bwd_num_stages": 3,
        "bwd_num_warps": 4,
    },
}


# Attention work (batch x query heads x T^2 x head_dim) from which an eager call of this path costs less
# than the masked SDPA: 2^35, about 3.6x `benchmarks/asq_attention.py`'s SmolLM2 shapes (4 x 9 x 2048^2 x
# 64), where called eagerly it took 2.66 ms per layer (host-bound) against the masked SDPA's 1.46, with
# kernels of 0.62 against 1.31 ms (break-even near 2x that work); 8B's layers at T 8192 (1 x 32 x 8192^2 x 128)
# do 8x this (docs/design-decisions.md, 'Large eager training steps attend block-sparsely too').
EAGER_MIN_WORK = 2**35


def fits(query: Tensor) -> bool:
    """Whether this path serves `query` [B, H, T, D]: on CUDA, in a training dtype, heads of at least 16
    (Inductor's FlexAttention refuses smaller) and T a whole number of tiles. ASQ blocks of any size are
    served: the tile lists and the rule follow the block each token lies in."""
    length, head_dim = query.shape[2], query.shape[3]
    return query.is_cuda and query.dtype in FLEX_DTYPES and head_dim >= 16 and length % TILE == 0


def pays_off_eagerly(query: Tensor) -> bool:
    """Whether a call over `query` [B, H, T, D] does enough attention work (B x H x T^2 x D of at least
    `EAGER_MIN_WORK`) that this path's kernels save more than its host time costs outside a CUDA graph."""
    batch, heads, length, head_dim = query.shape
    return batch * heads * length * length * head_dim >= EAGER_MIN_WORK


def serves(query: Tensor, captured: bool) -> bool:
    """Whether a training forward attends over `query` [B, H, T, D] with this path: it `fits`, and the
    step is `captured` in a CUDA graph or the call `pays_off_eagerly`."""
    return fits(query) and (captured or pays_off_eagerly(query))


@functools.cache
def _is_hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


def kernel_options(query: Tensor, dtype: torch.dtype | None = None) -> dict[str, int] | None:
    """FlexAttention kernel options for `query` [B, H, T, D] attended in `dtype` (None: the query's):
    `HOPPER_KERNEL_OPTIONS` for its head size on a Hopper GPU in bf16 or fp16 (as measured; fp32 tiles need
    more shared memory), else None (Inductor's defaults)."""
    hopper = query.is_cuda and _is_hopper(query.device)
    half = (dtype or query.dtype) in (torch.bfloat16, torch.float16)
    return HOPPER_KERNEL_OPTIONS.get(query.shape[-1]) if hopper and half else None


def attention_dtype(query: Tensor) -> torch.dtype:
    """The dtype the attention multiplies in: autocast's where it is on for the query's device, as SDPA's
    inputs are cast (FlexAttention is not on autocast's list, so fp32 queries would run fp32 tiles),
    else the query's own."""
    device = query.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype


def _flex_attention_in(
    dtype: torch.dtype,
    query: Tensor,
    stored: tuple[Tensor, Tensor],
    raw: tuple[Tensor, Tensor],
    **flex_arguments: object,
) -> Tensor:
    """`flex_attention` over keys and values [stored; raw] cast to `dtype`, with the query: built inside the
    compiled graph, where the concatenation and the casts fuse into one kernel per tensor."""
    keys, values = (torch.cat((first.to(dtype), second.to(dtype)), 2) for first, second in zip(stored, raw))
    return flex_attention(query.to(dtype), keys, values, **flex_arguments)


@functools.cache
def _tile_structure(length: int, block_size: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(kv_num_blocks [1, 1, nQ], kv_indices [1, 1, nQ, 2 nQ]) of the tiles some query of a query tile may
    see among the 2 x length keys [stored; raw]: stored tiles holding a key of an ASQ block earlier than
    some query's, raw tiles sharing an ASQ block with the query tile, up to the diagonal. A tile spans
    the ASQ blocks `first` to `last` (one block when blocks are whole tiles, several when they are smaller)."""
    tile = torch.arange(length // TILE, device=device)
    first, last = tile * TILE // block_size, ((tile + 1) * TILE - 1) // block_size
    stored = first[None, :] < last[:, None]  # [query tile, key tile]
    raw = (first[None, :] <= last[:, None]) & (last[None, :] >= first[:, None]) & (tile[None, :] <= tile[:, None])
    active = torch.cat((stored, raw), 1)  # [nQ, 2 nQ]
    counts = active.sum(1, dtype=torch.int32)
    indices = torch.argsort((~active).to(torch.int8), dim=1, stable=True).to(torch.int32)  # active tiles first
    return counts[None, None], indices[None, None]


def visible_codes(selection: Tensor, block_size: int) -> Tensor:
    """`selection` [B, n, T, T] (causal) as int8 codes of what a query sees of key j: 0 nothing, 1 its stored
    version (j in an earlier ASQ block), 2 its raw one (j in the query's own block)."""
    blocks = torch.arange(selection.shape[-1], device=selection.device) // block_size
    own = (blocks[:, None] == blocks[None, :]).to(torch.int8)
    return selection.to(torch.int8) * (own + 1)


def own_block_attention(
    query: Tensor,
    stored: tuple[Tensor, Tensor],
    raw: tuple[Tensor, Tensor],
    selection: Tensor,
    block_size: int,
    scaling: float,
    gqa: bool,
    compile_mode: str | None = None,
    tuned: bool = True,
    extra_options: dict[str, int | bool] | None = None,
) -> Tensor:
    """Attention of query [B, H, T, D] over the `stored` and the `raw` (key, value) pairs [B, Hkv, T, D]
    (2T keys side by side), where query t sees stored key j when `selection[b, g, t, j]` and j lies in an
    earlier ASQ block, and raw key j when `selection[b, g, t, j]` and j lies in its own block (g: 0, or the
    query head's KV group when the selection [B|1, n, T, T] has one row per KV head) -> [B, T, H, D], in
    `attention_dtype` (under autocast its dtype, as SDPA computes there). On CUDA FlexAttention runs
    compiled, with torch.compile's `compile_mode` and, when `tuned`, the `kernel_options` for the query;
    `extra_options` go on top (FlexAttention's `kernel_options`, for candidates that
    `benchmarks/asq_attention.py` times). The mask compares one int8 code a score: the selection is made
    `visible_codes` first (one compiled pass on CUDA), which tells a query's own block from earlier ones."""
    length = query.shape[2]
    heads_per_row = query.shape[1] // selection.shape[1]
    made = (compiled(visible_codes) if query.is_cuda else visible_codes)(selection, block_size)
    codes = made.expand(query.shape[0], -1, -1, -1)  # made from the selection as given: a batch shares one copy

    def visible(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        is_stored = kv < length
        key_at = torch.where(is_stored, kv, kv - length)
        return codes[b, h // heads_per_row, q, key_at] == 2 - is_stored.to(torch.int8)

    counts, indices = _tile_structure(length, block_size, query.device)
    mask = BlockMask.from_kv_blocks(
        counts, indices, BLOCK_SIZE=TILE, mask_mod=visible, seq_lengths=(length, 2 * length)
    )
    dtype = attention_dtype(query)
    attend = compiled(_flex_attention_in, compile_mode) if query.is_cuda else _flex_attention_in
    options = {**((kernel_options(query, dtype) or {}) if tuned else {}), **(extra_options or {})} or None
    out = attend(dtype, query, stored, raw, block_mask=mask, scale=scaling, enable_gqa=gqa, kernel_options=options)
    return out.transpose(1, 2).contiguous()
