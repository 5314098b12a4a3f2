"""The kernels, by language: triton/ (every target, and the CPU interpreter) and gluon/ (sm_90 only: the
warp-specialised prefill forward and dK/dV, the register-operand decode over NVFP4 caches). Low-precision kernels
(quantizers, the NVFP4 GEMM) live in tileflash.lowp.kernels; launchers in tileflash.launch. Comments that cite
"notebook, run N / session N" refer to benchmarks/archive/notebook-2026-11.md."""
