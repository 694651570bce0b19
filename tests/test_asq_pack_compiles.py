"""ASQ's packing kernel compiles for a Hopper GPU (sm_90) from this machine, no GPU needed: Triton's
interpreter (the kernel tests on the CPU) runs what a compiled kernel refuses, such as a module global read
inside the kernel, so the recipes' shapes are compiled here to PTX and to a cubin (Triton's own ptxas), and
ptxas says how much the kernel spills: with the products in IEEE fp32 the first form spilled 2.6 KB a thread at
D 64 and 6.5 KB at D 128 and took 7.5 ms of SmolLM2's 8k prefill on an H100; in tf32x3 at most 24 bytes."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from gsm_train.kernels import asq_pack
from gsm_train.quant import EPS, FP16_MAX, MIDRISE_STEP, RMS_SCALED_BITS, code_center

triton = pytest.importorskip("triton")
compiler = pytest.importorskip("triton.compiler")
backends = pytest.importorskip("triton.backends.compiler")

POINTERS = {"x_ptr": "*bf16", "ids_ptr": "*u8", "residual_ptr": "*u8", "scales_ptr": "*fp16", "prototypes_ptr": "*fp16"}
FP32_POINTERS = ("w1_ptr", "b1_ptr", "w2_ptr", "b2_ptr", "rotation_ptr")
INTEGERS = ("run_heads", "heads", "first_head", "n_blocks", "stride_b", "stride_h", "stride_s")


@pytest.mark.parametrize(("dim", "bits"), [(64, 4), (128, 2)])  # SmolLM2's and Llama-3-8B's heads, K's and V's widths
def test_the_recipes_packing_compiles_for_hopper(dim: int, bits: int, tmp_path: Path) -> None:
    """recipes/joint.yaml's compressor (blocks of 64, 2 clusters, a hidden layer of 64, rotated residuals)."""
    block, hidden, clusters = 64, 64, 2
    constants = {
        "HIDDEN": hidden, "CLUSTERS": clusters, "BS": block, "D": dim, "KP": asq_pack._padded(hidden),
        "CP": asq_pack._padded(clusters), "BITS": bits, "ROTATE": True, "EPS": EPS, "FP16_MAX": FP16_MAX,
        "MIDRISE_STEP": MIDRISE_STEP, "RMS_SCALED_BITS": RMS_SCALED_BITS, "HALF": code_center(bits),
        "PRECISION": asq_pack.DOT_PRECISION,
    }  # fmt: skip
    signature = POINTERS | dict.fromkeys(FP32_POINTERS, "*fp32") | dict.fromkeys(INTEGERS, "i32") | {"tau": "fp32"}
    signature |= dict.fromkeys(constants, "constexpr")
    source = compiler.ASTSource(asq_pack._asq_pack_kernel, signature, constants)
    warps = 4 if block * dim <= 4096 else 8
    kernel = triton.compile(source, target=backends.GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    assert kernel.asm["cubin"]
    assert _spilled_bytes(kernel.asm["ptx"], tmp_path) <= 64  # a thread's registers hold the block's work


def _spilled_bytes(ptx: str, folder: Path) -> int:
    """The bytes a thread spills (stores) in `ptx` compiled for sm_90a, as Triton's ptxas reports them."""
    from triton.backends.nvidia.compiler import get_ptxas

    source = folder / "kernel.ptx"
    source.write_text(ptx)
    command = [get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", str(source), "-o", str(folder / "kernel.cubin")]
    report = subprocess.run(command, capture_output=True, text=True, check=True).stderr
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))
