"""ASQ's packing kernel (`gsm_train.kernels.asq_pack`): the fields a cache stores for whole blocks, against the
PyTorch encoding (`encode_blocks`, then the casts and `pack_codes`) of the same rows, K's and V's heads side by
side at their own widths as `packed_together` packs them."""

from __future__ import annotations

import pytest
import torch
from run_helpers import KERNEL_DEVICE, TRITON_KERNEL_MARKS

from gsm_train.functional.asq import width_runs
from gsm_train.kernels import asq_pack
from gsm_train.modules.kv_compressor import ASQCompressor, _encoded_fields, packed_together
from gsm_train.quant import unpack_codes

pytestmark = TRITON_KERNEL_MARKS


def _compressors(heads: int, dim: int, clusters: int, hidden: int, block: int, widths: tuple[int, int], rotate: bool):
    """K's and V's compressors with random assignment MLPs (biases too), alike but for their widths."""
    torch.manual_seed(0)
    pair = [ASQCompressor(heads, dim, clusters, hidden, bits, block, 0.7, rotate) for bits in widths]
    for compressor in pair:
        with torch.no_grad():
            compressor.b1.normal_(0, 0.3)
            compressor.b2.normal_(0, 0.3)
    return [compressor.to(KERNEL_DEVICE).eval() for compressor in pair]


@pytest.mark.parametrize(
    ("dim", "clusters", "hidden", "block", "widths", "rotate", "dtype"),
    [
        (64, 2, 64, 64, (4, 2), True, torch.bfloat16),  # the recipes' compressor on SmolLM2's heads
        (32, 5, 24, 16, (4, 4), False, torch.float32),  # clusters and a hidden layer padded, one width
        (16, 16, 8, 32, (8, 2), True, torch.float16),
    ],
)
def test_the_kernel_packs_the_fields_the_pytorch_encoding_packs(
    dim: int, clusters: int, hidden: int, block: int, widths: tuple[int, int], rotate: bool, dtype: torch.dtype
) -> None:
    """Each field of every head and block: the ids (the argmax of the same probabilities), the prototypes
    (fp16, within one step of fp16's grid), the scales and codes of the tokens whose id agrees (a scale within
    one fp16 step, a code within one level), and the rows read back as close to the input as the PyTorch
    path's are. Equal ids and codes on nearly all tokens: only sums in another order separate the two."""
    batch, heads = 2, 3
    pair = _compressors(heads, dim, clusters, hidden, block, widths, rotate)
    torch.manual_seed(1)
    rows = [torch.randn(batch, heads, 4 * block, dim, device=KERNEL_DEVICE).to(dtype) for _ in pair]
    rows[1] = rows[1] * 3 + 1  # V's rows of another scale and offset
    assert asq_pack.kernel_runs(rows[0], block, clusters, hidden)
    fields = packed_together(pair, rows)  # the kernel serves (`kernel_runs`)
    order = sorted(range(2), key=lambda i: widths[i])
    joined = torch.cat([rows[i] for i in order], 1)
    mlp = [torch.cat([pair[i]._mlp(heads)[p] for i in order], 0) for p in range(4)]
    runs = width_runs(tuple(widths[i] for i in order))
    with torch.no_grad():
        ids, residuals, scales, prototypes = _encoded_fields(joined, tuple(mlp), pair[0], runs, heads)
    places = [(run, at) for run, (_, count) in enumerate(runs) for at in range(count)]
    for place, i in enumerate(order):
        got, side = fields[i], slice(place * heads, (place + 1) * heads)
        run, at = places[place]
        want_residual = residuals[run][:, at * heads : (at + 1) * heads]
        same_id = got["ids"] == ids[:, side]
        assert same_id.float().mean() >= 0.99
        torch.testing.assert_close(got["prototypes"].float(), prototypes[:, side].float(), rtol=2e-3, atol=1e-4)
        torch.testing.assert_close(
            got["scales"][same_id].float(), scales[:, side][same_id].float(), rtol=1.5e-3, atol=1e-7
        )
        codes = unpack_codes(got["residual"], widths[i], dim)
        want_codes = unpack_codes(want_residual, widths[i], dim)
        code_gap = (codes - want_codes)[same_id].abs()
        assert code_gap.max() <= 1 and (code_gap == 0).float().mean() >= 0.99
        read_back = pair[i].prefix_rows(got, rows[i].shape[2], torch.float32)
        want = {"ids": ids[:, side], "residual": want_residual, "scales": scales[:, side]}
        want["prototypes"] = prototypes[:, side]
        want_read_back = pair[i].prefix_rows(want, rows[i].shape[2], torch.float32)
        error, want_error = ((x - rows[i].float()).norm() for x in (read_back, want_read_back))
        assert error <= want_error * 1.01


def test_the_kernel_leaves_what_it_does_not_fit_to_pytorch() -> None:
    """fp64 rows (whose encoding stays fp64), heads and blocks that are not powers of two from 16 to 256,
    and more clusters or a wider MLP than a program holds take the PyTorch encoding."""
    rows = torch.zeros(1, 1, 64, 64, device=KERNEL_DEVICE)
    assert asq_pack.kernel_runs(rows, 64, 2, 64)
    assert not asq_pack.kernel_runs(rows.double(), 64, 2, 64)
    assert not asq_pack.kernel_runs(rows[..., :48], 64, 2, 64)
    assert not asq_pack.kernel_runs(rows, 8, 2, 64)
    assert not asq_pack.kernel_runs(rows, 64, asq_pack.MAX_CLUSTERS + 1, 64)
    assert not asq_pack.kernel_runs(rows, 64, 2, asq_pack.MAX_HIDDEN + 1)


def test_no_whole_block_packs_to_empty_fields() -> None:
    """Rows of no whole block give empty fields of the stored shapes (no launch)."""
    pair = _compressors(2, 16, 2, 8, 16, (4, 2), False)
    fields = packed_together(pair, [torch.zeros(1, 2, 0, 16, device=KERNEL_DEVICE) for _ in pair])
    assert [tuple(f["residual"].shape) for f in fields] == [(1, 2, 0, 8), (1, 2, 0, 4)]
    assert [tuple(f["prototypes"].shape) for f in fields] == [(1, 2, 0, 2, 16)] * 2


def test_a_store_packed_alone_holds_what_one_packed_beside_another_holds() -> None:
    """`pack_blocks` of one compressor takes the kernel where `packed_together` does, so K packed alone (a
    store whose partner packs apart) stores K's fields of the paired packing bit for bit (on a GPU the PyTorch
    encoding differs from the kernel's in a few rounding steps)."""
    pair = _compressors(3, 64, 2, 64, 64, (4, 2), True)
    torch.manual_seed(2)
    rows = [torch.randn(2, 3, 3 * 64, 64, device=KERNEL_DEVICE).to(torch.bfloat16) * scale for scale in (3.0, 0.5)]
    together = packed_together(pair, rows)
    for compressor, part, paired in zip(pair, rows, together, strict=True):
        alone = compressor.pack_blocks(part)
        assert alone.keys() == paired.keys()
        assert all(torch.equal(alone[name], paired[name]) for name in alone)
