"""Tests for the ASQ KV compressor and its quantization baselines."""

from __future__ import annotations

import pytest
import torch

from gsm_train.modules.kv_compressor import ASQCompressor, paired_training_pass
from gsm_train.quant import asq_bytes, fake_quant_kivi, fake_quant_per_token

H, D = 2, 64


def _rel_err(x_hat: torch.Tensor, x: torch.Tensor) -> float:
    return ((x_hat.float() - x.float()).norm() / x.float().norm()).item()


def _random(s: int = 256, seed: int = 0, b: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, H, s, D, generator=g)


def _offset_data(s: int = 256, seed: int = 0, strength: float = 8.0) -> torch.Tensor:
    """K-like data: strong fixed per-channel offsets plus per-token noise."""
    g = torch.Generator().manual_seed(seed)
    offsets = strength * torch.randn(1, H, 1, D, generator=g)
    return offsets + torch.randn(2, H, s, D, generator=g)


def _asq(bits: int = 4, block_size: int = 64, cluster_num: int = 16, **kw) -> ASQCompressor:
    torch.manual_seed(0)
    return ASQCompressor(H, D, cluster_num=cluster_num, quant_bits=bits, block_size=block_size, **kw).eval()


@pytest.mark.parametrize("make", [_random, _offset_data])
def test_error_falls_as_bits_rise(make) -> None:
    x = make()
    asq = [_rel_err(_asq(bits)(x), x) for bits in (2, 4, 8)]
    per_token = [_rel_err(fake_quant_per_token(x, bits), x) for bits in (2, 4, 8)]
    kivi = [_rel_err(fake_quant_kivi(x, bits, 64, per_channel=True), x) for bits in (2, 4, 8)]
    for errs in (asq, per_token, kivi):
        assert errs[0] > errs[1] > errs[2] > 0


def test_two_bits_use_all_four_levels_at_the_gaussian_optimum() -> None:
    """2-bit residuals sit on the mid-rise grid (levels -1.5, -0.5, 0.5, 1.5 times 0.9957 rms): on Gaussian
    data every level is used and the error is the MSE-optimal uniform 4-level quantizer's (0.345 of the
    signal, Max 1960; per-token rms estimated from 64 values). The symmetric grid's three levels with an
    absmax scale left 0.55."""
    x = torch.randn(4096, D, generator=torch.Generator().manual_seed(0))
    x_hat = fake_quant_per_token(x, 2)
    scale = (0.9957 * x.pow(2).mean(-1, keepdim=True).sqrt()).half().float()
    levels = x_hat / scale
    assert torch.allclose(levels, levels.mul(2).round().div(2), atol=1e-3)
    assert set(levels.round(decimals=1).unique().tolist()) == {-1.5, -0.5, 0.5, 1.5}
    assert 0.33 < _rel_err(x_hat, x) < 0.36


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_a_zero_residual_has_finite_gradients(bits: int) -> None:
    """A block of identical tokens leaves residuals of exactly zero; the 2-bit scale's square root must not
    turn their gradient into NaN (it would spread to every trained weight)."""
    comp = _asq(bits, block_size=16).train()
    x = torch.ones(1, H, 32, D).mul(torch.linspace(-1, 1, D).half().float()).requires_grad_(True)
    out, loss = comp(x, with_loss=True)
    (out.sum() + loss).backward()
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in comp.parameters())


def test_kivi_baseline_is_asymmetric_min_max() -> None:
    """KIVI quantizes from each group's minimum with a zero point: a channel that is constant over a block
    comes back exactly, and a channel's values take 2**bits levels from its minimum to its maximum."""
    x = torch.randn(1, 1, 64, 4, generator=torch.Generator().manual_seed(0))
    x[..., 0] = 3.0  # an offset channel, constant over the block
    x_hat = fake_quant_kivi(x, 2, 64, per_channel=True)
    assert torch.equal(x_hat[..., 0], x[..., 0])
    for channel in range(1, 4):
        low, high = x[0, 0, :, channel].min(), x[0, 0, :, channel].max()
        assert x_hat[0, 0, :, channel].unique().numel() <= 4
        assert torch.allclose(x_hat[0, 0, :, channel].min(), low, atol=2e-3)
        assert torch.allclose(x_hat[0, 0, :, channel].max(), high, atol=2e-3)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_packed_codes_span_their_range(bits: int) -> None:
    """Stored codes are level + code_center and every width uses all of them, 0 .. 2**bits - 1 (mid-rise
    grids: no code is left unused), and decompress gives back the reconstruction."""
    comp = _asq(bits)
    x = _random(s=512)
    packed = comp.compress_blocks(x)
    per = 8 // bits
    codes = torch.stack([(packed.residual.int() >> (bits * i)) & (2**bits - 1) for i in range(per)], -1).unique()
    assert codes.tolist() == list(range(2**bits))
    assert torch.equal(comp.decompress(packed), comp(x))


@pytest.mark.parametrize("make", [_random, _offset_data])
def test_8bit_round_trip_below_one_percent(make) -> None:
    x = make()
    comp = _asq(8)
    assert _rel_err(comp.decompress(comp.compress(x)), x) < 0.01


@pytest.mark.parametrize(
    ("s", "block_size", "bits", "cluster_num", "d"),
    [
        (256, 128, 4, 32, 64),
        (300, 128, 2, 16, 64),
        (50, 128, 8, 8, 64),
        (37, 8, 4, 3, 5),
        (41, 4, 2, 256, 7),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nbytes_matches_byte_account(s, block_size, bits, cluster_num, d, dtype) -> None:
    comp = ASQCompressor(3, d, cluster_num=cluster_num, quant_bits=bits, block_size=block_size)
    x = torch.randn(2, 3, s, d).to(dtype)
    packed = comp.compress(x)
    tail_bytes = x.element_size()
    account = asq_bytes(s, 3, d, cluster_num, bits, block_size, batch_size=2, tail_bytes=tail_bytes)
    assert packed.nbytes() == account["total"]
    assert comp.byte_account(s, batch_size=2, tail_bytes=tail_bytes) == account
    assert account["bf16"] == 2 * 2 * 3 * s * d
    assert comp.byte_account(s, tail_bytes=tail_bytes)["bytes_per_token"] == pytest.approx(
        account["total"] / (2 * 3 * s)
    )
    assert packed.ids.dtype == packed.residual.dtype == torch.uint8
    assert packed.scales.dtype == packed.prototypes.dtype == torch.float16
    assert comp.decompress(packed).shape == x.shape


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotate", [False, True])
def test_eval_forward_equals_decompress_compress(bits, dtype, rotate) -> None:
    comp = _asq(bits, rotate_residuals=rotate)
    x = _offset_data(s=200).to(dtype)
    with torch.no_grad():
        out = comp(x)
    rebuilt = comp.decompress(comp.compress(x))
    assert out.dtype == rebuilt.dtype == dtype
    # Same fp32 ops on the same fp16-rounded prototypes/scales: equal up to fp rounding.
    torch.testing.assert_close(rebuilt, out, rtol=0, atol=1e-6)


def test_fp64_input_is_encoded_and_rebuilt_in_fp64() -> None:
    """fp64 in, fp64 throughout (the exactness check of cached decoding relies on it: an fp32 step
    inside would turn fp64 rounding differences into fp32 ones, which flip 4-bit codes): the encoding
    (its loss shows its dtype) and the packed round trip, which equals the forward to fp64 rounding."""
    comp = _asq(4).double()
    x = _offset_data(s=200).double()
    with torch.no_grad():
        out, loss = comp(x, with_loss=True)
    rebuilt = comp.decompress(comp.compress(x))
    assert out.dtype == rebuilt.dtype == loss.dtype == torch.float64
    torch.testing.assert_close(rebuilt, out, rtol=0, atol=1e-12)


@pytest.mark.parametrize("train", [False, True])
def test_causality_and_uncompressed_tail(train) -> None:
    comp = _asq(4, block_size=64).train(train)
    x = _random(s=300)
    y = x.clone()
    y[:, :, 200:] = torch.randn_like(y[:, :, 200:]) * 5
    out_x, out_y = comp(x), comp(y)
    # Blocks [0, 192) end before position 200 and must not change at all.
    assert torch.equal(out_x[:, :, :192], out_y[:, :, :192])
    assert not torch.equal(out_x[:, :, 192:256], out_y[:, :, 192:256])
    # Trailing partial block [256, 300) is returned exactly; full blocks are compressed.
    assert torch.equal(out_x[:, :, 256:], x[:, :, 256:])
    assert not torch.equal(out_x[:, :, :256], x[:, :, :256])
    short = _random(s=40)
    assert torch.equal(comp(short), short)


def test_gradients_reach_mlp_and_input() -> None:
    comp = _asq(4).train()
    x = _offset_data(s=128).requires_grad_(True)
    (comp(x).pow(2).mean() + comp.reconstruction_loss(x)).backward()
    for grad in (comp.w1.grad, comp.w2.grad, comp.b2.grad, x.grad):
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_forward_with_loss_equals_forward_then_loss() -> None:
    """One shared encoding: the same reconstruction and loss as the two separate calls, the same gradients."""
    grads = []
    for shared in (True, False):
        comp = _asq(4).train()
        x = _offset_data(s=300).requires_grad_(True)
        out, loss = comp(x, with_loss=True) if shared else (comp(x), comp.reconstruction_loss(x))
        (out.pow(2).mean() + loss).backward()
        grads.append((out.detach(), loss.detach(), x.grad, comp.w1.grad, comp.b2.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    for shared_grad, separate_grad in zip(grads[0][2:], grads[1][2:]):
        torch.testing.assert_close(shared_grad, separate_grad, rtol=1e-5, atol=1e-6)


def test_storage_rounding_is_fp16_and_passes_the_gradient_within_its_range() -> None:
    """`_to_store` (integer arithmetic on fp32's bits, which torch.compile cannot fuse away) gives the fp16
    grid exactly, in the input's dtype, and the gradient unchanged wherever fp16 holds the value."""
    from gsm_train.quant import to_store as _to_store

    big = torch.finfo(torch.float16).max
    for dtype in (torch.float32, torch.float64):
        x = torch.cat(
            [
                torch.randn(1000, dtype=dtype) * 10.0 ** torch.randint(-9, 5, (1000,)),
                torch.tensor([-1e6, 1e6, 1e-9, 0.0], dtype=dtype),
            ]
        ).requires_grad_(True)
        stored = _to_store(x)
        assert stored.dtype == dtype
        assert torch.equal(stored, x.detach().clamp(-big, big).half().to(dtype))
        grad = torch.randn_like(x) * 1e-9  # below fp16's smallest step: passed on as it is, not rounded
        stored.backward(grad)
        assert torch.equal(x.grad, torch.where(x.detach().abs() <= big, grad, 0.0))


def test_storage_rounding_matches_fp16_at_every_tie_and_subnormal() -> None:
    """Every finite fp16 value, every midpoint between neighbours (ties go to the even one) and the fp32
    values either side of it, subnormals, NaN and values past fp16's range round as `.half()` rounds."""
    from gsm_train.quant import to_store as _to_store

    grid = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    grid = grid[torch.isfinite(grid)].sort().values
    ties = ((grid[1:].double() + grid[:-1].double()) / 2).float()  # exact in fp32: 12 significant bits
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    x = torch.cat(
        [
            grid,
            ties,
            torch.nextafter(ties, up),
            torch.nextafter(ties, down),
            torch.tensor([float("nan"), 1e-40, -1e-40, -0.0, -1e-8, 65519.0, 65520.0, -1e30]),
        ]
    )
    want = x.clamp(-65504, 65504).half().float().nan_to_num(7.0)
    got = _to_store(x).nan_to_num(7.0)
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())  # -0.0 stays -0.0, as fp16 has it
    if torch.cuda.is_available():  # compiled, fused with its neighbours as in ASQ's training pass
        fused = torch.compile(lambda v: -_to_store(-v), fullgraph=True)  # negation: exact, and fused
        assert torch.equal(fused(x.cuda()).nan_to_num(7.0).cpu(), want)
        # with a gradient to pass, as in ASQ's training pass: the straight-through sum, the same values
        assert torch.equal(fused(x.cuda().requires_grad_(True)).detach().nan_to_num(7.0).cpu(), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled training pass runs on the GPU only")
@pytest.mark.parametrize("rotate", [False, True])
def test_compiled_training_pass_matches_the_eager_one(rotate: bool) -> None:
    """On the GPU, forward(x, with_loss=True) in training runs the torch.compile'd pass; forward and
    reconstruction_loss run eagerly. Fused kernels sum in another order, so a token near a tie may take
    another cluster or code (a few rows differ: at most 2%), but prototypes and scales sit on the same fp16 grid
    (without that, most elements differed) and the loss and the MLP's gradients agree closely."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # a fresh compile, so that it cannot have fallen back to eager after earlier ones
    counters.clear()
    results = []
    for compiled in (True, False):
        comp = _asq(4, rotate_residuals=rotate).train().cuda()
        x = _offset_data(s=300).cuda().requires_grad_(True)
        out, loss = comp(x, with_loss=True) if compiled else (comp(x), comp.reconstruction_loss(x))
        (out.pow(2).mean() + loss).backward()
        results.append((out.detach(), loss.detach(), comp.w1.grad, comp.b1.grad, comp.w2.grad, comp.b2.grad))
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]  # compiled, in one piece
    (out, *rest), (want_out, *want_rest) = results
    rows_differing = ((out - want_out).abs() > 1e-5).any(-1).float().mean()  # a row near a tie moves whole
    assert rows_differing <= 0.02  # autotuned kernels may sum in another order from one run to the next
    for got, want in zip(rest, want_rest):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)


def _key_value_pair(bits: tuple[int, int], rotate: bool, **kw) -> tuple[ASQCompressor, ASQCompressor]:
    torch.manual_seed(0)
    return tuple(
        ASQCompressor(H, D, cluster_num=4, quant_bits=width, block_size=64, rotate_residuals=rotate, **kw)
        .double()
        .train()
        for width in bits
    )


def _training_passes(
    paired: bool,
    bits: tuple[int, int],
    rotate: bool,
    length: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float64,
) -> list[torch.Tensor]:
    """One training pass of a K/V compressor pair, paired or each side alone, then a backward: K's and V's
    reconstructions, the mean of their losses, the inputs' gradients and every parameter's gradient."""
    asq_k, asq_v = (module.to(device, dtype) for module in _key_value_pair(bits, rotate))
    key = _offset_data(s=length).to(device, dtype).requires_grad_(True)
    value = _random(s=length, seed=1).to(device, dtype).requires_grad_(True)
    if paired:
        out_k, out_v, loss = paired_training_pass(asq_k, asq_v, key, value)
    else:
        (out_k, loss_k), (out_v, loss_v) = asq_k(key, with_loss=True), asq_v(value, with_loss=True)
        loss = (loss_k + loss_v) / 2
    (out_k.pow(2).mean() + out_v.pow(3).mean() + loss).backward()
    return [
        out_k.detach(),
        out_v.detach(),
        loss.detach(),
        key.grad,
        value.grad,
        *(p.grad for module in (asq_k, asq_v) for p in module.parameters()),
    ]


@pytest.mark.parametrize(
    ("bits", "rotate", "length"), [((4, 4), False, 256), ((4, 2), True, 300), ((2, 8), False, 200)]
)
def test_paired_pass_gives_each_sides_own_pass(bits: tuple[int, int], rotate: bool, length: int) -> None:
    """K's and V's training passes run as one give each side what its own pass gives, at the same or
    different widths, with a tail after the last full block: reconstructions, the mean of the two losses,
    and the gradients of the inputs and of both MLPs (fp64: the fp32 sums' order would move ties)."""
    for got, want in zip(*(_training_passes(paired, bits, rotate, length) for paired in (True, False))):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled training pass runs on the GPU only")
def test_compiled_paired_pass_matches_the_separate_compiled_passes() -> None:
    """On the GPU both run compiled, in one graph each; fp32 sums in another order may move a token near a
    tie to another cluster or code (few elements), the losses and gradients agree closely."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    paired, separate = (_training_passes(paired, (4, 2), True, 300, "cuda", torch.float32) for paired in (True, False))
    assert not counters["graph_break"]
    out, want_out = torch.cat(paired[:2]), torch.cat(separate[:2])  # reconstructions
    rows_differing = ((out - want_out).abs() > 1e-5).any(-1).float().mean()  # as the compiled pass against eager
    assert rows_differing <= 0.02
    for got, want in zip([paired[2], *paired[5:]], [separate[2], *separate[5:]]):  # loss, parameters' gradients
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize(
    "other", [{"hidden_dim": 32}, {"cluster_num": 8}, {"block_size": 32}, {"tau": 0.5}, {"rotate_residuals": True}]
)
def test_paired_pass_declines_what_it_cannot_pair(other: dict) -> None:
    """None (each side runs its own pass) outside training (either side), before a first full block, for K
    and V of other shapes or dtypes, and for compressors that differ in more than their bits."""
    key, value = _random(s=128).double(), _random(s=128, seed=1).double()
    asq_k, asq_v = _key_value_pair((4, 2), False)
    assert paired_training_pass(asq_k, asq_v, key, value) is not None
    assert paired_training_pass(asq_k, asq_v, key[:, :, :63], value[:, :, :63]) is None
    assert paired_training_pass(asq_k, asq_v, key, value[:, :, :100]) is None
    assert paired_training_pass(asq_k, asq_v, key, value.float()) is None
    assert paired_training_pass(asq_k, asq_v.eval(), key, value) is None
    assert paired_training_pass(asq_k.eval(), asq_v.train(), key, value) is None
    settings = {"cluster_num": 4, "block_size": 64, "rotate_residuals": False, **other}
    torch.manual_seed(0)
    unlike_v = ASQCompressor(H, D, quant_bits=2, **settings).double().train()
    assert paired_training_pass(asq_k.train(), unlike_v, key, value) is None


def test_paired_pass_declines_fsdp2_units() -> None:
    """Compressors sharded by FSDP2 (each its own unit, as `shard_model` makes them) gather their parameters
    only in their own calls, so they run apart (one gloo process, in a child process of its own)."""
    script = """
import os, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from gsm_train.modules.kv_compressor import ASQCompressor, paired_training_pass
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
asq_k, asq_v = (ASQCompressor(2, 16, cluster_num=2, quant_bits=4, block_size=16).train() for _ in range(2))
key, value = torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16)
assert paired_training_pass(asq_k, asq_v, key, value) is not None
fully_shard(asq_k)
fully_shard(asq_v)
assert paired_training_pass(asq_k, asq_v, key, value) is None
dist.destroy_process_group()
print("declined")
"""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env={**os.environ, "PORT": port}
    )
    assert done.returncode == 0 and "declined" in done.stdout, done.stderr[-2000:]


def test_forward_alone_gives_mlp_gradient() -> None:
    comp = _asq(4).train()
    comp(_offset_data(s=128)).pow(2).mean().backward()
    assert comp.w1.grad is not None and comp.w1.grad.abs().sum() > 0


def test_reconstruction_loss_and_stats() -> None:
    comp = _asq(4)
    x = _offset_data()
    loss = comp.reconstruction_loss(x)
    assert loss.ndim == 0 and 0.0 < loss.item() <= 1.0 + 1e-5
    assert comp.reconstruction_loss(_random(s=10)).item() == 0.0
    comp.train()(x)
    assert comp.last_stats == {}  # training steps do not pay for the logging stats
    out = comp.eval()(x)
    stats = comp.last_stats
    assert stats["recon_rel_error"].item() == pytest.approx(_rel_err(out, x), rel=1e-4)
    assert 0.0 < stats["cluster_usage"].item() <= 1.0
    assert stats["dead_clusters"].item() == pytest.approx((1 - stats["cluster_usage"].item()) * 16, abs=1e-4)
    assert not any(v.requires_grad for v in stats.values())


def test_asq_beats_per_token_on_channel_offsets() -> None:
    x = _offset_data(strength=8.0)
    asq_err = _rel_err(_asq(4)(x), x)
    per_token_err = _rel_err(fake_quant_per_token(x, 4), x)
    assert asq_err < 0.5 * per_token_err


def test_kivi_keeps_tail_and_per_channel_helps_offsets() -> None:
    x = _offset_data(s=150)
    k = fake_quant_kivi(x, 4, 64, per_channel=True)
    v = fake_quant_kivi(x, 4, 64, per_channel=False)
    assert torch.equal(k[:, :, 128:], x[:, :, 128:]) and torch.equal(v[:, :, 128:], x[:, :, 128:])
    per_token = fake_quant_kivi(x[:, :, :128].transpose(-1, -2), 4, D, per_channel=True).transpose(-1, -2)
    assert torch.equal(v[:, :, :128], per_token)  # values: one group per token
    assert _rel_err(k[:, :, :128], x[:, :, :128]) < _rel_err(v[:, :, :128], x[:, :, :128])


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"quant_bits": 3}, "quant_bits"),
        ({"cluster_num": 1}, "cluster_num"),
        ({"cluster_num": 257}, "cluster_num"),
        ({"block_size": 0}, "block_size"),
        ({"tau": 0.0}, "tau"),
        ({"hidden_dim": 0}, "hidden_dim"),
    ],
)
def test_bad_arguments_raise(kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        ASQCompressor(H, D, **kwargs)


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="bits"):
        fake_quant_per_token(_random(), 5)
    with pytest.raises(ValueError, match="x"):
        _asq()(torch.randn(2, H + 1, 8, D))


@pytest.mark.parametrize("kind", ["per_token", "kivi"])
def test_plain_baselines_quantize_keys_and_values_at_their_own_bits(kind: str) -> None:
    """With ASQ's (K, V) bits apart, each baseline rounds K and V to the same grids as alone at those bits."""
    from gsm_train.attention.adapter import plain_kv_quant

    torch.manual_seed(0)
    key, value = torch.randn(2, 3, 40, 16), torch.randn(2, 3, 40, 16)
    mixed = plain_kv_quant(key, value, kind, (4, 2), 16)
    assert torch.equal(mixed[0], plain_kv_quant(key, value, kind, (4, 4), 16)[0])
    assert torch.equal(mixed[1], plain_kv_quant(key, value, kind, (2, 2), 16)[1])
    assert not torch.equal(mixed[1], plain_kv_quant(key, value, kind, (4, 4), 16)[1])


def test_hadamard_rotation_is_orthonormal_fixed_and_needs_a_power_of_two() -> None:
    """Entries +-1/sqrt(D), R R^T = I, the same matrix on every build (a reader rebuilds it from D), signs
    not all alike; any other size is refused, naming head_dim."""
    from gsm_train.quant import hadamard_rotation

    rotation = hadamard_rotation(D)
    assert torch.equal(rotation.abs(), torch.full((D, D), D**-0.5, dtype=torch.float64))
    torch.testing.assert_close(rotation @ rotation.T, torch.eye(D, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.equal(rotation, hadamard_rotation(D))
    assert 0 < (rotation[:, 0] > 0).sum() < D
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        hadamard_rotation(48)
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        ASQCompressor(H, 48, rotate_residuals=True)
    assert "rotation" not in ASQCompressor(H, D, rotate_residuals=True).state_dict()  # rebuilt, never exported
    for cast in (torch.bfloat16, torch.float16, torch.float32):  # a cast of the module leaves it exact
        assert torch.equal(ASQCompressor(H, 128, rotate_residuals=True).to(cast).rotation, hadamard_rotation(128))


def test_rotation_signs_are_the_rows_signs_of_a_sylvester_hadamard() -> None:
    """The fused decode kernel rotates with `rotation_signs` and a Walsh-Hadamard butterfly instead of the
    matrix: that holds only where rotation = diag(signs) H / sqrt(D) with Sylvester's H, whose first
    column is ones and whose H[i, j] is (-1)^popcount(i & j); the buffer stays exactly +-1 under casts."""
    from gsm_train.quant import hadamard_rotation

    for dim in (64, 128):
        sylvester = torch.tensor(
            [[(-1.0) ** bin(i & j).count("1") for j in range(dim)] for i in range(dim)], dtype=torch.float64
        )
        for cast in (torch.bfloat16, torch.float32):
            compressor = ASQCompressor(H, dim, rotate_residuals=True).to(cast)
            assert torch.equal(
                compressor.rotation_signs.double()[:, None] * sylvester / dim**0.5, hadamard_rotation(dim)
            )
            assert "rotation_signs" not in compressor.state_dict()  # rebuilt from head_dim, never exported
    assert ASQCompressor(H, D).rotation_signs is None  # nothing to rotate with


def test_rotation_spreads_a_channel_outlier_over_the_grid() -> None:
    """A residual channel 30x the others sets every token's absmax scale, so per-token codes leave the
    other channels almost nothing; in the rotated basis the outlier spreads over all channels and the
    4-bit error falls (QuaRot's argument). Without an outlier both stay close."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, H, 256, D, generator=g)
    outlier = x.clone()
    outlier[..., 3] *= 30.0
    plain, rotated = _asq(4), _asq(4, rotate_residuals=True)
    with torch.no_grad():
        assert _rel_err(rotated(outlier), outlier) < 0.5 * _rel_err(plain(outlier), outlier)
        assert _rel_err(rotated(x), x) < 1.2 * _rel_err(plain(x), x)
