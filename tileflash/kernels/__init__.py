"""The kernels, by language: triton/ (every target, and the CPU interpreter) and gluon/ (sm_90 only: the
warp-specialised prefill forward and dK/dV, the register-operand decode over FP8/NVFP4 caches). Low-precision
kernels (quantizers, the NVFP4 GEMM) live in tileflash.lowp.kernels. Launchers live in tileflash.launch."""
