"""flash_attn_func / flash_attn_varlen_func: checks, custom ops, public functions (flash-attn's names and order)."""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from .. import _utils, config
from . import backward as _bwd
from ..launch import direct
from ..launch.backward import BwdPlan
from ..launch.forward import launch_attn_fwd, launch_attn_fwd_ws
from ..launch.tensors import launch_values_t, values_t_width
from ..plan.prefill import Mask, fwd_config, values_t_gap, ws_forward_config
from ..plan.target import target_arch


FP8 = torch.float8_e4m3fn
FP8_OUT_DTYPES = (torch.bfloat16, torch.float16)


def _check_qkv(q, k, v, ndim: int, kv_ndim: int | None = None, qv=None) -> None:
    """kv_ndim: the rank of k/v when it differs from q's (paged pools [pages, page_size, Hkv, D]); qv: FA3's MLA
    queries (q's shape with V's head dim, the latent) or None."""
    kv_ndim = ndim if kv_ndim is None else kv_ndim
    _utils.check_tensor("q", q, ndim=ndim, dtypes=(*_utils.SUPPORTED_DTYPES, FP8))
    _utils.check_tensor("k", k, ndim=kv_ndim, dtypes=(q.dtype,), device=q.device)
    _utils.check_tensor("v", v, ndim=kv_ndim, dtypes=(q.dtype,), device=q.device)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _utils.check_last_dim_contiguous(name, t)
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k, v: expected equal shapes but for the head dim, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    hq, d = q.shape[-2], q.shape[-1]
    hkv = k.shape[-2]
    if k.shape[-1] != d:
        raise ValueError(f"k: expected head dim {d} (q's), got {k.shape[-1]}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"k: number of KV heads must divide the query heads, got Hq={hq}, Hkv={hkv}")
    _utils.check_head_dim(d)
    dv = v.shape[-1]
    if qv is not None:
        _check_qv(q, qv, dv)
    elif dv != d and not 1 <= dv <= _utils.MAX_LATENT_DIM:  # FA3's headdim_v (DeepSeek's 192 / 128): out takes it
        raise ValueError(f"v: head dim expected 1..{_utils.MAX_LATENT_DIM} (past {_utils.MAX_HEAD_DIM}: forward only), "
                         f"got {dv}")
    if dv != d and q.dtype == FP8:
        raise ValueError(f"v: FP8 attention takes V's head dim equal to q's ({d}), got {dv}")


def _check_qv(q, qv, dv: int) -> None:
    """FA3's qv on the prefill functions (MLA's latent queries; scores q k^T + qv v^T): q's shape with V's head dim
    (the latent, at most MAX_LATENT_DIM), q's 16-bit dtype."""
    if q.dtype == FP8:
        raise ValueError("qv: FP8 attention takes no qv (MLA's latent queries are 16-bit here)")
    _utils.check_tensor("qv", qv, ndim=q.dim(), dtypes=(q.dtype,), device=q.device)
    _utils.check_last_dim_contiguous("qv", qv)
    if not 1 <= dv <= _utils.MAX_LATENT_DIM:
        raise ValueError(f"v: with qv, V's head dim (MLA's latent) must be 1..{_utils.MAX_LATENT_DIM}, got {dv}")
    if tuple(qv.shape) != (*q.shape[:-1], dv):
        raise ValueError(f"qv: expected shape {(*q.shape[:-1], dv)} (q's, with V's head dim), got {tuple(qv.shape)}")


def _check_fp8(q, k, num_batches: int, q_descale, k_descale, v_descale, out_dtype) -> torch.dtype:
    """The output dtype of a checked q/k/v call; FP8 attention's extras checked: descales fp32 [num_batches, Hkv]
    (FA3's) or None, out_dtype bf16 (its default) or fp16. 16-bit calls take neither."""
    descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    if q.dtype != FP8:
        for name, t in descales.items():
            if t is not None:
                raise ValueError(f"{name}: descales are for float8_e4m3fn q, k, v; got {q.dtype} inputs")
        if out_dtype is not None and out_dtype != q.dtype:
            raise ValueError(f"out_dtype: {q.dtype} inputs give {q.dtype} outputs, got {out_dtype}")
        return q.dtype
    _utils.check_fp8_hardware("q", q)
    for name, t in descales.items():
        if t is not None:
            _utils.check_tensor(name, t, ndim=2, dtypes=(torch.float32,), device=q.device)
            if tuple(t.shape) != (num_batches, k.shape[-2]):
                raise ValueError(f"{name}: expected shape ({num_batches}, {k.shape[-2]}) ([batch, Hkv]), got "
                                 f"{tuple(t.shape)}")
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if out_dtype not in FP8_OUT_DTYPES:
        raise ValueError(f"out_dtype: FP8 attention writes bfloat16 or float16, got {out_dtype}")
    return out_dtype


def check_softcap(softcap) -> float:
    """softcap as a float, 0 (off) for any value <= 0 as flash-attn takes it."""
    return max(_utils.finite_float("softcap", softcap), 0.0)


class FwdPlan(direct.Replayable):
    """One forward call's host work done once: the kernel and tiles (Gluon or Triton), the arguments of its
    launch (recorded by the first run, launch/direct.py), the lse's home (a returned tensor, or the workspace when
    nobody reads it). launch(*tensors, out, lse, ws) launches into out/lse (lse None: the workspace's head)."""

    out_dtype = None  # FP8 attention's (bf16 / fp16); None: q's
    backward_args = None  # the backward's arguments (_AttnFunction) of a differentiable call
    no_backward = None  # why a forward-only call has no backward (_NoBackward)

    def __init__(self, launch, lse_shape, device, keep_lse: bool, empty: bool, vt_shape: tuple | None = None,
                 out_dim: int | None = None):
        """out is q's shape and dtype (made per run from q), with V's head dim out_dim where that differs (else
        None); lse_shape [B, Hq, Sq] or [Hq, total_q]. vt_shape: FP8 attention's V^T buffer [Hkv, D, width], made
        per run, which the launch fills (launch/tensors.launch_values_t) and reads."""
        self.launch, self.lse_shape, self.device, self.keep_lse, self.empty = launch, lse_shape, device, keep_lse, empty
        self.out_dim = out_dim
        self.vt_shape = vt_shape
        self.lse_numel = 0 if keep_lse else _utils.cdiv(math.prod(lse_shape), 4) * 4
        self.backward_plans = direct.PlanCache(register=False)  # by dout's and dlse's signature (_AttnFunction)

    def run(self, *tensors, rng=None, qv=None):
        """(out, lse) for the plan's call on these tensors (q, k, v, alibi_slopes, learnable_sink, the three FP8
        descales, and the index tensors of its kind); rng: the dropout seed of a plan made with dropout_p > 0; qv:
        FA3's MLA queries of a plan made with them."""
        q = tensors[0]
        if self.out_dtype is None and self.out_dim is None:
            out = _utils.new_output_like(q)
        else:
            out = _utils.new_output((*q.shape[:-1], self.out_dim or q.shape[-1]), self.out_dtype or q.dtype,
                                    self.device)
        lse = _utils.new_output(self.lse_shape, torch.float32, self.device) if self.keep_lse else None
        if self.empty:  # nothing to launch: every row sees no key
            return out, (lse.fill_(float("-inf")) if lse is not None else None)
        vt = torch.empty(self.vt_shape, dtype=FP8, device=self.device) if self.vt_shape else None
        stream = direct.current_stream(self.device)
        ws = direct.WORKSPACE.get(self.device, stream, self.lse_numel) if self.lse_numel else None
        self.execute(self.launch, (*tensors, out, lse, ws, vt, rng, qv), stream)
        return out, lse


def _out_dim(q, v) -> int | None:
    """out's head dim where it is not q's: V's (FA3's headdim_v), else None."""
    return v.shape[-1] if v.shape[-1] != q.shape[-1] else None


def _out_like(q, v):
    """The custom ops' fake out: q's shape with V's head dim."""
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def _lse_or_workspace(lse, ws, shape):
    return lse if lse is not None else direct.derived(ws[:math.prod(shape)].view(shape), ws)


def _launch_dense(ws_cfg, cfg, vt_gap: int, mask: Mask, softmax_scale: float, dropout_p: float, q, k, v, alibi_slopes,
                  learnable_sink, q_descale, k_descale, v_descale, out, lse, ws, vt, rng, qv) -> None:
    """vt: FP8 attention's V^T buffer (filled from v here, vt_gap columns per sequence), else None; rng: the
    dropout seed (dropout_p > 0), else None; qv: MLA's latent queries [B, Sq, Hq, Dv] or None."""
    b, sq, hq, _ = q.shape
    lse = _lse_or_workspace(lse, ws, (b, hq, sq))
    if vt is not None:
        launch_values_t(v, vt, None, vt_gap)
    if ws_cfg is not None:
        launch_attn_fwd_ws(q, k, v, out, lse, causal=mask.window_right == 0, softmax_scale=softmax_scale,
                           config=ws_cfg, learnable_sink=learnable_sink, vt=vt, vt_gap=vt_gap, q_scale=q_descale,
                           k_scale=k_descale, v_scale=v_descale)
    else:
        launch_attn_fwd(q, k, v if vt is None else vt, out, lse, q_batch_stride0=False, k_batch_stride0=False,
                        num_batches=b, seqlen_q=sq, seqlen_k=k.shape[1], m_rows=sq, softmax_scale=softmax_scale,
                        mask=mask, config=cfg, sp_overlap=cfg.sp_overlap, alibi_slopes=alibi_slopes,
                        learnable_sink=learnable_sink, q_scale=q_descale, k_scale=k_descale, v_scale=v_descale,
                        vt_gap=vt_gap if vt is not None else 0, rng=rng, dropout_p=dropout_p, qv=qv)


def _dense_plan(q, k, v, softmax_scale: float, mask: Mask, keep_lse: bool, alibi: bool,
                dropout_p: float = 0.0, qv: bool = False) -> FwdPlan:
    """q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D], checked; plan.run(q, k, v, alibi_slopes, learnable_sink, q_descale,
    k_descale, v_descale, rng=seed, qv=qv) (None where absent). Dropout and qv run on the Triton kernel (the Gluon
    forward has neither)."""
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    empty = q.numel() == 0
    ws_cfg = cfg = None
    vt_gap = values_t_gap(b * sk, b)
    if not empty:
        # out will be a fresh contiguous tensor of q's shape (with V's head dim), which a TMA descriptor addresses
        # whenever q's does, so q stands in for it (None for Sk = 0 too: no TMA over 0 rows).
        ws_cfg = None if dropout_p or qv else ws_forward_config(q, k, v, q, softmax_scale, mask, alibi=alibi,
                                                                vt_gap=vt_gap)
        if ws_cfg is None:
            cfg = config.chosen("fwd", fwd_config(max(d, v.shape[-1]), causal=mask.window_right >= 0,
                                                  interpret=_utils.is_interpreter(), seqlen_k=sk, arch=target_arch(),
                                                  fp8=q.dtype == FP8))
    vt_shape = (k.shape[2], d, values_t_width(b * sk, b, vt_gap)) if q.dtype == FP8 and not (cfg and cfg.v_rows) \
        else None
    launch = functools.partial(_launch_dense, ws_cfg, cfg, vt_gap, mask, softmax_scale, dropout_p)
    return FwdPlan(launch, (b, hq, sq), q.device, keep_lse, empty, vt_shape, _out_dim(q, v))


_DENSE_PLANS = direct.PlanCache()


def _attn_fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, window_left: int,
                   window_right: int, softcap: float, deterministic: bool,
                   alibi_slopes: Optional[torch.Tensor], learnable_sink: Optional[torch.Tensor],
                   dropout_p: float = 0.0, rng: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The custom op's implementation (torch.compile traces it); deterministic only travels to the backward (saved
    by setup_fwd_context), like the dropout seed rng, drawn by the caller (_utils.dropout_seed)."""
    mask = Mask(window_left, window_right, softcap)
    plan = direct.plan_for(
        _DENSE_PLANS, lambda: (direct.tensor_key(q), direct.tensor_key(k), direct.tensor_key(v), softmax_scale, mask,
                               direct.tensor_key(alibi_slopes), direct.tensor_key(learnable_sink), True, dropout_p),
        lambda: _dense_plan(q, k, v, softmax_scale, mask, keep_lse=True, alibi=alibi_slopes is not None,
                            dropout_p=dropout_p))
    return plan.run(q, k, v, alibi_slopes, learnable_sink, None, None, None, rng=rng)


_attn_fwd_op = torch.library.custom_op("tileflash::attn_fwd", mutates_args=())(_attn_fwd_impl)


@_attn_fwd_op.register_fake
def _(q, k, v, softmax_scale, window_left, window_right, softcap, deterministic, alibi_slopes, learnable_sink,
      dropout_p=0.0, rng=None):
    b, sq, hq, _ = q.shape
    return _out_like(q, v), q.new_empty((b, hq, sq), dtype=torch.float32)


_attn_fwd_op.register_autograd(_bwd.fwd_backward, setup_context=_bwd.setup_fwd_context)


def _varlen_ws_config(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, softmax_scale, mask, alibi: bool,
                      dropout_p: float, vt_gap: int):
    """The warp-specialised forward's tiles for packed sequences, or None where it does not serve the call
    (plan.prefill.ws_forward_config; no TMA descriptor over zero rows; no dropout)."""
    if dropout_p or q.shape[0] == 0 or k.shape[0] == 0 or max_seqlen_q == 0 or cu_seqlens_q.shape[0] < 2:
        return None
    q4, k4, v4 = (t.unsqueeze(0) for t in (q, k, v))
    # out will be a fresh contiguous tensor of q's shape (V's head dim), which a TMA descriptor addresses whenever
    # q's does.
    return ws_forward_config(q4, k4, v4, q4, softmax_scale, mask, max_seqlen_k=max_seqlen_k, alibi=alibi,
                             vt_gap=vt_gap)


def _launch_varlen(ws_cfg, cfg, vt_gap: int, mask: Mask, softmax_scale: float, max_seqlen_q: int, max_seqlen_k: int,
                   paged: bool, dropout_p: float, q, k, v, alibi_slopes, learnable_sink, q_descale, k_descale,
                   v_descale, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, out, lse, ws, vt, rng, qv) -> None:
    """Packed queries q [total_q, H, D] viewed as [1, total_q, H, D] with a batch stride of 0 (cu_seqlens_q gives
    each sequence's start); keys packed the same way, or (paged) page pools read through block_table. vt: FP8
    attention's V^T buffer (filled from v here, vt_gap columns per sequence), else None."""
    total_q, hq, _ = q.shape
    lse = _lse_or_workspace(lse, ws, (hq, total_q))
    q4, out4, lse3 = (direct.derived(t.unsqueeze(0), t) for t in (q, out, lse))
    if paged:
        k4, v4 = k, v
    else:
        k4 = direct.derived(k.unsqueeze(0), k)
        v4 = direct.derived(v.unsqueeze(0), v)
        if vt is not None:
            launch_values_t(v4, vt, cu_seqlens_k, vt_gap)
            v4 = vt
    if ws_cfg is not None:
        launch_attn_fwd_ws(q4, k4, v4, out4, lse3, causal=mask.window_right == 0, softmax_scale=softmax_scale,
                           config=ws_cfg, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                           max_seqlen_q=max_seqlen_q, learnable_sink=learnable_sink, vt=vt, vt_gap=vt_gap,
                           q_scale=q_descale, k_scale=k_descale, v_scale=v_descale)
        return
    capacity = block_table.shape[1] * k.shape[1] if paged else k.shape[0]
    launch_attn_fwd(q4, k4, v4, out4, lse3, q_batch_stride0=True, k_batch_stride0=not paged,
                    num_batches=cu_seqlens_q.shape[0] - 1, seqlen_q=total_q, seqlen_k=capacity, m_rows=max_seqlen_q,
                    softmax_scale=softmax_scale, mask=mask, config=cfg, sp_overlap=cfg.sp_overlap,
                    cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=None if paged else cu_seqlens_k, seqlens_k=seqused_k,
                    block_table=block_table, alibi_slopes=alibi_slopes, learnable_sink=learnable_sink,
                    q_scale=q_descale, k_scale=k_descale, v_scale=v_descale, vt_gap=vt_gap if vt is not None else 0,
                    rng=rng, dropout_p=dropout_p, qv=direct.derived(qv.unsqueeze(0), qv) if qv is not None else None)


def _varlen_plan(q, k, v, cu_seqlens_q, seqused_k, block_table, max_seqlen_q: int, max_seqlen_k: int,
                 softmax_scale: float, mask: Mask, keep_lse: bool, alibi: bool, dropout_p: float = 0.0,
                 qv: bool = False) -> FwdPlan:
    """Checked packed (or paged) arguments; plan.run(q, k, v, alibi_slopes, learnable_sink, q_descale, k_descale,
    v_descale, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, rng=seed, qv=qv)."""
    total_q, hq, d = q.shape
    paged = block_table is not None
    if paged:
        max_seqlen_k = block_table.shape[1] * k.shape[1]
    empty = total_q == 0 or cu_seqlens_q.shape[0] < 2 or max_seqlen_q == 0
    ws_cfg = cfg = None
    vt_gap = values_t_gap(k.shape[0], cu_seqlens_q.shape[0] - 1)
    if not empty:
        if not paged and seqused_k is None and not qv:
            ws_cfg = _varlen_ws_config(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, softmax_scale, mask,
                                       alibi, dropout_p, vt_gap)
        if ws_cfg is None:
            cfg = config.chosen("fwd", fwd_config(max(d, v.shape[-1]), causal=mask.window_right >= 0,
                                                  interpret=_utils.is_interpreter(), seqlen_k=max_seqlen_k,
                                                  arch=target_arch(), fp8=q.dtype == FP8, paged=paged))
    vt_shape = (k.shape[1], d, values_t_width(k.shape[0], cu_seqlens_q.shape[0] - 1, vt_gap)) \
        if q.dtype == FP8 and not paged and not (cfg and cfg.v_rows) else None  # paged pools read V as stored
    launch = functools.partial(_launch_varlen, ws_cfg, cfg, vt_gap, mask, softmax_scale, max_seqlen_q, max_seqlen_k,
                               paged, dropout_p)
    return FwdPlan(launch, (hq, total_q), q.device, keep_lse, empty, vt_shape, _out_dim(q, v))


_VARLEN_PLANS = direct.PlanCache()


def _varlen_key(q, k, v, alibi_slopes, learnable_sink, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table,
                max_seqlen_q, max_seqlen_k, *args):
    return (direct.tensor_key(q), direct.tensor_key(k), direct.tensor_key(v), direct.tensor_key(alibi_slopes),
            direct.tensor_key(learnable_sink),
            direct.tensor_key(cu_seqlens_q), direct.tensor_key(cu_seqlens_k), direct.tensor_key(seqused_k),
            direct.tensor_key(block_table), max_seqlen_q, max_seqlen_k, *args)


def _attn_varlen_fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          cu_seqlens_k: torch.Tensor, seqused_k: Optional[torch.Tensor], max_seqlen_q: int,
                          max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int,
                          softcap: float, deterministic: bool,
                          alibi_slopes: Optional[torch.Tensor], learnable_sink: Optional[torch.Tensor],
                          dropout_p: float = 0.0,
                          rng: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    mask = Mask(window_left, window_right, softcap)
    plan = direct.plan_for(
        _VARLEN_PLANS, lambda: _varlen_key(q, k, v, alibi_slopes, learnable_sink, cu_seqlens_q, cu_seqlens_k,
                                           seqused_k, None, max_seqlen_q, max_seqlen_k, softmax_scale, mask, True,
                                           dropout_p),
        lambda: _varlen_plan(q, k, v, cu_seqlens_q, seqused_k, None, max_seqlen_q, max_seqlen_k, softmax_scale,
                             mask, keep_lse=True, alibi=alibi_slopes is not None, dropout_p=dropout_p))
    return plan.run(q, k, v, alibi_slopes, learnable_sink, None, None, None, cu_seqlens_q, cu_seqlens_k, seqused_k,
                    None, rng=rng)


_attn_varlen_fwd_op = torch.library.custom_op("tileflash::attn_varlen_fwd",
                                              mutates_args=())(_attn_varlen_fwd_impl)


@_attn_varlen_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
      window_right, softcap, deterministic, alibi_slopes, learnable_sink, dropout_p=0.0, rng=None):
    total_q, hq, _ = q.shape
    return _out_like(q, v), q.new_empty((hq, total_q), dtype=torch.float32)


_attn_varlen_fwd_op.register_autograd(_bwd.varlen_backward, setup_context=_bwd.setup_varlen_context)


def _attn_varlen_paged_fwd_impl(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor, block_table: torch.Tensor,
                                max_seqlen_q: int, softmax_scale: float, window_left: int, window_right: int,
                                softcap: float, alibi_slopes: Optional[torch.Tensor],
                                learnable_sink: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed queries over paged keys: sequence b's keys are its first seqused_k[b] tokens in its pages."""
    mask = Mask(window_left, window_right, softcap)
    plan = direct.plan_for(
        _VARLEN_PLANS, lambda: _varlen_key(q, k_cache, v_cache, alibi_slopes, learnable_sink, cu_seqlens_q, None,
                                           seqused_k, block_table, max_seqlen_q, 0, softmax_scale, mask, True),
        lambda: _varlen_plan(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, 0,
                             softmax_scale, mask, keep_lse=True, alibi=alibi_slopes is not None))
    return plan.run(q, k_cache, v_cache, alibi_slopes, learnable_sink, None, None, None, cu_seqlens_q, None,
                    seqused_k, block_table)


_attn_varlen_paged_fwd_op = torch.library.custom_op("tileflash::attn_varlen_paged_fwd",
                                                    mutates_args=())(_attn_varlen_paged_fwd_impl)


@_attn_varlen_paged_fwd_op.register_fake
def _(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, softmax_scale, window_left,
      window_right, softcap, alibi_slopes, learnable_sink):
    total_q, hq, _ = q.shape
    return _out_like(q, v_cache), q.new_empty((hq, total_q), dtype=torch.float32)


def _check_paged_kv(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, qv=None) -> None:
    _check_qkv(q, k_cache, v_cache, 3, kv_ndim=4, qv=qv)
    if k_cache.shape[1] < 1:  # any size: the kernels read one table entry per token (or per TMA box)
        raise ValueError(f"k: page size (dim 1) must be >= 1, got {k_cache.shape[1]}")
    _utils.check_int32("block_table", block_table, 2, q.device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if block_table.shape[0] != num_seqs or (block_table.shape[1] > 1 and block_table.stride(1) != 1):
        raise ValueError(f"block_table: expected a [{num_seqs}, max_pages] int32 table with a contiguous last dim, "
                         f"got shape {tuple(block_table.shape)}, strides {block_table.stride()}")
    if seqused_k is None:
        raise ValueError("seqused_k: required with block_table (keys per sequence in its pages), got None")
    _utils.check_int32("seqused_k", seqused_k, 1, q.device)
    if seqused_k.shape[0] != num_seqs:
        raise ValueError(f"seqused_k: expected {num_seqs} elements, got {seqused_k.shape[0]}")


def _check_max_seqlens(**max_seqlens) -> None:
    for name, val in max_seqlens.items():
        if _utils.as_int(name, val) < 0:
            raise ValueError(f"{name}: expected >= 0, got {val}")


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    return_lse=False, deterministic=False, dropout_p=0.0, alibi_slopes=None, learnable_sink=None,
                    q_descale=None, k_descale=None, v_descale=None, out_dtype=None, *, return_attn_probs=False,
                    num_splits=1, pack_gqa=None, sm_margin=0, attention_chunk=0, qv=None):
    """Attention over a padded batch. q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] (Hq % Hkv == 0), fp16/bf16, or
    float8_e4m3fn for FP8 attention (below). v's head dim Dv may differ from D (FA3's headdim_v, e.g. DeepSeek-V3's
    prefill with D = 192, Dv = 128; 16-bit inputs, the Triton kernels; up to 256, or up to 512 forward only): out is
    then [B, Sq, Hq, Dv].

    Causal and windows are bottom-right aligned (query i sees key j iff j <= i + Sk - Sq). Returns out
    [B, Sq, Hq, D], and with return_lse=True (out, lse) with lse [B, Hq, Sq] float32, natural log.
    Differentiable in q, k, v (and through lse). Above head dim 64 the backward adds dq up with fp32 atomics, so
    dq may differ in the last bits from run to run; deterministic=True computes dq in a separate pass without
    atomics (bitwise reproducible gradients, slower). The argument order is FA3's (softmax_scale fourth);
    flash-attn 2.x's dropout_p is taken as a keyword only.
    dropout_p in [0, 1) (flash-attn 2.x's attention dropout): each probability is dropped with probability
    dropout_p and the kept ones scaled by 1 / (1 - dropout_p); the lse is the undropped softmax's. The pattern comes
    from a seed drawn from torch's generator of q's device at every call (torch.manual_seed reproduces it; a captured
    CUDA graph draws a new one at every replay), and the backward regenerates it (kernels/triton/dropout.py). Not
    with FP8 inputs or attention_chunk; it runs on the Triton kernels (the sm_90 warp-specialised ones have none).
    alibi_slopes: fp32 [Hq] or [B, Hq] (flash-attn's ALiBi): -slope * |i + Sk - Sq - j| is added to the score of
    query i and key j after softmax_scale (and softcap), causal or not; gradients flow to q, k, v, not the slopes.
    learnable_sink: fp32 [Hq] (FA4's attention sink): one more logit per query head in every row's softmax, with no
    value: p_ij = exp(s_ij) / (exp(sink_h) + sum_k exp(s_ik)), not scaled or softcapped; lse includes it, and a row
    that sees no key gives out = 0, lse = sink_h. Differentiable (the sink gets its gradient too).
    FP8 attention (FA3's): q, k, v in float8_e4m3fn with q_descale, k_descale, v_descale fp32 [B, Hkv] (positive;
    None: 1), so q = q_descale * q8 for the queries of KV head h (likewise k, v): the scores are
    q_descale k_descale (q8 k8^T) and out = v_descale (P v8) with P rounded to e4m3 (paged caches: P v8 in fp16),
    in fp32 otherwise (each KV block's P v8 is added into an fp32 accumulator, so long rows keep their precision).
    out_dtype: bfloat16 (default) or float16; lse as above. Forward only, as in FA3: inputs that require grad are
    taken, and a backward through the output raises. tileflash.fp8_quantize_qkv makes the inputs.
    FA3's keyword arguments: return_attn_probs=True returns (out, lse) as return_lse does (FA3's pair; flash-attn
    2.x's third value, the probabilities with the dropout pattern, is not materialised); num_splits, pack_gqa and
    sm_margin are accepted and leave the result as it is (tileflash plans its own schedule). qv [B, Sq, Hq, Dv]
    (FA3's MLA queries, Dv = v's head dim, up to 512; 16-bit): scores q k^T + qv v^T, default scale 1 / sqrt(D +
    Dv); forward only (inputs that require grad are taken and a backward raises; FA3's backward leaves qv out).
    attention_chunk=c > 0 (Llama 4's chunked attention): a query at key position p sees only keys in
    [floor(p / c) * c, + c), intersected with causal / the window (FA3's mask); it runs as packed sequences of one
    chunk each (ops/repack.py), forward and backward.
    """
    if dropout_p:
        dropout_p = _utils.check_dropout(dropout_p, **{"FP8 inputs": getattr(q, "dtype", None) == FP8,
                                                       "attention_chunk": attention_chunk, "qv": qv is not None})
    else:
        dropout_p = 0.0  # None, 0, False: one plan key, and the custom op's float
    if return_attn_probs or num_splits != 1 or pack_gqa is not None or sm_margin or attention_chunk or \
            qv is not None:
        _utils.check_fa3_tail(num_splits, pack_gqa, sm_margin,
                              **({"attention_chunk with qv": attention_chunk} if qv is not None else {}))
        return_lse = bool(return_lse or return_attn_probs)
        if _utils.check_attention_chunk(attention_chunk) and isinstance(q, torch.Tensor) and q.dim() == 4 \
                and q.shape[1] > 0:
            from .repack import chunked_attention

            return chunked_attention(flash_attn_varlen_func, q, k, v, int(attention_chunk), return_lse,
                                     alibi_slopes, q_descale, k_descale, v_descale, softmax_scale=softmax_scale,
                                     causal=causal, window_size=window_size, softcap=softcap,
                                     deterministic=deterministic, learnable_sink=learnable_sink, out_dtype=out_dtype)
    if torch.compiler.is_compiling():
        if _no_graph_op(q, v, qv):
            return _flash_attn_func_eager(q, k, v, softmax_scale, causal, window_size, softcap, return_lse,
                                          deterministic, dropout_p, alibi_slopes, learnable_sink, q_descale,
                                          k_descale, v_descale, out_dtype, qv=qv)
        _check_fp8(q, k, q.shape[0], q_descale, k_descale, v_descale, out_dtype)
        mask, scale = _checked_dense(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                     learnable_sink)
        out, lse = _attn_fwd_op(q, k, v, scale, mask.window_left, mask.window_right, mask.softcap,
                                bool(deterministic), alibi_slopes, learnable_sink, dropout_p,
                                _utils.dropout_seed(q.device) if dropout_p else None)
        return (out, lse) if return_lse else out
    grad = _utils.needs_grad(q, k, v, learnable_sink, qv)
    key = direct.tensor_key
    plan = direct.plan_for(
        # The optional tensors' keys only where one is given (direct.optional_keys): the common call's key is
        # shorter to build and hash (~1 us of a call's host time on the CPU stand-in).
        _PUBLIC_DENSE, lambda: (key(q), key(k), key(v), softmax_scale, causal, direct.window_key(window_size),
                                softcap, return_lse, deterministic, grad, out_dtype, dropout_p,
                                direct.optional_keys(alibi_slopes, learnable_sink, q_descale, k_descale, v_descale,
                                                     qv)),
        lambda: _public_dense_plan(q, k, v, softmax_scale, causal, window_size, softcap, return_lse or grad,
                                   deterministic, alibi_slopes, learnable_sink, q_descale, k_descale, v_descale,
                                   out_dtype, dropout_p, qv))
    rng = _utils.dropout_seed(q.device) if dropout_p else None
    if grad and plan.backward_args is not None:
        return _attn_autograd(bool(return_lse), q, k, v, plan, alibi_slopes, learnable_sink, rng)
    out, lse = plan.run(q, k, v, alibi_slopes, learnable_sink, q_descale, k_descale, v_descale, rng=rng, qv=qv)
    if grad:
        out, lse = _NoBackward.apply(plan.no_backward, out, lse, q, k, v, learnable_sink, qv)
    return (out, lse) if return_lse else out


_flash_attn_func_eager = _utils.compiler_disabled(flash_attn_func)


def _checked_dense(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   learnable_sink, qv=None) -> tuple[Mask, float]:
    _check_qkv(q, k, v, 4, qv=qv)
    if softmax_scale is not None and _utils.finite_float("softmax_scale", softmax_scale) == 0.0:
        # flash-attn 2.x's fourth positional argument is dropout_p: flash_attn_func(q, k, v, 0.0) written for it
        # would otherwise average the values uniformly
        raise ValueError("softmax_scale: 0 makes every key weigh the same; flash-attn 2.x code passing dropout_p "
                         "positionally (the fourth argument here is FA3's softmax_scale) must pass dropout_p=0.0 by "
                         "name")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k: expected batch {q.shape[0]} (q's), got {k.shape[0]}")
    _utils.check_alibi_slopes(alibi_slopes, q.shape[0], q.shape[2], q.device)
    _utils.check_learnable_sink(learnable_sink, q.shape[2], q.device)
    left, right = _utils.check_window(window_size)
    mask = Mask.make(causal, (left, right), check_softcap(softcap))
    return mask, _utils.default_scale(softmax_scale, q, qv)


FP8_NO_BACKWARD = ("FP8 attention (float8_e4m3fn q, k, v) is forward only, as in FA3: its output has no gradient; "
                   "differentiate through 16-bit q, k, v")
PAGED_NO_BACKWARD = ("flash_attn_varlen_func with block_table: paged keys have no backward (inputs that require grad "
                     "are accepted, as flash-attn does, for forward-only use); gather the pages into packed k/v to "
                     "differentiate")
QV_NO_BACKWARD = ("qv (FA3's MLA queries): the prefill call with qv is forward only (FA3's backward gives none of its "
                  "gradients)")
WIDE_V_NO_BACKWARD = (f"v: a head dim past {_utils.MAX_HEAD_DIM} is forward only (as FA3's; the backward's tiles would "
                      "spill)")


def _forward_only(q, v, qv, paged: bool = False) -> str | None:
    """Why a call has no backward (FA3 has none either), or None. (v may be unchecked yet: torch.compile's path.)"""
    if q.dtype == FP8:
        return FP8_NO_BACKWARD
    if qv is not None:
        return QV_NO_BACKWARD
    if paged:
        return PAGED_NO_BACKWARD
    return WIDE_V_NO_BACKWARD if isinstance(v, torch.Tensor) and v.shape[-1] > _utils.MAX_HEAD_DIM else None


def _no_graph_op(q, v, qv) -> bool:
    """Forward-only calls (paged ones have their own op) that torch.compile runs eagerly (a graph break) instead of
    through the custom ops, whose registered backward they have not."""
    return _forward_only(q, v, qv) is not None


def _public_dense_plan(q, k, v, softmax_scale, causal, window_size, softcap, keep_lse, deterministic,
                       alibi_slopes, learnable_sink, q_descale, k_descale, v_descale, out_dtype,
                       dropout_p, qv) -> FwdPlan:
    mask, scale = _checked_dense(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, learnable_sink,
                                 qv)
    out_dtype = _check_fp8(q, k, q.shape[0], q_descale, k_descale, v_descale, out_dtype)
    plan = _dense_plan(q, k, v, scale, mask, keep_lse, alibi=alibi_slopes is not None, dropout_p=dropout_p,
                       qv=qv is not None)
    plan.out_dtype = out_dtype if out_dtype != q.dtype else None
    plan.no_backward = _forward_only(q, v, qv)
    if plan.no_backward is None:
        plan.backward_args = (None, None, None, 0, 0, scale, mask.window_left, mask.window_right, mask.softcap,
                              bool(deterministic), dropout_p)
    return plan


_PUBLIC_DENSE = direct.PlanCache()
_PUBLIC_VARLEN = direct.PlanCache()


class _AttnFunction(torch.autograd.Function):
    """Eager autograd for flash_attn_func / flash_attn_varlen_func: the plan's forward and the backward's plan,
    without the torch.library dispatch of the custom ops (which torch.compile still traces). The backward plans
    hang off the forward's: q, k, v, out, lse, alibi_slopes and learnable_sink are fixed by its signature, so only
    dout and dlse key them. lse is an output only when the caller asked for it: one output less for autograd to
    track in a training step."""

    @staticmethod
    def forward(ctx, return_lse, q, k, v, plan, alibi_slopes, learnable_sink, rng, *index):
        out, lse = plan.run(q, k, v, alibi_slopes, learnable_sink, None, None, None, *index, rng=rng)
        ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, learnable_sink, rng, *index)
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        return (out, lse) if return_lse else out

    @staticmethod
    def backward(ctx, dout, dlse=None):
        q, k, v, out, lse, alibi_slopes, learnable_sink, rng, *index = ctx.saved_tensors
        if dout is None:  # only lse was used
            dout = torch.zeros_like(out)
        cu_q, cu_k, seqused_k, max_q, max_k, *rest = ctx.plan.backward_args
        if index:  # varlen: (cu_seqlens_q, cu_seqlens_k, seqused_k, block_table None)
            cu_q, cu_k, seqused_k = index[:3]
        bwd = direct.plan_for(
            ctx.plan.backward_plans,
            lambda: (direct.tensor_key(dout), direct.tensor_key(dlse)),
            lambda: BwdPlan(q, k, v, dout, cu_q, seqused_k, alibi_slopes, learnable_sink, max_q, max_k, *rest,
                            has_dlse=dlse is not None))
        dq, dk, dv, dsink = bwd.run(q, k, v, out, lse, dout, dlse, cu_q, cu_k, seqused_k, alibi_slopes,
                                    learnable_sink, rng)
        return (None, dq, dk, dv, None, None, dsink, None) + (None,) * len(index)


class _NoBackward(torch.autograd.Function):
    """Outputs of a forward-only call (_forward_only's reasons) on inputs that require grad, which FA3 and
    flash-attn take: the outputs join the graph, and a backward through them raises `reason` rather than leaving
    the inputs without their gradient."""

    @staticmethod
    def forward(ctx, reason, out, lse, *inputs):
        ctx.reason = reason
        return out, lse

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(ctx.reason)


_FAST_APPLY = super(torch.autograd.Function, _AttnFunction).apply  # autograd's C++ entry point


def _attn_autograd(return_lse: bool, *args):
    """_AttnFunction.apply(return_lse, *args), entered through autograd's C++ entry point unless a functorch
    transform is active: Function.apply's Python wrapper (default-argument binding, functorch's unwrapping) is host
    time every layer of a training step pays."""
    if torch._C._are_functorch_transforms_active():
        return _AttnFunction.apply(return_lse, *args)
    return _FAST_APPLY(return_lse, *args)


def _check_cu_seqlens(name: str, t, device) -> None:
    _utils.check_int32(name, t, 1, device)
    if t.shape[0] < 1:
        raise ValueError(f"{name}: expected at least one element (batch + 1 offsets), got shape {tuple(t.shape)}")


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=None,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, return_lse=False,
                           deterministic=False, block_table=None, dropout_p=0.0, alibi_slopes=None,
                           learnable_sink=None, q_descale=None, k_descale=None, v_descale=None, out_dtype=None, *,
                           return_attn_probs=False, num_splits=1, pack_gqa=None, sm_margin=0, attention_chunk=0,
                           qv=None, seqused_q=None):
    """Attention over packed variable-length sequences. q [total_q, Hq, D], k/v [total_k, Hkv, D] (v's head dim may
    differ, as in flash_attn_func);
    cu_seqlens_q/k [batch + 1] int32 offsets; optional seqused_k [batch] int32 (keys actually used per sequence).
    Empty sequences are allowed. Returns out [total_q, Hq, D] and with return_lse=True lse [Hq, total_q].

    max_seqlen_q / max_seqlen_k must be >= every query / key length (they size the grids). Differentiable in
    q, k, v like flash_attn_func (`deterministic` as there).

    Paged keys (vLLM-style chunked prefill / prefix caching): with block_table [batch, max_pages] int32, k and v
    are page pools [num_pages, page_size, Hkv, D], sequence b's keys are the first seqused_k[b] tokens of its pages
    (cu_seqlens_k is ignored and may be None), and its queries are the last tokens of that sequence (bottom-right
    causal). Forward only. dropout_p (flash-attn 2.x's, as in flash_attn_func; rows and keys count from each
    sequence's start) is taken as a keyword; not with block_table, seqused_q or attention_chunk.
    alibi_slopes: fp32 [Hq] or [batch, Hq], as in flash_attn_func, with i, j, Sq and Sk those of each sequence.
    learnable_sink: fp32 [Hq], as in flash_attn_func (every sequence's rows; rows of an empty key range: out 0, lse
    sink_h).
    FP8 attention: float8_e4m3fn q, k, v (or page pools) with descales fp32 [batch, Hkv] and out_dtype, as in
    flash_attn_func (forward only).
    FA3's keyword arguments as in flash_attn_func (attention_chunk without seqused_k or block_table: each sequence's
    positions are its own). seqused_q [batch] int32 (FA3's): sequence b's queries are its first seqused_q[b] rows,
    bottom-right aligned to its keys; its other rows get out 0 and lse -inf (not with block_table).
    FA3's positional order differs from this one after max_seqlen_k (its seqused_q comes before seqused_k): pass those
    by name.
    """
    if dropout_p:
        dropout_p = _utils.check_dropout(dropout_p, block_table=block_table is not None,
                                         seqused_q=seqused_q is not None, attention_chunk=attention_chunk,
                                         qv=qv is not None, **{"FP8 inputs": getattr(q, "dtype", None) == FP8})
    else:
        dropout_p = 0.0
    if return_attn_probs or num_splits != 1 or pack_gqa is not None or sm_margin or attention_chunk or \
            qv is not None or seqused_q is not None:
        chunk = _utils.check_attention_chunk(attention_chunk)
        _utils.check_fa3_tail(num_splits, pack_gqa, sm_margin, **(
            {"attention_chunk with seqused_k, seqused_q, block_table or qv": chunk}
            if seqused_k is not None or seqused_q is not None or block_table is not None or qv is not None else {}),
            **({"seqused_q with block_table": seqused_q} if block_table is not None else {}),
            **({"seqused_q with qv": seqused_q} if qv is not None else {}))
        return_lse = bool(return_lse or return_attn_probs)
        if (chunk or seqused_q is not None) and isinstance(cu_seqlens_q, torch.Tensor) \
                and isinstance(cu_seqlens_k, torch.Tensor):
            from . import repack

            _check_packed_offsets(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cu_seqlens_q.device)
            kw = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                      return_lse=return_lse, deterministic=deterministic, learnable_sink=learnable_sink,
                      out_dtype=out_dtype)
            if chunk:
                return repack.chunked_varlen(flash_attn_varlen_func, q, k, v, cu_seqlens_q.contiguous(),
                                             cu_seqlens_k.contiguous(), int(max_seqlen_q), int(max_seqlen_k), chunk,
                                             alibi_slopes, q_descale, k_descale, v_descale, **kw)
            return repack.used_rows_varlen(flash_attn_varlen_func, q, k, v, cu_seqlens_q.contiguous(),
                                           cu_seqlens_k.contiguous(), seqused_q, int(max_seqlen_q),
                                           int(max_seqlen_k), seqused_k, alibi_slopes, q_descale, k_descale,
                                           v_descale, **kw)
    # The kernels index these with unit stride; a strided view (e.g. every other element) becomes a small copy.
    cu_seqlens_q, cu_seqlens_k, seqused_k = (t.contiguous() if isinstance(t, torch.Tensor) else t
                                             for t in (cu_seqlens_q, cu_seqlens_k, seqused_k))
    if block_table is not None and isinstance(q, torch.Tensor) and q.device.type == "cpu" \
            and not torch.compiler.is_compiling():  # page indices: free to check on the CPU, so checked every call
        _check_paged_kv(q, k, v, cu_seqlens_q, seqused_k, block_table, qv)
        _utils.check_block_table_values(block_table, seqused_k.tolist(), k.shape[1], k.shape[0])
    if torch.compiler.is_compiling():
        if _no_graph_op(q, v, qv):
            return _flash_attn_varlen_func_eager(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, softmax_scale, causal,
                window_size, softcap, return_lse, deterministic, block_table, dropout_p, alibi_slopes, learnable_sink,
                q_descale, k_descale, v_descale, out_dtype, qv=qv)
        _check_fp8(q, k, cu_seqlens_q.shape[0] - 1, q_descale, k_descale, v_descale, out_dtype)
        mask, scale = _checked_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q,
                                      max_seqlen_k, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                      learnable_sink)
        if block_table is not None:
            out, lse = _attn_varlen_paged_fwd_op(q, k, v, cu_seqlens_q, seqused_k, block_table, int(max_seqlen_q),
                                                 scale, mask.window_left, mask.window_right, mask.softcap,
                                                 alibi_slopes, learnable_sink)
        else:
            out, lse = _attn_varlen_fwd_op(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, int(max_seqlen_q),
                                           int(max_seqlen_k), scale, mask.window_left, mask.window_right,
                                           mask.softcap, bool(deterministic), alibi_slopes, learnable_sink, dropout_p,
                                           _utils.dropout_seed(q.device) if dropout_p else None)
        return (out, lse) if return_lse else out
    grad = _utils.needs_grad(q, k, v, learnable_sink, qv)
    plan = direct.plan_for(
        _PUBLIC_VARLEN, lambda: _varlen_key(q, k, v, alibi_slopes, learnable_sink, cu_seqlens_q, cu_seqlens_k,
                                            seqused_k, block_table, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                            direct.window_key(window_size), softcap, return_lse, deterministic, grad,
                                            direct.tensor_key(q_descale), direct.tensor_key(k_descale),
                                            direct.tensor_key(v_descale), out_dtype, dropout_p,
                                            direct.tensor_key(qv)),
        lambda: _public_varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q,
                                    max_seqlen_k, softmax_scale, causal, window_size, softcap, return_lse or grad,
                                    deterministic, alibi_slopes, learnable_sink, q_descale, k_descale, v_descale,
                                    out_dtype, dropout_p, qv))
    index = (cu_seqlens_q, cu_seqlens_k, seqused_k, block_table)
    rng = _utils.dropout_seed(q.device) if dropout_p else None
    if grad and plan.backward_args is not None:
        return _attn_autograd(bool(return_lse), q, k, v, plan, alibi_slopes, learnable_sink, rng, *index)
    out, lse = plan.run(q, k, v, alibi_slopes, learnable_sink, q_descale, k_descale, v_descale, *index, rng=rng,
                        qv=qv)
    if grad:
        out, lse = _NoBackward.apply(plan.no_backward, out, lse, q, k, v, learnable_sink, qv)
    return (out, lse) if return_lse else out


_flash_attn_varlen_func_eager = _utils.compiler_disabled(flash_attn_varlen_func)


def _check_packed_offsets(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, device) -> None:
    """Packed sequences' int32 offsets [batch + 1], as many for the keys as for the queries, and their bounds."""
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, device)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, device)
    if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0]:
        raise ValueError(f"cu_seqlens_k: expected {cu_seqlens_q.shape[0]} elements (cu_seqlens_q's), "
                         f"got {cu_seqlens_k.shape[0]}")
    _check_max_seqlens(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def _checked_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q, max_seqlen_k,
                    softmax_scale, causal, window_size, softcap, alibi_slopes, learnable_sink,
                    qv=None) -> tuple[Mask, float]:
    if block_table is not None:
        _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
        _check_paged_kv(q, k, v, cu_seqlens_q, seqused_k, block_table, qv)
        _check_max_seqlens(max_seqlen_q=max_seqlen_q)
    else:
        _check_qkv(q, k, v, 3, qv=qv)
        _check_packed_offsets(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.device)
        if seqused_k is not None:
            _utils.check_int32("seqused_k", seqused_k, 1, q.device)
            if seqused_k.shape[0] != cu_seqlens_q.shape[0] - 1:
                raise ValueError(f"seqused_k: expected {cu_seqlens_q.shape[0] - 1} elements, "
                                 f"got {seqused_k.shape[0]}")
    _utils.check_alibi_slopes(alibi_slopes, cu_seqlens_q.shape[0] - 1, q.shape[1], q.device)
    _utils.check_learnable_sink(learnable_sink, q.shape[1], q.device)
    left, right = _utils.check_window(window_size)
    mask = Mask.make(causal, (left, right), check_softcap(softcap))
    return mask, _utils.default_scale(softmax_scale, q, qv)


def _public_varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q, max_seqlen_k,
                        softmax_scale, causal, window_size, softcap, keep_lse, deterministic,
                        alibi_slopes, learnable_sink, q_descale, k_descale, v_descale, out_dtype,
                        dropout_p, qv) -> FwdPlan:
    mask, scale = _checked_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q,
                                  max_seqlen_k, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  learnable_sink, qv)
    out_dtype = _check_fp8(q, k, cu_seqlens_q.shape[0] - 1, q_descale, k_descale, v_descale, out_dtype)
    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), (int(max_seqlen_k) if block_table is None else 0)
    plan = _varlen_plan(q, k, v, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k, scale, mask,
                        keep_lse, alibi=alibi_slopes is not None, dropout_p=dropout_p, qv=qv is not None)
    plan.out_dtype = out_dtype if out_dtype != q.dtype else None
    plan.no_backward = _forward_only(q, v, qv, block_table is not None)
    if plan.no_backward is None:
        plan.backward_args = (None, None, None, max_seqlen_q, max_seqlen_k, scale, mask.window_left,
                              mask.window_right, mask.softcap, bool(deterministic), dropout_p)
    return plan
