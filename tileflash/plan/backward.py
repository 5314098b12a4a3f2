"""Backward policy: the Triton dK/dV and dQ tiles, and whether (and with which tiles) the sm_90 Gluon dK/dV kernel
serves a call (tests/plan/test_plan.py)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from .. import _utils, config
from .prefill import Mask, ws_call_ok
from .target import has_tma, mma_sync_target, tma_4d_ok, padded_head_dim, small_shared_memory, tensor_memory


@dataclass(frozen=True)
class BwdConfig:
    dkdv_block_m: int  # query rows per step of a dK/dV program
    dkdv_block_n: int  # keys owned by a dK/dV program (K, V, dK, dV stay in registers)
    dq_block_m: int  # query rows owned by a dQ program
    dq_block_n: int  # keys per step of a dQ program
    dkdv_warps: int
    dkdv_stages: int
    dq_warps: int
    dq_stages: int
    atomic_dq: bool = True  # dQ added up by the dK/dV programs (fp32 atomics) unless deterministic=True asks otherwise
    rotate: bool = False  # without a right mask bound, dK/dV programs start their query blocks at staggered blocks
    tma: bool = False  # dK/dV programs read unmasked Q/dO blocks through TMA descriptors (power-of-two head dims)


WS_BWD_KEYS = 128  # keys per CTA of the Gluon dK/dV kernel (its BLOCK_KEYS)


@dataclass(frozen=True)
class WsBwdConfig:
    """The warp-specialised sm_90 dK/dV kernel (kernels/gluon/attn_bwd.py): WS_BWD_KEYS keys per CTA, always."""
    block_m: int  # query rows per step
    num_stages: int  # Q/dO stages in shared memory
    atomic_dq: bool  # dQ added up by the kernel (TMA reduce-adds into fp32) unless deterministic=True asks otherwise
    # The dQ tile's reduce-add waits for the P/dS fence at the end of the step instead of a fence of its own right
    # after its store (one fence and barrier fewer per step; the reduce-add leaves later).
    one_fence: bool = True
    # Each consumer warpgroup computes dQ for half the step's rows over the whole head dim (instead of all rows over
    # half the head dim): its dQ product's N is the head dim, not half of it.
    dq_by_rows: bool = False
    # An eager call's backward in one launch (the kernel's ONE_LAUNCH: row statistics and the dQ cast in the dK/dV
    # kernel, see ws_backward_config) instead of three; CUDA-graph captures always take the three.
    one_launch: bool = False


def bwd_ws_config(head_dim: int, causal: bool, seqlen_k: int, one_launch: bool = False) -> WsBwdConfig | None:
    """Whether the backward takes the warp-specialised dK/dV kernel, by shape (ws_backward_config
    adds what the tensors and masks allow). Measured on the H200 (benchmarks/archive/notebook-2026-11.md, session 11:
    `ws_bwd_sweep.py`, bf16, 16k tokens, 2048/d heads, TFLOP/s at s = 4k / 16k, same run):
      d128, 64 query rows per step: one fence per step vs two: full 504 / 558 vs 531 / 567, causal 475 / 568 vs
           441 / 545 (run 76), so one fence when causal only.
      d64, 128 rows, one fence: full 430 / 457, causal 387 / 463 (two fences 424 / 446, 366 / 433, run 76); 64 rows
           (two fences) 404 / 429 and 344 / 408 (run 72). At 1k keys the Triton kernels' small programs did as well
           or better then (session 10: full 304 vs 309, causal 172 vs 226); see below for now.
    Two Q/dO stages: a third measured no gain at d64 with 64 rows (session 10) and does not fit in shared memory at
    d128 or with 128 rows. 128 rows at d128 do not fit either (the S and dP accumulators double). Head dims other
    than 64 and 128 would need padding inside the kernel, which it does not do; d256's dK/dV accumulators do not
    fit two consumer warpgroups' registers.
      d64, dQ split by rows (each consumer warpgroup's dQ product [64 rows, 64] over 128 keys, not [128 rows, 32];
           session 20, `python -m tileflash sweep backward-ws`, s = 4k full / causal, 16k full): 436.3 / 379.8 / 478.1
           vs 416.5 / 382.3 / 453.4 by columns, so by rows. At d128 that tile does not fit (RuntimeError).
      d64 at short rows again, after sessions 11-41's work on the kernel (H100 runs 235-236, `sweep backward-ws`, 16k
           tokens, us, Triton kernels vs this one): full 256 / 512 / 1024 keys 657 / 851 / 1259-1271 vs 673 / 814 /
           1116-1125, causal 590 / 686 / 890-902 vs 647 / 718 / 867-871: it takes full rows past 256 keys and
           causal rows past 512.
      one_launch (an eager call one_launch_rule takes): the whole backward as one launch of this kernel, which at d64
           also beats the Triton kernels' three launches at short rows (H100 run 260, b=1 32 heads causal, eager
           fwd+bwd us / GPU us: s=128 169.3 / 17.7 vs 179.3 / 19.4, s=512 171.1 / 37.6 vs 180.9 / 38.9).
    """
    if head_dim == 128:
        return WsBwdConfig(block_m=64, num_stages=2, atomic_dq=True, one_fence=causal, one_launch=one_launch)
    if head_dim == 64 and (one_launch or seqlen_k > (512 if causal else 256)):
        return WsBwdConfig(block_m=128, num_stages=2, atomic_dq=True, one_fence=True, dq_by_rows=True,
                           one_launch=one_launch)
    return None


def bwd_config(head_dim: int, interpret: bool = False, arch: int | None = 90, dropout: bool = False) -> BwdConfig:
    """Backward tiles per head dim, measured on the H200 (config_sweep.py bwd-d64 / bwd-d128 / bwd-det,
    bf16, 16k tokens at s = 4096, 2048/d heads, TFLOP/s = 2.5 x forward FLOPs / t, 2026-11-30):
      d64:  the separate dQ pass with (64, 64, 128, 32, warps 4/8, stages 3/3): 298 full / 288 causal (session 2);
            with atomic dQ the best tile, (64, 128 keys, 8 warps, 3 stages), ran 294 / 267 (run 25).
      d128: atomic dQ with (64, 128, 8 warps, 2 stages) 346 full / 312 causal (run 25; the separate dQ pass 335 /
            298, run 26); 32 query rows per step (no spills) 281 / 276, 16 rows 227 / 238.
      d256: atomic dQ with (32, 32, 4 warps, 2 stages) 155 full / 148 causal; the former (32, 32, 8 warps, 1 stage)
            89 / 88 (run 26); the separate dQ pass spills at every dQ tile tried (87-103).
    Staggered starts (rotate; run 30, same run, off / on, atomic dQ): d128 non-causal 4k 330 / 355, 16k 342 / 372;
    d256 161 / 166, 166 / 170; causal (masked on the right, where programs already start at their diagonals) lost
    1-2% (d128 327 / 319, 393 / 387), so the launcher staggers only without a right bound.
    After the predicate-free interiors (run 34, config_sweep.py bwd-d128 / bwd-tma, s = 4096 full / causal): d128
    with a third Q/dO stage (198 KB of shared memory) 377.7 / 328.0 vs 333.5 / 322.6 with two (staggered starts off
    in both); d64's Q/dO through TMA 355.7 / 321.0 vs 336.0 / 308.5 (16k: 374.8 / 363.5 vs 355.8 / 349.9); d128
    with TMA spills (86-92 B) and lost (300.6 vs 354.1), so it keeps pointers.
    Fields: dK/dV (query rows per step, keys per program), dQ (query rows per program, keys per step), then warps
    and stages of each kernel, whether dQ is added up with atomics by default, the staggered starts, and TMA loads
    of Q/dO in the dK/dV interior (power-of-two head dims only; the launcher takes pointers otherwise).
    arch (the target's compute capability): sm_10x (B200) keeps tl.dot accumulators in tensor memory (512 columns
    of 32 bits), which d128's 64-row dK/dV step overflows (576: dK, dV, S^T, dP^T and dQ); it takes 16 rows over 64
    keys (416 columns; see below for why not 32 x 128). Compiled for sm_100 on the CPU only, never timed. On
    mma.sync targets (sm_8x, sm_12x: operands and accumulators in registers) both kernels take 8 warps and dK/dV
    steps of at most 32 query rows at d <= 64, 16 above (with 4 warps the dK/dV tiles spilled 480-536 bytes on
    sm_80 and sm_120; with 8, d64's 64-row step 32 bytes, d128's 32-row step 40 on sm_80; none at these), and
    Q/dO by pointers (target.has_tma); compiled only.
    dropout: d64's dQ is added up with atomics too, since its own pass would regenerate the keep pattern a third
    time (run 215, H100, `sweep backward --vary dropout_p=0.1 atomic_dq=0,1`, d64 4k, the 64 x 64 tile on 4 warps:
    5.49 / 3.10 ms non-causal / causal vs 6.64 / 3.96 with the pass)."""
    if interpret:
        return BwdConfig(16, 16, 16, 16, 4, 1, 4, 1, rotate=True, tma=True)
    cfg = _bwd_tiles(head_dim, arch)
    if dropout:
        cfg = replace(cfg, atomic_dq=True)
    if mma_sync_target(arch):
        d = padded_head_dim(head_dim)
        cfg = replace(cfg, dkdv_warps=8, dq_warps=8, dkdv_block_m=min(cfg.dkdv_block_m, 32 if d <= 64 else 16))
    return cfg if has_tma(arch) else replace(cfg, tma=False)


def _bwd_tiles(head_dim: int, arch: int | None) -> BwdConfig:
    """bwd_config's tiles by head dim, with the shared-memory and tensor-memory rules (mma.sync's come after)."""
    d = padded_head_dim(head_dim)
    if d > 64 and small_shared_memory(arch):
        # Under 200 KB of shared memory per block (A100, Ada, consumer Blackwell; compiled only): K, V, Q and dO
        # tiles of half the rows (d128's H200 tile needed 112 KB at one stage, over a 99 KB limit).
        return BwdConfig(32, 64, 64, 64, 4, 2, 4, 2, rotate=True) if d <= 128 else \
            BwdConfig(16, 32, 32, 32, 4, 2, 4, 1, rotate=True)
    if d <= 64:
        return BwdConfig(64, 64, 128, 32, 4, 3, 8, 3, atomic_dq=False, tma=True)
    if d <= 128 and tensor_memory(arch):
        # sm_10x (compiled only): 16 query rows x 64 keys (416 tensor-memory columns); 32 x 128 (448) spilled
        # 160 bytes, and 1400 with ALiBi, against sm_90's 16 / 512 (compile check --res-usage), 16 x 64 none / 384.
        return BwdConfig(16, 64, 128, 64, 8, 3, 8, 2, rotate=True)
    if d <= 128:
        return BwdConfig(64, 128, 128, 64, 8, 3, 8, 2, rotate=True)
    # d256; sm_10x takes 8 warps for dK/dV (4 spilled 88 bytes there, 48 on sm_90; 8: none)
    return BwdConfig(32, 32, 64, 32, 8 if tensor_memory(arch) else 4, 2, 8, 1, rotate=True)


def ws_backward_config(q, k, v, dout, *, varlen: bool, window_left: int, window_right: int, softcap: float,
                       max_seqlen_k: int = 0, seqused_k: bool = False, alibi: bool = False,
                       max_seqlen_q: int = 0, num_batches: int = 0, eager: bool = True) -> WsBwdConfig | None:
    """The warp-specialised dK/dV kernel's tiles when it serves this call (sm_90, a head dim bwd_ws_config
    takes, at most a causal mask, no ALiBi, TMA-addressable tensors, V's head dim q's; varlen without seqused_k,
    tiles by max_seqlen_k), else None (the Triton kernels). num_batches: the sequences of a varlen call (0: q's
    batch); eager: whether the call may run as one launch (one_launch_rule)."""
    if (varlen and seqused_k) or v.shape[3] != q.shape[3]:
        return None
    if not ws_call_ok(q.dtype, Mask(window_left, window_right, softcap), alibi):
        return None
    seqlen_k = max_seqlen_k if varlen else k.shape[1]
    ctas = (num_batches or q.shape[0]) * k.shape[2] * _utils.cdiv(seqlen_k, WS_BWD_KEYS)
    one = eager and one_launch_rule((max_seqlen_q if varlen else q.shape[1]) * (q.shape[2] // k.shape[2]), ctas,
                                    _utils.num_sms(q.device))
    cfg = config.chosen("bwd_ws", bwd_ws_config(q.shape[3], window_right == 0, seqlen_k, one))
    if cfg is None or not all(tma_4d_ok(t) for t in (q, k, v, dout)):
        return None
    return cfg


ONE_LAUNCH_MAX_ROWS = 512


def one_launch_rule(rows: int, ctas: int, sms: int) -> bool:
    """Whether an eager backward runs as one launch of the Gluon kernel (ONE_LAUNCH): where its rows per (batch, KV
    head), query rows x query heads per KV head, are at most ONE_LAUNCH_MAX_ROWS and its CTAs (WS_BWD_KEYS keys
    each) fit one wave of the sms SMs. Such calls spend more time on the host than on the GPU, and a launch less in
    autograd's device thread is worth more than the GPU time the one launch adds (every CTA computes delta and lse2
    of the rows it reads, the preprocess's work repeated by the group's CTAs, and the last CTA of a group casts the
    group's dQ rows alone); past one wave that GPU time grows with every wave, which a GPU-bound caller (a batch, or
    many keys per query row) would pay. H100 run 260 (probe one_launch_ab.py, one process), eager fwd+bwd us (GPU
    us), three launches -> one, d128 causal unless noted: b=1 s=128 157.7 -> 148.0 (24.3 -> 23.8; 32 CTAs), s=512
    174.4 -> 165.4 (50.0 -> 54.7; 128 CTAs), b=4 s=128 177.2 -> 168.3 (39.0 -> 36.4; 128 CTAs), GQA 32/8 s=128 172.7
    -> 163.3 (36.6 -> 45.7; run 257); past one wave b=2 s=512 176.2 -> 166.5 but 101.1 -> 110.0 of GPU time (256
    CTAs; d64 190.3 -> 178.3, 63.4 -> 77.4), and 128 query rows over 16k keys, full (4096 CTAs, GPU-bound), 684.5 ->
    753.2 (674.6 -> 736.0)."""
    return rows <= ONE_LAUNCH_MAX_ROWS and ctas <= sms
