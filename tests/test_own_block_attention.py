"""The block-sparse attention of ASQ layers computes what the masked SDPA over both key versions does."""

from __future__ import annotations

import pytest
import torch

from gsm_train.attention.layout import block_causal_kv
from gsm_train.functional.own_block_attention import fits, own_block_attention, visible_codes


@pytest.mark.parametrize(
    ("block_size", "selectors", "mask_batch"), [(128, 1, 2), (256, 1, 2), (64, 1, 2), (128, 2, 2), (128, 1, 1)]
)
def test_forward_equals_masked_sdpa_over_both_versions(block_size: int, selectors: int, mask_batch: int) -> None:
    """Same output for one selection per layer or per KV head, ASQ blocks of one or two tiles or half a tile, and
    a selection shared by the batch (dense mode: the causal mask)."""
    torch.manual_seed(0)
    batch, heads, kv_heads, length, dim = 2, 4, 2, 512, 16
    query = torch.randn(batch, heads, length, dim)
    stored_k, stored_v, raw_k, raw_v = (torch.randn(batch, kv_heads, length, dim) for _ in range(4))
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    selection = (torch.rand(mask_batch, selectors, length, length) > 0.6) & causal
    selection |= torch.eye(length, dtype=torch.bool)  # every query keeps itself, as select_top_k forces
    positions = torch.arange(length)
    keys, values, mask = block_causal_kv(stored_k, stored_v, (raw_k, raw_v), selection, positions, block_size)
    groups = heads // selectors
    expected = torch.nn.functional.scaled_dot_product_attention(
        query,
        keys.repeat_interleave(heads // kv_heads, 1),
        values.repeat_interleave(heads // kv_heads, 1),
        attn_mask=mask.repeat_interleave(groups, 1),
        scale=0.25,
    ).transpose(1, 2)
    got = own_block_attention(query, (stored_k, stored_v), (raw_k, raw_v), selection, block_size, 0.25, gqa=True)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the block-sparse path serves CUDA tensors only")
def test_fits_whole_tiles_in_training_dtypes_only() -> None:
    def query(length: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.zeros(1, 2, length, 16, device="cuda", dtype=dtype)

    assert fits(query(2048)) and fits(query(512)) and fits(query(512, torch.float32))
    assert not fits(query(2000)) and not fits(query(512, torch.float64))


def test_cpu_tensors_take_the_masked_sdpa() -> None:
    assert not fits(torch.zeros(1, 2, 512, 16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward runs on GPUs only")
@pytest.mark.parametrize("block_size", [128, 64])
def test_gradients_equal_masked_sdpa_on_the_gpu(block_size: int) -> None:
    """Compiled on the GPU, forward and gradients (query, both key and value versions) match the masked SDPA,
    for ASQ blocks of one tile and of half a tile."""
    torch.manual_seed(0)
    batch, heads, kv_heads, length, dim = 2, 6, 2, 1024, 64
    inputs = [torch.randn(batch, heads, length, dim, device="cuda", requires_grad=True)]
    inputs += [torch.randn(batch, kv_heads, length, dim, device="cuda", requires_grad=True) for _ in range(4)]
    query, stored_k, stored_v, raw_k, raw_v = inputs
    causal = torch.ones(length, length, dtype=torch.bool, device="cuda").tril()
    selection = ((torch.rand(batch, 1, length, length, device="cuda") > 0.9) & causal) | torch.eye(
        length, dtype=torch.bool, device="cuda"
    )
    keys, values, mask = block_causal_kv(
        stored_k, stored_v, (raw_k, raw_v), selection, torch.arange(length, device="cuda"), block_size
    )
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, scale=0.125, enable_gqa=True
    ).transpose(1, 2)
    got = own_block_attention(query, (stored_k, stored_v), (raw_k, raw_v), selection, block_size, 0.125, gqa=True)
    grad = torch.randn_like(expected)
    for a, b in zip(torch.autograd.grad(expected, inputs, grad), torch.autograd.grad(got, inputs, grad)):
        torch.testing.assert_close(b, a, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize(
    ("length", "block_size"), [(512, 128), (512, 256), (1024, 512), (256, 256), (512, 64), (512, 32), (768, 96)]
)
def test_tile_lists_are_the_tiles_the_rule_touches(length: int, block_size: int) -> None:
    """The block mask's tile lists (built from the block structure alone) name exactly the tiles where some
    query may see some key, as FlexAttention's own builder finds them from the rule itself. On CPU flex
    applies only the rule, so this is where a wrong tile list shows."""
    from torch.nn.attention.flex_attention import create_block_mask

    from gsm_train.functional.own_block_attention import TILE, _tile_structure

    def rule(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        key_at = torch.where(kv < length, kv, kv - length)
        same_block = key_at // block_size == q // block_size
        return (key_at <= q) & torch.where(kv < length, ~same_block, same_block)

    reference = create_block_mask(rule, None, None, length, 2 * length, device="cpu", BLOCK_SIZE=TILE)
    counts, indices = _tile_structure(length, block_size, torch.device("cpu"))
    ref_counts = reference.kv_num_blocks + (
        reference.full_kv_num_blocks if reference.full_kv_num_blocks is not None else 0
    )
    assert torch.equal(counts.flatten(), ref_counts.flatten().to(counts.dtype))
    for row in range(length // TILE):
        ours = set(indices[0, 0, row, : counts[0, 0, row]].tolist())
        theirs = set(reference.kv_indices[0, 0, row, : reference.kv_num_blocks[0, 0, row]].tolist())
        if reference.full_kv_num_blocks is not None:
            theirs |= set(reference.full_kv_indices[0, 0, row, : reference.full_kv_num_blocks[0, 0, row]].tolist())
        assert ours == theirs, row


def test_attention_dtype_follows_autocast_as_sdpa_does() -> None:
    """Under autocast the block-sparse path multiplies in autocast's dtype (FlexAttention is not on
    autocast's list; SDPA, which the masked path and dense layers use, is cast there); else the query's."""
    from gsm_train.functional.own_block_attention import attention_dtype

    query = torch.zeros(1, 2, 128, 16)
    assert attention_dtype(query) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attention_dtype(query) == torch.bfloat16
    assert attention_dtype(query.double()) == torch.float64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the block-sparse path serves CUDA tensors only")
def test_under_autocast_fp32_inputs_attend_in_bf16_as_the_masked_sdpa() -> None:
    """fp32 inputs under bf16 autocast (an fp32 base's queries after RoPE): the output is bf16 and matches
    the masked SDPA under the same autocast."""
    torch.manual_seed(0)
    batch, heads, kv_heads, length, dim, block_size = 2, 6, 2, 1024, 64, 128
    query = torch.randn(batch, heads, length, dim, device="cuda")
    stored_k, stored_v, raw_k, raw_v = (torch.randn(batch, kv_heads, length, dim, device="cuda") for _ in range(4))
    causal = torch.ones(length, length, dtype=torch.bool, device="cuda").tril()
    selection = ((torch.rand(batch, 1, length, length, device="cuda") > 0.9) & causal) | torch.eye(
        length, dtype=torch.bool, device="cuda"
    )
    keys, values, mask = block_causal_kv(
        stored_k, stored_v, (raw_k, raw_v), selection, torch.arange(length, device="cuda"), block_size
    )
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected = torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=0.125, enable_gqa=True
        ).transpose(1, 2)
        got = own_block_attention(query, (stored_k, stored_v), (raw_k, raw_v), selection, block_size, 0.125, gqa=True)
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_eager_calls_pay_off_from_the_work_threshold() -> None:
    """The eager rule on shapes alone (meta tensors): Llama-3-8B's layers at T 8192 take the block-sparse path,
    `benchmarks/asq_attention.py`'s SmolLM2 shapes (measured slower eagerly) and 8B at T 2048 do not."""
    from gsm_train.functional.own_block_attention import EAGER_MIN_WORK, pays_off_eagerly

    def query(batch: int, heads: int, length: int, dim: int) -> torch.Tensor:
        return torch.empty(batch, heads, length, dim, device="meta")

    assert pays_off_eagerly(query(1, 32, 8192, 128)) and pays_off_eagerly(query(1, 9, 8192, 64))
    assert not pays_off_eagerly(query(4, 9, 2048, 64)) and not pays_off_eagerly(query(1, 32, 2048, 128))
    assert pays_off_eagerly(query(1, 1, 2**14, 128)) and EAGER_MIN_WORK == 2**14 * 2**14 * 128  # the bound itself
    assert not pays_off_eagerly(query(1, 1, 2**14 - 128, 128))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the block-sparse path serves CUDA tensors only")
def test_serves_captured_steps_at_any_size_and_eager_ones_from_the_threshold() -> None:
    from gsm_train.functional.own_block_attention import serves

    small = torch.empty(1, 9, 2048, 64, device="cuda", dtype=torch.bfloat16)
    large = torch.empty(1, 32, 8192, 128, device="cuda", dtype=torch.bfloat16)
    assert serves(small, captured=True) and not serves(small, captured=False)
    assert serves(large, captured=True) and serves(large, captured=False)
    assert not serves(torch.empty(1, 32, 8192 - 64, 128, device="cuda", dtype=torch.bfloat16), captured=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward runs on GPUs only")
def test_under_activation_checkpointing_gqa_heads_of_128_are_as_close_as_the_chunked_masked_sdpa() -> None:
    """As an eager 8B step runs it: 4 query heads per KV head of 128 in bf16 (Inductor's default kernel
    options), the call recomputed in the backward by non-reentrant checkpointing. Forward and gradients lie
    as close to the fp32 result as `chunked_masked_attention` in bf16 (the path it replaces) does."""
    from torch.utils.checkpoint import checkpoint

    from gsm_train.attention.dispatch import chunked_masked_attention

    torch.manual_seed(0)
    batch, heads, kv_heads, length, dim, block_size = 1, 8, 2, 1024, 128, 64
    exact = [torch.randn(batch, heads, length, dim, device="cuda", requires_grad=True)]
    exact += [torch.randn(batch, kv_heads, length, dim, device="cuda", requires_grad=True) for _ in range(4)]
    causal = torch.ones(length, length, dtype=torch.bool, device="cuda").tril()
    selection = ((torch.rand(batch, kv_heads, length, length, device="cuda") > 0.8) & causal) | torch.eye(
        length, dtype=torch.bool, device="cuda"
    )

    def run(attend, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        query, stored_k, stored_v, raw_k, raw_v = inputs
        out = attend(query, (stored_k, stored_v), (raw_k, raw_v), selection, block_size, dim**-0.5, True)
        return [out.float(), *(grad.float() for grad in torch.autograd.grad(out, inputs, upstream.to(out.dtype)))]

    def halved() -> list[torch.Tensor]:
        return [tensor.detach().bfloat16().requires_grad_() for tensor in exact]

    upstream = torch.randn(batch, length, heads, dim, device="cuda")
    expected = run(chunked_masked_attention, exact)
    masked = run(chunked_masked_attention, halved())
    flex = run(lambda *args: checkpoint(own_block_attention, *args, use_reentrant=False), halved())
    for name, want, old, new in zip(("out", "query", "stored_k", "stored_v", "raw_k", "raw_v"), expected, masked, flex):
        old_error, new_error = (want - old).abs().max(), (want - new).abs().max()
        assert new_error <= 2 * old_error + 1e-3 * want.abs().max(), (name, new_error, old_error)


def test_visible_codes_say_stored_for_earlier_blocks_and_raw_for_the_own_one() -> None:
    selection = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    selection[0, 0, 5, 1] = False
    codes = visible_codes(selection, 2)
    expected = torch.tensor(
        [
            [2, 0, 0, 0, 0, 0],
            [2, 2, 0, 0, 0, 0],
            [1, 1, 2, 0, 0, 0],
            [1, 1, 2, 2, 0, 0],
            [1, 1, 1, 1, 2, 0],
            [1, 0, 1, 1, 2, 2],
        ],
        dtype=torch.int8,
    )
    assert torch.equal(codes[0, 0], expected)
