"""Launchers: turn torch tensors into the kernels' pointer/stride arguments. No input checking here (the public
functions check before calling), no allocation whose size depends on tensor values (CUDA-graph safe)."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from .. import _utils, heuristics
from . import direct
from ..heuristics import WsFwdConfig, combine_tiles, fwd_ws_config, padded_head_dim
from ..kernels import attn_fwd_ws, decode_quant_mma
from ..kernels.attn_combine import attn_combine_kernel, merge_states_kernel
from ..kernels.attn_fwd import attn_fwd_kernel
from ..kernels.kv_append import kv_append_kernel
from ..kernels.quant import NVFP4_PURE_ASM, NVFP4_SCALE_BYTES, NVFP4_SCALE_WORDS
from triton.tools.tensor_descriptor import TensorDescriptor

COMBINE_BLOCK_ROWS = 16


@dataclass(frozen=True)
class Mask:
    """Normalised masking: causal is a right window of 0; -1 is unbounded."""
    window_left: int
    window_right: int
    softcap: float

    @staticmethod
    def make(causal: bool, window_size, softcap: float) -> "Mask":
        left, right = window_size
        if causal:
            right = 0
        return Mask(left, right, float(softcap))


@functools.lru_cache(maxsize=None)
def _dummy(device) -> torch.Tensor:
    """The stand-in for pointer arguments a launch does not use (never read or written): one per device, since an
    allocation per launch is a measurable part of an eager decode call's host time."""
    return direct.constant(torch.empty(1, dtype=torch.int32, device=device))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """t's bytes (FP8 / e4m3 tensors are read and written as uint8 bit patterns)."""
    return direct.derived(t.view(torch.uint8), t)


def _strides3(t: torch.Tensor, batch_stride0: bool) -> tuple[int, int, int]:
    """The first three strides, the batch's as 0 where one tensor is shared by every batch (varlen)."""
    s = t.stride()
    return (0 if batch_stride0 else s[0]), s[1], s[2]


def tma_tiles(config, page_size: int, nvfp4: bool) -> bool:
    """Whether K/V tiles are asked for through TMA descriptors (row_descriptors may still decline the layout):
    NVFP4 tiles are decoded from bytes, not loaded as values, and a paged tile must lie inside one page (page_size
    0: a contiguous cache). Otherwise K/V rows are gathered by pointers."""
    return config.tma and not nvfp4 and (page_size == 0 or page_size % config.block_n == 0)


def _tma_aligned(t: torch.Tensor, dims) -> bool:
    """TMA's layout rules for a [B, S, H, D] tensor whose dims `dims` a descriptor spans by stride: a 16-byte
    aligned base, those strides multiples of 16 bytes, and D contiguous."""
    es = t.element_size()
    return t.data_ptr() % 16 == 0 and t.stride(3) == 1 and all((t.stride(i) * es) % 16 == 0 for i in dims)


def row_descriptors(tensors, rows: int, block_rows: int):
    """TMA descriptors over [B, S, H, D] tensors viewed as [rows, H, D] (batch and sequence merged), blocks of
    block_rows rows of one head, or None when the layout does not allow it: merged dims need stride(0) == S *
    stride(1), and TMA needs 16-byte aligned bases and strides. Only for head dims that are powers of two, so a
    tile never reaches past D, and for at least one row (a descriptor's dims must be positive; an empty tensor,
    e.g. Sk = 0, takes the pointer path). The forward reads K/V through them (paged: a pool [pages, page_size, ...]
    viewed as pages x page_size rows), the backward Q/dO."""
    if not 0 < rows < 2 ** 31:  # TMA coordinates are int32
        return None
    descs = []
    for t in tensors:
        d = t.shape[3]
        if d != padded_head_dim(d) or d > 256:  # a TMA box spans at most 256 elements per dimension
            return None
        mergeable = t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1)
        if not (mergeable and _tma_aligned(t, dims=(1, 2))):
            return None
        desc = TensorDescriptor(t, [rows, t.shape[2], d], [t.stride(1), t.stride(2), 1], [block_rows, 1, d])
        descs.append(direct.derived(desc, t))
    return descs


def alibi_args(alibi_slopes, dummy) -> tuple:
    """(slopes, batch stride) for a kernel's alibi_ptr, stride_alibi_b: [Hq] slopes are every batch's (stride 0);
    without ALiBi the dummy, never read."""
    if alibi_slopes is None:
        return dummy, 0
    return alibi_slopes, alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0


def launch_attn_fwd(q4, k4, v4, out4, lse3, *, q_batch_stride0: bool, k_batch_stride0: bool, num_batches: int,
                    seqlen_q: int, seqlen_k: int, m_rows: int, softmax_scale: float, mask: Mask, config,
                    cu_seqlens_q=None, cu_seqlens_k=None, seqlens_k=None, seqlen_k_add: int = 0,
                    block_table=None, pack_gqa: bool = False, num_splits: int = 1, sp_overlap: bool = False,
                    o_part=None, lse_part=None, k_scale=None, v_scale=None, k_block_scale=None, v_block_scale=None,
                    pdl: bool = False, alibi_slopes=None, cache_batch_idx=None, cache_leftpad=None, rotary_cos=None,
                    rotary_sin=None, rotary_interleaved: bool = False, rotary_per_token: bool = False,
                    cu_seqlens_k_new=None, learnable_sink=None, qv=None):
    """q4 [Bq, Sq, Hq, D]; k4/v4 [Bk, Sk, Hkv, D] (paged: [pages, page_size, Hkv, D]); out4 [Bq, Sq, Hq, Dv] (Dv:
    v4's head dim); lse3 [Bq, Hq, Sq]. qv [Bq, Sq, Hq, Dv] or None: MLA's latent queries (scores add qv v^T).
    alibi_slopes: fp32 [Hq] or [num_batches, Hq] (checked by the public functions), or None.
    learnable_sink: fp32 [Hq] or None; a split launch leaves it out of its partials (launch_combine adds it).

    m_rows: rows per (batch, head program) = max query tokens (x group size when packing).
    cache_batch_idx / cache_leftpad [Bq] int32, rotary_cos / rotary_sin [seqlen_ro, rotary_dim / 2] (q rotated
    at seqlens_k positions), cu_seqlens_k_new [Bq + 1] int32 (tokens appended per sequence, added to seqlens_k):
    flash_attn_with_kvcache's arguments (kernels/attn_fwd.py).
    pdl: a split launch lets launch_combine(..., pdl=True) start as its programmatic dependent (sm_90 only).
    """
    dev = q4.device
    hq, d = q4.shape[2], q4.shape[3]  # q's head dim (an NVFP4 cache stores d / 2 bytes per head)
    dv = out4.shape[3]
    hkv = k4.shape[2]
    group = hq // hkv
    heads_prog = hkv if pack_gqa else hq
    m_tiles = _utils.cdiv(max(m_rows, 1), config.block_m)
    dummy = _dummy(dev)
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
    descs = None
    if tma_tiles(config, k4.shape[1] if paged else 0, nvfp4):
        descs = row_descriptors((k4, v4), k4.shape[0] * k4.shape[1], config.block_n)
    k_arg, v_arg = descs if descs else (k4, v4)
    return direct.launch(
        attn_fwd_kernel, grid,
        q4, k_arg, v_arg, out4, lse3,
        o_part if split else dummy, lse_part if split else dummy,
        cu_seqlens_q if cu_seqlens_q is not None else dummy,
        cu_seqlens_k if cu_seqlens_k is not None else dummy,
        seqlens_k if seqlens_k is not None else dummy,
        block_table if paged else dummy,
        k_scale if k_scale is not None else dummy, v_scale if v_scale is not None else dummy,
        1 if k_scale is not None and k_scale.numel() > 1 else 0,
        cache_batch_idx if cache_batch_idx is not None else dummy,
        cache_leftpad if cache_leftpad is not None else dummy,
        *_rotary_args(rotary_cos, rotary_sin, dummy), cu_seqlens_k_new if cu_seqlens_k_new is not None else dummy,
        *((_bytes(k_block_scale), _bytes(v_block_scale), *k_block_scale.stride()[:3]) if nvfp4
          else (dummy, dummy, 0, 0, 0)),
        *_strides3(q4, q_batch_stride0), *_strides3(k4, k_batch_stride0), *_strides3(v4, k_batch_stride0),
        *_strides3(out4, q_batch_stride0), *_strides3(lse3, q_batch_stride0),
        block_table.stride(0) if paged else 0,
        seqlen_q, seqlen_k, seqlen_k_add, 0 if k_batch_stride0 else k4.shape[1],
        hq, group, m_tiles, num_batches * seqlen_q * hq,
        softmax_scale, mask.softcap, mask.window_left, mask.window_right, *alibi_args(alibi_slopes, dummy),
        learnable_sink if learnable_sink is not None else dummy,
        *((qv, *_strides3(qv, q_batch_stride0)) if qv is not None else (dummy, 0, 0, 0)),
        HEAD_DIM=d, HEAD_DIM_PAD=padded_head_dim(d), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        VARLEN_Q=cu_seqlens_q is not None, VARLEN_K=cu_seqlens_k is not None, HAS_SEQLENS_K=seqlens_k is not None,
        PAGE_SIZE=k4.shape[1] if paged else 0, KV_SCALED=k_scale is not None, KV_NVFP4=kv_nvfp4, PACK_GQA=pack_gqa,
        SPLIT=split,
        HAS_LEFT=mask.window_left >= 0, HAS_RIGHT=mask.window_right >= 0, SOFTCAP=mask.softcap > 0.0,
        USE_DESC=descs is not None, SP_OVERLAP=sp_overlap,
        TILE_DTYPE=_utils.tile_dtype(torch.float16 if k_scale is not None else q4.dtype),
        TRANS=config.trans,
        RAW_SCORES=softmax_scale > 0 and mask.softcap == 0.0 and k_scale is None and alibi_slopes is None,
        ALIBI=alibi_slopes is not None, HAS_KV_BATCH=cache_batch_idx is not None,
        LEFTPAD_K=cache_leftpad is not None, ROTARY_DIM=2 * rotary_cos.shape[1] if rotary_cos is not None else 0,
        ROTARY_INTERLEAVED=bool(rotary_interleaved), ROTARY_PER_TOKEN=bool(rotary_per_token),
        VARLEN_K_NEW=cu_seqlens_k_new is not None, PDL=pdl and split and sm90_target(),
        HAS_SINK=learnable_sink is not None, HEAD_DIM_V=dv, HEAD_DIM_V_PAD=padded_head_dim(dv), HAS_QV=qv is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def launch_decode_quant(q4, k4, v4, out4, lse3, *, seqlen_k: int, seqlens_k, seqlen_k_add: int, block_table,
                        softmax_scale: float, mask: Mask, config, num_splits: int, o_part, lse_part, k_scale, v_scale,
                        k_block_scale=None, v_block_scale=None, pdl: bool = False) -> None:
    """The register-operand decode over an FP8 (k_scale/v_scale per tensor or KV head) or NVFP4 (block scales,
    k_scale/v_scale = global scales) cache; shapes as launch_attn_fwd's (seqlen_k: the cache capacity per
    sequence), the call accepted by ops.decode._quant_mma_config."""
    b, sq, hq, d = q4.shape
    hkv = k4.shape[2]
    paged = block_table is not None
    nvfp4 = k_block_scale is not None
    dummy = _dummy(q4.device)
    split = num_splits > 1
    cache = (k4, v4) if nvfp4 else (_bytes(k4), _bytes(v4))
    scales = (_bytes(k_block_scale), _bytes(v_block_scale)) if nvfp4 else (dummy, dummy)
    s_strides = k_block_scale.stride()[:3] if nvfp4 else (0, 0, 0)
    direct.launch(
        decode_quant_mma.decode_quant_kernel, (b * hkv, num_splits),
        q4, *cache, *scales, k_scale, v_scale, out4, lse3,
        o_part if split else dummy, lse_part if split else dummy, seqlens_k, block_table if paged else dummy,
        q4.stride(0), q4.stride(1), q4.stride(2), *k4.stride()[:3], *s_strides,
        out4.stride(0), out4.stride(1), out4.stride(2), *lse3.stride(), block_table.stride(0) if paged else 0,
        1 if k_scale.numel() > 1 else 0,
        sq, seqlen_k, seqlen_k_add, hkv, hq // hkv, b * sq * hq,
        softmax_scale, mask.softcap, mask.window_left, mask.window_right,
        D=d, FMT=2 if nvfp4 else 1, BN=config.block_n, WARPS=config.num_warps,
        PAGE_SHIFT=k4.shape[1].bit_length() - 1 if paged else -1,
        HAS_LEFT=mask.window_left >= 0, HAS_RIGHT=mask.window_right >= 0, SOFTCAP=mask.softcap > 0.0, SPLIT=split,
        PV_T=sq * (hq // hkv) <= 8, PDL=pdl and split,
        num_warps=config.num_warps,
    )


def target_arch() -> int | None:
    """The CUDA compute capability kernels compile for (80, 90, 100, 120, ...), from Triton's active target, not
    torch's device, so the CPU compile check (tests/sm90_compile_check.py --arch) takes the same paths as that GPU;
    None in the interpreter or without a CUDA driver."""
    if _utils.is_interpreter():
        return None
    try:
        import triton

        target = triton.runtime.driver.active.get_current_target()
    except Exception:  # no usable GPU driver
        return None
    return target.arch if target.backend == "cuda" else None


def sm90_target() -> bool:
    """Whether kernels compile for sm_90 (H100/H200), where the Gluon kernels run."""
    return target_arch() == 90


def _tma_4d_ok(t: torch.Tensor) -> bool:
    """A [B, S, H, D] tensor a 4-D TMA descriptor can address: aligned, and every dim in TMA's positive int32 range."""
    return _tma_aligned(t, dims=(0, 1, 2)) and all(0 < n < 2 ** 31 for n in t.shape)


def ws_call_ok(dtype: torch.dtype, mask: Mask, alibi: bool) -> bool:
    """What both warp-specialised Gluon kernels (forward and dK/dV) need of a call beyond shapes and layouts: a
    16-bit dtype, at most a causal mask (no left window, no softcap), no ALiBi (they have no bias) and an sm_90
    target. A learnable sink is fine: the forward folds it in, the dK/dV kernel sees it only through the lse (the
    preprocess adds d sink)."""
    plain_mask = mask.window_left < 0 and mask.window_right in (-1, 0) and mask.softcap == 0.0
    return plain_mask and not alibi and dtype in (torch.float16, torch.bfloat16) and sm90_target()


def ws_forward_config(q4, k4, v4, out4, softmax_scale: float, mask: Mask, max_seqlen_k: int | None = None,
                      alibi: bool = False) -> WsFwdConfig | None:
    """The warp-specialised forward's tiles when it serves this call (sm_90, a shape heuristics.fwd_ws_config
    takes, at most a causal mask, no ALiBi, a positive scale, TMA-addressable tensors), else None (the Triton
    kernel). max_seqlen_k: given for varlen batches (packed [1, total, H, D] tensors), which take one CTA per tile."""
    if max_seqlen_k is not None and not heuristics.GLUON_VARLEN:
        return None
    if not (softmax_scale > 0 and ws_call_ok(q4.dtype, mask, alibi)):
        return None
    cfg = fwd_ws_config(q4.shape[3], mask.window_right == 0, k4.shape[1] if max_seqlen_k is None else max_seqlen_k)
    if cfg is None or not all(_tma_4d_ok(t) for t in (q4, k4, v4, out4)):
        return None
    return cfg if max_seqlen_k is None else replace(cfg, persistent=False)


_GLUON_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _desc_4d(t: torch.Tensor, block_rows: int, block_cols: int | None = None):
    """A Gluon TMA descriptor over [B, S, H, D] with blocks [1, block_rows, 1, block_cols (default D)]."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    block = [1, block_rows, 1, block_cols or t.shape[3]]
    layout = gl.NVMMASharedLayout.get_default_for(block, getattr(gl, _GLUON_DTYPES[t.dtype]))
    return direct.derived(GluonDescriptor(t, list(t.shape), list(t.stride()), block, layout), t)


def launch_attn_fwd_ws(q4, k4, v4, out4, lse3, *, causal: bool, softmax_scale: float, config: WsFwdConfig,
                       cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                       max_seqlen_q: int = 0, learnable_sink: torch.Tensor | None = None) -> None:
    """q4/out4 [B, Sq, Hq, D], k4/v4 [B, Sk, Hkv, D], lse3 [B, Hq, Sq] contiguous float32 (see ws_forward_config);
    learnable_sink fp32 [Hq] or None. Varlen (cu_seqlens_q/k int32 [num_seqs + 1]): q4, k4, v4, out4 [1, total, H,
    D] and lse3 [1, Hq, total_q]."""
    varlen = cu_seqlens_q is not None
    b, sq, hq, d = q4.shape
    m_tiles = attn_fwd_ws.m_tiles(max_seqlen_q if varlen else sq)
    if varlen:
        b = cu_seqlens_q.shape[0] - 1
    num_units = attn_fwd_ws.units(m_tiles, b * hq)
    grid = min(num_units, _utils.num_sms(q4.device)) if config.persistent else m_tiles * b * hq
    rows = attn_fwd_ws.ROWS_PER_WARPGROUP
    direct.launch(
        attn_fwd_ws.attn_fwd_ws_kernel, (grid,),
        _desc_4d(q4, rows), _desc_4d(k4, config.block_n), _desc_4d(v4, config.block_n), _desc_4d(out4, rows), out4,
        lse3, cu_seqlens_q if varlen else lse3, cu_seqlens_k if varlen else lse3, sq, k4.shape[1], m_tiles, hq,
        hq // k4.shape[2], num_units, 0 if varlen else out4.stride(0), out4.stride(1), out4.stride(2),
        0 if varlen else lse3.stride(0), lse3.stride(1), softmax_scale * math.log2(math.e),
        learnable_sink if learnable_sink is not None else lse3, CAUSAL=causal,
        HEAD_DIM=d, BLOCK_N=config.block_n, K_STAGES=config.k_stages, V_STAGES=config.v_stages,
        PERSISTENT=config.persistent, VARLEN=varlen, HAS_SINK=learnable_sink is not None, num_warps=4)


def launch_combine(o_part, lse_part, out4, lse3, pdl: bool = False, learnable_sink=None) -> None:
    """Merge split partials o_part [splits, B*Sq*Hq, D], lse_part [splits, B*Sq*Hq] into out4 / lse3, with the
    sink (fp32 [Hq] or None) added once per row, not per split. pdl (taken on
    sm_90 only): launch it as a programmatic dependent of the kernel before it on the stream, so its launch
    overlaps that kernel's tail (the split decode kernels allow it once all their programs have started)."""
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
        HAS_SINK=learnable_sink is not None, num_warps=4, **({"launch_pdl": True} if pdl else {}),
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


def cache_capacity(k_cache, block_table) -> int:
    """Tokens a sequence's KV cache holds: its pages (block_table [B, max_pages]), or the contiguous cache's length."""
    return block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]


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
    dummy = _dummy(k_new.device)
    nvfp4 = k_block_scale is not None
    fmt = 2 if nvfp4 else (1 if k_scale is not None else 0)
    if fmt == 1:  # the kernel writes e4m3 bit patterns (see kv_append.e4m3_bits)
        k_cache, v_cache = _bytes(k_cache), _bytes(v_cache)
    bs_strides = k_block_scale.stride()[:3] if nvfp4 else (0, 0, 0)
    rotary = rotary_cos is not None
    direct.launch(
        kv_append_kernel, (b * s_new,),  # varlen: b = 1, s_new = total_new
        k_new, v_new, k_cache, v_cache,
        _bytes(k_block_scale) if nvfp4 else dummy, _bytes(v_block_scale) if nvfp4 else dummy,
        k_scale if k_scale is not None else dummy, v_scale if v_scale is not None else dummy,
        cache_seqlens, block_table if paged else dummy, cache_batch_idx if cache_batch_idx is not None else dummy,
        *_rotary_args(rotary_cos, rotary_sin, dummy), cu_seqlens_k_new if varlen else dummy, batches,
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


def _rotary_args(rotary_cos, rotary_sin, dummy) -> tuple:
    """(cos, sin, row stride, rows) of a rotary table, or stand-ins without one."""
    if rotary_cos is None:
        return dummy, dummy, 0, 1
    return rotary_cos, rotary_sin, rotary_cos.stride(0), rotary_cos.shape[0]
