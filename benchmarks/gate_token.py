"""The decode step's gate-token kernel (`gsm_train.kernels.gate_token`) against the PyTorch work it replaces,
side by side in one run: the gate module on the token (`SparseGateHead.forward`), `encode_gate_keys` and the
`index_copy_` at the device lengths' slot (what `GSMCacheLayer.keep_gate_keys` does at a token step). Shapes:
the 8B model's (d 4096, one selector of 16 dimensions, int8 keys; and one selector per KV head, 8 x 64) and
SmolLM2's (d 576), at batch 1 and 16, bf16 hidden states and RoPE tables as a bf16 model gives them. Each
time is `LAYERS` layers' gates captured in one CUDA graph (median of 50 replays), per layer. Every run
checks the agreement: query within 1e-5 relative, codes equal or one apart (counted). The kernel's time is
its two launches (the projections split over d in chunks of `SPLIT` columns, then the finish).

python -m benchmarks.gate_token --result OUT.json
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.common import graph_ms, kernel_benchmark_args, write_result
from gsm_train.functional.gate_keys import encode_gate_keys
from gsm_train.kernels.gate_token import SPLIT, gate_token
from gsm_train.modules.sparse_gate import SparseGateHead

LAYERS = 30  # the 8B model's sparse layers (32, less the two dense ones)
HEAD_DIM = 128
CAPACITY = 32768
POSITION = 20000
# (name, hidden size, gate head dim, selectors, key bits)
SHAPES = (
    ("8b", 4096, 16, 1, 8),
    ("8b_bf16_keys", 4096, 16, 1, 16),
    ("8b_per_kv_head", 4096, 64, 8, 8),
    ("smollm2", 576, 16, 1, 8),
)
BATCHES = (1, 16)


def _rope(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
    angles = POSITION * inv_freq
    angles = torch.cat((angles, angles))[None, None]
    return angles.cos().bfloat16().to(device), angles.sin().bfloat16().to(device)


def _buffers(batch: int, selectors: int, dim: int, bits: int, device: torch.device) -> list:
    shape = (batch, selectors, CAPACITY, dim)
    if bits == 16:
        return [(torch.zeros(shape, dtype=torch.bfloat16, device=device), None) for _ in range(LAYERS)]
    return [
        (
            torch.zeros(shape, dtype=torch.int8, device=device),
            torch.zeros(*shape[:3], 1, dtype=torch.float16, device=device),
        )
        for _ in range(LAYERS)
    ]


def measure(hidden_size: int, dim: int, selectors: int, bits: int, batch: int, device: torch.device) -> dict:
    """One shape: the agreement of the kernel with the PyTorch path, and both paths' time per layer."""
    torch.manual_seed(0)
    gates = []
    for _ in range(LAYERS):
        gate = SparseGateHead(hidden_size, dim, HEAD_DIM, num_selectors=selectors, key_bits=bits)
        with torch.no_grad():
            gate.rope_freq_index.copy_(torch.randint(0, HEAD_DIM // 2, gate.rope_freq_index.shape))
        gates.append(gate.to(device))
    hidden = torch.randn(batch, 1, hidden_size, device=device).bfloat16()
    cos, sin = _rope(device)
    lengths = torch.tensor([POSITION + 1, 0], dtype=torch.int32, device=device)
    torch_buffers = _buffers(batch, selectors, dim, bits, device)
    kernel_buffers = _buffers(batch, selectors, dim, bits, device)
    queries: dict[str, list] = {"torch": [None] * LAYERS, "kernel": [None] * LAYERS}

    @torch.no_grad()
    def pytorch_path() -> None:
        slot = (lengths[0] - 1).view(1).long()
        for layer, (gate, (keys, scales)) in enumerate(zip(gates, torch_buffers, strict=True)):
            gate_q, gate_k = gate(hidden, cos, sin)
            codes, new_scales = encode_gate_keys(gate_k, bits)
            keys.index_copy_(2, slot, codes)
            if new_scales is not None:
                scales.index_copy_(2, slot, new_scales)
            queries["torch"][layer] = gate_q

    def kernel_path() -> None:
        for layer, (gate, (keys, scales)) in enumerate(zip(gates, kernel_buffers, strict=True)):
            queries["kernel"][layer] = gate_token(
                hidden, gate.q_proj.weight, gate.k_proj.weight, cos, sin, gate.rope_freq_index, keys, scales, lengths
            )

    pytorch_path()
    kernel_path()
    expected, got = torch.stack(queries["torch"]), torch.stack(queries["kernel"])
    codes = [torch.stack([pair[0][:, :, POSITION].float() for pair in b]) for b in (torch_buffers, kernel_buffers)]
    code_gap = (codes[0] - codes[1]).abs()
    row = {
        "query_max_relative_error": ((expected - got).abs().max() / expected.abs().max()).item(),
        "codes": code_gap.numel(),
        "codes_differing": int((code_gap > 0).sum()),
        "largest_code_gap": code_gap.max().item(),
    }
    if bits == 8 and row["largest_code_gap"] > 1:
        raise AssertionError(f"codes more than one apart: {row}")
    row["pytorch_us_per_layer"] = graph_ms(pytorch_path) * 1e3 / LAYERS
    row["kernel_us_per_layer"] = graph_ms(kernel_path) * 1e3 / LAYERS
    return row


def main() -> None:
    args = kernel_benchmark_args(__doc__)
    device = torch.device("cuda")
    results = []
    for name, hidden_size, dim, selectors, bits in SHAPES:
        for batch in BATCHES:
            row = {"shape": name, "hidden_size": hidden_size, "gate_head_dim": dim, "selectors": selectors}
            row |= {"key_bits": bits, "batch": batch, **measure(hidden_size, dim, selectors, bits, batch, device)}
            results.append(row)
            print(
                f"{name:<16} batch {batch:>2}: PyTorch {row['pytorch_us_per_layer']:6.1f} us/layer, kernel "
                f"{row['kernel_us_per_layer']:6.1f}; codes differing {row['codes_differing']}/{row['codes']}",
                flush=True,
            )
    write_result(Path(args.result), {"layers": LAYERS, "capacity": CAPACITY, "split_columns": SPLIT, "rows": results})


if __name__ == "__main__":
    main()
