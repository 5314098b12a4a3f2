"""Low-precision formats: FP8 / NVFP4 layouts and quantizers, the NVFP4 weight GEMM."""
