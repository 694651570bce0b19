"""Triton kernels: the fused sparse decode (inference) and the stage-1 target (training). Optional:
each module imports Triton if it can, and callers use them only on a CUDA device (or under Triton's
interpreter in tests); the PyTorch paths serve everywhere else."""
