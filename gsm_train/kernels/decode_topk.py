"""Top-k at decode (CUDA, compiled at run time with NVRTC): the positions of the k largest gate
scores of each row, the row held in shared memory by one thread block of 1,024 threads, or on Hopper
and later by a thread-block cluster of 2, 4 or 8 such blocks (with Hopper's 227 KiB of shared memory
per block, 53,952 scores in one block, 398,848 in a cluster of 8; `unordered_top_k` takes
``torch.topk`` for longer rows). A cost model (`fastest_blocks_per_row`, constants at `FIXED_US`)
picks the blocks per row: a cluster for few long rows (at batch 1 one block per row would leave all
SMs but one idle), one block for short rows or many rows.

A radix select on the scores' order-preserving 32-bit keys. The first pass reads the row from global
memory once (8 loads in flight per thread), keeps its keys in shared memory and counts their top 12 bits
into a shared-memory histogram; the next passes (12 and 8 bits) count only the keys that still match the
chosen prefix. In a cluster every block counts its share of the row, and the blocks sum the counts into
every block's shared memory through the cluster's distributed shared memory, so each runs the same
search on the same counts. After each pass one block-wide scan over the bins, from the top, finds the
bin holding the k-th key; a pass ends the search early when that bin is taken whole. Then one pass
counts, per thread, the keys above the threshold and those equal to it, one block-wide scan (plus the
counts of the cluster's lower-ranked blocks) gives every thread its write offsets, and a last pass
writes the positions.

Exact: the k largest scores, in no particular order, like ``torch.topk(sorted=False)``. Among keys equal
to the k-th one the kernel takes them in a fixed order (by block, thread, then position), so a selection
is the same run after run for the same shape (the rows and their length set the blocks per row, and
with them which of the tied keys are taken). NaN ranks above +inf, as in ``torch.topk``; -0.0 ranks below +0.0.

Why CUDA and not Triton: a radix select wants blocks with shared-memory atomics and block-wide scans
over a row held on chip; five Triton designs were slower than ``torch.topk``. NVRTC ships with
PyTorch's CUDA wheels (``torch.cuda._compile_kernel``), so no compiler is needed. Timings against
``torch.topk`` and the Triton designs: docs/design-decisions.md, 'Top-k at decode is a CUDA kernel
compiled by NVRTC'.
"""

from __future__ import annotations

import ctypes
import warnings

import torch
from torch import Tensor

THREADS = 1024
BINS = 4096
CLUSTER_SIZES = (1, 2, 4, 8)  # blocks per row; 8 is a Hopper thread-block cluster's portable maximum
# What a wave of rows costs, in us: a fixed part that grows with the cluster (its barriers and
# distributed-shared-memory sums) and a part per score one block reads. Fitted on the H200 (CUDA
# graphs, one launch per graph, 1-128 rows of 8k-128k scores): docs/design-decisions.md, 'Top-k at
# decode is a CUDA kernel compiled by NVRTC', its 'Clusters' paragraph.
FIXED_US = {1: 8.2, 2: 10.8, 4: 11.5, 8: 12.4}
US_PER_SCORE = 0.29e-3


def _smem_fixed(cluster: int) -> int:
    """Shared bytes besides the row: the histogram (and with a cluster the cluster's summed one), the
    scan's warp sums and the shared search state."""
    return (BINS * (2 if cluster > 1 else 1) + 64) * 4


def _source(cluster: int) -> str:
    """The kernel for `cluster` blocks per row (a thread-block cluster, sm_90 and later, where above 1)."""
    dims = f"__cluster_dims__({cluster}, 1, 1)" if cluster > 1 else ""
    defines = {"THREADS": THREADS, "BINS": BINS, "CLUSTER": cluster, "CLUSTER_DIMS": dims}
    return "".join(f"#define {name} {value}\n" for name, value in defines.items()) + _KERNEL


_KERNEL = r"""
#define UNROLL 8

__device__ __forceinline__ unsigned ordered_key(float value) {
    if (value != value) return 0xffffffffu;  // every NaN ranks first, whatever its sign bit, as in torch.topk
    unsigned bits = __float_as_uint(value);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

__device__ __forceinline__ void count_bin(unsigned* hist, int bin) {
    if (bin >= 0) atomicAdd(&hist[bin], 1u);
}

#if CLUSTER > 1
// A thread-block cluster's blocks reach each other's shared memory (PTX: no headers needed under NVRTC).
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    return rank;
}

__device__ __forceinline__ void cluster_sync() {  // every thread of every block of the cluster
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ unsigned in_block(const void* local, unsigned rank) {  // the same variable in block `rank`
    unsigned address = (unsigned)__cvta_generic_to_shared(local), remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(address), "r"(rank));
    return remote;
}

__device__ __forceinline__ unsigned load_from(unsigned remote) {
    unsigned value;
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(value) : "r"(remote) : "memory");
    return value;
}

__device__ __forceinline__ void store_to(unsigned remote, unsigned value) {
    asm volatile("st.shared::cluster.u32 [%0], %1;" :: "r"(remote), "r"(value) : "memory");
}
#endif

__device__ __forceinline__ unsigned warp_inclusive_scan(unsigned value) {
    const int lane = threadIdx.x & 31;
    for (int offset = 1; offset < 32; offset <<= 1) {
        const unsigned other = __shfl_up_sync(0xffffffffu, value, offset);
        if (lane >= offset) value += other;
    }
    return value;
}

// Exclusive prefix sum of one unsigned per thread over the block (32 warps, modulo 2^32); *total gets the
// sum. One barrier: every warp scans the 32 warp totals itself. The caller syncs before `warp_sums` is
// written again.
__device__ __forceinline__ unsigned block_exclusive_scan(unsigned value, unsigned* warp_sums, unsigned* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned inclusive = warp_inclusive_scan(value);
    if (lane == 31) warp_sums[warp] = inclusive;
    __syncthreads();
    const unsigned warp_total = warp_sums[lane];
    const unsigned through = warp_inclusive_scan(warp_total);  // warps 0..lane
    *total = __shfl_sync(0xffffffffu, through, 31);
    return __shfl_sync(0xffffffffu, through - warp_total, warp) + inclusive - value;
}

// One row per CLUSTER blocks: block `rank` holds positions [rank * chunk, (rank + 1) * chunk) of it. Each
// pass counts every block's keys apart, then (CLUSTER > 1) block r sums slice r of the bins over the
// cluster and writes the sums into every block's `counted`, so every block runs the same search on the
// same counts and reaches the same threshold; the write offsets add the lower-ranked blocks' counts.
extern "C" __global__ void __launch_bounds__(THREADS) CLUSTER_DIMS
gsm_decode_topk(const float* __restrict__ scores, long long* __restrict__ out, int length, int k) {
    extern __shared__ unsigned smem[];
    unsigned* hist = smem;
#if CLUSTER > 1
    unsigned* counted = smem + BINS;  // the cluster's counts
    const unsigned rank = cluster_rank();
#else
    unsigned* counted = hist;
    const unsigned rank = 0;
#endif
    unsigned* warp_sums = counted + BINS;
    int* state = (int*)(counted + BINS + 32);  // [0] chosen bin, [1] keys still wanted, [2] search finished,
                                               // [4 + 2r], [5 + 2r]: block r's keys above and equal
    unsigned* row = counted + BINS + 64;
    const int chunk = (length + CLUSTER - 1) / CLUSTER;
    const int first = (int)rank * chunk;
    const int mine = max(0, min(chunk, length - first));  // this block's share of the row
    const float* src = scores + (size_t)(blockIdx.x / CLUSTER) * length + first;
    long long* dst = out + (size_t)(blockIdx.x / CLUSTER) * k;
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
            for (int base = 0; base < mine; base += THREADS * UNROLL) {
                unsigned keys[UNROLL];
#pragma unroll
                for (int j = 0; j < UNROLL; ++j) {
                    const int i = base + j * THREADS + tid;
                    keys[j] = i < mine ? ordered_key(src[i]) : 0u;
                }
#pragma unroll
                for (int j = 0; j < UNROLL; ++j) {
                    const int i = base + j * THREADS + tid;
                    if (i < mine) row[i] = keys[j];
                    count_bin(hist, i < mine ? (int)(keys[j] >> shift) : -1);
                }
            }
        } else {
#pragma unroll 8
            for (int base = 0; base < mine; base += THREADS) {
                const int i = base + tid;
                int bin = -1;
                if (i < mine) {
                    const unsigned key = row[i];
                    if ((key & mask) == prefix) bin = (int)((key >> shift) & (unsigned)(bins - 1));
                }
                count_bin(hist, bin);
            }
        }
#if CLUSTER > 1
        cluster_sync();  // every block's counts are in
        for (int b = (int)rank * (bins / CLUSTER) + tid; b < ((int)rank + 1) * (bins / CLUSTER); b += THREADS) {
            unsigned sum = 0u;
            for (unsigned q = 0; q < CLUSTER; ++q) sum += load_from(in_block(&hist[b], q));
            for (unsigned q = 0; q < CLUSTER; ++q) store_to(in_block(&counted[b], q), sum);
        }
        cluster_sync();  // every block holds the cluster's counts (and no block reads another's hist again this pass)
#else
        __syncthreads();
#endif
        // thread t owns bins bins-1-4t .. bins-4-4t, counted from the top: the bin where the k-th key falls
        int counts[4], sum = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int bin = bins - 1 - 4 * tid - j;
            counts[j] = bin >= 0 ? (int)counted[bin] : 0;
            sum += counts[j];
        }
        unsigned total;
        int above = (int)block_exclusive_scan((unsigned)sum, warp_sums, &total);
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
    // keys with (key & mask) > prefix are taken; of those equal to it, the first `wanted` in (block, thread,
    // position) order
    int n_above = 0, n_equal = 0;
#pragma unroll 8
    for (int i = tid; i < mine; i += THREADS) {
        const unsigned top = row[i] & mask;
        n_above += top > prefix;
        n_equal += top == prefix;
    }
    // one scan for both counts, above in the low 16 bits and equal in the high: a block holds fewer than
    // 65,536 keys (its shared memory), so neither half carries into the other or past 32 bits
    unsigned total;
    const unsigned at = block_exclusive_scan((unsigned)n_above | ((unsigned)n_equal << 16), warp_sums, &total);
    int at_above = (int)(at & 0xffffu), at_equal = (int)(at >> 16);
    int total_above = (int)(total & 0xffffu), total_equal = (int)(total >> 16);
#if CLUSTER > 1
    if (tid < CLUSTER) {  // this block's counts to every block, then each adds those of the blocks before it
        store_to(in_block(&state[4 + 2 * rank], tid), (unsigned)total_above);
        store_to(in_block(&state[5 + 2 * rank], tid), (unsigned)total_equal);
    }
    cluster_sync();
    total_above = 0;
    for (int q = 0; q < CLUSTER; ++q) {
        if (q < (int)rank) {
            at_above += state[4 + 2 * q];
            at_equal += state[5 + 2 * q];
        }
        total_above += state[4 + 2 * q];
    }
#endif
    for (int i = tid; i < mine; i += THREADS) {
        const unsigned top = row[i] & mask;
        if (top > prefix) {
            dst[at_above++] = first + i;
        } else if (top == prefix) {
            if (at_equal < wanted) dst[total_above + at_equal] = first + i;
            ++at_equal;
        }
    }
}
"""


def fastest_blocks_per_row(rows: int, length: int, capacity: dict[int, int]) -> int:
    """Of the blocks-per-row sizes in `capacity` (size -> rows it runs at once), the one with the least
    estimated time for `rows` rows of `length` scores, the fewer blocks on a tie: as many waves as the rows
    need, each the size's fixed cost plus the scores one of its blocks reads (`FIXED_US`, `US_PER_SCORE`)."""

    def estimated_us(size: int) -> float:
        return -(-rows // capacity[size]) * (FIXED_US[size] + US_PER_SCORE * length / size)

    return min(capacity, key=lambda size: (estimated_us(size), size))


class _LaunchConfig(ctypes.Structure):
    """The driver's ``CUlaunchConfig`` (for ``cuOccupancyMaxActiveClusters``)."""

    _fields_ = [
        ("grid_x", ctypes.c_uint),
        ("grid_y", ctypes.c_uint),
        ("grid_z", ctypes.c_uint),
        ("block_x", ctypes.c_uint),
        ("block_y", ctypes.c_uint),
        ("block_z", ctypes.c_uint),
        ("shared_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attributes", ctypes.c_void_p),
        ("attribute_count", ctypes.c_uint),
    ]


class _Launcher:
    """The compiled kernels of one device (one per cluster size it runs) and a lean launch of them: the
    driver's ``cuLaunchKernel`` looked up once with its argument types (PyTorch's `_CudaKernel.__call__`
    loads libcuda and converts its arguments on every call, several times ``torch.topk``'s host
    time, which matters in eager `generate()`)."""

    def __init__(self, device: int) -> None:
        properties = torch.cuda.get_device_properties(device)
        self.shared_limit = properties.shared_memory_per_block_optin
        self._driver = torch.cuda._utils._get_gpu_runtime_library()
        self._launch = self._driver.cuLaunchKernel
        self._launch.argtypes = (
            [ctypes.c_void_p]
            + [ctypes.c_uint] * 7
            + [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        )
        self._compiled = {}  # blocks per row -> the compiled kernel (which holds the module it lives in)
        self._capacity = {1: properties.multi_processor_count}  # blocks per row -> rows in flight at once
        self._choice: dict[tuple[int, int], int] = {}  # (rows, length) -> blocks per row
        with torch.cuda.device(device):
            self._compiled[1] = self._build(1)
            if (properties.major, properties.minor) >= (9, 0):  # thread-block clusters: Hopper on
                try:
                    for cluster in CLUSTER_SIZES[1:]:
                        kernel = self._build(cluster)
                        capacity = self._clusters_at_once(kernel, cluster)
                        if capacity:  # none where a MIG or MPS slice cannot place a whole cluster
                            self._compiled[cluster], self._capacity[cluster] = kernel, capacity
                except (RuntimeError, OSError, AttributeError) as error:
                    warnings.warn(f"decode top-k: clusters unavailable ({error}); one block per row", stacklevel=4)
        self.cluster_sizes = tuple(sorted(self._compiled))

    def _build(self, cluster: int):  # noqa: ANN202 (PyTorch's private kernel wrapper)
        kernel = torch.cuda._compile_kernel(_source(cluster), "gsm_decode_topk")
        kernel.set_shared_memory_config(self.shared_limit)
        return kernel

    def _clusters_at_once(self, kernel: object, cluster: int) -> int:
        """How many clusters of `cluster` blocks, each block with all the shared memory it may take, run at
        once: a cluster's blocks share one GPC, so this is not simply SMs / cluster."""
        config = _LaunchConfig(cluster, 1, 1, THREADS, 1, 1, self.shared_limit, None, None, 0)
        count = ctypes.c_int()
        error = self._driver.cuOccupancyMaxActiveClusters(ctypes.byref(count), kernel.func, ctypes.byref(config))
        if error:
            raise RuntimeError(f"cuOccupancyMaxActiveClusters failed with CUDA error {error}")
        return count.value

    @staticmethod
    def _shared_bytes(cluster: int, length: int) -> int:
        return _smem_fixed(cluster) + 4 * -(-length // cluster)

    def holds(self, cluster: int, length: int) -> bool:
        """Whether `cluster` blocks (a size this GPU runs) hold a row of `length` scores in shared memory."""
        share = -(-length // cluster)  # below 65,536: the kernel's write offsets pack two counts in 32 bits
        # (a guard: Hopper's shared memory holds fewer keys per block, 53,952)
        fits_shared = self._shared_bytes(cluster, length) <= self.shared_limit
        return cluster in self._compiled and share < 1 << 16 and fits_shared

    def sizes_holding(self, length: int) -> tuple[int, ...]:
        """The sizes this GPU runs whose blocks hold a row of `length` scores."""
        return tuple(size for size in self.cluster_sizes if self.holds(size, length))

    def fits(self, length: int) -> bool:
        """Whether a row of `length` scores fits the shared memory of the most blocks a row may take
        (on Hopper 53,952 scores in one block, 398,848 in a cluster of 8)."""
        return self.holds(max(self._compiled), length)

    def blocks_per_row(self, rows: int, length: int) -> int:
        """`fastest_blocks_per_row` among the sizes whose blocks hold the row, for this GPU's capacities."""
        choice = self._choice.get((rows, length))
        if choice is None:
            capacity = {size: self._capacity[size] for size in self.sizes_holding(length)}
            choice = self._choice[rows, length] = fastest_blocks_per_row(rows, length, capacity)
        return choice

    def __call__(self, scores: Tensor, k: int, out: Tensor | None = None, cluster: int | None = None) -> Tensor:
        """The positions [..., k] for checked `scores` [..., S] (written into `out` when given), with
        `cluster` blocks per row (a size that holds the row) or as `blocks_per_row` chooses."""
        length = scores.shape[-1]
        rows = scores.reshape(-1, length).contiguous()
        if out is None:
            out = torch.empty(*scores.shape[:-1], k, dtype=torch.int64, device=scores.device)
        if not rows.shape[0]:  # no launch for no rows (a grid of 0 blocks is a CUDA error)
            return out
        args = (
            ctypes.c_void_p(rows.data_ptr()),
            ctypes.c_void_p(out.data_ptr()),
            ctypes.c_int(length),
            ctypes.c_int(k),
        )
        params = (ctypes.c_void_p * 4)(*(ctypes.addressof(arg) for arg in args))
        cluster = cluster or self.blocks_per_row(rows.shape[0], length)
        with torch.cuda.device(rows.device):  # the function belongs to its device's context
            stream = torch.cuda.current_stream(rows.device).cuda_stream
            error = self._launch(
                self._compiled[cluster].func,
                rows.shape[0] * cluster,
                1,
                1,
                THREADS,
                1,
                1,
                self._shared_bytes(cluster, length),
                stream,
                params,
                None,
            )
        if error:
            raise RuntimeError(f"decode_topk: cuLaunchKernel failed with CUDA error {error} ({cluster} blocks per row)")
        return out


_launchers: dict[int, _Launcher] = {}
_compile_failure: list[str] = []  # why the kernel could not be built here (then torch.topk serves)


def cuda_topk_available() -> bool:
    """Whether the kernel can run here: a CUDA device and PyTorch's NVRTC wrapper (`torch.cuda._compile_kernel`),
    and no earlier attempt to build it failed."""
    return torch.cuda.is_available() and hasattr(torch.cuda, "_compile_kernel") and not _compile_failure


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _launcher(device: torch.device) -> _Launcher:
    """The kernel for `device`, compiled on first use."""
    index = _device_index(device)
    if index not in _launchers:
        _launchers[index] = _Launcher(index)
    return _launchers[index]


def _ready_launcher(device: torch.device) -> _Launcher | None:
    """The kernel for `device`, built on first use; None where it cannot run: off CUDA, or where NVRTC, the
    driver or this PyTorch refused it (said once in a warning; torch.topk serves from then on)."""
    if device.type != "cuda" or _compile_failure:
        return None
    launcher = _launchers.get(_device_index(device))
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
    """Whether a row of `length` scores fits the kernel: held in the shared memory of its blocks (on
    Hopper 398,848 scores in a cluster of 8, 53,952 in one block; a GPU without clusters holds what
    one block's shared memory holds)."""
    return _launcher(device).fits(length)


def blocks_per_row_options(length: int, device: torch.device) -> tuple[int, ...]:
    """The blocks-per-row sizes (`CLUSTER_SIZES`) this GPU runs whose blocks hold a row of `length` scores."""
    return _launcher(device).sizes_holding(length)


def chosen_blocks_per_row(rows: int, length: int, device: torch.device) -> int:
    """The blocks per row `decode_topk` takes for `rows` rows of `length` scores when not told."""
    return _launcher(device).blocks_per_row(rows, length)


def decode_topk(scores: Tensor, k: int, out: Tensor | None = None, blocks_per_row: int | None = None) -> Tensor:
    """Positions [..., k] (int64, unordered) of the k largest of `scores` [..., S] (fp32, CUDA, S within
    `row_fits`) along the last dimension, 1 <= k <= S: the same set as ``scores.topk(k, sorted=False).indices``
    up to the choice among keys tied with the k-th. `out`: a contiguous int64 tensor of that shape to write
    them into (else a new one). `blocks_per_row`: one of `CLUSTER_SIZES` that this GPU runs and whose
    blocks hold the row (else `fastest_blocks_per_row` chooses)."""
    length = scores.shape[-1]
    if scores.dtype != torch.float32 or not scores.is_cuda:
        raise ValueError(f"decode_topk takes fp32 CUDA scores, got {scores.dtype} on {scores.device}")
    if not 1 <= k <= length:
        raise ValueError(f"decode_topk: k must be in [1, {length}] (the row length), got {k}")
    launcher = _launcher(scores.device)
    if blocks_per_row is not None and not launcher.holds(blocks_per_row, length):
        raise ValueError(
            f"decode_topk: blocks_per_row must be one of {launcher.cluster_sizes} (this GPU's) "
            f"whose blocks hold a row of {length} scores, got {blocks_per_row}"
        )
    if not launcher.fits(length):
        raise ValueError(
            f"decode_topk: a row of {length} scores does not fit the shared memory of "
            f"{max(launcher.cluster_sizes)} blocks; "
            "use unordered_top_k, which takes torch.topk for such rows"
        )
    shape = (*scores.shape[:-1], k)
    if out is not None and (
        out.shape != shape or out.dtype != torch.int64 or out.device != scores.device or not out.is_contiguous()
    ):
        raise ValueError(
            f"decode_topk: out must be a contiguous int64 tensor of shape {shape} on {scores.device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    return launcher(scores, k, out, blocks_per_row)


def unordered_top_k(scores: Tensor, k: int) -> Tensor:
    """Positions [..., k] of the k largest `scores` [..., S], in no particular order: this kernel
    where it runs (fp32 on CUDA, rows within `row_fits`), ``torch.topk`` elsewhere (a kernel reading rows
    too long for shared memory from global memory in every pass was slower than ``torch.topk``:
    docs/design-decisions.md, 'Top-k at decode is a CUDA kernel compiled by NVRTC')."""
    launcher = _ready_launcher(scores.device) if scores.dtype == torch.float32 else None
    if launcher is not None and 1 <= k <= scores.shape[-1] and launcher.fits(scores.shape[-1]):
        return launcher(scores, k)  # (torch.topk below names a k out of range)
    return scores.topk(k, dim=-1, sorted=False).indices
