"""Pure tensor functions the GSM modules are built from: ASQ's encoding, the gate's RoPE and
stage 1's attention targets and KL. They import only the kernels, `quant` and `compiled`."""
