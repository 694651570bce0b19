"""The decode step's gate-token kernel (`gsm_train.kernels.gate_token`): the new token's gate query and its
key, encoded as `encode_gate_keys` stores it and written at the slot the device lengths name, against the
PyTorch gate (`SparseGateHead.forward`) and `encode_gate_keys`."""

from __future__ import annotations

import math

import pytest
import torch
from run_helpers import KERNEL_DEVICE, TRITON_KERNEL_MARKS

from gsm_train.functional.gate_keys import encode_gate_keys
from gsm_train.modules.sparse_gate import SparseGateHead

pytestmark = TRITON_KERNEL_MARKS

HEAD_DIM = 64  # the base model's head: 32 RoPE frequencies to choose from
CAPACITY = 40


def _rope(positions: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's cos/sin [len(positions), 1, HEAD_DIM] as a Llama rotary embedding gives them."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
    angles = torch.tensor(positions, dtype=torch.float32)[:, None, None] * inv_freq
    angles = torch.cat((angles, angles), -1)
    return angles.cos().to(dtype).to(KERNEL_DEVICE), angles.sin().to(dtype).to(KERNEL_DEVICE)


def _gate(hidden_size: int, gate_head_dim: int, selectors: int, bits: int, unrotated: int = 0) -> SparseGateHead:
    """A gate with random projections (about unit-size keys) and random frequencies per selector, except
    for `unrotated` pairs of each selector at random places, marked unrotated (`gate_rope.unrotated_index`)."""
    gate = SparseGateHead(hidden_size, gate_head_dim, HEAD_DIM, num_selectors=selectors, key_bits=bits)
    with torch.no_grad():
        for proj in (gate.q_proj, gate.k_proj):
            proj.weight.normal_(0, hidden_size**-0.5)
        gate.rope_freq_index.copy_(torch.randint(0, HEAD_DIM // 2, gate.rope_freq_index.shape))
        for index in gate.rope_freq_index:
            index[torch.randperm(len(index))[:unrotated]] = HEAD_DIM // 2
    return gate.to(KERNEL_DEVICE)


def _buffers(batch: int, gate: SparseGateHead) -> tuple[torch.Tensor, torch.Tensor | None]:
    shape = (batch, gate.num_selectors, CAPACITY, gate.gate_head_dim)
    if gate.key_bits == 16:
        return torch.zeros(shape, dtype=torch.bfloat16, device=KERNEL_DEVICE), None
    keys = torch.zeros(shape, dtype=torch.int8, device=KERNEL_DEVICE)
    return keys, torch.zeros(*shape[:3], 1, dtype=torch.float16, device=KERNEL_DEVICE)


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("selectors", [1, 3])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("hidden_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("unrotated", [0, 3])
def test_gate_token_kernel_equals_the_pytorch_gate(
    bits: int, selectors: int, batch: int, hidden_dtype: torch.dtype, unrotated: int
) -> None:
    """d = 576 (SmolLM2's, no power of two), dg = 16: the query and key agree with the PyTorch gate's to
    1e-5 relative, the codes equal `encode_gate_keys` of the PyTorch gate's key or differ by one (the
    projections sum in another order than the GEMV), the same for several steps at their slots, and
    nothing else in the buffers changes. RoPE tables in bf16 with one row for the batch (as a model
    whose position ids have one row gives them), or in fp32 with a row per batch row. With 3 of the 8 pairs
    of each selector unrotated (cos 1, sin 0, not the table's column past the frequencies)."""
    from gsm_train.kernels.gate_token import gate_token

    torch.manual_seed(batch * 10 + selectors + bits)
    gate = _gate(576, 16, selectors, bits, unrotated)
    keys, scales = _buffers(batch, gate)
    codes_seen, off_by_one = 0, 0
    for slot in (0, 7, CAPACITY - 1):
        hidden = torch.randn(batch, 1, 576, device=KERNEL_DEVICE).to(hidden_dtype)
        positions = [slot] if hidden_dtype == torch.bfloat16 else [slot + row for row in range(batch)]
        cos, sin = _rope(positions, hidden_dtype)
        keys_before = keys.clone()
        scales_before = None if scales is None else scales.clone()
        lengths = torch.tensor([slot + 1, 0], dtype=torch.int32, device=KERNEL_DEVICE)
        gate_q = gate_token(
            hidden, gate.q_proj.weight, gate.k_proj.weight, cos, sin, gate.rope_freq_index, keys, scales, lengths
        )
        with torch.no_grad():
            expected_q, expected_k = gate(hidden, cos, sin)
        torch.testing.assert_close(gate_q, expected_q, rtol=1e-5, atol=1e-5 * expected_q.abs().max().item())
        expected_codes, expected_scales = encode_gate_keys(expected_k, bits)
        stored = keys[:, :, slot : slot + 1]
        if bits == 16:  # bf16 of keys within 1e-5 relative: equal, or one bf16 step apart at a rounding tie
            size = expected_k.abs().max().item()  # (a key near zero after the rotation's cancellation: absolute)
            torch.testing.assert_close(stored.float(), expected_codes.float(), rtol=2**-7, atol=1e-5 * size)
            codes_seen += stored.numel()
            off_by_one += int((stored != expected_codes).sum())
        else:
            difference = (stored.int() - expected_codes.int()).abs()
            assert int(difference.max()) <= 1
            codes_seen += stored.numel()
            off_by_one += int((difference > 0).sum())
            torch.testing.assert_close(scales[:, :, slot : slot + 1], expected_scales, rtol=2**-10, atol=0)
        keys_before[:, :, slot : slot + 1] = stored
        assert torch.equal(keys, keys_before)  # only the slot was written
        if scales is not None:
            scales_before[:, :, slot : slot + 1] = scales[:, :, slot : slot + 1]
            assert torch.equal(scales, scales_before)
    assert off_by_one <= max(1, codes_seen // 50)  # rare: only values within ~1e-5 of a rounding boundary


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("hidden_size", [1024, 1000])
def test_gate_token_kernel_split_over_d_equals_one_split(
    monkeypatch: pytest.MonkeyPatch, hidden_size: int, bits: int
) -> None:
    """The projections split over d (16 chunks of 64 columns; at d = 1000 the last holds 40) give the query
    and key that one chunk over all of d gives (one program per row, looping over d): the query within
    1e-5 relative of it and of the PyTorch gate's, codes equal or one apart, scales within one fp16 step.
    The splits are summed in a fixed order, so two calls return and store the same bits."""
    from gsm_train.kernels import gate_token as module

    torch.manual_seed(hidden_size + bits)
    gate = _gate(hidden_size, 16, 2, bits, unrotated=2)
    hidden = torch.randn(2, 1, hidden_size, device=KERNEL_DEVICE).bfloat16()
    cos, sin = _rope([5], torch.bfloat16)
    lengths = torch.tensor([6, 0], dtype=torch.int32, device=KERNEL_DEVICE)
    grids = []
    partial_kernel = module._gate_token_partial_kernel

    class Recorded:
        def __getitem__(self, grid: tuple[int, int]) -> object:
            grids.append(grid)
            return partial_kernel[grid]

    monkeypatch.setattr(module, "_gate_token_partial_kernel", Recorded())
    runs = {}
    for name, split in (("one", 1024), ("split", 64), ("again", 64)):
        monkeypatch.setattr(module, "SPLIT", split)
        keys, scales = _buffers(2, gate)
        gate_q = module.gate_token(
            hidden, gate.q_proj.weight, gate.k_proj.weight, cos, sin, gate.rope_freq_index, keys, scales, lengths
        )
        runs[name] = (gate_q, keys[:, :, 5:6], None if scales is None else scales[:, :, 5:6])
    assert grids == [(4, 1), (4, 16), (4, 16)]  # 2 batch rows x 2 selectors; one chunk, then 16
    for split, again in zip(runs["split"], runs["again"], strict=True):
        assert split is None or torch.equal(split, again)  # deterministic: the same bits
    with torch.no_grad():
        expected_q, expected_k = gate(hidden, cos, sin)
    for gate_q, stored, stored_scales in (runs["one"], runs["split"]):
        for reference in (runs["one"][0], expected_q):
            torch.testing.assert_close(gate_q, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())
        if bits == 8:
            assert int((stored.int() - runs["one"][1].int()).abs().max()) <= 1
            torch.testing.assert_close(stored_scales, runs["one"][2], rtol=2**-10, atol=0)
        else:  # bf16 of keys within 1e-5 relative: equal, or one bf16 step apart at a rounding tie
            torch.testing.assert_close(
                stored.float(), runs["one"][1].float(), rtol=2**-7, atol=1e-5 * expected_k.abs().max().item()
            )


def test_gate_token_kernel_encodes_like_encode_gate_keys_at_rounding_ties() -> None:
    """The encoding itself is exact: with weights that make the projections exact sums (one nonzero per row,
    integers over powers of two), the stored codes and scale are `encode_gate_keys`' to the bit, ties that
    round half to even (k / scale = 0.5, 2.5, -1.5) and a key of zeros (scale fp16's smallest normal)
    included."""
    from gsm_train.kernels.gate_token import gate_token

    gate = _gate(32, 16, 1, 8)
    cos, sin = _rope([0], torch.float32)  # position 0: no rotation, the keys as projected
    values = torch.tensor([127.0, 0.5, 2.5, -1.5, 3.5, -0.5, 126.5, -127.0, 1.0, 0.0, 64.0, -63.5, 0.25, 8.0, 9.5, 0.0])
    with torch.no_grad():
        gate.q_proj.weight.zero_()
        gate.k_proj.weight.zero_()
        gate.k_proj.weight[torch.arange(16), torch.arange(16)] = values.to(KERNEL_DEVICE) / 8
    hidden = torch.full((2, 1, 32), 8.0, device=KERNEL_DEVICE)
    hidden[1] = 0.0
    keys, scales = _buffers(2, gate)
    lengths = torch.tensor([3, 0], dtype=torch.int32, device=KERNEL_DEVICE)
    gate_token(hidden, gate.q_proj.weight, gate.k_proj.weight, cos, sin, gate.rope_freq_index, keys, scales, lengths)
    with torch.no_grad():
        _, expected_k = gate(hidden, cos, sin)
    expected_codes, expected_scales = encode_gate_keys(expected_k, 8)
    assert torch.equal(keys[:, :, 2:3], expected_codes) and torch.equal(scales[:, :, 2:3], expected_scales)
    assert scales[1, 0, 2, 0].item() == 2.0**-14 and math.isclose(scales[0, 0, 2, 0].item(), 1.0)


def test_gate_token_kernel_refuses_buffers_of_another_width() -> None:
    from gsm_train.kernels.gate_token import gate_token

    gate = _gate(32, 16, 1, 8)
    keys, scales = _buffers(1, gate)
    cos, sin = _rope([0], torch.float32)
    lengths = torch.tensor([1, 0], dtype=torch.int32, device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match="gate_token: takes hidden"):
        gate_token(
            torch.zeros(1, 1, 32, device=KERNEL_DEVICE), gate.q_proj.weight, gate.k_proj.weight, cos, sin,
            gate.rope_freq_index, keys.to(torch.bfloat16), scales, lengths,
        )  # fmt: skip


def test_a_fused_token_step_keeps_its_gate_keys_through_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A token step over a fused cache (int8 gate keys, one selector per KV head) runs the kernel once per
    sparse layer, and the cache then holds the gate keys the PyTorch path's cache holds (codes equal or one
    apart, scales within one fp16 step)."""
    from gsm_train.attention import inject_gsm
    from gsm_train.config.schema import GSMConfig
    from gsm_train.inference.cache import GSMCache, cache_kwargs
    from gsm_train.kernels import gate_token as module
    from gsm_train.models.model_zoo import tiny_model

    calls = []
    kernel = module.gate_token
    monkeypatch.setattr(module, "gate_token", lambda *args: calls.append(args[6].shape) or kernel(*args))
    model = tiny_model("llama")
    sparse = {"top_k": 4, "k_min": 2, "gate_head_dim": 16, "dense_layers": [0], "heads": "kv", "gate_key_bits": 8}
    inject_gsm(model, GSMConfig.model_validate({"sparse_attention": sparse}), mode="sparse")
    model.to(KERNEL_DEVICE)
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0)).to(KERNEL_DEVICE)
    caches = [GSMCache(model, capacity=8, fused=fused, prefill="sparse") for fused in (True, False)]
    with torch.no_grad():
        for cache in caches:
            model(ids[:, :6], use_cache=True, **cache_kwargs(model, cache))
            model(ids[:, 6:], use_cache=True, **cache_kwargs(model, cache))
    gated = [pair for pair in zip(*(cache.layers for cache in caches), strict=True) if pair[0].adapter.gate]
    assert len(gated) >= 2 and len(calls) == len(gated)  # the dense layer 0 has no gate
    for fused, eager in gated:
        assert int((fused.gate_keys[:, :, :7].int() - eager.gate_keys[:, :, :7].int()).abs().max()) <= 1
        torch.testing.assert_close(
            fused.gate_key_scales[:, :, :7], eager.gate_key_scales[:, :, :7], rtol=2**-10, atol=0
        )
