"""What the fused decode kernel compiles to, without a GPU: every autotune configuration of
`gsm_train.kernels.sparse_decode` compiled by Triton for sm_90 (the H200) for SmolLM2 and Llama-8B layer
shapes, ASQ as recipes/joint.yaml sets it, with the integer and pointer hints a launch at 32k, k=2048 gives
(multiples of 16). Per configuration: registers and stack per thread (spills), shared memory, SASS
instructions per thread (a static count: prologue, one tile's body and epilogue, each once) and the most
frequent opcodes. Needs Triton's NVIDIA backend (its bundled ptxas and cuobjdump), not a device: on a
CPU machine, Triton installed beside the project (`pip install triton==3.6.0`, the GPU image's version).

python -m benchmarks.decode_sass --result OUT.json
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from benchmarks.common import write_result
from benchmarks.decode import REPO, SHAPES, compressors, config_name, filled_stores
from gsm_train.config.schema import load_recipe
from gsm_train.kernels.sparse_decode import (
    _sparse_decode_kernel,
    decode_configs,
    kernel_constants,
)

TARGET = GPUTarget("cuda", 90, 32)
POINTER_TYPES = {
    "q_ptr": "*bf16",
    "signs_ptr": "*fp32",
    "index_ptr": "*i64",
    "valid_ptr": "*i64",
    "k_ids": "*u8",
    "k_res": "*u8",
    "k_scales": "*fp16",
    "k_protos": "*fp16",
    "k_tail": "*bf16",
    "v_ids": "*u8",
    "v_res": "*u8",
    "v_scales": "*fp16",
    "v_protos": "*fp16",
    "v_tail": "*bf16",
    "acc_ptr": "*fp32",
    "raw_ptr": "*fp32",
    "max_ptr": "*fp32",
    "sum_ptr": "*fp32",
    "lengths_ptr": "*i32",
}
INT_TYPES = {
    "capacity": "i32",
    "tail_slots": "i32",
    "n_blocks": "i32",
    "selected": "i32",
    "size_class": "i32",
    "rows": "i32",
    "scaling": "fp32",
}
MULTIPLES_OF_16 = ("capacity", "tail_slots", "selected", "size_class")  # at 32k capacity, blocks of 64, k=2048
SASS_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,6}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def _constants(q_heads: int, kv_heads: int, dim: int) -> dict[str, object]:
    """The kernel's constexpr arguments as a launch computes them for one layer shape (bf16, one selection
    for all KV heads, no valid mask) over stores holding a packed block, ASQ as recipes/joint.yaml sets it."""
    gsm = load_recipe(str(REPO / "recipes" / "joint.yaml")).gsm
    asqs = compressors(gsm, kv_heads, dim, device="cpu")
    stores = [store.packed_rows() for store in filled_stores(asqs, 1, asqs[0].block_size + 1)]
    query = torch.empty(1, q_heads, 1, dim, dtype=torch.bfloat16)
    return kernel_constants(query, *stores, shared_selection=True, has_valid=False)


def _tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _cuobjdump(kernel: object, flag: str) -> str:
    """`cuobjdump FLAG` of a compiled Triton kernel's cubin (Triton's bundled tool)."""
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        return subprocess.run([_tool("cuobjdump"), flag, str(cubin)], capture_output=True, text=True, check=True).stdout


def resource_usage(kernel: object) -> dict[str, int]:
    """Registers, stack, shared and local memory per thread (REG, STACK, SHARED, LOCAL) of a kernel compiled
    by `triton.compile`, as cuobjdump reports them."""
    return {
        name: int(value)
        for name, value in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", _cuobjdump(kernel, "-res-usage"))
    }


def compiled_stats(constants: dict[str, object], config: triton.Config) -> dict[str, object]:
    """Registers, stack, shared memory and SASS instruction counts of the kernel compiled for sm_90 with
    `constants` and `config`'s block sizes, warps and stages."""
    fn = _sparse_decode_kernel.fn
    names = fn.arg_names
    signature = {name: POINTER_TYPES.get(name) or INT_TYPES.get(name) or "constexpr" for name in names}
    fixed = {**constants, **config.kwargs}
    hinted = [name for name, kind in signature.items() if kind.startswith("*")] + list(MULTIPLES_OF_16)
    source = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(names.index(name),): value for name, value in fixed.items()},
        attrs={(names.index(name),): [["tt.divisibility", 16]] for name in hinted},
    )
    kernel = triton.compile(
        source, target=TARGET, options={"num_warps": config.num_warps, "num_stages": config.num_stages}
    )
    resources = resource_usage(kernel)
    opcodes = collections.Counter(match.group(1) for match in SASS_INSTRUCTION.finditer(_cuobjdump(kernel, "-sass")))
    return {
        "registers": resources["REG"],
        "stack_bytes": resources["STACK"],
        "shared_bytes": kernel.metadata.shared,
        "instructions": sum(opcodes.values()),
        "top_opcodes": dict(opcodes.most_common(12)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    rows = []
    for shape, dims in SHAPES.items():
        constants = _constants(*dims)
        for config in decode_configs():
            stats = compiled_stats(constants, config)
            rows.append({"shape": shape, "config": config_name(config), **stats})
            print(
                f"{shape:>8} {config_name(config):>14}  registers {stats['registers']:>3}  stack "
                f"{stats['stack_bytes']:>4} B  shared {stats['shared_bytes']:>6} B  instructions "
                f"{stats['instructions']:>5}",
                flush=True,
            )
    write_result(Path(args.result), {"target": "sm_90 (cuda 9.0, warp 32)", "triton": triton.__version__, "rows": rows})


if __name__ == "__main__":
    main()
