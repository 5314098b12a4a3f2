"""Gluon kernels for sm_90 (Hopper): warp-specialised prefill forward and dK/dV, register-operand quantized decode."""
