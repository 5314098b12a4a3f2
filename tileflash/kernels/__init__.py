"""Triton kernels only. The torch-facing launchers live in tileflash.ops."""
