"""flash_attn_with_kvcache: decode / speculative verify over a contiguous or paged KV cache.

Split-KV: num_splits programs share one (sequence, KV head); each writes fp32 partial (o, lse) and attn_combine
merges them. Pack-GQA: the Hq/Hkv query heads of one KV head x the Sq new tokens form one tile of rows.
No host-device synchronisation and no value-dependent allocation, so the call can be captured in a CUDA graph
(validate=True is the exception: it reads device values to check them).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import _utils
from ..heuristics import (GATHER_PROGRAMS_PER_SM, LONG_SPLIT_PROGRAMS_PER_SM, MAX_SPLITS, QUANT_MMA_MAX_ROWS,
                          decode_config, num_splits_heuristic, quant_decode_config)
from ._launch import (Mask, cache_capacity, launch_attn_fwd, launch_combine, launch_decode_quant, launch_kv_append,
                      sm90_target, tma_tiles)
from .prefill import _check_softcap

MAX_QUERY_TOKENS = 16


KV_FORMATS = {torch.float8_e4m3fn: "fp8", torch.uint8: "nvfp4"}  # cache dtype -> format; others are 16-bit


def _plan(q, k_cache, block_table, num_splits: int):
    """(config, num_splits, capacity) from shapes only: the tile, the split count, then the tile again knowing how
    many tokens each program streams."""
    b, sq, hq, d = q.shape
    hkv = k_cache.shape[2]
    rows = sq * (hq // hkv)
    capacity = cache_capacity(k_cache, block_table)
    tiles = functools.partial(decode_config, d, rows, _utils.is_interpreter(),
                              kv_format=KV_FORMATS.get(k_cache.dtype, "16bit"), paged=block_table is not None,
                              kv_tokens=b * capacity * hkv)
    sms = _utils.num_sms(q.device)

    def count(cfg):  # the asked count, else the heuristic's for this tile
        gathers = (block_table is not None and not cfg.resident_per_sm
                   and not tma_tiles(cfg, k_cache.shape[1], k_cache.dtype == torch.uint8))
        return num_splits or num_splits_heuristic(b, hkv, _utils.cdiv(rows, cfg.block_m), capacity, cfg.block_n,
                                                  sms, cfg.resident_per_sm,
                                                  per_sm=GATHER_PROGRAMS_PER_SM if gathers else 2,
                                                  long_per_sm=LONG_SPLIT_PROGRAMS_PER_SM if block_table is None else 0)

    cfg = tiles()
    splits = count(cfg)
    long_cfg = tiles(tokens_per_program=capacity // splits)
    if long_cfg != cfg:  # fewer programs fit an SM: count again (never more splits than before)
        splits = count(long_cfg)
    return long_cfg, splits, capacity


def _combine_pdl(block_table) -> bool:
    """Whether the split combine is a programmatic dependent launch of the attention kernel (sm_90; its launch then
    overlaps the attention's tail): for contiguous caches, where it was timed (RESULTS.md, session 14, run 102:
    -0.5 to -1.2 us at batch 1, neutral from b=8). Paged caches are slower with it (run 107, `benchmarks/
    splits_sweep.py --pdl --flush-read`: page 16 b=8 ctx 8k 79.1 vs 74.7 us, page 64 b=1 ctx 32k 46.5 vs 44.7)."""
    return block_table is None


def _quant_mma_config(q, k_cache, v_cache, block_table, capacity: int, sp_overlap: bool):
    """The register-operand decode's tiles (kernels/decode_quant_mma.py) when it serves this call, else None: a
    cache heuristics.quant_decode_config takes on sm_90, at most 16 query rows per KV head, a contiguous cache or
    power-of-two pages, 16-byte aligned K/V rows with equal K and V strides (it reads rows as 16-byte words), and
    the plain loop (sp_overlap=True asks for the Triton kernel's S/P-overlapped loop)."""
    cfg = quant_decode_config(q.shape[3], KV_FORMATS.get(k_cache.dtype, "16bit"), q.shape[0] * k_cache.shape[2],
                              capacity)
    if cfg is None or sp_overlap or not sm90_target():
        return None
    if q.shape[1] * (q.shape[2] // k_cache.shape[2]) > QUANT_MMA_MAX_ROWS:
        return None
    page = k_cache.shape[1]
    if block_table is not None and page & (page - 1):
        return None
    aligned = all(t.data_ptr() % 16 == 0 and all(st % 16 == 0 for st in t.stride()[:3]) for t in (k_cache, v_cache))
    return cfg if aligned and k_cache.stride() == v_cache.stride() else None


def _attn_kvcache_impl(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: Optional[torch.Tensor],
                     v: Optional[torch.Tensor], cache_seqlens: torch.Tensor, block_table: Optional[torch.Tensor],
                     softmax_scale: float, window_left: int, window_right: int, softcap: float, num_splits: int,
                     sp_overlap: bool, k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
                     k_global_scale: Optional[torch.Tensor],
                     v_global_scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    b, sq, hq, d = q.shape
    out = _utils.new_output(q.shape, q.dtype, q.device)
    lse = _utils.new_output((b, hq, sq), torch.float32, q.device)
    if b == 0:
        return out, lse
    # FP8: k_scale/v_scale factor out of the dots. NVFP4: the global scales do; k_scale/v_scale are block scales.
    if k_global_scale is not None:
        scales = dict(k_scale=k_global_scale, v_scale=v_global_scale, k_block_scale=k_scale, v_block_scale=v_scale)
    else:
        scales = dict(k_scale=k_scale, v_scale=v_scale)
    s_new = 0
    if k is not None and k.shape[1] > 0:
        s_new = k.shape[1]
        launch_kv_append(k, v, k_cache, v_cache, cache_seqlens, block_table, **scales)
    if hq == 0:  # nothing to attend with; the append above still happened
        return out, lse
    capacity = cache_capacity(k_cache, block_table)
    qcfg = _quant_mma_config(q, k_cache, v_cache, block_table, capacity, sp_overlap)
    if qcfg is not None:
        num_splits = num_splits or num_splits_heuristic(b, k_cache.shape[2], 1, capacity, qcfg.step,
                                                        _utils.num_sms(q.device), per_sm=qcfg.programs_per_sm)
    else:
        cfg, num_splits, _ = _plan(q, k_cache, block_table, num_splits)
    o_part = lse_part = None
    if num_splits > 1:  # one allocation for both partials (host time: see benchmarks/host_profile.py)
        rows = b * sq * hq
        part = _utils.new_output((num_splits * rows * (d + 1),), torch.float32, q.device)
        o_part = part[:num_splits * rows * d].view(num_splits, rows, d)
        lse_part = part[num_splits * rows * d:].view(num_splits, rows)
    pdl = _combine_pdl(block_table)
    if qcfg is not None:
        launch_decode_quant(q, k_cache, v_cache, out, lse, seqlen_k=capacity, seqlens_k=cache_seqlens,
                            seqlen_k_add=s_new, block_table=block_table, softmax_scale=softmax_scale,
                            mask=Mask(window_left, window_right, softcap), config=qcfg, num_splits=num_splits,
                            o_part=o_part, lse_part=lse_part, pdl=pdl, **scales)
    else:
        launch_attn_fwd(q, k_cache, v_cache, out, lse, q_batch_stride0=False, k_batch_stride0=False,
                        num_batches=b, seqlen_q=sq, seqlen_k=capacity, m_rows=sq * (hq // k_cache.shape[2]),
                        softmax_scale=softmax_scale, mask=Mask(window_left, window_right, softcap), config=cfg,
                        seqlens_k=cache_seqlens, seqlen_k_add=s_new, block_table=block_table, pack_gqa=True,
                        num_splits=num_splits, sp_overlap=sp_overlap, o_part=o_part, lse_part=lse_part, pdl=pdl,
                        **scales)
    if num_splits > 1:
        launch_combine(o_part, lse_part, out, lse, pdl=pdl)
    return out, lse


_attn_kvcache_op = torch.library.custom_op(
    "tileflash::attn_kvcache", mutates_args=("k_cache", "v_cache", "k_scale", "v_scale"))(_attn_kvcache_impl)


@_attn_kvcache_op.register_fake
def _(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, window_left, window_right, softcap,
      num_splits, sp_overlap, k_scale, v_scale, k_global_scale, v_global_scale):
    b, sq, hq, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, hq, sq), dtype=torch.float32)


def _check_kv_scales(k_cache, v_cache, k_scale, v_scale, k_global_scale, v_global_scale, num_heads_kv: int,
                     head_dim: int, device) -> None:
    """FP8 caches need fp32 scales ([1] per tensor or [Hkv] per KV head); NVFP4 caches (uint8) need e4m3 block
    scales shaped like the cache with D/16 in the last dim, sharing strides, and fp32 global scales; bf16/fp16
    caches take none."""
    fmt = KV_FORMATS.get(k_cache.dtype)
    if fmt is not None:
        _utils.check_fp8_hardware("k_cache", k_cache)
    names = (("k_scale", k_scale), ("v_scale", v_scale), ("k_global_scale", k_global_scale),
             ("v_global_scale", v_global_scale))
    needed = {None: (), "fp8": ("k_scale", "v_scale"), "nvfp4": tuple(n for n, _ in names)}[fmt]
    for name, t in names:
        if name not in needed:
            if t is not None:
                raise ValueError(f"{name}: not used with a {k_cache.dtype} cache (fp8 caches take k_scale/v_scale, "
                                 f"nvfp4 (uint8) caches also k_global_scale/v_global_scale); expected None, got a "
                                 f"tensor")
        elif t is None:
            raise ValueError(f"{name}: required with a {k_cache.dtype} cache, got None")
    if fmt == "fp8":
        for name, t in names[:2]:
            _utils.check_tensor(name, t, ndim=1, dtypes=(torch.float32,), device=device)
            if t.shape[0] not in (1, num_heads_kv) or (t.shape[0] > 1 and t.stride(0) != 1):
                raise ValueError(f"{name}: expected a contiguous shape [1] or [{num_heads_kv}], got {tuple(t.shape)}")
        if k_scale.shape != v_scale.shape:
            raise ValueError(f"k_scale, v_scale: expected equal shapes, got {tuple(k_scale.shape)} and "
                             f"{tuple(v_scale.shape)}")
    elif fmt == "nvfp4":
        if head_dim & (head_dim - 1) or head_dim < 32:
            # Head dim 16 (one scale per head vector) decoded wrongly on the H200 (triton 3.6) while the
            # interpreter was exact; refused until that is understood (benchmarks/RESULTS.md).
            raise ValueError(f"k_cache: NVFP4 caches need a power-of-two head dim >= 32, got {head_dim}")
        expected = (*k_cache.shape[:-1], head_dim // 16)
        for name, t in names[:2]:
            _utils.check_tensor(name, t, ndim=4, dtypes=(torch.float8_e4m3fn,), device=device)
            if tuple(t.shape) != expected or t.stride(-1) != 1:
                raise ValueError(f"{name}: expected e4m3 block scales of shape {expected} (last dim contiguous), "
                                 f"got {tuple(t.shape)}")
        if k_scale.stride() != v_scale.stride() or k_cache.stride() != v_cache.stride():
            raise ValueError(f"k_scale, v_scale / k_cache, v_cache: NVFP4 K and V tensors must share strides, got "
                             f"{k_scale.stride()} / {v_scale.stride()} and {k_cache.stride()} / {v_cache.stride()}")
        for name, t in names[2:]:
            _utils.check_tensor(name, t, dtypes=(torch.float32,), device=device)
            if t.numel() != 1:
                raise ValueError(f"{name}: expected one float32 value, got shape {tuple(t.shape)}")


def _check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits, k_scale, v_scale,
                   k_global_scale, v_global_scale):
    _utils.check_tensor("q", q, ndim=4, dtypes=_utils.SUPPORTED_DTYPES)
    dev = q.device
    cache_dtypes = (q.dtype, torch.float8_e4m3fn, torch.uint8)
    _utils.check_tensor("k_cache", k_cache, ndim=4, dtypes=cache_dtypes, device=dev)
    _utils.check_tensor("v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,), device=dev)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _utils.check_last_dim_contiguous(name, t)
    b, sq, hq, d = q.shape
    _utils.check_head_dim(d)
    if not 1 <= sq <= MAX_QUERY_TOKENS:
        raise ValueError(f"q: expected 1..{MAX_QUERY_TOKENS} query tokens per sequence (dim 1), got {sq}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache, v_cache: expected equal shapes, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    hkv = k_cache.shape[2]
    cache_d = k_cache.shape[3] * (2 if k_cache.dtype == torch.uint8 else 1)  # NVFP4 packs two values per byte
    if cache_d != d:
        raise ValueError(f"k_cache: expected head dim {d} (q's; NVFP4: {d // 2} bytes), got {k_cache.shape[3]}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"k_cache: number of KV heads must divide the query heads, got Hq={hq}, Hkv={hkv}")
    _check_kv_scales(k_cache, v_cache, k_scale, v_scale, k_global_scale, v_global_scale, hkv, d, dev)
    if block_table is not None:
        _utils.check_int32("block_table", block_table, 2, dev)
        if block_table.shape[0] != b:
            raise ValueError(f"block_table: expected {b} rows (batch), got {block_table.shape[0]}")
        if block_table.shape[1] > 1 and block_table.stride(1) != 1:
            raise ValueError(f"block_table: last dimension must be contiguous (stride 1), got stride "
                             f"{block_table.stride(1)}")
        page_size = k_cache.shape[1]
        if not 1 <= page_size <= _utils.MAX_PAGE_SIZE:
            raise ValueError(f"k_cache: page size (dim 1) must be in 1..{_utils.MAX_PAGE_SIZE}, got {page_size}")
        capacity = block_table.shape[1] * page_size
    else:
        if k_cache.shape[0] != b:
            raise ValueError(f"k_cache: expected batch {b} (q's) for a contiguous cache, got {k_cache.shape[0]} "
                             f"(pass block_table for a paged cache)")
        capacity = k_cache.shape[1]
    if cache_seqlens is None:
        raise ValueError("cache_seqlens: required ([batch] int32, tokens already in each sequence's cache), got None")
    _utils.check_int32("cache_seqlens", cache_seqlens, 1, dev)
    if cache_seqlens.shape[0] != b:
        raise ValueError(f"cache_seqlens: expected {b} elements (batch), got {cache_seqlens.shape[0]}")
    if (k is None) != (v is None):
        given = lambda t: "None" if t is None else "a tensor"  # noqa: E731
        raise ValueError(f"k, v: pass both new keys and new values, or neither; got k={given(k)}, v={given(v)}")
    s_new = 0
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            _utils.check_tensor(name, t, ndim=4, dtypes=(q.dtype,), device=dev)
            _utils.check_last_dim_contiguous(name, t)
            if tuple(t.shape) != (b, t.shape[1], hkv, d):
                raise ValueError(f"{name}: expected shape [{b}, Snew, {hkv}, {d}], got {tuple(t.shape)}")
        if k.shape != v.shape:
            raise ValueError(f"k, v: expected equal shapes, got {tuple(k.shape)} and {tuple(v.shape)}")
        s_new = k.shape[1]
        if s_new > capacity:
            raise ValueError(f"k: {s_new} new tokens exceed the cache capacity of {capacity} tokens")
    num_splits = _utils.as_int("num_splits", num_splits)
    if not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits: expected 0 (heuristic), 1 (no split) or 2..{MAX_SPLITS}, got {num_splits}")
    return capacity, s_new


def _validate_values(k_cache, cache_seqlens, block_table, capacity: int, s_new: int) -> None:
    """Checks that read device values (a host sync): lengths within capacity, page indices inside the pool."""
    seqlens = cache_seqlens.cpu()
    if seqlens.numel() and int(seqlens.min()) < 0:
        raise ValueError(f"cache_seqlens: expected values >= 0, got min {int(seqlens.min())}")
    if seqlens.numel() and int(seqlens.max()) + s_new > capacity:
        raise ValueError(f"cache_seqlens + Snew: {int(seqlens.max())} + {s_new} exceeds the cache capacity of "
                         f"{capacity} tokens")
    if block_table is not None:
        _utils.check_block_table_values(block_table, (seqlens + s_new).tolist(), k_cache.shape[1], k_cache.shape[0])


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None,
                            softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0, num_splits=0,
                            return_lse=False, sp_overlap=False, validate=False, k_scale=None, v_scale=None,
                            k_global_scale=None, v_global_scale=None):
    """Attention of 1..16 new query tokens per sequence over a KV cache, appending new K/V in place.

    q [B, Sq, Hq, D]; k_cache/v_cache [B, S_max, Hkv, D], or paged [num_pages, page_size, Hkv, D] with
    block_table [B, max_pages] int32 (page_size 1..256, pages in any order); cache_seqlens [B] int32.
    k, v [B, Snew, Hkv, D] are written at positions cache_seqlens .. cache_seqlens + Snew, then attention runs over
    cache_seqlens + Snew tokens (causal bottom-right aligned). num_splits: 0 heuristic, 1 none, n exactly n.
    sp_overlap=True selects the S/P-overlapped inner loop (QK^T of block j+1 issued before the softmax of block j);
    the default plain loop measured as fast or faster on the H200 with triton 3.6 (benchmarks/RESULTS.md).
    FP8 caches: k_cache/v_cache in float8_e4m3fn with k_scale/v_scale (float32, [1] per tensor or [Hkv] per KV
    head): K = k_scale * k_cache; new k/v (in q's dtype) are quantized into the cache (x / scale, saturated, RNE).
    NVFP4 caches: k_cache/v_cache uint8 [.., S, Hkv, D/2] (element 2i in the low nibble), k_scale/v_scale
    float8_e4m3fn [.., S, Hkv, D/16] (one scale per 16 elements), k_global_scale/v_global_scale float32 [1]:
    K = e2m1 * k_scale * k_global_scale (tileflash.nvfp4_quantize's format); appends quantize with the global
    scale. D must be a power of two >= 32.
    validate=True checks cache_seqlens and block_table values against the cache (costs a device sync); without it
    they are the caller's contract (lengths are clamped to the capacity in the kernel; page indices are trusted).
    Returns out [B, Sq, Hq, D], and with return_lse=True (out, lse [B, Hq, Sq] float32).
    """
    capacity, s_new = _check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits, k_scale,
                                     v_scale, k_global_scale, v_global_scale)
    cache_seqlens = cache_seqlens.contiguous()  # read with unit stride by the kernels
    # On the CPU reading values costs no sync (but torch.compile cannot trace value-dependent checks).
    if validate or (q.device.type == "cpu" and not torch.compiler.is_compiling()):
        _validate_values(k_cache, cache_seqlens, block_table, capacity, s_new)
    left, right = _utils.check_window(window_size)
    mask = Mask.make(causal, (left, right), _check_softcap(softcap))
    op = _utils.eager_or_op(_attn_kvcache_op, _attn_kvcache_impl)
    out, lse = op(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                  _utils.softmax_scale_or_default(softmax_scale, q.shape[-1]), mask.window_left, mask.window_right,
                  mask.softcap, int(num_splits), bool(sp_overlap), k_scale, v_scale, k_global_scale, v_global_scale)
    return (out, lse) if return_lse else out
