"""Peer implementations to compare against: attention, and the FP8 GEMM of the low-precision suite.

Each builder returns a zero-argument callable whose output is laid out like tileflash's ([B, S, H, D] for
attention, [M, N] for the GEMM), or None when the peer is not installed or fails on these inputs. Failures are
reported through ``note`` and never raised: a broken peer must not stop a benchmark.
Layout changes of the inputs happen once, outside the returned callable, so they are not timed.
"""

import functools
import importlib

import torch
import torch.nn.functional as F


@functools.cache
def _import(name):
    try:
        return importlib.import_module(name)
    except Exception:  # a broken install raises more than ImportError (OSError, RuntimeError)
        return None


def _first(out):
    # FA4 returns out or (out, lse) depending on its version.
    return out[0] if isinstance(out, tuple) else out


def short_error(e):
    """First line of an exception, with its type: enough for a one-line note."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def _guarded(name, make, note):
    """Build the callable and run it once, so unsupported shapes fail here and not mid-timing."""
    try:
        fn = make()
        fn()
        return fn
    except Exception as e:
        note(f"  note: peer {name} failed: {short_error(e)}")
        return None


def available_peers():
    """Which peers can be tried on this machine: name -> bool."""
    cuda = torch.cuda.is_available()
    return {
        "sdpa_flash": cuda,
        "sdpa_cudnn": cuda and torch.backends.cudnn.is_available(),
        "sdpa": cuda,
        "fa4": cuda and _import("flash_attn.cute") is not None,
        "flashinfer": cuda and _import("flashinfer") is not None,
        "torch_fp8": cuda and torch.cuda.get_device_capability() >= (8, 9),  # cuBLASLt FP8 needs sm89+
    }


def sdpa_prefill(q, k, v, causal, backend, note=print, dropout_p=0.0):
    """torch SDPA forced to one backend, "flash" or "cudnn"; q/k/v are [B, S, H, D]; dropout_p: SDPA's attention
    dropout (its own RNG)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdp_backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    # Transposed views: SDPA's flash and cuDNN kernels take [B, S, H, D] memory as it is.
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    gqa = q.shape[2] != k.shape[2]

    def make():
        def fn():
            with sdpa_kernel(sdp_backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa,
                                                      dropout_p=dropout_p).transpose(1, 2)

        return fn

    return _guarded(f"sdpa_{backend}", make, note)


def heads_major_copy(x):
    """A new [B, H, S, D] contiguous copy of x [B, S, H, D], always a copy: when H == 1 the transposed view is
    already contiguous, so `.contiguous()` returns it, on x's own storage, and the rotating graph timer's copies of
    an MQA cache shared one 33.5 MiB cache that stayed in the L2 (run 228: SDPA's MQA b=8 ctx 8k at 12.5 us,
    2.7 TB/s)."""
    return x.transpose(1, 2).clone(memory_format=torch.contiguous_format)


def sdpa_decode(q, k, v, note=print):
    """torch SDPA, default backend choice, on its own contiguous [B, Hkv, ctx, D] copy of the cache.
    q is [B, 1, Hq, D]; k and v are the logical cache [B, ctx, Hkv, D]."""
    qt = q.transpose(1, 2)

    def make():
        kt, vt = heads_major_copy(k), heads_major_copy(v)

        def fn():
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).transpose(1, 2)

        return fn

    return _guarded("sdpa", make, note)


def fa4_prefill(q, k, v, causal, note=print):
    """flash-attn 4 (flash_attn.cute) forward."""
    fa4 = _import("flash_attn.cute")
    if fa4 is None:
        return None
    return _guarded("fa4", lambda: lambda: _first(fa4.flash_attn_func(q, k, v, causal=causal)), note)


def fa4_decode(q, k_cache, v_cache, cache_seqlens, block_table=None, note=print):
    """flash-attn 4 decode: contiguous cache through flash_attn_func, paged through
    flash_attn_varlen_func with page_table. Sq = 1, so no causal mask is needed."""
    fa4 = _import("flash_attn.cute")
    if fa4 is None:
        return None
    if block_table is None:
        call = functools.partial(fa4.flash_attn_func, q, k_cache, v_cache, causal=False)
    else:
        call = functools.partial(
            fa4.flash_attn_varlen_func, q, k_cache, v_cache,
            seqused_k=cache_seqlens, page_table=block_table, causal=False,
        )
    # num_splits=0 asks FA4's split-KV heuristic, which decode needs to fill the GPU; versions
    # without split-KV (or without the argument) get the plain call.
    for kwargs in ({"num_splits": 0}, {}):
        fn = _guarded("fa4", lambda kw=kwargs: lambda: _first(call(**kw)), note)
        if fn is not None:
            return fn
    return None


def flashinfer_decode(q, k_cache, v_cache, block_table, seqlen, use_tensor_cores, note=print):
    """FlashInfer BatchDecodeWithPagedKVCacheWrapper, NHD layout.
    q [B, 1, Hq, D]; k/v_cache [num_pages, page_size, Hkv, D]; block_table [B, pages] int32;
    every sequence holds ``seqlen`` tokens. Planning is done here, outside the timed call."""
    flashinfer = _import("flashinfer")
    if flashinfer is None:
        return None

    def make():
        batch, page_size = q.shape[0], k_cache.shape[1]
        pages = -(-seqlen // page_size)
        dev = q.device
        workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=use_tensor_cores)
        wrapper.plan(
            torch.arange(batch + 1, dtype=torch.int32, device=dev) * pages,
            block_table[:, :pages].reshape(-1).to(torch.int32).contiguous(),
            torch.full((batch,), seqlen - (pages - 1) * page_size, dtype=torch.int32, device=dev),
            q.shape[2], k_cache.shape[2], q.shape[3], page_size,
            q_data_type=q.dtype, kv_data_type=k_cache.dtype,
        )
        q3 = q[:, 0]  # [B, Hq, D], contiguous since dim 1 has size 1

        def fn():
            return wrapper.run(q3, (k_cache, v_cache)).unsqueeze(1)

        return fn

    return _guarded("flashinfer_tc" if use_tensor_cores else "flashinfer", make, note)


def flashinfer_mla(inputs, seqlens, block_table, note=print):
    """FlashInfer's BatchMLAPagedAttentionWrapper (its MLA decode, backend chosen by FlashInfer) over the same
    caches: inputs a list of (q [B, 1, H, 64], qv [B, 1, H, 512], k_cache, v_cache) copies, caches [B, ctx, 1, D]
    (taken as pages of 64 tokens) or page pools [pages, page, 1, D] with block_table [B, pages]; seqlens [B] int32.
    Planned once here; returns one call per copy (for rotating graph replay), each giving out [B, 1, H, 512]."""
    flashinfer = _import("flashinfer")
    if flashinfer is None:
        return None
    q, qv, kc, vc = inputs[0]
    batch, heads, dev = q.shape[0], q.shape[2], q.device
    paged = block_table is not None
    page = kc.shape[1] if paged else 64
    pages_per_seq = block_table.shape[1] if paged else kc.shape[1] // page
    indices = (block_table.reshape(-1) if paged else torch.arange(batch * pages_per_seq, device=dev)).to(torch.int32)

    calls = []

    def make():  # one plan, a call per copy; _guarded runs the first
        wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(torch.zeros(128 << 20, dtype=torch.uint8, device=dev))
        wrapper.plan(torch.arange(batch + 1, dtype=torch.int32, device=dev),
                     torch.arange(batch + 1, dtype=torch.int32, device=dev) * pages_per_seq, indices,
                     seqlens.to(torch.int32), heads, 512, 64, page, False, 576 ** -0.5, q.dtype, vc.dtype)

        def call(x):
            q_pe, q_nope = x[0][:, 0].contiguous(), x[1][:, 0].contiguous()
            kpe, ckv = (c.reshape(-1, page, c.shape[-1]) for c in (x[2], x[3]))
            return lambda: wrapper.run(q_nope, q_pe, ckv, kpe).unsqueeze(1)

        calls.extend(call(x) for x in inputs)
        return calls[0]

    return calls if _guarded("flashinfer_mla", make, note) is not None else None


def _e4m3_per_tensor(x):
    """x -> (e4m3 copy, fp32 [] scale) with x ~= x8 * scale; scale = amax / 448 (1.0 for an all-zero x)."""
    amax = x.abs().amax().float()
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def scaled_mm_fp8(a, w, note=print):
    """torch._scaled_mm (cuBLASLt FP8) on e4m3 copies of a [M, K] and w [N, K] with per-tensor scales: a @ w.T in
    a's dtype. The quantization happens here, outside the timed call; cuBLASLt wants the second operand column-major,
    which w8.t() (a [K, N] view of the row-major [N, K] w8) is."""

    def make():
        a8, sa = _e4m3_per_tensor(a)
        w8, sw = _e4m3_per_tensor(w)
        b = w8.t()

        def fn():
            return torch._scaled_mm(a8, b, scale_a=sa, scale_b=sw, out_dtype=a.dtype)

        return fn

    return _guarded("torch_fp8", make, note)
