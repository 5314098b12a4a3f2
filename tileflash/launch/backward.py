"""Launchers of the backward of flash_attn_func / flash_attn_varlen_func. The dK/dV kernel also adds its share of dQ
into a zeroed fp32 buffer (5 matrix products per block): on sm_90 at d64/d128 the warp-specialised Gluon kernel
with TMA reduce-adds (plan.backward.ws_backward_config, kernels/gluon/attn_bwd.py), elsewhere the Triton kernel with
atomics where BwdConfig.atomic_dq says so (d > 64). deterministic=True (and the Triton path at d <= 64) computes
dQ in its own pass instead (7 products, no atomics, bitwise reproducible). See kernels/triton/attn_bwd.py.
Around the dK/dV kernel run a preprocess (delta, lse2, the zeroed dQ buffer) and the dQ cast; where the Gluon
kernel serves a short eager call (plan.backward.one_launch_rule) it does all three in one launch (BwdPlan)."""
from __future__ import annotations

import functools
import math

import torch

from .. import _utils, config
from . import direct
from ..kernels.gluon import attn_bwd as gluon_bwd
from ..kernels.triton.attn_bwd import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, attn_bwd_preprocess_kernel
from ..plan.backward import WsBwdConfig, bwd_config, ws_backward_config
from ..plan.target import padded_head_dim, target_arch
from .tensors import alibi_args, desc_4d, dropout_args, launch_sum_cast, unused_pointer, row_descriptors, strides3


PREPROCESS_BLOCK_ROWS = 32
DQ_WORKSPACE_BYTES = 16 << 20  # b=1 s=1k 32 heads d128; beyond that the per-call allocation is noise


def launch_attn_bwd_ws(q4, k4, v4, do4, lse2, delta, dk4, dv4, dq_acc, *, causal: bool, softmax_scale: float,
                       config: WsBwdConfig, atomic_dq: bool, cu_seqlens_q: torch.Tensor | None = None,
                       cu_seqlens_k: torch.Tensor | None = None, max_seqlen_k: int = 0, one_launch=None) -> None:
    """q4/do4 [B, Sq, Hq, D], k4/v4/dk4/dv4 [B, Sk, Hkv, D], lse2/delta [B, Hq, Sq] float32 from _stats_views (see
    ws_backward_config); dq_acc: the zeroed fp32 dQ buffer when atomic_dq. Varlen (cu_seqlens_q/k int32
    [num_seqs + 1]): every tensor [1, total, H, D] and lse2/delta [1, Hq, total_q]. one_launch: (o4, lse3, dq4,
    counters) for the kernel's ONE_LAUNCH (lse3 [B, Hq, Sq] as the forward returned it, dq4 contiguous, dq_acc
    contiguous fp32 zeros, counters int32 zeros [B * Hkv]): delta, lse2 and dq4 are then written by this launch."""
    varlen = cu_seqlens_q is not None
    b, sk, hkv, d = k4.shape
    if varlen:
        b = cu_seqlens_q.shape[0] - 1
    n_tiles = gluon_bwd.n_tiles(max_seqlen_k if varlen else sk)
    keys = gluon_bwd.BLOCK_KEYS
    dq_rows, dq_cols = (config.block_m // 2, d) if config.dq_by_rows else (config.block_m, d // 2)
    if not atomic_dq:  # the descriptor's stand-in, never read or written
        dq_acc = _dq_stand_in(q4.device, dq_rows, dq_cols)
    if one_launch is not None:
        o4, lse3, dq4, counters = one_launch
        one = (o4, do4, lse3, dq4, dq_acc, counters, *strides3(o4), *strides3(do4), *strides3(lse3), *strides3(dq4))
    else:
        one = (lse2,) * 6 + (0,) * 12
    direct.launch(
        gluon_bwd.attn_bwd_ws_kernel, (n_tiles * b * hkv,),
        desc_4d(q4, config.block_m), desc_4d(k4, keys), desc_4d(v4, keys), desc_4d(do4, config.block_m),
        desc_4d(dq_acc, dq_rows, dq_cols), lse2, delta, dk4, dv4, cu_seqlens_q if varlen else lse2,
        cu_seqlens_k if varlen else lse2, q4.shape[1], sk,
        n_tiles, hkv, q4.shape[2] // hkv, lse2.stride(0), lse2.stride(1), *dk4.stride()[:3], *dv4.stride()[:3],
        softmax_scale * math.log2(math.e), softmax_scale, *one, CAUSAL=causal, ROTATE=not causal,
        ATOMIC_DQ=atomic_dq, HEAD_DIM=d, BLOCK_M=config.block_m, STAGES=config.num_stages,
        ONE_FENCE=config.one_fence, DQ_BY_ROWS=config.dq_by_rows, VARLEN=varlen, ONE_LAUNCH=one_launch is not None,
        num_warps=4)


@functools.lru_cache(maxsize=None)
def _dq_stand_in(device, rows: int, cols: int) -> torch.Tensor:
    return direct.constant(torch.empty(1, rows, 1, cols, dtype=torch.float32, device=device))


def _stats_numel(lse_shape) -> int:
    """fp32 elements of one _stats_views buffer for an lse of lse_shape [B, H, S]."""
    bv, h, s = lse_shape
    return bv * h * s


def _stats_views(ws: torch.Tensor, lse3: torch.Tensor, start: int = 0):
    """(delta, lse2) in the workspace from element `start`: contiguous fp32 tensors shaped like lse3 [B, H, S]."""
    n = _stats_numel(lse3.shape)
    return [direct.derived(ws[start + i * n:start + (i + 1) * n].view(lse3.shape), ws) for i in range(2)]


def _launch_bwd(q4, k4, v4, o4, lse3, do4, dlse3, dq4, dk4, dv4, delta, lse2, dq_acc, *, cfg, ws, atomic_dq: bool,
                varlen: bool, num_batches: int, seqlen_q: int, seqlen_k: int, max_seqlen_q: int, max_seqlen_k: int,
                cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, learnable_sink, dsink, softmax_scale: float,
                window_left: int, window_right: int, softcap: float, dropout_p: float = 0.0, rng=None,
                counters=None) -> None:
    """All tensors 4-D [Bv, S, H, D] (v, o, do, dv: [Bv, S, H, Dv]; varlen: Bv = 1 with batch strides passed as 0)
    and lse/dlse [Bv, H, S]; delta, lse2 from _stats_views; dq_acc: the fp32 dQ buffer (contiguous, like dq4) when atomic_dq, zeroed by the
    first launch (dq4 = its scaled copy, made by the caller after these launches). cfg: the Triton kernels' tiles;
    ws: the Gluon dK/dV kernel's or None (never with alibi_slopes: fp32 [Hq] or [num_batches, Hq], or None, nor
    with dropout: rng the forward's seed tensor, or None; learnable_sink, fp32 [Hq] or None, reaches it only
    through the lse). dsink: fp32 [Hq], zeroed, which the preprocess adds d sink into. counters: int32 zeros
    [B * Hkv] for the Gluon kernel's ONE_LAUNCH (ws.one_launch; dq_acc then zeros too), which writes delta, lse2
    and dq4 itself: no preprocess, no cast."""
    dev = q4.device
    hq, d = q4.shape[2], q4.shape[3]
    hkv, dv = k4.shape[2], v4.shape[3]  # dv: V's (and O's, dO's) head dim
    dims = dict(HEAD_DIM=d, HEAD_DIM_PAD=padded_head_dim(d), HEAD_DIM_V=dv, HEAD_DIM_V_PAD=padded_head_dim(dv))
    rows = lse3.numel()
    if counters is None:
        direct.launch(
            attn_bwd_preprocess_kernel, (_utils.cdiv(rows, PREPROCESS_BLOCK_ROWS),),
            o4, do4, lse3, dlse3 if dlse3 is not None else delta, delta, lse2, dq_acc if atomic_dq else delta,
            *((learnable_sink, dsink) if learnable_sink is not None else (delta, delta)),
            cu_seqlens_q if varlen else delta, num_batches, o4.shape[1], hq, rows,
            *strides3(o4), *strides3(do4), *strides3(lse3), lse2.stride(0), lse2.stride(1),
            BLOCK_R=PREPROCESS_BLOCK_ROWS, HAS_DLSE=dlse3 is not None, ZERO_DQ=atomic_dq,
            HAS_SINK=learnable_sink is not None, VARLEN=varlen, num_warps=4, **dims)

    def bstride(t):  # varlen tensors are one packed sequence: the batch index must not move the pointer
        return (0, t.stride(1), t.stride(2)) if varlen else strides3(t)

    dummy = unused_pointer(dev)
    common = dict(**dims, VARLEN_Q=varlen, VARLEN_K=varlen, HAS_SEQUSED_K=seqused_k is not None,
                  HAS_LEFT=window_left >= 0, HAS_RIGHT=window_right >= 0, SOFTCAP=softcap > 0.0,
                  TILE_DTYPE=_utils.tile_dtype(q4.dtype), ALIBI=alibi_slopes is not None, DROPOUT=rng is not None)
    extras = (*alibi_args(alibi_slopes, dummy), *dropout_args(rng, dropout_p, dummy))  # ALiBi's, dropout's arguments
    seq_args = (cu_seqlens_q if varlen else dummy, cu_seqlens_k if varlen else dummy,
                seqused_k if seqused_k is not None else dummy)
    lse_strides = (0, lse2.stride(1), lse2.stride(2)) if varlen else strides3(lse2)  # lse2 and delta
    if not atomic_dq:
        dq_acc = delta  # not read
    if ws is not None:
        launch_attn_bwd_ws(q4, k4, v4, do4, lse2, delta, dk4, dv4, dq_acc, causal=window_right == 0,
                           softmax_scale=softmax_scale, config=ws, atomic_dq=atomic_dq,
                           cu_seqlens_q=cu_seqlens_q if varlen else None, cu_seqlens_k=cu_seqlens_k,
                           max_seqlen_k=max_seqlen_k,
                           one_launch=None if counters is None else (o4, lse3, dq4, counters))
    else:
        _launch_dkdv(q4, k4, v4, do4, lse2, delta, dk4, dv4, dq_acc, cfg, common, seq_args, lse_strides, bstride,
                     extras, varlen=varlen, num_batches=num_batches, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                     max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, softcap=softcap,
                     window_left=window_left, window_right=window_right, atomic_dq=atomic_dq)
    if atomic_dq:
        return
    m_tiles = _utils.cdiv(max(max_seqlen_q, 1), cfg.dq_block_m)
    direct.launch(
        attn_bwd_dq_kernel, (m_tiles * num_batches * hq,),
        q4, k4, v4, do4, lse2, delta, dq4, *seq_args,
        *bstride(q4), *bstride(k4), *bstride(v4), *bstride(do4), *bstride(dq4), *lse_strides,
        seqlen_q, seqlen_k, hq, hq // hkv, m_tiles, softmax_scale, softcap, window_left, window_right, *extras,
        BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n, num_warps=cfg.dq_warps, num_stages=cfg.dq_stages, **common)


def _launch_dkdv(q4, k4, v4, do4, lse2, delta, dk4, dv4, dq_acc, cfg, common, seq_args, lse_strides, bstride, extras,
                 *, varlen, num_batches, seqlen_q, seqlen_k, max_seqlen_k, softmax_scale, softcap, window_left,
                 window_right, atomic_dq):
    """The Triton dK/dV kernel (kernels/triton/attn_bwd.py), every variant."""
    hq, hkv = q4.shape[2], k4.shape[2]
    n_tiles = _utils.cdiv(max(max_seqlen_k, 1), cfg.dkdv_block_n)
    qdo_descs = row_descriptors((q4, do4), q4.shape[0] * q4.shape[1], cfg.dkdv_block_m) if cfg.tma else None
    direct.launch(
        attn_bwd_dkdv_kernel, (n_tiles * num_batches * hkv,),
        q4, k4, v4, do4, lse2, delta, dk4, dv4, dq_acc, *(qdo_descs or (q4, do4)), 0 if varlen else q4.shape[1],
        *seq_args,
        *bstride(q4), *bstride(k4), *bstride(v4), *bstride(do4), *bstride(dk4), *bstride(dv4),
        *(bstride(dq_acc) if atomic_dq else (0, 0, 0)), *lse_strides,
        seqlen_q, seqlen_k, hkv, hq // hkv, n_tiles, softmax_scale, softcap, window_left, window_right, *extras,
        BLOCK_M=cfg.dkdv_block_m, BLOCK_N=cfg.dkdv_block_n, num_warps=cfg.dkdv_warps, num_stages=cfg.dkdv_stages,
        # Bounded on the right (causal), the programs already start at staggered query blocks (their diagonals).
        ATOMIC_DQ=atomic_dq, ROTATE=cfg.rotate and window_right < 0, QDO_DESC=qdo_descs is not None, **common)


class BwdPlan(direct.Replayable):
    """One backward call's host work done once: the kernels and tiles, dQ by atomics or by its own pass, the
    launches' arguments (recorded by the first run, launch/direct.py); delta and lse2 live in the workspace.
    run returns (dq, dk, dv, dsink), dsink fp32 [Hq] with a learnable_sink, else None."""

    def __init__(self, q, k, v, dout, cu_seqlens_q, seqused_k, alibi_slopes, learnable_sink, max_seqlen_q: int,
                 max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int, softcap: float,
                 deterministic: bool, dropout_p: float = 0.0, has_dlse: bool = False, eager: bool = True):
        self.varlen = cu_seqlens_q is not None
        if self.varlen:
            num_batches, seqlen_q, seqlen_k = cu_seqlens_q.shape[0] - 1, q.shape[0], k.shape[0]  # packed rows
            q4, k4, v4, do4 = (t.unsqueeze(0) for t in (q, k, v, dout))
            self.lse_shape = (1, q.shape[1], q.shape[0])
        else:
            num_batches, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
            max_seqlen_q, max_seqlen_k = seqlen_q, seqlen_k
            q4, k4, v4, do4 = q, k, v, dout
            self.lse_shape = (q.shape[0], q.shape[2], q.shape[1])
        self.empty = q.numel() == 0 or k.numel() == 0 or num_batches == 0
        self.dout_contiguous = dout.stride(-1) != 1
        if self.dout_contiguous:
            do4 = do4.contiguous()
        # tiles for the wider of the two head dims (V's may differ from q's, e.g. 192 / 128)
        cfg = config.chosen("bwd", bwd_config(max(q.shape[-1], v.shape[-1]), _utils.is_interpreter(), target_arch(),
                                              dropout=dropout_p > 0))
        # A small dQ accumulator lives in the workspace (an allocation less per call, where host time matters); a
        # large one is allocated per call, so that the workspace, which only grows, never holds training-sized
        # buffers. Rounded up to keep the statistics after it 16-byte aligned.
        small = q.numel() * 4 <= DQ_WORKSPACE_BYTES
        # One launch (ws.one_launch, an eager call the plan takes) needs the kernel's row statistics to cover the
        # call (no dlse, no sink) and dQ summed in the workspace (atomic, small); dQ's sums and the arrival counters
        # then come from direct.COUNTERS. Other calls plan as not eager (at d64's short rows: the Triton kernels).
        eager = eager and small and not (deterministic or has_dlse or learnable_sink is not None)
        ws = None if self.empty or dropout_p else ws_backward_config(
            q4, k4, v4, do4, varlen=self.varlen, window_left=window_left, window_right=window_right,
            softcap=softcap, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k is not None,
            alibi=alibi_slopes is not None, max_seqlen_q=max_seqlen_q, num_batches=num_batches, eager=eager)
        self.atomic_dq = (ws.atomic_dq if ws is not None else cfg.atomic_dq) and not deterministic
        self.softmax_scale = softmax_scale
        self.stats_numel = _stats_numel(self.lse_shape)
        self.dq_ws_numel = _utils.cdiv(q.numel(), 4) * 4 if self.atomic_dq and small else 0
        self.one_launch = eager and ws is not None and ws.one_launch and self.dq_ws_numel > 0
        self.zeros_numel = self.dq_ws_numel + num_batches * k.shape[-2]
        # A CUDA-graph capture gets no zeros (direct.Counters): it runs the plan of a call that is not eager (three
        # launches; at d64's short rows the Triton kernels').
        self.captured = BwdPlan(q, k, v, dout, cu_seqlens_q, seqused_k, alibi_slopes, learnable_sink, max_seqlen_q,
                                max_seqlen_k, softmax_scale, window_left, window_right, softcap, deterministic,
                                dropout_p, has_dlse, eager=False) if self.one_launch else None
        self.kw = dict(cfg=cfg, ws=ws, atomic_dq=self.atomic_dq, varlen=self.varlen, num_batches=num_batches,
                       seqlen_q=seqlen_q, seqlen_k=seqlen_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                       softmax_scale=softmax_scale, window_left=window_left, window_right=window_right,
                       softcap=softcap, dropout_p=dropout_p)

    def _launch(self, q, k, v, out, lse, dout, dlse, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes,
                learnable_sink, dq, dk, dv, dsink, dq_acc, ws, rng, zeros) -> None:
        counters = None
        if zeros is not None:  # ONE_LAUNCH: dQ's accumulator and the counters are zeros the launch leaves zeroed
            dq_acc = direct.derived(zeros[:dq.numel()].view(torch.float32).view(dq.shape), zeros)
            counters = direct.derived(zeros[self.dq_ws_numel:self.zeros_numel], zeros)
        elif self.dq_ws_numel:  # the fp32 dQ accumulator heads the workspace (a TMA descriptor's 16-byte aligned start)
            dq_acc = direct.derived(ws[:dq.numel()].view(dq.shape), ws)
        if self.varlen:
            q, k, v, out, dout, dq, dk, dv, lse = (direct.derived(t.unsqueeze(0), t)
                                                   for t in (q, k, v, out, dout, dq, dk, dv, lse))
            if dlse is not None:
                dlse = direct.derived(dlse.unsqueeze(0), dlse)
            if dq_acc is not None:
                dq_acc = direct.derived(dq_acc.unsqueeze(0), dq_acc)
        delta, lse2 = _stats_views(ws, lse, self.dq_ws_numel)
        _launch_bwd(q, k, v, out, lse, dout, dlse, dq, dk, dv, delta, lse2, dq_acc, cu_seqlens_q=cu_seqlens_q,
                    cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k, alibi_slopes=alibi_slopes,
                    learnable_sink=learnable_sink, dsink=dsink, rng=rng, counters=counters, **self.kw)
        if self.atomic_dq and counters is None:
            launch_sum_cast(dq_acc, dq, 1, self.softmax_scale)

    def run(self, q, k, v, out, lse, dout, dlse, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes,
            learnable_sink, rng=None):
        """rng: the forward's dropout seed (a plan made with dropout_p > 0), else None."""
        stream = direct.current_stream(q.device)
        zeros = direct.COUNTERS.get(q.device, stream, self.zeros_numel) if self.one_launch else None
        if self.one_launch and zeros is None:  # inside a CUDA-graph capture
            return self.captured.run(q, k, v, out, lse, dout, dlse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                     alibi_slopes, learnable_sink, rng)
        dq, dk, dv = _utils.new_output_like(q), _utils.new_output_like(k), _utils.new_output_like(v)
        # Zeroed here, not by a launch: every preprocess program adds its rows' shares into it.
        dsink = torch.zeros_like(learnable_sink) if learnable_sink is not None else None
        if self.empty:
            return dq.zero_(), dk.zero_(), dv.zero_(), dsink
        if self.dout_contiguous:
            dout = dout.contiguous()
        if dlse is not None:
            dlse = dlse.contiguous()  # read with lse's (contiguous) strides
        # The fp32 dQ accumulator, zeroed by the preprocess launch; rows no program adds to (no visible key, outside
        # every varlen sequence) keep the zeros: dQ = 0 there.
        dq_acc = torch.empty_like(dq, dtype=torch.float32) if self.atomic_dq and not self.dq_ws_numel else None
        ws = direct.WORKSPACE.get(q.device, stream, self.dq_ws_numel + 2 * self.stats_numel)
        self.execute(self._launch, (q, k, v, out, lse, dout, dlse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                    alibi_slopes, learnable_sink, dq, dk, dv, dsink, dq_acc, ws, rng, zeros), stream)
        return dq, dk, dv, dsink


_PLANS = direct.PlanCache()


def attn_backward(q, k, v, out, lse, dout, dlse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q: int,
                  max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int, softcap: float,
                  deterministic: bool, alibi_slopes=None, learnable_sink=None, dropout_p: float = 0.0, rng=None):
    """(dq, dk, dv, dsink) of flash_attn_func (cu_seqlens_q None) or flash_attn_varlen_func; lse as their forward
    returned it, dlse its gradient or None, alibi_slopes, learnable_sink, dropout_p and its seed tensor rng the
    forward's (dsink None without a sink)."""
    plan = direct.plan_for(
        _PLANS, lambda: (*(direct.tensor_key(t) for t in (q, k, v, out, lse, dout, dlse, cu_seqlens_q, cu_seqlens_k,
                                                            seqused_k, alibi_slopes, learnable_sink, rng)),
                         max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap,
                         deterministic, dropout_p),
        lambda: BwdPlan(q, k, v, dout, cu_seqlens_q, seqused_k, alibi_slopes, learnable_sink, max_seqlen_q,
                        max_seqlen_k, softmax_scale, window_left, window_right, softcap, deterministic, dropout_p,
                        dlse is not None))
    return plan.run(q, k, v, out, lse, dout, dlse, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes,
                    learnable_sink, rng)
