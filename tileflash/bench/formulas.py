"""The one place for FLOP and byte counts and the H200 ceilings they are judged against."""

# Ceilings measured on the H200 this project benchmarks on.
COPY_TBPS = 4.25  # device-to-device copy, read + write bytes
BF16_GEMM_TFLOPS = 695.0
FP8_GEMM_TFLOPS = 1289.0


def attn_fwd_flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal=False, headdim_v=None):
    """Two matmuls, QK^T (2*sq*sk*d) and PV (2*sq*sk*dv, dv = headdim_v or d); causal halves them (the sq == sk
    convention)."""
    flops = 2 * batch * nheads * seqlen_q * seqlen_k * (headdim + (headdim_v or headdim))
    return flops // 2 if causal else flops


def extend_flops(batch, nheads, seqlen_q, prefix, headdim):
    """Causal attention of seqlen_q new queries over prefix cached keys plus themselves (bottom-right aligned):
    query i sees prefix + i + 1 keys."""
    return 4 * batch * nheads * headdim * (seqlen_q * prefix + seqlen_q * (seqlen_q + 1) // 2)


def attn_bwd_flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal=False):
    """Backward does five matmuls to forward's two: 2.5x."""
    return 5 * attn_fwd_flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal) // 2


def decode_kv_bytes(batch, seqlen_k, nheads_kv, headdim, dtype_bytes=2):
    """Bytes of K and V a decode step must read; q, output and page tables are negligible."""
    return 2 * batch * seqlen_k * nheads_kv * headdim * dtype_bytes


def mla_decode_bytes(batch, seqlen_k, rope_dim=64, latent_dim=512, dtype_bytes=2):
    """Bytes an MLA decode step must read: one rotary key and one latent (also the value) per token."""
    return batch * seqlen_k * (rope_dim + latent_dim) * dtype_bytes


def mla_decode_flops(batch, nheads, seqlen_q, seqlen_k, rope_dim=64, latent_dim=512):
    """Per query row and token: the score over rope + latent dims and the latent-wide PV, 2 FLOPs per MAC."""
    return 2 * batch * nheads * seqlen_q * seqlen_k * (rope_dim + 2 * latent_dim)


def gemm_flops(m, n, k):
    """One multiply and one add per (m, n, k): 2*M*N*K."""
    return 2 * m * n * k


def gemm_weight_bytes(n, k, dtype_bytes=2):
    """Bytes of a dense [N, K] weight (bf16: 2, fp8: 1 per element) a GEMM must read."""
    return n * k * dtype_bytes


def nvfp4_weight_bytes(n, k):
    """Bytes of an NVFP4 [N, K] weight: K/2 bytes of packed e2m1 pairs and K/16 one-byte e4m3 block scales per row
    (the 4-byte global scale is negligible)."""
    return n * k // 2 + n * k // 16


def tflops(flops, ms):
    return flops / ms / 1e9


def gbps(nbytes, ms):
    return nbytes / ms / 1e6
