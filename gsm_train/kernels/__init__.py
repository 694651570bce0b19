"""GPU kernels: in Triton the fused sparse decode (inference) and the stage-1 target (training), in CUDA
(compiled at run time by NVRTC) the decode top-k. Optional: each module imports Triton if it can, and
callers use them only on a CUDA device (or, for Triton, under its interpreter in tests); the PyTorch
paths serve everywhere else."""


def kernel_fits(dim: int) -> bool:
    """Whether a head (or gate head) dimension suits the kernels: a power of two from 16 to 256 (Triton's
    block shapes are powers of two and its dot wants at least 16); other sizes take the PyTorch paths."""
    return 16 <= dim <= 256 and dim & (dim - 1) == 0
