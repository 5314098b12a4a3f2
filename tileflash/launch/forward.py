"""Launchers of the forward kernels: the Triton forward / decode loop, the Gluon prefill forward, the register-operand
quantized decode, the split combine, merge_attn_states and the KV append. They turn torch tensors into the kernels'
pointer / stride arguments; no input checking here (the public functions check before calling), no allocation
whose size depends on tensor values (CUDA-graph safe)."""
from __future__ import annotations

import math

import torch

from .. import _utils
from . import direct
from ..kernels.gluon import attn_fwd as gluon_fwd, decode_mma, mla_decode, mla_decode_narrow
from ..kernels.triton.attn_fwd import attn_fwd_kernel
from ..kernels.triton.inner import FP8_V_ROWS, FP8_V_T, FP8_V_T_DESC, FP8_V_T_ZEROS, TRANS_PERM_K
from ..kernels.triton.combine import attn_combine_kernel, merge_states_kernel
from ..kernels.triton.kv_append import kv_append_kernel
from ..lowp.kernels.quant import NVFP4_PURE_ASM, NVFP4_SCALE_BYTES, NVFP4_SCALE_WORDS
from ..plan.decode import cache_capacity, combine_tiles, merge_tiles
from ..plan.prefill import Mask, WsFwdConfig, split_head_dim, tma_tiles
from ..plan.target import padded_head_dim, sm90_target
from .tensors import (alibi_args, as_bytes, desc_4d, dropout_args, unused_pointer, row_descriptors, rotary_args,
                      rows_desc, scale_strides, strides3, unit_scale, values_t_descriptor, values_t_gluon_desc)


COMBINE_BLOCK_ROWS = 16


def launch_attn_fwd(q4, k4, v4, out4, lse3, *, q_batch_stride0: bool, k_batch_stride0: bool, num_batches: int,
                    seqlen_q: int, seqlen_k: int, m_rows: int, softmax_scale: float, mask: Mask, config,
                    cu_seqlens_q=None, cu_seqlens_k=None, seqlens_k=None, seqlen_k_add: int = 0,
                    block_table=None, pack_gqa: bool = False, num_splits: int = 1, sp_overlap: bool = False,
                    o_part=None, lse_part=None, k_scale=None, v_scale=None, k_block_scale=None, v_block_scale=None,
                    pdl: bool = False, alibi_slopes=None, cache_batch_idx=None, cache_leftpad=None, rotary_cos=None,
                    rotary_sin=None, rotary_interleaved: bool = False, rotary_per_token: bool = False,
                    cu_seqlens_k_new=None, learnable_sink=None, qv=None, q_scale=None, vt_gap: int = 0,
                    counters=None, k_new=None, v_new=None, rng=None, dropout_p: float = 0.0,
                    after_prior: bool = False):
    """q4 [Bq, Sq, Hq, D]; k4/v4 [Bk, Sk, Hkv, D] (paged: [pages, page_size, Hkv, D]); out4 [Bq, Sq, Hq, Dv] (Dv:
    v4's head dim); lse3 [Bq, Hq, Sq]. qv [Bq, Sq, Hq, Dv] or None: MLA's latent queries (scores add qv v^T).
    alibi_slopes: fp32 [Hq] or [num_batches, Hq] (checked by the public functions), or None.
    learnable_sink: fp32 [Hq] or None; a split launch leaves it out of its partials (launch_combine adds it).

    m_rows: rows per (batch, head program) = max query tokens (x group size when packing).
    cache_batch_idx / cache_leftpad [Bq] int32, rotary_cos / rotary_sin [seqlen_ro, rotary_dim / 2] (q rotated
    at seqlens_k positions), cu_seqlens_k_new [Bq + 1] int32 (tokens appended per sequence, added to seqlens_k):
    flash_attn_with_kvcache's arguments (kernels/triton/attn_fwd.py).
    pdl: a split launch lets launch_combine(..., pdl=True) start as its programmatic dependent (sm_90 only).
    after_prior: launched as a programmatic dependent of the kernel before it on the stream (sm_90 only): its
    programs start during that kernel's tail and wait for it to finish before reading anything.
    counters: int32 zeros [>= grid axis 0] (direct.COUNTERS): a split launch merges its own splits (no
    launch_combine; the learnable_sink goes into that merge).
    k_new, v_new [Bq, Snew, Hkv, D] (equal strides) or None: appended at cache_seqlens (seqlens_k) by the attention
    programs themselves (16-bit caches, or FP8 caches quantizing them with k_scale / v_scale; pack-GQA decode of
    one M tile; seqlen_k_add = Snew): no launch_kv_append.
    FP8 attention: q4, k4, v4 in float8_e4m3fn, q_scale / k_scale / v_scale FA3's descales (fp32 [B, Hkv], any
    strides, or None for 1); out4 in bf16 or fp16. A cache's k_scale / v_scale (fp32 [1] or [Hkv]) otherwise.
    rng: attention dropout's int64 seed tensor [1] (dropout_p in (0, 1); prefill tiles only: no split or pack-GQA),
    or None.
    vt_gap > 0: v4 is FP8 attention's V^T [Hkv, D, width] (tensors.launch_values_t of a contiguous or packed v, not
    paged, vt_gap columns per sequence: tensors.values_t_column); 0: v4 as stored.
    """
    dev = q4.device
    hq, d = q4.shape[2], q4.shape[3]  # q's head dim (an NVFP4 cache stores d / 2 bytes per head)
    dv = out4.shape[3]
    hkv = k4.shape[2]
    group = hq // hkv
    heads_prog = hkv if pack_gqa else hq
    m_tiles = _utils.cdiv(max(m_rows, 1), config.block_m)
    dummy = unused_pointer(dev)
    paged = block_table is not None
    split = num_splits > 1
    nvfp4 = k_block_scale is not None
    grid = (m_tiles * num_batches * heads_prog, num_splits)
    kv_nvfp4 = 0
    if nvfp4:  # int32 scale words need 4-byte aligned scale rows (d >= 64 is a whole number of words per row)
        aligned = d >= 64 and all(_utils.words_aligned(t, 3) for t in (k_block_scale, v_block_scale))
        kv_nvfp4 = NVFP4_SCALE_WORDS if aligned else NVFP4_SCALE_BYTES
        if not sm90_target():
            kv_nvfp4 += NVFP4_PURE_ASM
    elif k4.dtype == torch.float8_e4m3fn and not sm90_target():
        kv_nvfp4 = NVFP4_PURE_ASM  # an e4m3 cache widened by Triton's cast (inner._pin_widening)
    descs = None
    rows = k4.shape[0] * k4.shape[1]
    fp8_mode = FP8_V_T if vt_gap else FP8_V_ROWS
    # (a left pad moves a paged cache's keys off the page boundaries that descriptor boxes keep to)
    if tma_tiles(config, k4.shape[1] if paged else 0, nvfp4) and not (paged and cache_leftpad is not None):
        if vt_gap:  # every sequence's V^T columns start 16-byte aligned (tensors.values_t_column)
            k_desc = row_descriptors((k4,), rows, config.block_n)
            v_desc = values_t_descriptor(v4, v4.shape[2], config.block_n)
            descs = k_desc and (*k_desc, v_desc if v_desc is not None else v4)
            if descs and v_desc is not None:  # zeros through each sequence's last block: no V^T mask there
                fp8_mode = FP8_V_T_ZEROS if vt_gap >= config.block_n + 14 else FP8_V_T_DESC
        else:
            descs = row_descriptors((k4, v4), rows, config.block_n)
    k_arg, v_arg = descs if descs else (k4, v4)
    fp8, scale_args = _scale_args(q4, k_scale, v_scale, q_scale, dummy)
    fused = split and counters is not None
    merge_rows, merge_splits = merge_tiles(min(config.block_m, m_rows), padded_head_dim(dv, fp8)) if fused else (1, 1)
    # V^T's strides as the kernel takes them: none per batch (tensors.values_t_column), D's, the head's (attn_fwd.py)
    v_strides = (0, v4.stride(1), v4.stride(0)) if vt_gap else \
        strides3(v4, k_batch_stride0)
    return direct.launch(
        attn_fwd_kernel, grid,
        q4, k_arg, v_arg, out4, lse3,
        o_part if split else dummy, lse_part if split else dummy, counters if fused else dummy,
        cu_seqlens_q if cu_seqlens_q is not None else dummy,
        cu_seqlens_k if cu_seqlens_k is not None else dummy,
        seqlens_k if seqlens_k is not None else dummy,
        block_table if paged else dummy,
        *scale_args,
        cache_batch_idx if cache_batch_idx is not None else dummy,
        cache_leftpad if cache_leftpad is not None else dummy,
        *rotary_args(rotary_cos, rotary_sin, dummy), cu_seqlens_k_new if cu_seqlens_k_new is not None else dummy,
        *((as_bytes(k_block_scale), as_bytes(v_block_scale), *k_block_scale.stride()[:3]) if nvfp4
          else (dummy, dummy, 0, 0, 0)),
        *strides3(q4, q_batch_stride0), *strides3(k4, k_batch_stride0), *v_strides,
        *strides3(out4, q_batch_stride0), *strides3(lse3, q_batch_stride0),
        block_table.stride(0) if paged else 0,
        seqlen_q, seqlen_k, seqlen_k_add, 0 if k_batch_stride0 else k4.shape[1],
        hq, group, m_tiles, num_batches * seqlen_q * hq,
        softmax_scale, mask.softcap, mask.window_left, mask.window_right, *alibi_args(alibi_slopes, dummy),
        learnable_sink if learnable_sink is not None else dummy,
        *((qv, *strides3(qv, q_batch_stride0)) if qv is not None else (dummy, 0, 0, 0)),
        *((k_new, v_new, *_raw_caches(k4, v4), *k_new.stride()[:3]) if k_new is not None
          else (dummy,) * 4 + (0, 0, 0)),
        *dropout_args(rng, dropout_p, dummy), mask.chunk,
        HEAD_DIM=d, HEAD_DIM_PAD=padded_head_dim(d, fp8), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        VARLEN_Q=cu_seqlens_q is not None, VARLEN_K=cu_seqlens_k is not None, HAS_SEQLENS_K=seqlens_k is not None,
        PAGE_SIZE=k4.shape[1] if paged else 0, KV_SCALED=fp8 or k_scale is not None, KV_NVFP4=kv_nvfp4,
        PACK_GQA=pack_gqa, SPLIT=split,
        HAS_LEFT=mask.window_left >= 0, HAS_RIGHT=mask.window_right >= 0, SOFTCAP=mask.softcap > 0.0,
        USE_DESC=descs is not None, SP_OVERLAP=sp_overlap,
        TILE_DTYPE=_utils.tile_dtype(q4.dtype if fp8 or k_scale is None else torch.float16),
        # 8-bit caches' K tiles through TMA feed the transposed products' register operand (inner.TRANS_PERM_K)
        TRANS=TRANS_PERM_K if config.trans and descs and k4.element_size() == 1 and not fp8 else config.trans,
        RAW_SCORES=softmax_scale > 0 and mask.softcap == 0.0 and (fp8 or k_scale is None) and alibi_slopes is None,
        ALIBI=alibi_slopes is not None, HAS_KV_BATCH=cache_batch_idx is not None,
        LEFTPAD_K=cache_leftpad is not None, ROTARY_DIM=2 * rotary_cos.shape[1] if rotary_cos is not None else 0,
        ROTARY_INTERLEAVED=bool(rotary_interleaved), ROTARY_PER_TOKEN=bool(rotary_per_token),
        VARLEN_K_NEW=cu_seqlens_k_new is not None, PDL=pdl and split and not fused and sm90_target(),
        HAS_SINK=learnable_sink is not None, HEAD_DIM_V=dv, HEAD_DIM_V_PAD=padded_head_dim(dv, fp8),
        HAS_QV=qv is not None,
        QKV_FP8=fp8_mode if fp8 else 0, FUSED_COMBINE=fused, MERGE_ROWS=merge_rows, MERGE_SPLITS=merge_splits,
        APPEND_NEW=_utils.next_pow2(k_new.shape[1]) if k_new is not None else 0, VT_GAP=vt_gap,
        # masked blocks' boxes kept inside each sequence (no V mask): contiguous descriptors, calls without new keys
        # (appended in this launch they could be another program's; appended before, the call's result stays the
        # in-launch append's bit for bit)
        BOX_IN_SEQ=descs is not None and not paged and not seqlen_k_add and cu_seqlens_k_new is None and not vt_gap
        and rng is None and qv is None, DROPOUT=rng is not None, CHUNK=mask.chunk > 0,
        AFTER_PRIOR=after_prior, num_warps=config.num_warps, num_stages=config.num_stages,
        **({"launch_pdl": True} if after_prior else {}),
    )


def _raw_caches(k4, v4) -> tuple:
    """The caches the in-launch append writes: FP8 ones as their bytes (it stores e4m3 bit patterns)."""
    if k4.dtype == torch.float8_e4m3fn:
        return as_bytes(k4), as_bytes(v4)
    return k4, v4


def _scale_args(q4, k_scale, v_scale, q_scale, dummy) -> tuple:
    """(fp8, the kernel's scale pointers and strides): FP8 attention (e4m3 q) with descales or ones, a quantized
    cache's scales, or none."""
    fp8 = q4.dtype == torch.float8_e4m3fn
    if fp8:
        one = unit_scale(q4.device)
        ptrs = tuple(t if t is not None else one for t in (q_scale, k_scale, v_scale))
    else:
        ptrs = (dummy, k_scale if k_scale is not None else dummy, v_scale if v_scale is not None else dummy)
    strides = (scale_strides(t, fp8) for t in (q_scale, k_scale, v_scale))
    return fp8, (*ptrs, *(st for pair in strides for st in pair))


def launch_decode_quant(q4, k4, v4, out4, lse3, *, seqlen_k: int, seqlens_k, seqlen_k_add: int, block_table,
                        softmax_scale: float, mask: Mask, config, num_splits: int, o_part, lse_part, k_scale, v_scale,
                        k_block_scale, v_block_scale, pdl: bool = False) -> None:
    """The register-operand decode over an NVFP4 cache (k_block_scale / v_block_scale: e4m3 block scales, k_scale /
    v_scale: the fp32 [1] global scales); shapes as launch_attn_fwd's (seqlen_k: the cache capacity per sequence),
    the call accepted by plan.decode.quant_mma_config."""
    b, sq, hq, d = q4.shape
    hkv = k4.shape[2]
    paged = block_table is not None
    dummy = unused_pointer(q4.device)
    split = num_splits > 1
    direct.launch(
        decode_mma.decode_quant_kernel, (b * hkv, num_splits),
        q4, k4, v4, as_bytes(k_block_scale), as_bytes(v_block_scale), k_scale, v_scale, out4, lse3,
        o_part if split else dummy, lse_part if split else dummy, seqlens_k, block_table if paged else dummy,
        q4.stride(0), q4.stride(1), q4.stride(2), *k4.stride()[:3], *k_block_scale.stride()[:3],
        out4.stride(0), out4.stride(1), out4.stride(2), *lse3.stride(), block_table.stride(0) if paged else 0,
        sq, seqlen_k, seqlen_k_add, hkv, hq // hkv, b * sq * hq,
        softmax_scale, mask.softcap, mask.window_left, mask.window_right,
        D=d, BN=config.block_n, WARPS=config.num_warps,
        PAGE_SHIFT=k4.shape[1].bit_length() - 1 if paged else -1,
        HAS_LEFT=mask.window_left >= 0, HAS_RIGHT=mask.window_right >= 0, SOFTCAP=mask.softcap > 0.0, SPLIT=split,
        PV_T=sq * (hq // hkv) <= 8, PDL=pdl and split,
        num_warps=config.num_warps,
    )


def launch_attn_fwd_ws(q4, k4, v4, out4, lse3, *, causal: bool, softmax_scale: float, config: WsFwdConfig,
                       cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                       max_seqlen_q: int = 0, learnable_sink: torch.Tensor | None = None, vt=None, vt_gap: int = 0,
                       q_scale=None, k_scale=None, v_scale=None) -> None:
    """q4 [B, Sq, Hq, D], k4 [B, Sk, Hkv, D], v4 [B, Sk, Hkv, Dv], out4 [B, Sq, Hq, Dv], lse3 [B, Hq, Sq]
    contiguous float32 (see ws_forward_config); learnable_sink fp32 [Hq] or None. Varlen (cu_seqlens_q/k int32
    [num_seqs + 1]): q4, k4, v4, out4 [1, total, H, D] and lse3 [1, Hq, total_q]. FP8 attention (e4m3 q4, k4):
    vt the V^T buffer launch_values_t filled (vt_gap columns per sequence), FA3's descales q/k/v_scale fp32
    [B, Hkv] or None (1); out4 16-bit."""
    varlen = cu_seqlens_q is not None
    b, sq, hq, d = q4.shape
    m_tiles = gluon_fwd.m_tiles(max_seqlen_q if varlen else sq)
    if varlen:
        b = cu_seqlens_q.shape[0] - 1
    num_units = gluon_fwd.units(m_tiles, b * hq)
    grid = min(num_units, _utils.num_sms(q4.device)) if config.persistent else m_tiles * b * hq
    rows, bn = gluon_fwd.ROWS_PER_WARPGROUP, config.block_n
    main, tail = split_head_dim(d)
    fp8, scale_args = _scale_args(q4, k_scale, v_scale, q_scale, lse3)
    direct.launch(
        gluon_fwd.attn_fwd_ws_kernel, (grid,),
        desc_4d(q4, rows, main), desc_4d(q4, rows, tail) if tail else None, desc_4d(k4, bn, main),
        desc_4d(k4, bn, tail) if tail else None, values_t_gluon_desc(vt, bn) if fp8 else desc_4d(v4, bn),
        desc_4d(out4, rows), out4,
        lse3, cu_seqlens_q if varlen else lse3, cu_seqlens_k if varlen else lse3, sq, k4.shape[1], m_tiles, hq,
        hq // k4.shape[2], num_units, 0 if varlen else out4.stride(0), out4.stride(1), out4.stride(2),
        0 if varlen else lse3.stride(0), lse3.stride(1), softmax_scale * math.log2(math.e),
        learnable_sink if learnable_sink is not None else lse3, *scale_args, vt_gap, CAUSAL=causal,
        HEAD_DIM=main, TAIL=tail, HEAD_DIM_V=out4.shape[3], BLOCK_N=bn, K_STAGES=config.k_stages,
        V_STAGES=config.v_stages, Q_BUFS=config.q_bufs if config.persistent else 1, PERSISTENT=config.persistent,
        VARLEN=varlen, HAS_SINK=learnable_sink is not None, FP8=fp8, num_warps=4)


def launch_mla_decode(q, qv, k_cache, v_cache, out, lse, *, seqlens_k, seqlen_k_add: int, block_table,
                      softmax_scale: float, causal: bool, config, o_part=None, lse_part=None, k_scale=None,
                      v_scale=None, after_prior: bool = False) -> None:
    """The Gluon MLA decode (plan.decode.mla_gluon_config accepted the call): q [B, Sq, H, 64], qv [B, Sq, H, 512],
    k_cache [.., 1, 64] and v_cache [.., 1, 512] contiguous ([B, S, 1, D]) or paged ([pages, page, 1, D] with
    block_table [B, max_pages]); out [B, Sq, H, 512] and lse [B, H, Sq], or with o_part / lse_part the split
    partials ([splits, B * Sq * H, 512] and [splits, B * Sq * H] fp32) for attn_combine. e4m3 caches (the narrow
    kernel): their fp32 scales k_scale / v_scale [1] (absent: 1). after_prior: as launch_attn_fwd's."""
    b, sq, hq, _ = q.shape
    bn = config.block_n
    page = k_cache.shape[1] if block_table is not None else 0
    chunk = min(bn, page) if page else bn
    descs = [rows_desc(t, chunk, w, bn) for t, w in ((k_cache, mla_decode.ROPE_DIM), (v_cache, mla_decode.HALF_DIM))]
    narrow = config.narrow
    m_tiles = _utils.cdiv(sq * hq, config.rows)
    split = o_part is not None
    dummy = unused_pointer(q.device)
    extra, constexprs = (), {}
    if narrow:
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        extra = tuple(t if t is not None else unit_scale(q.device) for t in (k_scale, v_scale)) if fp8 else (dummy,) * 2
        constexprs = {"ROWS": config.rows, "FP8": fp8, "AHEAD": config.ahead and fp8}
    direct.launch(
        mla_decode_narrow.mla_decode_narrow_kernel if narrow else mla_decode.mla_decode_kernel,
        (m_tiles * b, o_part.shape[0] if split else 1),
        q, qv, *descs, out, lse, o_part if split else dummy, lse_part if split else dummy, seqlens_k,
        block_table if page else dummy, block_table.stride(0) if page else 0,
        block_table.shape[1] if page else 1, k_cache.shape[1], seqlen_k_add, sq, m_tiles, hq, b * sq * hq,
        *q.stride()[:3], *qv.stride()[:3], *out.stride()[:3], *lse.stride(), softmax_scale * math.log2(math.e),
        *extra, BN=bn, STAGES=config.stages, PAGE=page, CAUSAL=causal, SPLIT=split, AFTER_PRIOR=after_prior,
        num_warps=4, **constexprs, **({"launch_pdl": True} if after_prior else {}))


def launch_combine(o_part, lse_part, out4, lse3, pdl: bool = False, learnable_sink=None,
                   let_next: bool = False) -> None:
    """Merge split partials o_part [splits, B*Sq*Hq, D], lse_part [splits, B*Sq*Hq] into out4 / lse3, with the
    sink (fp32 [Hq] or None) added once per row, not per split. pdl (taken on
    sm_90 only): launch it as a programmatic dependent of the kernel before it on the stream, so its launch
    overlaps that kernel's tail (the split decode kernels allow it once all their programs have started).
    let_next (the planner's, sm_90 only: plan.decode.decode_after_prior): a programmatic dependent launched after it
    may start once all its programs have."""
    num_splits, num_rows, d = o_part.shape
    b, sq, hq, _ = out4.shape
    split_chunk, d_chunk = combine_tiles(num_splits, padded_head_dim(d))
    pdl = pdl and sm90_target()
    direct.launch(
        attn_combine_kernel, (num_rows, _utils.cdiv(d, d_chunk)),
        o_part, lse_part, out4, lse3, num_splits, sq, hq, num_rows,
        out4.stride(0), out4.stride(1), out4.stride(2), lse3.stride(0), lse3.stride(1), lse3.stride(2),
        learnable_sink if learnable_sink is not None else lse_part,
        HEAD_DIM=d, D_CHUNK=d_chunk, SPLIT_CHUNK=split_chunk, INTERPRETED=_utils.is_interpreter(), PDL=pdl,
        HAS_SINK=learnable_sink is not None, LET_NEXT=let_next, num_warps=4, **({"launch_pdl": True} if pdl else {}),
    )


def launch_merge(oa4, la3, ob4, lb3, out4, lse3) -> None:
    """All outputs [B, S, H, D], all LSEs [B, H, S] (any strides, last dim of outputs contiguous)."""
    b, s, h, d = out4.shape
    num_rows = b * s * h
    grid = (_utils.cdiv(num_rows, COMBINE_BLOCK_ROWS),)
    direct.launch(
        merge_states_kernel, grid,
        oa4, la3, ob4, lb3, out4, lse3, s, h, num_rows,
        oa4.stride(0), oa4.stride(1), oa4.stride(2), la3.stride(0), la3.stride(1), la3.stride(2),
        ob4.stride(0), ob4.stride(1), ob4.stride(2), lb3.stride(0), lb3.stride(1), lb3.stride(2),
        out4.stride(0), out4.stride(1), out4.stride(2), lse3.stride(0), lse3.stride(1), lse3.stride(2),
        HEAD_DIM=d, HEAD_DIM_PAD=padded_head_dim(d), BLOCK_R=COMBINE_BLOCK_ROWS, INTERPRETED=_utils.is_interpreter(),
        num_warps=4,
    )


def launch_kv_append(k_new, v_new, k_cache, v_cache, cache_seqlens, block_table, k_scale=None, v_scale=None,
                     k_block_scale=None, v_block_scale=None, cache_batch_idx=None, rotary_cos=None, rotary_sin=None,
                     rotary_interleaved: bool = False, cu_seqlens_k_new=None) -> None:
    """Write new tokens k_new/v_new [B, Snew, Hkv, D] (packed [total_new, Hkv, D] with cu_seqlens_k_new) into the
    cache (row cache_batch_idx[b] of a contiguous cache when given), k rotated first when rotary_cos/rotary_sin
    [seqlen_ro, rotary_dim / 2] are given. FP8 caches (k_scale/v_scale per tensor or KV head) and NVFP4 caches
    (uint8 data, e4m3 block scales, k_scale/v_scale = global scales) quantize them in the kernel."""
    varlen = cu_seqlens_k_new is not None
    if varlen:  # one packed sequence of tokens, each program finding its own sequence
        k_new, v_new = (direct.derived(t.unsqueeze(0), t) for t in (k_new, v_new))
    b, s_new, hkv, d = k_new.shape
    dv = v_new.shape[3]
    batches = cache_seqlens.shape[0]
    paged = block_table is not None
    dummy = unused_pointer(k_new.device)
    nvfp4 = k_block_scale is not None
    fmt = 2 if nvfp4 else (1 if k_scale is not None else 0)
    if fmt == 1:  # the kernel writes e4m3 bit patterns (see kv_append.e4m3_bits)
        k_cache, v_cache = as_bytes(k_cache), as_bytes(v_cache)
    bs_strides = k_block_scale.stride()[:3] if nvfp4 else (0, 0, 0)
    rotary = rotary_cos is not None
    direct.launch(
        kv_append_kernel, (b * s_new,),  # varlen: b = 1, s_new = total_new
        k_new, v_new, k_cache, v_cache,
        as_bytes(k_block_scale) if nvfp4 else dummy, as_bytes(v_block_scale) if nvfp4 else dummy,
        k_scale if k_scale is not None else dummy, v_scale if v_scale is not None else dummy,
        cache_seqlens, block_table if paged else dummy, cache_batch_idx if cache_batch_idx is not None else dummy,
        *rotary_args(rotary_cos, rotary_sin, dummy), cu_seqlens_k_new if varlen else dummy, batches,
        1 if fmt == 1 and k_scale.numel() > 1 else 0,
        k_new.stride(0), k_new.stride(1), k_new.stride(2), v_new.stride(0), v_new.stride(1), v_new.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), *bs_strides, block_table.stride(0) if paged else 0, s_new,
        k_cache.shape[1] if paged else 1, hkv, cache_capacity(k_cache, block_table),
        HEAD_DIM=d, HEAD_DIM_PAD=padded_head_dim(d), HEADS_PAD=_utils.next_pow2(hkv), PAGED=paged, FORMAT=fmt,
        HAS_KV_BATCH=cache_batch_idx is not None, ROTARY_DIM=2 * rotary_cos.shape[1] if rotary else 0,
        INTERLEAVED=bool(rotary_interleaved), INTERPRETED=_utils.is_interpreter(), VARLEN_NEW=varlen,
        BATCH_PAD=_utils.next_pow2(batches) if varlen else 1, HEAD_DIM_V=dv, HEAD_DIM_V_PAD=padded_head_dim(dv),
        num_warps=4,
    )
