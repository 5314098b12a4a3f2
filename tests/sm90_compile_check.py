"""Compile the kernels behind every public op for a GPU target on a machine without a GPU (sm_90 by default).

The CPU test suite runs kernels through Triton's interpreter, which executes Python: it never runs Triton's GPU
compiler, so code the interpreter accepts can still fail to compile for the GPU (a `return` inside a static `if`,
shapes the layout passes reject). This script installs a stand-in for Triton's CUDA driver that reports the target
and turns launches into no-ops, then calls each op on CPU tensors: every kernel goes through the real compiler and
ptxas (bundled with triton) for that target, and nothing runs. Results are garbage; only compilation is checked.
Usage: `python tests/sm90_compile_check.py [--res-usage] [--arch 80|90|100|120] [--only "NAME|NAME"]` (exit status 1
if any case fails to compile; --only keeps the cases whose names contain one of the fragments; --res-usage prints
under each case the registers and stack bytes, i.e. spills, of every kernel variant it compiled). Off sm_90 the
cases that take the Gluon sm_90 kernels there must compile without them (the dispatch declines them by its
capability check), the cases that force a Gluon kernel's config are skipped, and below sm_89 so are the FP8 /
NVFP4 ones (the ops refuse such GPUs before any launch). Run by tests/kernels/test_compile_targets.py in a
subprocess, since it replaces the process's active Triton driver.
"""
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from triton.runtime import driver  # noqa: E402

from tileflash.bench.standin import Sm90CompileOnly  # noqa: E402


def _variants(kernels) -> list:
    return [sum(len(c[0]) for c in kern.device_caches.values()) for kern in kernels]


def _compiles(kernels, call) -> None:
    """Run call; raise unless it compiled a new variant of every kernel in kernels (the call took those kernels)."""
    before = _variants(kernels)
    call()
    for kern, n0, n1 in zip(kernels, before, _variants(kernels)):
        if n1 <= n0:
            raise AssertionError(f"{kern.fn.__name__} did not compile for this call")


def _avoids(kernels, call) -> None:
    """Run call; raise if it compiled any of kernels (off sm_90: the dispatch must decline the Gluon kernels by
    its capability check, and the call compile through the Triton kernels)."""
    before = _variants(kernels)
    call()
    for kern, n0, n1 in zip(kernels, before, _variants(kernels)):
        if n1 > n0:
            raise AssertionError(f"{kern.fn.__name__} compiled for a target it does not serve")


def _cases(arch: int = 90):
    """name -> case (a callable; None: the case exercises an sm_90-only kernel with a forced config and is skipped
    on other targets). Off sm_90 the cases that take the Gluon kernels there must compile without them."""
    import dataclasses

    import tileflash
    from tileflash import config
    from tileflash.plan import GemmDecodedConfig, GemmWgmmaConfig, MlaGluonConfig, WsBwdConfig, WsFwdConfig

    sm90 = arch == 90

    bf, fp16 = torch.bfloat16, torch.float16

    def grad_leaves(*shape, dtype=bf):
        return [torch.randn(*shape, dtype=dtype, requires_grad=True) for _ in range(3)]

    def decode(fmt, d=128, append=False, paged=False, ctx=512, page=16, b=2, sq=1, extras=False, **call_kw):
        """extras: flash-attn's cache_batch_idx (contiguous), cache_leftpad (contiguous) and rotary tables."""
        hq, hkv = 32, 8
        q = torch.randn(b, sq, hq, d, dtype=bf)
        lens = torch.full((b,), ctx - sq, dtype=torch.int32)
        table = None
        shape = (b, ctx, hkv) if not paged else (b * ctx // page, page, hkv)
        if paged:
            table = torch.arange(b * ctx // page, dtype=torch.int32).view(b, -1)
        kw = {}
        if fmt == "16bit":
            kc = torch.zeros(*shape, d, dtype=bf)
            vc = kc.clone()
        elif fmt == "fp8":
            kc = torch.zeros(*shape, d, dtype=torch.float8_e4m3fn)
            vc = kc.clone()
            kw = dict(k_scale=torch.ones(hkv), v_scale=torch.ones(hkv))
        else:
            kc = torch.zeros(*shape, d // 2, dtype=torch.uint8)
            vc = kc.clone()
            sc = torch.zeros(*shape, d // 16, dtype=torch.float8_e4m3fn)
            kw = dict(k_scale=sc, v_scale=sc.clone(), k_global_scale=torch.ones(1), v_global_scale=torch.ones(1))
        new = torch.randn(b, sq, hkv, d, dtype=bf) if append else None
        if extras:
            kw.update(rotary_cos=torch.ones(ctx, d // 4, dtype=bf), rotary_sin=torch.zeros(ctx, d // 4, dtype=bf))
            if not paged:
                kw.update(cache_batch_idx=torch.arange(b, dtype=torch.int32), cache_leftpad=lens // 2)
        tileflash.flash_attn_with_kvcache(q, kc, vc, new, new, cache_seqlens=lens, block_table=table, **kw, **call_kw)

    def mla(hq, sq=1, page=0, append=False, b=2, ctx=1024, fp8=False, **call_kw):
        """MLA decode through qv: a 64-wide rotary key and a 512-wide latent (the value), one KV head."""
        q, qv = torch.randn(b, sq, hq, 64, dtype=bf), torch.randn(b, sq, hq, 512, dtype=bf)
        rows = (b * ctx // page, page) if page else (b, ctx)
        cache = torch.float8_e4m3fn if fp8 else bf
        kc, vc = torch.zeros(*rows, 1, 64, dtype=cache), torch.zeros(*rows, 1, 512, dtype=cache)
        if fp8:
            call_kw.update(k_scale=torch.ones(1), v_scale=torch.ones(1))
        table = torch.arange(rows[0], dtype=torch.int32).view(b, -1) if page else None
        new = (torch.randn(b, sq, 1, 64, dtype=bf), torch.randn(b, sq, 1, 512, dtype=bf)) if append else (None, None)
        tileflash.flash_attn_with_kvcache(q, kc, vc, *new, cache_seqlens=torch.full((b,), ctx - sq, dtype=torch.int32),
                                          block_table=table, qv=qv, **call_kw)

    def gluon_mla(hq, rows=64, ahead=False, **kw):
        """An MLA decode the Gluon MLA kernel serves on sm_90 (kernels/gluon/mla_decode.py at 64 query rows per CTA,
        else mla_decode_narrow.py), forced even where the planner declines it, and other targets compile without
        it."""
        from tileflash.kernels.gluon.mla_decode import mla_decode_kernel
        from tileflash.kernels.gluon.mla_decode_narrow import mla_decode_narrow_kernel

        kern = mla_decode_kernel if rows == 64 else mla_decode_narrow_kernel

        def call():
            with config.override(mla_gluon=lambda cfg: dataclasses.replace(cfg or MlaGluonConfig(), rows=rows,
                                                                           ahead=ahead)):
                mla(hq, **kw)
        return lambda: (_compiles if sm90 else _avoids)((kern,), call)

    def triton_mla(hq, **kw):
        """An MLA decode on the Triton kernel (the Gluon ones declined by config)."""
        with config.override(mla_gluon=lambda cfg: None):
            mla(hq, **kw)

    def register_decode(fmt, **kw):
        """A decode that must take the register-operand Gluon kernel (kernels/gluon/decode_mma.py)."""
        from tileflash.kernels.gluon.decode_mma import decode_quant_kernel as kern

        if not sm90:
            return None
        return lambda: _compiles((kern,), lambda: decode(fmt, ctx=4096, **kw))

    def varlen():
        cu = torch.tensor([0, 100, 100, 250], dtype=torch.int32)
        q, k, v = (torch.randn(250, 4, 64, dtype=bf, requires_grad=True) for _ in range(3))
        tileflash.flash_attn_varlen_func(q, k, v, cu, cu, 150, 150, causal=True).sum().backward()

    def varlen_ws(d, causal, backward=False):
        """Packed sequences (one empty, one of 1300 keys: d64's backward takes the Gluon kernel past 256)
        through the Gluon kernels' varlen paths."""
        cu = torch.tensor([0, 100, 100, 1400, 2000], dtype=torch.int32)
        q, k, v = (torch.randn(2000, 4, d, dtype=bf, requires_grad=backward) for _ in range(3))
        out = tileflash.flash_attn_varlen_func(q, k, v, cu, cu, 1300, 1300, causal=causal)
        if backward:
            out.sum().backward()

    def warp_specialised(call, backward=False):
        """Run a call that must take the warp-specialised Gluon forward (kernels/gluon/attn_fwd.py) and, with
        backward, the warp-specialised dK/dV kernel (kernels/gluon/attn_bwd.py)."""
        from tileflash.kernels.gluon.attn_bwd import attn_bwd_ws_kernel
        from tileflash.kernels.gluon.attn_fwd import attn_fwd_ws_kernel

        kernels = (attn_fwd_ws_kernel, attn_bwd_ws_kernel) if backward else (attn_fwd_ws_kernel,)
        return (lambda: _compiles(kernels, call)) if sm90 else (lambda: _avoids(kernels, call))

    def backward_variant(d, causal, config, varlen=False):
        """A backward through the warp-specialised dK/dV kernel with a config the heuristic does not pick."""
        from tileflash import config as tf_config

        if not sm90:
            return None

        def case():
            with tf_config.override(bwd_ws=config):
                if varlen:
                    warp_specialised(lambda: varlen_ws(d, causal, backward=True), backward=True)()
                else:
                    warp_specialised(lambda: tileflash.flash_attn_func(*grad_leaves(1, 1500, 2, d), causal=causal)
                                     .sum().backward(), backward=True)()

        return case

    def gemm(m, n, k, dtype=bf, kernel=None, forced=None):
        """An nvfp4_matmul call; kernel "mma" / "wgmma": it must take that Gluon kernel on sm_90
        (lowp/kernels/gemm_mma.py, gemm_wgmma.py), "decoded": the weight decode of the cuBLAS route (every
        target); forced: config.override's keywords."""
        from tileflash.lowp.kernels.gemm_mma import nvfp4_matmul_mma_kernel
        from tileflash.lowp.kernels.gemm_wgmma import nvfp4_matmul_wgmma_kernel
        from tileflash.lowp.kernels.quant import nvfp4_dequantize_kernel

        kern = {"mma": (nvfp4_matmul_mma_kernel,), "wgmma": (nvfp4_matmul_wgmma_kernel,),
                "decoded": (nvfp4_dequantize_kernel,)}.get(kernel, ())
        call = lambda: tileflash.nvfp4_matmul(torch.randn(m, k, dtype=dtype),  # noqa: E731
                                              *tileflash.nvfp4_quantize(torch.randn(n, k)))
        with config.override(**(forced or {})):
            (_compiles if sm90 or kernel == "decoded" else _avoids)(kern, call)  # decoded: every target

    def gemm_w4a4(m, n, k):
        """nvfp4_matmul with an NVFP4 a: on Blackwell its kernel's SASS must hold the block-scaled FP4 MMA
        (UTCOMMA on sm_10x's tcgen05, OMMA.SF ... E2M1.E2M1.UE4M3 on sm_12x), elsewhere it decodes both operands."""
        from tileflash.lowp.kernels.gemm_dequant import nvfp4_matmul_kernel as kern

        def case():
            before = _compiled(kern)
            a_data, a_scales, a_g = tileflash.nvfp4_quantize(torch.randn(m, k))
            tileflash.nvfp4_matmul(a_data, *tileflash.nvfp4_quantize(torch.randn(n, k)), a_scales, a_g)
            new = [k_ for k_ in _compiled(kern) if all(k_ is not b for b in before)]
            assert new, "nvfp4_matmul_kernel did not compile for this call"
            native = [_sass_has_fp4_mma(k_) for k_ in new]
            if arch >= 100 and not all(native):
                raise AssertionError("no block-scaled FP4 MMA in the SASS of a Blackwell target")
            if arch < 100 and any(native):
                raise AssertionError("a block-scaled FP4 MMA off Blackwell")
        return case

    def on_triton_kernels(call, backward=False, dq_pass=True):
        """Run a call with alibi_slopes or dropout_p whose shape would take a Gluon kernel: it must compile the
        Triton kernels' ALIBI / DROPOUT variants instead (the forward; with backward also the dK/dV and dQ
        kernels)."""
        from tileflash.kernels.triton.attn_bwd import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel
        from tileflash.kernels.triton.attn_fwd import attn_fwd_kernel

        kernels = (attn_fwd_kernel, attn_bwd_dkdv_kernel, attn_bwd_dq_kernel)
        kernels = kernels[:(3 if dq_pass else 2) if backward else 1]  # (dQ by atomics: no dQ pass)
        return lambda: _compiles(kernels, call)

    def forced_fwd_ws(tile, call):
        with config.override(fwd_ws=lambda cfg: tile):
            call()

    def deepseek(call, backward=False):
        """q, k 192 wide, v 128 (DeepSeek-V3's prefill): the Gluon forward on sm_90 (q and k as 128 + 64 columns),
        the Triton forward elsewhere; a backward runs on the Triton kernels (the Gluon dK/dV takes V's head dim
        only equal to q's)."""
        from tileflash.kernels.gluon.attn_fwd import attn_fwd_ws_kernel
        from tileflash.kernels.triton.attn_bwd import attn_bwd_dkdv_kernel

        if not sm90:
            return on_triton_kernels(call, backward=backward, dq_pass=False)
        return lambda: _compiles((attn_fwd_ws_kernel,) + ((attn_bwd_dkdv_kernel,) if backward else ()), call)

    def sink_on_gluon(call):
        """Run a forward and backward with learnable_sink on a shape the warp-specialised kernels take: it must
        compile the Gluon forward's HAS_SINK variant and the preprocess's (d sink); the dK/dV kernel has no sink
        variant (it sees the sink through the lse)."""
        from tileflash.kernels.gluon.attn_fwd import attn_fwd_ws_kernel
        from tileflash.kernels.triton.attn_bwd import attn_bwd_preprocess_kernel

        if not sm90:
            return lambda: _avoids((attn_fwd_ws_kernel,), call)
        return lambda: _compiles((attn_fwd_ws_kernel, attn_bwd_preprocess_kernel), call)

    def fp8_prefill(d, causal=False, b=2, s=1024, packed=False, page=0):
        """FP8 attention (e4m3 q, k, v with descales) through the Triton forward: padded, packed or paged."""
        q8, k8, v8 = (torch.randn(b, s, h, d).to(torch.float8_e4m3fn) for h in (8, 2, 2))
        qd, kd, vd = (torch.rand(b, 2) for _ in range(3))
        if not packed:
            return tileflash.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
        cu = torch.arange(0, b * s + 1, s, dtype=torch.int32)
        q8, k8, v8 = (t.flatten(0, 1) for t in (q8, k8, v8))
        table = seqused = None
        if page:
            k8, v8 = (t.view(-1, page, 2, d) for t in (k8, v8))
            table = torch.arange(k8.shape[0], dtype=torch.int32).view(b, -1)
            seqused = torch.full((b,), s, dtype=torch.int32)
        return tileflash.flash_attn_varlen_func(q8, k8, v8, cu, cu, s, s, seqused_k=seqused, causal=causal,
                                                block_table=table, q_descale=qd, k_descale=kd, v_descale=vd,
                                                out_dtype=fp16)

    def merge(call, fused: bool):
        """call with its splits merged in the attention launch (fused) or by the combine's own launch, forced
        whatever the planner would pick for the shape."""
        with config.override(decode=lambda cfg: dataclasses.replace(cfg, fused_combine=fused)):
            call()

    def combine_launch(call):
        merge(call, False)

    def fused_merge(call):
        merge(call, True)

    def sinks_on_triton(call, combine=True):
        """Run a decode with learnable_sink whose shape would take the register-operand kernel: it must compile
        the Triton kernel's HAS_SINK variant and the split combine (or its fused merge) instead."""
        from tileflash.kernels.triton.attn_fwd import attn_fwd_kernel
        from tileflash.kernels.triton.combine import attn_combine_kernel

        return lambda: _compiles((attn_fwd_kernel, attn_combine_kernel) if combine else (attn_fwd_kernel,), call)

    return {
        "prefill fwd+bwd d128 causal GQA alibi [B, Hq], deterministic (Triton kernels)": on_triton_kernels(
            lambda: tileflash.flash_attn_func(
                torch.randn(2, 300, 8, 128, dtype=bf, requires_grad=True),
                *(torch.randn(2, 333, 2, 128, dtype=bf, requires_grad=True) for _ in range(2)), causal=True,
                deterministic=True, alibi_slopes=torch.rand(2, 8)).sum().backward(), backward=True),
        "prefill fwd+bwd d128 causal GQA dropout, deterministic (Triton kernels)": on_triton_kernels(
            lambda: tileflash.flash_attn_func(
                torch.randn(2, 300, 8, 128, dtype=bf, requires_grad=True),
                *(torch.randn(2, 333, 2, 128, dtype=bf, requires_grad=True) for _ in range(2)), causal=True,
                deterministic=True, dropout_p=0.1).sum().backward(), backward=True),
        "prefill fwd+bwd d128 fp16 dropout, dQ by atomics (Triton kernels)": on_triton_kernels(
            lambda: tileflash.flash_attn_func(
                *(torch.randn(1, 1500, 4, 128, dtype=fp16, requires_grad=True) for _ in range(3)),
                dropout_p=0.25).sum().backward(), backward=True, dq_pass=False),
        "varlen fwd+bwd d64 windowed dropout, dQ by atomics (Triton kernels)": on_triton_kernels(
            lambda: tileflash.flash_attn_varlen_func(
                *(torch.randn(700, 4, 64, dtype=bf, requires_grad=True) for _ in range(3)),
                torch.tensor([0, 300, 700], dtype=torch.int32), torch.tensor([0, 300, 700], dtype=torch.int32), 400,
                400, window_size=(64, 0), dropout_p=0.1).sum().backward(), backward=True, dq_pass=False),
        "prefill fwd+bwd d192 v128 causal GQA (DeepSeek-V3's dims: the Gluon forward's q, k as 128 + 64 columns, "
        "persistent; the Triton backward, dQ by atomics)": deepseek(lambda: tileflash.flash_attn_func(
            torch.randn(2, 300, 8, 192, dtype=bf, requires_grad=True),
            torch.randn(2, 333, 2, 192, dtype=bf, requires_grad=True),
            torch.randn(2, 333, 2, 128, dtype=bf, requires_grad=True), causal=True).sum().backward(), backward=True),
        "prefill d192 v128, 3000 keys (the Gluon forward, one CTA per tile)": deepseek(
            lambda: tileflash.flash_attn_func(torch.randn(1, 700, 4, 192, dtype=bf), torch.randn(1, 3000, 4, 192,
                                                                                              dtype=bf),
                                              torch.randn(1, 3000, 4, 128, dtype=bf))),
        "varlen d192 v128 causal (the Gluon forward's packed sequences)": deepseek(
            lambda: tileflash.flash_attn_varlen_func(
                torch.randn(700, 16, 192, dtype=bf), torch.randn(700, 16, 192, dtype=bf),
                torch.randn(700, 16, 128, dtype=bf), torch.tensor([0, 300, 700], dtype=torch.int32),
                torch.tensor([0, 300, 700], dtype=torch.int32), 400, 400, causal=True)),
        "varlen fwd+bwd d128 v64, deterministic (Triton kernels: V's head dim not q's, Q / dO by TMA)":
            on_triton_kernels(lambda: tileflash.flash_attn_varlen_func(
                torch.randn(700, 4, 128, dtype=bf, requires_grad=True),
                torch.randn(700, 4, 128, dtype=bf, requires_grad=True),
                torch.randn(700, 4, 64, dtype=bf, requires_grad=True), torch.tensor([0, 300, 700], dtype=torch.int32),
                torch.tensor([0, 300, 700], dtype=torch.int32), 400, 400, deterministic=True).sum().backward(),
                backward=True),
        "prefill qv d64 v512 causal MQA (FA3's MLA queries, Triton kernel)": on_triton_kernels(
            lambda: tileflash.flash_attn_func(
                torch.randn(2, 300, 16, 64, dtype=bf), torch.randn(2, 333, 1, 64, dtype=bf),
                torch.randn(2, 333, 1, 512, dtype=bf), causal=True, qv=torch.randn(2, 300, 16, 512, dtype=bf))),
        "varlen qv d64 v256 (FA3's MLA queries, Triton kernel)": on_triton_kernels(
            lambda: tileflash.flash_attn_varlen_func(
                torch.randn(700, 8, 64, dtype=bf), torch.randn(700, 1, 64, dtype=bf),
                torch.randn(700, 1, 256, dtype=bf), torch.tensor([0, 300, 700], dtype=torch.int32),
                torch.tensor([0, 300, 700], dtype=torch.int32), 400, 400, qv=torch.randn(700, 8, 256, dtype=bf))),
        "decode nvfp4 paged split alibi [Hq] (Triton kernel, not register operands)": on_triton_kernels(
            lambda: decode("nvfp4", paged=True, b=8, ctx=4096, num_splits=2, alibi_slopes=torch.rand(32))),
        "prefill fwd+bwd d128 GQA fp16 learnable_sink (Gluon forward, d sink in the preprocess)": sink_on_gluon(
            lambda: tileflash.flash_attn_func(
                torch.randn(2, 300, 8, 128, dtype=fp16, requires_grad=True),
                *(torch.randn(2, 333, 2, 128, dtype=fp16, requires_grad=True) for _ in range(2)),
                learnable_sink=torch.rand(8, requires_grad=True)).sum().backward()),
        "prefill d128 causal learnable_sink, warp-specialised forward, persistent": warp_specialised(
            lambda: tileflash.flash_attn_func(*(torch.randn(2, 2048, 16, 128, dtype=bf) for _ in range(3)),
                                              causal=True, learnable_sink=torch.rand(16))),
        "decode 16-bit paged cache_leftpad split (Triton kernel, pages by pointers from the pad)": on_triton_kernels(
            lambda: decode("16bit", paged=True, b=8, ctx=4096, num_splits=2,
                           cache_leftpad=torch.full((8,), 37, dtype=torch.int32))),
        "decode nvfp4 paged split attention_chunk (Triton kernel, CHUNK masks)": on_triton_kernels(
            lambda: decode("nvfp4", paged=True, b=8, ctx=4096, num_splits=2, causal=True, attention_chunk=1024)),
        "decode 16-bit paged attention_chunk causal, 4 tokens (Triton kernel, CHUNK masks)": on_triton_kernels(
            lambda: decode("16bit", paged=True, sq=4, causal=True, attention_chunk=128)),
        "extend 16-bit attention_chunk window (Triton prefill tiles, CHUNK masks)": on_triton_kernels(
            lambda: decode("16bit", sq=40, ctx=1024, window_size=(300, 0), attention_chunk=256)),
        "decode nvfp4 split learnable_sink (Triton kernel, the sink in the fused merge)": sinks_on_triton(
            lambda: fused_merge(lambda: decode("nvfp4", b=8, ctx=4096, num_splits=2, learnable_sink=torch.rand(32))),
            combine=False),
        "decode nvfp4 split learnable_sink, combine launch (Triton kernel, the sink in the combine)": sinks_on_triton(
            lambda: combine_launch(lambda: decode("nvfp4", b=8, ctx=4096, num_splits=2,
                                                  learnable_sink=torch.rand(32)))),
        "prefill fwd+bwd d64 causal": lambda: tileflash.flash_attn_func(*grad_leaves(2, 300, 4, 64),
                                                                        causal=True).sum().backward(),
        "prefill fwd+bwd d128 window softcap": lambda: tileflash.flash_attn_func(
            *grad_leaves(1, 200, 4, 128), window_size=(50, 10), softcap=5.0).sum().backward(),
        "prefill fwd+bwd d256 fp16": lambda: tileflash.flash_attn_func(
            *grad_leaves(1, 100, 2, 256, dtype=fp16)).sum().backward(),
        "prefill fwd+bwd d128 GQA, warp-specialised": warp_specialised(lambda: tileflash.flash_attn_func(
            torch.randn(2, 300, 8, 128, dtype=bf, requires_grad=True),
            *(torch.randn(2, 333, 2, 128, dtype=bf, requires_grad=True) for _ in range(2))).sum().backward(),
            backward=True),
        "prefill fwd+bwd d128 causal fp16, warp-specialised": warp_specialised(lambda: tileflash.flash_attn_func(
            *grad_leaves(1, 300, 2, 128, dtype=fp16), causal=True).sum().backward(), backward=True),
        "prefill fwd+bwd d64 causal deterministic, warp-specialised": warp_specialised(
            lambda: tileflash.flash_attn_func(*grad_leaves(1, 4096, 2, 64), causal=True,
                                              deterministic=True).sum().backward(), backward=True),
        "prefill fwd+bwd d64, dQ by columns": backward_variant(64, False, WsBwdConfig(128, 2, True, True)),
        "prefill fwd+bwd d128 causal, two fences": backward_variant(128, True, WsBwdConfig(64, 2, True, False)),
        "prefill fwd+bwd d64 causal s=128, one launch (eager short rows)": warp_specialised(
            lambda: tileflash.flash_attn_func(*grad_leaves(1, 128, 4, 64), causal=True).sum().backward(), True),
        "prefill fwd+bwd d64 causal, one launch, dQ by columns": backward_variant(
            64, True, WsBwdConfig(128, 2, True, True, one_launch=True)),
        "varlen fwd+bwd d128, one launch": backward_variant(  # non-causal: the causal forward is another case's
            128, False, WsBwdConfig(64, 2, True, False, one_launch=True), varlen=True),
        "varlen fwd+bwd d128 causal, warp-specialised": warp_specialised(lambda: varlen_ws(128, True, True), True),
        "varlen fwd+bwd d64, warp-specialised": warp_specialised(lambda: varlen_ws(64, False, True), True),
        "varlen fwd+bwd d64 causal, two fences": backward_variant(
            64, True, WsBwdConfig(128, 2, True, False, dq_by_rows=True), varlen=True),
        "prefill d64 causal fp16, warp-specialised forward": warp_specialised(lambda: tileflash.flash_attn_func(
            *(torch.randn(1, 4096, 2, 64, dtype=fp16) for _ in range(3)), causal=True)),
        "prefill d128 causal, warp-specialised forward, one CTA per tile": warp_specialised(
            lambda: tileflash.flash_attn_func(*(torch.randn(1, 2304, 2, 128, dtype=bf) for _ in range(3)),
                                              causal=True)),
        "varlen fwd+bwd": varlen,
        "prefill fp8 d128 causal": lambda: fp8_prefill(128, causal=True),
        "prefill fp8 d128, 8192 keys (the Gluon forward: the planner's pick)": warp_specialised(
            lambda: fp8_prefill(128, b=1, s=8192)),
        "prefill fp8 d128 causal, persistent (a Gluon sweep tile)": warp_specialised(
            lambda: forced_fwd_ws(WsFwdConfig(128, 3, 3, True), lambda: fp8_prefill(128, causal=True))),
        "prefill fp8 d64 (a Gluon sweep tile)": warp_specialised(
            lambda: forced_fwd_ws(WsFwdConfig(128, 4, 4), lambda: fp8_prefill(64, b=1, s=4096))),
        "prefill fp8 d128 packed (the Gluon forward's varlen, forced)": warp_specialised(
            lambda: forced_fwd_ws(WsFwdConfig(128, 4, 4), lambda: fp8_prefill(128, packed=True))),
        "prefill fp8 d128, 64-key steps (a Gluon sweep tile)": warp_specialised(
            lambda: forced_fwd_ws(WsFwdConfig(64, 4, 4), lambda: fp8_prefill(128, s=2048))),
        "prefill fp8 d256 (the Gluon forward: the planner's pick)": warp_specialised(lambda: fp8_prefill(256)),
        "prefill fp8 d256 causal, 1024 keys (the Triton kernel)": lambda: fp8_prefill(256, causal=True),
        "prefill fp8 d256 causal, 32-key steps (a Gluon sweep tile)": warp_specialised(
            lambda: forced_fwd_ws(WsFwdConfig(32, 4, 4), lambda: fp8_prefill(256, causal=True, b=1, s=4096))),
        "prefill fp8 d80 packed, fp16 out (V^T by pointers)": lambda: fp8_prefill(80, s=1000, packed=True),
        "prefill fp8 d128 causal paged (page 128)": lambda: fp8_prefill(128, causal=True, packed=True,
                                                                         page=128),
        "prefill fp8 d256 paged (page 64)": lambda: fp8_prefill(256, packed=True, page=64),
        "decode 16-bit contiguous": lambda: decode("16bit"),
        "decode 16-bit b=16 ctx 4k, one split of three 128-token stages (whole_cache_programs)":
            lambda: decode("16bit", b=16, ctx=4096),
        "decode 16-bit d256 b=16 ctx 4k, one split, a stage more (whole_cache_programs)":
            lambda: decode("16bit", d=256, b=16, ctx=4096),
        "decode 16-bit b=1 ctx 8k, split, fused merge": lambda: fused_merge(lambda: decode("16bit", b=1, ctx=8192)),
        "decode 16-bit b=1 ctx 8k, split, combine launch": lambda: combine_launch(lambda: decode("16bit", b=1,
                                                                                                ctx=8192)),
        "decode fp8 b=1 ctx 8k, split, fused merge, sink": lambda: fused_merge(lambda: decode(
            "fp8", b=1, ctx=8192, learnable_sink=torch.zeros(32))),
        "decode 16-bit paged append": lambda: decode("16bit", append=True, paged=True),
        "decode 16-bit paged, large cache (128-token steps)": lambda: decode("16bit", paged=True, ctx=16384),
        "decode 16-bit paged, page 64 (TMA tiles)": lambda: decode("16bit", paged=True, page=64),
        "decode 16-bit paged, page 64, large pool (3-stage TMA tiles)": lambda: decode("16bit", paged=True, page=64,
                                                                                     ctx=16384),
        "decode fp8 paged, page 64 (TMA tiles)": lambda: decode("fp8", paged=True, page=64),
        # large pools (plan/decode "fp8-paged-large"): 64-token steps; 128-token gathers spilled ~600 B a step
        "decode fp8 paged, page 16, large pool (gathers)": lambda: decode("fp8", paged=True, page=16, b=8, ctx=8192),
        "decode fp8 paged, page 64, large pool (TMA tiles)": lambda: decode("fp8", paged=True, page=64, b=8, ctx=8192),
        "decode fp8 append": lambda: decode("fp8", append=True),
        "decode fp8 paged append (in the attention launch)": lambda: decode("fp8", append=True, paged=True),
        "decode 16-bit append, rotary, cache_batch_idx, cache_leftpad": lambda: decode("16bit", append=True,
                                                                                  extras=True, causal=True),
        "decode fp8 paged append, rotary (GPT-NeoX)": lambda: decode("fp8", append=True, paged=True, extras=True,
                                                                     rotary_interleaved=False),
        "extend 16-bit paged, 64 query tokens, rotary, causal": lambda: decode("16bit", append=True, paged=True,
                                                                              sq=64, extras=True, causal=True),
        "extend 16-bit contiguous, 40 query tokens": lambda: decode("16bit", append=True, sq=40),
        "decode 16-bit paged, packed appends (cu_seqlens_k_new)": lambda: tileflash.flash_attn_with_kvcache(
            torch.randn(2, 1, 32, 128, dtype=bf), torch.zeros(64, 16, 8, 128, dtype=bf),
            torch.zeros(64, 16, 8, 128, dtype=bf), torch.randn(5, 8, 128, dtype=bf), torch.randn(5, 8, 128, dtype=bf),
            cache_seqlens=torch.tensor([100, 7], dtype=torch.int32),
            block_table=torch.arange(64, dtype=torch.int32).view(2, 32),
            cu_seqlens_k_new=torch.tensor([0, 2, 5], dtype=torch.int32)),
        "decode 16-bit d59 append, rotary, split": lambda: decode("16bit", d=59, append=True, extras=True,
                                                                 num_splits=4),
        "prefill fwd+bwd d59 causal (masked pointer loads)": lambda: tileflash.flash_attn_func(
            *grad_leaves(2, 300, 4, 59), causal=True).sum().backward(),
        "decode MLA H=128 (qv, latent 512), split": gluon_mla(128, num_splits=4),
        "decode MLA H=128, no split": gluon_mla(128, b=1, ctx=256),
        "decode MLA H=16 paged page 64, append, causal Sq=2": gluon_mla(16, sq=2, page=64, append=True, causal=True),
        "decode MLA H=16 paged page 16, causal Sq=4, split": gluon_mla(16, sq=4, page=16, causal=True, num_splits=3),
        "decode MLA narrow H=16, split": gluon_mla(16, rows=16, num_splits=4),
        "decode MLA narrow H=8 at 8 rows, split": gluon_mla(8, rows=8, num_splits=2),
        "decode MLA narrow H=16 paged page 64, causal Sq=2, no split": gluon_mla(16, rows=32, sq=2, page=64,
                                                                                causal=True, ctx=256),
        "decode MLA narrow H=32 paged page 16, append, split": gluon_mla(32, rows=32, page=16, append=True,
                                                                         num_splits=3),
        "decode MLA H=128 softcap (Triton kernel)": lambda: mla(128, softcap=5.0, num_splits=2),
        "decode fp8 MLA H=128 latent (transposed 32-token steps), append, split": lambda: mla(128, append=True,
                                                                                              fp8=True, num_splits=3),
        "decode fp8 MLA H=16 latent (Triton kernel, 128-token steps), split": lambda: triton_mla(16, fp8=True,
                                                                                                 num_splits=3),
        "decode fp8 MLA H=32 latent (Triton kernel, two 16-row tiles), paged page 64, split":
            lambda: triton_mla(32, page=64, fp8=True, num_splits=3),
        "decode fp8 MLA narrow H=16 (widened blocks), split": gluon_mla(16, rows=16, fp8=True, num_splits=3),
        "decode fp8 MLA narrow H=16, widened ahead, split": gluon_mla(16, rows=16, fp8=True, ahead=True, num_splits=3),
        "decode fp8 MLA narrow H=8 x Sq=2, widened ahead, paged page 16, append, causal": gluon_mla(
            8, rows=16, sq=2, page=16, append=True, causal=True, fp8=True, ahead=True),
        "decode fp8 MLA narrow H=16 x Sq=2 (32 rows) paged page 16, append, causal": gluon_mla(16, rows=32, sq=2,
                                                                                               page=16, append=True,
                                                                                               causal=True, fp8=True),
        "decode nvfp4 append": lambda: decode("nvfp4", append=True),
        "decode nvfp4 d32 append": lambda: decode("nvfp4", d=32, append=True),
        "decode nvfp4 paged": lambda: decode("nvfp4", paged=True),
        "decode nvfp4 S/P-overlapped loop (Triton kernel)": lambda: decode("nvfp4", sp_overlap=True),
        "decode nvfp4 window softcap append, register operands": register_decode(
            "nvfp4", append=True, softcap=5.0, window_size=(100, 0)),
        "decode nvfp4 large page 16, 16-token steps, register operands": register_decode("nvfp4", paged=True, b=8),
        "decode nvfp4 d64 page 64, register operands": register_decode("nvfp4", d=64, paged=True, page=64),
        "nvfp4_dequantize": lambda: tileflash.nvfp4_dequantize(*tileflash.nvfp4_quantize(torch.randn(64, 128))),
        "fp8_quantize": lambda: tileflash.fp8_quantize(torch.randn(64, 128, dtype=bf)),
        "merge_attn_states [B, S, H, D] and packed [T, H, D]": lambda: [
            tileflash.merge_attn_states(*(torch.randn(*shape, dtype=bf) if i % 2 == 0 else torch.randn(*lse_shape)
                                          for i in range(4)))
            for shape, lse_shape in (((2, 33, 8, 128), (2, 8, 33)), ((45, 4, 80), (4, 45)))],
        "nvfp4_quantize": lambda: tileflash.nvfp4_quantize(torch.randn(64, 128, dtype=bf)),
        "gemm M=1 (split-K), register operands, wgmma declined": None if not sm90 else lambda: gemm(
            1, 4096, 4096, kernel="mma", forced={"gemm_wgmma": None}),
        # K not a multiple of 256: the heuristic's own fallback from the wgmma kernel
        "gemm M=16 fp16, K tail, one slice, register operands": lambda: gemm(16, 200, 416, torch.float16,
                                                                              kernel="mma"),
        "gemm M=64 (split-K), wgmma": lambda: gemm(64, 512, 4096, kernel="wgmma"),
        "gemm M=200 fp16, N tail, wgmma": lambda: gemm(200, 320, 1024, torch.float16, kernel="wgmma"),
        "gemm M=100, one consumer, wgmma": None if not sm90 else lambda: gemm(100, 256, 512, kernel="wgmma", forced={
            "gemm_wgmma": GemmWgmmaConfig(block_m=128, consumers=1, stages=3, split_k=1, steps=1)}),
        "gemm M=1 (split-K), wgmma, one-step stages": None if not sm90 else lambda: gemm(1, 4096, 4096, kernel="wgmma",
            forced={"gemm_wgmma": GemmWgmmaConfig(block_m=16, consumers=2, stages=6, split_k=2, steps=1, prefetch=3)}),
        "gemm M=5, wgmma 16 rows": lambda: gemm(5, 4096, 4096, kernel="wgmma"),
        "gemm M=777, wgmma over seven 128-row tiles": lambda: gemm(777, 1088, 512, kernel="wgmma"),
        "gemm M=128, K tail (Triton kernel)": lambda: gemm(128, 512, 1040),
        "gemm M=1024, Triton kernel's large-M tile (what W4A4 keeps)": lambda: gemm(
            1024, 512, 1024, forced={"gemm_decoded": None, "gemm_wgmma": None}),
        "gemm M=300, decoded weight in chunks + cuBLAS": lambda: gemm(300, 520, 1024, kernel="decoded", forced={
            "gemm_decoded": GemmDecodedConfig(chunk_rows=256)}),
        "gemm W4A4 M=1 (split-K, swapped)": gemm_w4a4(1, 512, 2048),
        "gemm W4A4 M=200, K tail": gemm_w4a4(200, 384, 1040),
    }


def _compiled(kern) -> list:
    return [k for caches in kern.device_caches.values() for k in caches[0].values()]


def _sass(kernel) -> str:
    """A compiled kernel's SASS (cuobjdump, bundled with triton)."""
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def _sass_has_fp4_mma(kernel) -> bool:
    """The block-scaled e2m1 MMA: sm_10x's tcgen05 (UTCOMMA; .4X: e4m3 scales per 16 values) or sm_12x's
    OMMA.SF ... E2M1.E2M1.UE4M3."""
    sass = _sass(kernel)
    return "UTCOMMA.4X" in sass or "E2M1.E2M1.UE4M3" in sass


def _kernels() -> list:
    """(name, JIT function) of every kernel module's kernels."""
    from tileflash.kernels.gluon import (attn_bwd as attn_bwd_ws, attn_fwd as attn_fwd_ws, decode_mma, mla_decode,
                                         mla_decode_narrow)
    from tileflash.kernels.triton import attn_bwd, attn_fwd, cast, combine, kv_append
    from tileflash.lowp.kernels import gemm_dequant, gemm_mma, gemm_wgmma, quant

    mods = (attn_fwd, attn_fwd_ws, attn_bwd, attn_bwd_ws, cast, combine, kv_append, quant, gemm_dequant, gemm_mma,
            gemm_wgmma, decode_mma, mla_decode, mla_decode_narrow)
    return [(name, getattr(mod, name)) for mod in mods for name in sorted(dir(mod))
            if hasattr(getattr(mod, name), "device_caches")]


def _resource_usage(kernels) -> list:
    """One line per compiled variant of kernels: registers and stack (spills) from cuobjdump -res-usage, and
    whether ptxas serialised its wgmma instructions (warnings C7515 / C7514: a non-wgmma instruction defines / reads
    an accumulator register while its pipeline stage is in flight; every wgmma then waits for the one before it)."""
    import subprocess
    import tempfile

    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    tool, ptxas = os.path.join(bin_dir, "cuobjdump"), os.path.join(bin_dir, "ptxas")
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in kernels:
            for kernel in _compiled(fn):
                path = os.path.join(tmp, "k.cubin")
                with open(path, "wb") as f:
                    f.write(kernel.asm["cubin"])
                out = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True).stdout
                usage = next((ln.strip() for ln in out.splitlines() if "REG:" in ln), "?")
                serialised = ""
                if "wgmma" in kernel.asm.get("ptx", ""):
                    ptx = os.path.join(tmp, "k.ptx")
                    with open(ptx, "w") as f:
                        f.write(kernel.asm["ptx"])
                    info = subprocess.run([ptxas, "--gpu-name", "sm_90a", "-v", ptx, "-o",
                                           os.path.join(tmp, "k.o")], capture_output=True, text=True)
                    warned = info.stdout + info.stderr
                    serialised = "".join(f" WGMMA SERIALISED ({code})" for code in ("C7514", "C7515") if code in warned)
                consts = {k[0] if isinstance(k, tuple) else k: v
                          for k, v in getattr(kernel.src, "constants", {}).items()}
                lines.append(f"{name} warps={kernel.metadata.num_warps} {' '.join(usage.split()[:3])} "
                             f"constexprs={list(consts.values())}{serialised}")
    return lines


def _needs_fp8(name: str) -> bool:
    """Cases of FP8 / NVFP4 kernels (FP8 and NVFP4 caches, NVFP4 dequantization, the NVFP4 GEMM): their e4m3
    conversions need sm_89+. (fp8_quantize is torch code; nvfp4_quantize's kernel builds e4m3 bits by integer ops.)"""
    return any(word in name for word in ("decode fp8", "prefill fp8", "decode nvfp4", "nvfp4_dequantize", "gemm"))


def main() -> int:
    """Exit status 1 if any case fails to compile; with --res-usage also print registers and spills."""
    arch = int(sys.argv[sys.argv.index("--arch") + 1]) if "--arch" in sys.argv else 90
    driver.set_active(Sm90CompileOnly(arch))
    failed = []
    from tileflash.launch import direct

    cases = _cases(arch)
    if "--only" in sys.argv:  # name fragments separated by "|": the cases whose names hold one of them
        wanted = sys.argv[sys.argv.index("--only") + 1].split("|")
        cases = {name: fn for name, fn in cases.items() if any(w in name for w in wanted)}
    usage = "--res-usage" in sys.argv
    kernels = _kernels() if usage else ()
    for name, fn in cases.items():
        direct.clear_all()  # each case plans afresh
        for _, kern in kernels:  # each case's own variants (Triton reloads shared ones from its disk cache)
            kern.device_caches.clear()
        if fn is None or (arch < 89 and _needs_fp8(name)):
            print(f"skip  {name}: " + ("an sm_90 kernel's forced config" if fn is None else
                                       "FP8 / NVFP4 kernels need sm_89+ (the ops refuse older GPUs)"))
            continue
        try:
            fn()
            print(f"ok    {name}")
            for line in _resource_usage(kernels):
                print(f"      {line}")
        except Exception as exc:  # noqa: BLE001 - report every case
            while exc.__cause__ is not None:
                exc = exc.__cause__
            failed.append(name)
            print(f"FAIL  {name}: {type(exc).__name__}: {str(exc)[-600:]}")
    print(f"{len(failed)} of {len(cases)} cases failed to compile for sm_{arch}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
