"""Triton kernels for GPU inference (optional: imported only where Triton and a CUDA device exist)."""
