"""The one place for FLOP and byte counts and the H200 ceilings they are judged against."""

# Ceilings measured on the H200 this project benchmarks on.
COPY_TBPS = 4.25  # device-to-device copy, read + write bytes
BF16_GEMM_TFLOPS = 695.0
FP8_GEMM_TFLOPS = 1289.0


def attn_fwd_flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal=False):
    """Two matmuls (QK^T and PV) of 2*sq*sk*d each; causal halves them (the sq == sk convention)."""
    flops = 4 * batch * nheads * seqlen_q * seqlen_k * headdim
    return flops // 2 if causal else flops


def attn_bwd_flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal=False):
    """Backward does five matmuls to forward's two: 2.5x."""
    return 5 * attn_fwd_flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal) // 2


def decode_kv_bytes(batch, seqlen_k, nheads_kv, headdim, dtype_bytes=2):
    """Bytes of K and V a decode step must read; q, output and page tables are negligible."""
    return 2 * batch * seqlen_k * nheads_kv * headdim * dtype_bytes


def tflops(flops, ms):
    return flops / ms / 1e9


def gbps(nbytes, ms):
    return nbytes / ms / 1e6
