"""Pure tensor functions the GSM modules are built from: ASQ's encoding, the gate's RoPE, its stored
keys and the top-k schedule and selection, stage 1's attention targets and KL, and the block-sparse
attention of captured training steps. They import only the kernels, `quant`, `compiled` and the
config schema."""
