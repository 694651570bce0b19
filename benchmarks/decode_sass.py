"""What the fused decode kernel compiles to, without a GPU: every autotune configuration of
`gsm_train.kernels.sparse_decode` compiled by Triton for sm_90 (the H200) for SmolLM2 and Llama-8B layer
shapes, ASQ as recipes/joint.yaml sets it, with the integer and pointer hints a launch at 32k, k=2048 gives
(multiples of 16). Per configuration: registers and stack per thread (spills), shared memory, SASS
instructions per thread (a static count: prologue, one tile's body and epilogue, each once) and the most
frequent opcodes. Needs Triton's NVIDIA backend (its bundled ptxas and cuobjdump), not a device: on a
CPU machine, Triton installed beside the project (`pip install triton==3.6.0`, the GPU image's version).

python benchmarks/decode_sass.py --result OUT.json
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

from gsm_train.config import load_recipe  # noqa: E402
from gsm_train.kernels.sparse_decode import _sparse_decode_kernel, decode_configs  # noqa: E402
from gsm_train.modules.kv_compressor import code_center  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHAPES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}  # q heads, KV heads, head_dim (as decode.py)
TARGET = GPUTarget("cuda", 90, 32)
POINTER_TYPES = {"q_ptr": "*bf16", "signs_ptr": "*fp32", "index_ptr": "*i64", "valid_ptr": "*i64",
                 "k_ids": "*u8", "k_res": "*u8", "k_scales": "*fp16", "k_protos": "*fp16", "k_tail": "*bf16",
                 "v_ids": "*u8", "v_res": "*u8", "v_scales": "*fp16", "v_protos": "*fp16", "v_tail": "*bf16",
                 "acc_ptr": "*fp32", "max_ptr": "*fp32", "sum_ptr": "*fp32"}
INT_TYPES = {"packed_len": "i32", "tail_len": "i32", "n_blocks": "i32", "selected": "i32", "size_class": "i32",
             "rows": "i32", "scaling": "fp32"}
MULTIPLES_OF_16 = ("packed_len", "tail_len", "selected", "size_class")  # at 32k (32,704 packed), k=2048
SASS_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,6}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def _constants(q_heads: int, kv_heads: int, dim: int) -> dict[str, object]:
    """The kernel's constexpr arguments for one layer shape, ASQ as recipes/joint.yaml sets it."""
    asq = load_recipe(str(REPO / "recipes" / "joint.yaml")).gsm.kv_compression
    k_bits, v_bits = asq.bits()
    groups = q_heads // kv_heads
    return dict(KV_HEADS=kv_heads, G=groups, GP=max(16, triton.next_power_of_2(groups)), D=dim,
                LOG_D=dim.bit_length() - 1, K_BITS=k_bits, V_BITS=v_bits, K_CENTER=code_center(k_bits),
                V_CENTER=code_center(v_bits), C=asq.cluster_num, TOKENS_PER_BLOCK=asq.block_size, PACKED=True,
                ROTATED=asq.rotate_residuals, HAS_VALID=False, PRECISION="tf32", SHARED_SELECTION=True)


def _tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def compiled_stats(constants: dict[str, object], config: triton.Config) -> dict[str, object]:
    """Registers, stack, shared memory and SASS instruction counts of the kernel compiled for sm_90 with
    `constants` and `config`'s block sizes, warps and stages."""
    fn = _sparse_decode_kernel.fn
    names = fn.arg_names
    signature = {name: POINTER_TYPES.get(name) or INT_TYPES.get(name) or "constexpr" for name in names}
    fixed = {**constants, **config.kwargs}
    hinted = [name for name, kind in signature.items() if kind.startswith("*")] + list(MULTIPLES_OF_16)
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(names.index(name),): value for name, value in fixed.items()},
                       attrs={(names.index(name),): [["tt.divisibility", 16]] for name in hinted})
    kernel = triton.compile(source, target=TARGET,
                            options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    resources = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    opcodes = collections.Counter(match.group(1) for match in SASS_INSTRUCTION.finditer(sass))
    return {"registers": int(resources["REG"]), "stack_bytes": int(resources["STACK"]),
            "shared_bytes": kernel.metadata.shared, "instructions": sum(opcodes.values()),
            "top_opcodes": dict(opcodes.most_common(12))}


def _name(config: triton.Config) -> str:
    return f"{config.kwargs['BLOCK_N']}x{config.kwargs['TILES']} w{config.num_warps} s{config.num_stages}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    rows = []
    for shape, dims in SHAPES.items():
        constants = _constants(*dims)
        for config in decode_configs():
            stats = compiled_stats(constants, config)
            rows.append({"shape": shape, "config": _name(config), **stats})
            print(f"{shape:>8} {_name(config):>14}  registers {stats['registers']:>3}  stack "
                  f"{stats['stack_bytes']:>4} B  shared {stats['shared_bytes']:>6} B  instructions "
                  f"{stats['instructions']:>5}", flush=True)
    write_result(Path(args.result), {"target": "sm_90 (cuda 9.0, warp 32)", "triton": triton.__version__,
                                     "rows": rows})


if __name__ == "__main__":
    main()
