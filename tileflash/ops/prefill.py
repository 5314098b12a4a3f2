"""flash_attn_func / flash_attn_varlen_func: checks, custom ops, public functions (flash-attn's names and order)."""
from __future__ import annotations

from typing import Optional

import torch

from .. import _utils
from ..heuristics import fwd_config
from . import backward as _bwd
from ._launch import Mask, launch_attn_fwd, launch_attn_fwd_ws, ws_forward_config


def _check_qkv(q, k, v, ndim: int, kv_ndim: int | None = None) -> None:
    """kv_ndim: the rank of k/v when it differs from q's (paged pools [pages, page_size, Hkv, D])."""
    kv_ndim = ndim if kv_ndim is None else kv_ndim
    _utils.check_tensor("q", q, ndim=ndim, dtypes=_utils.SUPPORTED_DTYPES)
    _utils.check_tensor("k", k, ndim=kv_ndim, dtypes=(q.dtype,), device=q.device)
    _utils.check_tensor("v", v, ndim=kv_ndim, dtypes=(q.dtype,), device=q.device)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _utils.check_last_dim_contiguous(name, t)
    if k.shape != v.shape:
        raise ValueError(f"k, v: expected equal shapes, got {tuple(k.shape)} and {tuple(v.shape)}")
    hq, d = q.shape[-2], q.shape[-1]
    hkv = k.shape[-2]
    if k.shape[-1] != d:
        raise ValueError(f"k: expected head dim {d} (q's), got {k.shape[-1]}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"k: number of KV heads must divide the query heads, got Hq={hq}, Hkv={hkv}")
    _utils.check_head_dim(d)


def _check_softcap(softcap) -> float:
    softcap = _utils.finite_float("softcap", softcap)
    if softcap < 0:
        raise ValueError(f"softcap: expected >= 0 (0 disables it), got {softcap}")
    return softcap


def _attn_fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, window_left: int,
                   window_right: int, softcap: float, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """deterministic only travels to the backward (saved by setup_fwd_context)."""
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    out = _utils.new_output(q.shape, q.dtype, q.device)
    lse = _utils.new_output((b, hq, sq), torch.float32, q.device)
    if out.numel() == 0:
        return out, lse.fill_(float("-inf"))
    mask = Mask(window_left, window_right, softcap)
    ws_cfg = ws_forward_config(q, k, v, out, softmax_scale, mask)  # None for Sk = 0 too (no TMA over 0 rows)
    if ws_cfg is not None:
        launch_attn_fwd_ws(q, k, v, out, lse, causal=window_right == 0, softmax_scale=softmax_scale, config=ws_cfg)
        return out, lse
    cfg = fwd_config(d, causal=window_right >= 0, interpret=_utils.is_interpreter(), seqlen_k=sk)
    launch_attn_fwd(q, k, v, out, lse, q_batch_stride0=False, k_batch_stride0=False, num_batches=b,
                    seqlen_q=sq, seqlen_k=sk, m_rows=sq, softmax_scale=softmax_scale, mask=mask, config=cfg,
                    sp_overlap=cfg.sp_overlap)
    return out, lse


_attn_fwd_op = torch.library.custom_op("tileflash::attn_fwd", mutates_args=())(_attn_fwd_impl)


@_attn_fwd_op.register_fake
def _(q, k, v, softmax_scale, window_left, window_right, softcap, deterministic):
    b, sq, hq, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, hq, sq), dtype=torch.float32)


_attn_fwd_op.register_autograd(_bwd.fwd_backward, setup_context=_bwd.setup_fwd_context)


def _varlen_forward(q, k4, v4, cu_seqlens_q, max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right,
                    softcap, **launch_kw):
    """Allocate (out, lse [Hq, total_q]) and launch over packed queries: q [total, H, D] is viewed as
    [1, total, H, D] with a batch stride of 0, and cu_seqlens_q gives each sequence's start."""
    total_q, hq, d = q.shape
    out = _utils.new_output(q.shape, q.dtype, q.device)
    lse = _utils.new_output((hq, total_q), torch.float32, q.device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if total_q == 0 or num_seqs == 0 or max_seqlen_q == 0:
        return out, lse.fill_(float("-inf"))
    cfg = fwd_config(d, causal=window_right >= 0, interpret=_utils.is_interpreter(), seqlen_k=max_seqlen_k)
    launch_attn_fwd(q.unsqueeze(0), k4, v4, out.unsqueeze(0), lse.unsqueeze(0), q_batch_stride0=True,
                    num_batches=num_seqs, seqlen_q=total_q, m_rows=max_seqlen_q, softmax_scale=softmax_scale,
                    mask=Mask(window_left, window_right, softcap), config=cfg, sp_overlap=cfg.sp_overlap,
                    cu_seqlens_q=cu_seqlens_q, **launch_kw)
    return out, lse


def _varlen_forward_ws(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, mask):
    """(out, lse [Hq, total_q]) from the warp-specialised forward over packed sequences, or None where it does not
    serve the call (ops/_launch.ws_forward_config; no TMA descriptor over zero rows)."""
    total_q, hq, _ = q.shape
    if total_q == 0 or k.shape[0] == 0 or max_seqlen_q == 0 or cu_seqlens_q.shape[0] < 2:
        return None
    q4, k4, v4 = (t.unsqueeze(0) for t in (q, k, v))
    # Decided before out exists (no allocation on the calls it declines): out will be a fresh contiguous tensor of
    # q's shape, which a TMA descriptor addresses whenever q's does, so q stands in for it.
    cfg = ws_forward_config(q4, k4, v4, q4, softmax_scale, mask, max_seqlen_k=max_seqlen_k)
    if cfg is None:
        return None
    out = _utils.new_output(q.shape, q.dtype, q.device)
    lse = _utils.new_output((hq, total_q), torch.float32, q.device)
    launch_attn_fwd_ws(q4, k4, v4, out.unsqueeze(0), lse.unsqueeze(0), causal=mask.window_right == 0,
                       softmax_scale=softmax_scale, config=cfg, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                       max_seqlen_q=max_seqlen_q)
    return out, lse


def _attn_varlen_fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          cu_seqlens_k: torch.Tensor, seqused_k: Optional[torch.Tensor], max_seqlen_q: int,
                          max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int,
                          softcap: float, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if seqused_k is None:
        ws = _varlen_forward_ws(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                Mask(window_left, window_right, softcap))
        if ws is not None:
            return ws
    return _varlen_forward(q, k.unsqueeze(0), v.unsqueeze(0), cu_seqlens_q, max_seqlen_q, max_seqlen_k, softmax_scale,
                           window_left, window_right, softcap, k_batch_stride0=True, seqlen_k=k.shape[0],
                           cu_seqlens_k=cu_seqlens_k, seqlens_k=seqused_k)


_attn_varlen_fwd_op = torch.library.custom_op("tileflash::attn_varlen_fwd",
                                              mutates_args=())(_attn_varlen_fwd_impl)


@_attn_varlen_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
      window_right, softcap, deterministic):
    total_q, hq, _ = q.shape
    return torch.empty_like(q), q.new_empty((hq, total_q), dtype=torch.float32)


_attn_varlen_fwd_op.register_autograd(_bwd.varlen_backward, setup_context=_bwd.setup_varlen_context)


def _attn_varlen_paged_fwd_impl(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor, block_table: torch.Tensor,
                                max_seqlen_q: int, softmax_scale: float, window_left: int, window_right: int,
                                softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed queries over paged keys: sequence b's keys are its first seqused_k[b] tokens in its pages."""
    capacity = block_table.shape[1] * k_cache.shape[1]
    return _varlen_forward(q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, capacity, softmax_scale, window_left,
                           window_right, softcap, k_batch_stride0=False, seqlen_k=capacity, seqlens_k=seqused_k,
                           block_table=block_table)


_attn_varlen_paged_fwd_op = torch.library.custom_op("tileflash::attn_varlen_paged_fwd",
                                                    mutates_args=())(_attn_varlen_paged_fwd_impl)


@_attn_varlen_paged_fwd_op.register_fake
def _(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, softmax_scale, window_left,
      window_right, softcap):
    total_q, hq, _ = q.shape
    return torch.empty_like(q), q.new_empty((hq, total_q), dtype=torch.float32)


def _check_paged_kv(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table) -> None:
    _check_qkv(q, k_cache, v_cache, 3, kv_ndim=4)
    if not 1 <= k_cache.shape[1] <= _utils.MAX_PAGE_SIZE:
        raise ValueError(f"k: page size (dim 1) must be in 1..{_utils.MAX_PAGE_SIZE}, got {k_cache.shape[1]}")
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
    if q.device.type == "cpu" and not torch.compiler.is_compiling():  # page indices: free to check on the CPU
        _utils.check_block_table_values(block_table, seqused_k.tolist(), k_cache.shape[1], k_cache.shape[0])


def _check_max_seqlens(**max_seqlens) -> None:
    for name, val in max_seqlens.items():
        if _utils.as_int(name, val) < 0:
            raise ValueError(f"{name}: expected >= 0, got {val}")


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    return_lse=False, deterministic=False):
    """Attention over a padded batch. q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] (Hq % Hkv == 0), fp16/bf16.

    Causal and windows are bottom-right aligned (query i sees key j iff j <= i + Sk - Sq). Returns out
    [B, Sq, Hq, D], and with return_lse=True (out, lse) with lse [B, Hq, Sq] float32, natural log.
    Differentiable in q, k, v (and through lse). Above head dim 64 the backward adds dq up with fp32 atomics, so
    dq may differ in the last bits from run to run; deterministic=True computes dq in a separate pass without
    atomics (bitwise reproducible gradients, slower).
    """
    _check_qkv(q, k, v, 4)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k: expected batch {q.shape[0]} (q's), got {k.shape[0]}")
    left, right = _utils.check_window(window_size)
    mask = Mask.make(causal, (left, right), _check_softcap(softcap))
    op = _utils.eager_or_op(_attn_fwd_op, _attn_fwd_impl, _utils.needs_grad(q, k, v))
    out, lse = op(q, k, v, _utils.softmax_scale_or_default(softmax_scale, q.shape[-1]), mask.window_left,
                  mask.window_right, mask.softcap, bool(deterministic))
    return (out, lse) if return_lse else out


def _check_cu_seqlens(name: str, t, device) -> None:
    _utils.check_int32(name, t, 1, device)
    if t.shape[0] < 1:
        raise ValueError(f"{name}: expected at least one element (batch + 1 offsets), got shape {tuple(t.shape)}")


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=None,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, return_lse=False,
                           deterministic=False, block_table=None):
    """Attention over packed variable-length sequences. q [total_q, Hq, D], k/v [total_k, Hkv, D];
    cu_seqlens_q/k [batch + 1] int32 offsets; optional seqused_k [batch] int32 (keys actually used per sequence).
    Empty sequences are allowed. Returns out [total_q, Hq, D] and with return_lse=True lse [Hq, total_q].

    max_seqlen_q / max_seqlen_k must be >= every query / key length (they size the grids). Differentiable in
    q, k, v like flash_attn_func (`deterministic` as there).

    Paged keys (vLLM-style chunked prefill / prefix caching): with block_table [batch, max_pages] int32, k and v
    are page pools [num_pages, page_size, Hkv, D], sequence b's keys are the first seqused_k[b] tokens of its pages
    (cu_seqlens_k is ignored and may be None), and its queries are the last tokens of that sequence (bottom-right
    causal). Forward only.
    """
    if block_table is not None:
        _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
        _check_paged_kv(q, k, v, cu_seqlens_q, seqused_k, block_table)
        _check_max_seqlens(max_seqlen_q=max_seqlen_q)
        if _utils.needs_grad(q, k, v):
            raise ValueError("block_table: paged keys are forward-only; got inputs that require grad")
        left, right = _utils.check_window(window_size)
        mask = Mask.make(causal, (left, right), _check_softcap(softcap))
        op = _utils.eager_or_op(_attn_varlen_paged_fwd_op, _attn_varlen_paged_fwd_impl)
        out, lse = op(q, k, v, cu_seqlens_q.contiguous(), seqused_k.contiguous(), block_table, int(max_seqlen_q),
                      _utils.softmax_scale_or_default(softmax_scale, q.shape[-1]), mask.window_left,
                      mask.window_right, mask.softcap)
        return (out, lse) if return_lse else out
    _check_qkv(q, k, v, 3)
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device)
    if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0]:
        raise ValueError(f"cu_seqlens_k: expected {cu_seqlens_q.shape[0]} elements (cu_seqlens_q's), "
                         f"got {cu_seqlens_k.shape[0]}")
    if seqused_k is not None:
        _utils.check_int32("seqused_k", seqused_k, 1, q.device)
        if seqused_k.shape[0] != cu_seqlens_q.shape[0] - 1:
            raise ValueError(f"seqused_k: expected {cu_seqlens_q.shape[0] - 1} elements, got {seqused_k.shape[0]}")
    _check_max_seqlens(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    left, right = _utils.check_window(window_size)
    mask = Mask.make(causal, (left, right), _check_softcap(softcap))
    # The kernels index these with unit stride; a strided view (e.g. every other element) becomes a small copy.
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    seqused_k = seqused_k.contiguous() if seqused_k is not None else None
    op = _utils.eager_or_op(_attn_varlen_fwd_op, _attn_varlen_fwd_impl, _utils.needs_grad(q, k, v))
    out, lse = op(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, int(max_seqlen_q), int(max_seqlen_k),
                  _utils.softmax_scale_or_default(softmax_scale, q.shape[-1]), mask.window_left, mask.window_right,
                  mask.softcap, bool(deterministic))
    return (out, lse) if return_lse else out
