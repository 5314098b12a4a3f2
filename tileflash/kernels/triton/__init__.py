"""Triton kernels: the forward / decode loop, the backward, the split combine and merge, the KV append."""
