r"""How ASQ's residual quantizer compares with KIVI's, training-free, on SmolLM2-135M: the loss increase over
the unquantized model on `--windows` windows of `--seq-len` tokens of the training prose (not the evaluation
text) when every layer's keys and values go through a quantizer, at K/V bits (4, 4), (4, 2) and (2, 2):

- `kivi`: `fake_quant_kivi`, keys per channel over each block of 128 tokens, values per token, asymmetric
  min-max (the baseline joint.py uses);
- `asq_per_token`: ASQ's current scheme, each token's residual after its block's prototype quantized per
  token on ASQ's grid (`fake_quant_per_token`), keys and values;
- `asq_key_channels`: the key residual quantized per channel over the block on ASQ's symmetric grid
  (mid-rise at 2 bits), the value residual per token asymmetric (min-max with a zero point);
- `asq_key_channels_asymmetric`: the key residual per channel asymmetric, the value residual per token
  asymmetric;
- `asq_rotated`: as `asq_per_token`, in the randomized Hadamard basis of `rotate_residuals`
  (`kv_compressor.hadamard_rotation`; QuaRot's rotation), keys and values.

The ASQ rows use 16 prototypes per block, `asq_per_token`, `asq_key_channels` and `asq_rotated` also 2 (the
cheap end).
Caveats: no training; the prototypes are k-means stand-ins for trained ASQ prototypes (`asq_grid.py`'s
`_kmeans_prototypes`); every full block is quantized (ASQ keeps a query's own block raw), only the newest
incomplete block stays raw. The 2-bit rows are chaotic at the level of a few thousandths: rounding the three
keys that sit exactly on a 2-bit decision boundary the other way moves `asq_key_channels` C16 at K2V2 by
0.003. Prints the table and writes JSON.

python -m benchmarks.residual_quantizers --train-data ../shared/data/prose \
    --result benchmarks/results/residual_quantizers.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from benchmarks.asq_grid import _kmeans_prototypes
from benchmarks.common import write_result
from benchmarks.prose_probe import (
    add_prose_arguments,
    kv_hooked_loss,
    prose_model_and_windows,
)
from gsm_train.quant import (
    fake_quant,
    fake_quant_asymmetric,
    fake_quant_kivi,
    fake_quant_per_token,
    hadamard_rotation,
    join_blocks,
    rotated,
    split_blocks,
    unrotated,
)

BLOCK = 128
BIT_PAIRS = ((4, 4), (4, 2), (2, 2))
Quantizer = Callable[[torch.Tensor, int], torch.Tensor]
_per_token_asymmetric = partial(fake_quant_asymmetric, dim=-1)


def _per_token_rotated(residual: torch.Tensor, bits: int) -> torch.Tensor:
    """`fake_quant_per_token` of the residual in the randomized Hadamard basis, rotated back (as ASQ with
    `rotate_residuals` stores and rebuilds it)."""
    rotation = hadamard_rotation(residual.shape[-1]).to(residual.device)
    return unrotated(fake_quant_per_token(rotated(residual, rotation), bits), rotation)


# (key residual, value residual) quantizer of each ASQ proxy, on residuals [B, H, blocks, BLOCK, D]
RESIDUAL_QUANTIZERS: dict[str, tuple[Quantizer, Quantizer]] = {
    "asq_per_token": (fake_quant_per_token, fake_quant_per_token),
    "asq_key_channels": (partial(fake_quant, dim=-2), _per_token_asymmetric),
    "asq_key_channels_asymmetric": (partial(fake_quant_asymmetric, dim=-2), _per_token_asymmetric),
    "asq_rotated": (_per_token_rotated, _per_token_rotated),
}
# (scheme, prototypes per block; None for kivi), run at every pair of BIT_PAIRS
SETTINGS = (
    ("kivi", None),
    ("asq_per_token", 16),
    ("asq_key_channels", 16),
    ("asq_key_channels_asymmetric", 16),
    ("asq_rotated", 16),
    ("asq_per_token", 2),
    ("asq_key_channels", 2),
    ("asq_rotated", 2),
)


def _quantized(x: torch.Tensor, scheme: str, clusters: int | None, bits: int, is_key: bool) -> torch.Tensor:
    """Keys (`is_key`) or values [B, H, S, D] through `scheme` at `bits`, the newest incomplete block raw."""
    if scheme == "kivi":
        return fake_quant_kivi(x, bits, BLOCK, per_channel=is_key)
    blocks, tail = split_blocks(x, BLOCK)
    blocks = blocks.float()
    prototypes = _kmeans_prototypes(blocks, clusters)
    quantizer = RESIDUAL_QUANTIZERS[scheme][0 if is_key else 1]
    return join_blocks(quantizer(blocks - prototypes, bits) + prototypes, tail)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prose_arguments(parser)
    args = parser.parse_args()
    model, rows = prose_model_and_windows(args, "cuda" if torch.cuda.is_available() else "cpu")
    setting: dict[str, object] = {}  # empty: unquantized

    def quantized(module: torch.nn.Module, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not setting:
            return key, value
        return (
            _quantized(key, setting["scheme"], setting["clusters"], setting["k_bits"], is_key=True),
            _quantized(value, setting["scheme"], setting["clusters"], setting["v_bits"], is_key=False),
        )

    loss = kv_hooked_loss(model, rows, "gsm_residual_quantizers", quantized)
    base = loss()
    print(
        f"base loss {base:.4f}\n{'scheme':28s} {'clusters':>8s} {'K bits':>6s} {'V bits':>6s} {'loss increase':>13s}",
        flush=True,
    )
    results = []
    for k_bits, v_bits in BIT_PAIRS:
        for scheme, clusters in SETTINGS:
            setting.update(scheme=scheme, clusters=clusters, k_bits=k_bits, v_bits=v_bits)
            results.append({**setting, "loss_increase": loss() - base})
            print(
                f"{scheme:28s} {clusters or '-':>8} {k_bits:6d} {v_bits:6d} {results[-1]['loss_increase']:+13.4f}",
                flush=True,
            )
    write_result(
        Path(args.result),
        {"windows": len(rows), "seq_len": args.seq_len, "block": BLOCK, "base_loss": base, "rows": results},
    )


if __name__ == "__main__":
    main()
