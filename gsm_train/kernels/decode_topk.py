"""Top-k at decode (CUDA, compiled at run time with NVRTC): the positions of the k largest gate scores of
each row, one thread block of 1,024 threads per row, the row held in shared memory (up to ~54k scores
on the H200; `unordered_top_k` takes ``torch.topk`` for longer rows).

A radix select on the scores' order-preserving 32-bit keys. The first pass reads the row from global
memory once (8 loads in flight per thread), keeps its keys in shared memory and counts their top 12 bits
into a shared-memory histogram; the next passes (12 and 8 bits) count only the keys that still match the
chosen prefix. After each pass one block-wide scan over the bins, from the top, finds the bin holding
the k-th key; a pass ends the search early when that bin is taken whole. Then one pass counts, per
thread, the keys above the threshold and those equal to it, one block-wide scan gives every thread its
write offsets, and a last pass writes the positions.

Exact: the k largest scores, in no particular order, like ``torch.topk(sorted=False)``. Among keys equal
to the k-th one the kernel takes them in a fixed order (by thread, then position), so a selection is the
same run after run. NaN ranks above +inf, as in ``torch.topk``; -0.0 ranks below +0.0.

Why CUDA and not Triton: a radix select wants one block with shared-memory atomics and block-wide scans
over a row held on chip; five Triton designs were slower than ``torch.topk`` (docs/design-decisions.md).
NVRTC ships with PyTorch's CUDA wheels (``torch.cuda._compile_kernel``), so no compiler is needed.
On the H200, in CUDA graphs, at k=2048: 17.1 against 46.1 us for ``torch.topk`` on 8 rows of 32k scores,
24.6 against 103.8 us on 128 rows (decode's batch 1 and 16 with a Llama-8B layer's 8 KV heads).
"""

from __future__ import annotations

import ctypes
import warnings

import torch
from torch import Tensor

THREADS = 1024
BINS = 4096
SMEM_FIXED = (BINS + 64) * 4  # the histogram, the scan's warp sums and the shared search state

_SOURCE = f"#define THREADS {THREADS}\n#define BINS {BINS}\n" + r"""
#define UNROLL 8

__device__ __forceinline__ unsigned ordered_key(float value) {
    if (value != value) return 0xffffffffu;  // every NaN ranks first, whatever its sign bit, as in torch.topk
    unsigned bits = __float_as_uint(value);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

__device__ __forceinline__ void count_bin(unsigned* hist, int bin) {
    if (bin >= 0) atomicAdd(&hist[bin], 1u);
}

// Exclusive prefix sum of one int per thread over the block (32 warps); *total gets the sum.
__device__ __forceinline__ int block_exclusive_scan(int value, int* warp_sums, int* total) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int inclusive = value;
    for (int offset = 1; offset < 32; offset <<= 1) {
        int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += other;
    }
    if (lane == 31) warp_sums[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
        int sum = warp_sums[lane];
        for (int offset = 1; offset < 32; offset <<= 1) {
            int other = __shfl_up_sync(0xffffffffu, sum, offset);
            if (lane >= offset) sum += other;
        }
        warp_sums[lane] = sum;
    }
    __syncthreads();
    int before = (warp ? warp_sums[warp - 1] : 0) + inclusive - value;
    *total = warp_sums[31];
    __syncthreads();
    return before;
}

extern "C" __global__ void __launch_bounds__(THREADS)
gsm_decode_topk(const float* __restrict__ scores, long long* __restrict__ out, int length, int k) {
    extern __shared__ unsigned smem[];
    unsigned* hist = smem;
    int* warp_sums = (int*)(smem + BINS);
    int* state = (int*)(smem + BINS + 32);  // [0] chosen bin, [1] keys still wanted, [2] search finished
    unsigned* row = smem + BINS + 64;
    const float* src = scores + (size_t)blockIdx.x * length;
    long long* dst = out + (size_t)blockIdx.x * k;
    const int tid = threadIdx.x;
    unsigned prefix = 0u, mask = 0u;
    int wanted = k;
    int shift = 32;
#pragma unroll 1
    for (int pass = 0; pass < 3; ++pass) {
        const int width = pass < 2 ? 12 : 8, bins = 1 << width;
        shift -= width;
        for (int b = tid; b < BINS; b += THREADS) hist[b] = 0u;
        __syncthreads();
        if (pass == 0) {  // the one read of the row from global memory: UNROLL loads in flight per thread
            for (int base = 0; base < length; base += THREADS * UNROLL) {
                unsigned keys[UNROLL];
#pragma unroll
                for (int j = 0; j < UNROLL; ++j) {
                    const int i = base + j * THREADS + tid;
                    keys[j] = i < length ? ordered_key(src[i]) : 0u;
                }
#pragma unroll
                for (int j = 0; j < UNROLL; ++j) {
                    const int i = base + j * THREADS + tid;
                    if (i < length) row[i] = keys[j];
                    count_bin(hist, i < length ? (int)(keys[j] >> shift) : -1);
                }
            }
        } else {
#pragma unroll 8
            for (int base = 0; base < length; base += THREADS) {
                const int i = base + tid;
                int bin = -1;
                if (i < length) {
                    const unsigned key = row[i];
                    if ((key & mask) == prefix) bin = (int)((key >> shift) & (unsigned)(bins - 1));
                }
                count_bin(hist, bin);
            }
        }
        __syncthreads();
        // thread t owns bins bins-1-4t .. bins-4-4t, counted from the top: the bin where the k-th key falls
        int counts[4], sum = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int bin = bins - 1 - 4 * tid - j;
            counts[j] = bin >= 0 ? (int)hist[bin] : 0;
            sum += counts[j];
        }
        int total;
        int above = block_exclusive_scan(sum, warp_sums, &total);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (counts[j] > 0 && above < wanted && above + counts[j] >= wanted) {
                state[0] = bins - 1 - 4 * tid - j; state[1] = wanted - above; state[2] = counts[j] == wanted - above;
            }
            above += counts[j];
        }
        __syncthreads();
        prefix |= ((unsigned)state[0]) << shift;
        mask |= ((unsigned)(bins - 1)) << shift;
        wanted = state[1];
        const int finished = state[2];
        __syncthreads();
        if (finished) break;
    }
    // keys with (key & mask) > prefix are taken; of those equal to it, the first `wanted` in (thread, position) order
    int n_above = 0, n_equal = 0;
#pragma unroll 8
    for (int i = tid; i < length; i += THREADS) {
        const unsigned top = row[i] & mask;
        n_above += top > prefix;
        n_equal += top == prefix;
    }
    int total_above, total_equal;
    int at_above = block_exclusive_scan(n_above, warp_sums, &total_above);
    int at_equal = block_exclusive_scan(n_equal, warp_sums, &total_equal);
    for (int i = tid; i < length; i += THREADS) {
        const unsigned top = row[i] & mask;
        if (top > prefix) {
            dst[at_above++] = i;
        } else if (top == prefix) {
            if (at_equal < wanted) dst[total_above + at_equal] = i;
            ++at_equal;
        }
    }
}
"""

class _Launcher:
    """The compiled kernel of one device and a lean launch of it: the driver's ``cuLaunchKernel`` looked up
    once with its argument types (PyTorch's `_CudaKernel.__call__` loads libcuda and converts its arguments
    on every call: 66 us of host time per eager call on the H200 host, against 11 us for ``torch.topk``)."""

    def __init__(self, device: int) -> None:
        with torch.cuda.device(device):
            compiled = torch.cuda._compile_kernel(_SOURCE, "gsm_decode_topk")
            self.shared_limit = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
            compiled.set_shared_memory_config(self.shared_limit)
        self._compiled = compiled  # holds the module the function lives in
        self._launch = torch.cuda._utils._get_gpu_runtime_library().cuLaunchKernel
        self._launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p,
                                                                            ctypes.POINTER(ctypes.c_void_p),
                                                                            ctypes.c_void_p]

    def fits(self, length: int) -> bool:
        """Whether a row of `length` scores fits one block's shared memory (~54k on the H200)."""
        return SMEM_FIXED + 4 * length <= self.shared_limit

    def __call__(self, scores: Tensor, k: int, out: Tensor | None = None) -> Tensor:
        """The positions [..., k] for checked `scores` [..., S] (written into `out` when given)."""
        length = scores.shape[-1]
        rows = scores.reshape(-1, length).contiguous()
        if out is None:
            out = torch.empty(*scores.shape[:-1], k, dtype=torch.int64, device=scores.device)
        if not rows.shape[0]:  # no launch for no rows (a grid of 0 blocks is a CUDA error)
            return out
        args = (ctypes.c_void_p(rows.data_ptr()), ctypes.c_void_p(out.data_ptr()), ctypes.c_int(length),
                ctypes.c_int(k))
        params = (ctypes.c_void_p * 4)(*(ctypes.addressof(arg) for arg in args))
        with torch.cuda.device(rows.device):  # the function belongs to its device's context
            error = self._launch(self._compiled.func, rows.shape[0], 1, 1, THREADS, 1, 1, SMEM_FIXED + 4 * length,
                                 torch.cuda.current_stream(rows.device).cuda_stream, params, None)
        if error:
            raise RuntimeError(f"decode_topk: cuLaunchKernel failed with CUDA error {error}")
        return out


_launchers: dict[int, _Launcher] = {}
_compile_failure: list[str] = []  # why the kernel could not be built here (then torch.topk serves)


def cuda_topk_available() -> bool:
    """Whether the kernel can run here: a CUDA device and PyTorch's NVRTC wrapper (`torch.cuda._compile_kernel`),
    and no earlier attempt to build it failed."""
    return torch.cuda.is_available() and hasattr(torch.cuda, "_compile_kernel") and not _compile_failure


def _launcher(device: torch.device) -> _Launcher:
    """The kernel for `device`, compiled on first use."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _launchers:
        _launchers[index] = _Launcher(index)
    return _launchers[index]


def _ready_launcher(device: torch.device) -> _Launcher | None:
    """The kernel for `device`, built on first use; None where it cannot run: off CUDA, or where NVRTC, the
    driver or this PyTorch refused it (said once in a warning; torch.topk serves from then on)."""
    if device.type != "cuda" or _compile_failure:
        return None
    launcher = _launchers.get(device.index if device.index is not None else torch.cuda.current_device())
    if launcher is not None:
        return launcher
    if not cuda_topk_available():
        return None
    try:
        return _launcher(device)
    except (RuntimeError, OSError, AttributeError) as error:  # no NVRTC, no CUDA headers' path, an older wrapper
        _compile_failure.append(str(error))
        warnings.warn(f"decode top-k kernel unavailable ({error}); decoding with torch.topk", stacklevel=3)
        return None


def kernel_ready(device: torch.device) -> bool:
    """Build the kernel for `device` now (e.g. before a CUDA graph is captured, which cannot load a module)
    and say whether it runs there (`_ready_launcher`)."""
    return _ready_launcher(device) is not None


def row_fits(length: int, device: torch.device) -> bool:
    """Whether a row of `length` scores fits the kernel: held in one block's shared memory (~54k on the H200)."""
    return _launcher(device).fits(length)


def decode_topk(scores: Tensor, k: int, out: Tensor | None = None) -> Tensor:
    """Positions [..., k] (int64, unordered) of the k largest of `scores` [..., S] (fp32, CUDA, S within
    `row_fits`) along the last dimension, 1 <= k <= S: the same set as ``scores.topk(k, sorted=False).indices``
    up to the choice among keys tied with the k-th. `out`: a contiguous int64 tensor of that shape to write
    them into (else a new one)."""
    length = scores.shape[-1]
    if scores.dtype != torch.float32 or not scores.is_cuda:
        raise ValueError(f"decode_topk takes fp32 CUDA scores, got {scores.dtype} on {scores.device}")
    if not 1 <= k <= length:
        raise ValueError(f"decode_topk: k must be in [1, {length}] (the row length), got {k}")
    launcher = _launcher(scores.device)
    if not launcher.fits(length):
        raise ValueError(f"decode_topk: a row of {length} scores does not fit one block's shared memory; "
                         "use unordered_top_k, which takes torch.topk for such rows")
    shape = (*scores.shape[:-1], k)
    if out is not None and (out.shape != shape or out.dtype != torch.int64 or out.device != scores.device
                            or not out.is_contiguous()):
        raise ValueError(f"decode_topk: out must be a contiguous int64 tensor of shape {shape} on {scores.device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    return launcher(scores, k, out)


def unordered_top_k(scores: Tensor, k: int) -> Tensor:
    """Positions [..., k] of the k largest `scores` [..., S], in no particular order: this kernel
    where it runs (fp32 on CUDA, rows within `row_fits`), ``torch.topk`` elsewhere (faster than the kernel
    would be on rows read again from global memory in every pass: 68 against 120 us at 128k, batch 1, on the
    H200)."""
    launcher = _ready_launcher(scores.device) if scores.dtype == torch.float32 else None
    if launcher is not None and 1 <= k <= scores.shape[-1] and launcher.fits(scores.shape[-1]):
        return launcher(scores, k)  # (torch.topk below names a k out of range)
    return scores.topk(k, dim=-1, sorted=False).indices
