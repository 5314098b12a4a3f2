"""Low-precision kernels: NVFP4 / e4m3 encode and decode helpers, the quantizers, the NVFP4 GEMMs."""
