"""Benchmark suites: the shape registries (plain data) and the prefill, decode, backward and GEMM runners.

Every backend of every shape is first checked against an fp32 reference (SDPA's math backend, or an fp32 matmul
for the GEMM), then timed;
a failure of one backend is printed and recorded, and the run goes on.
"""

from collections import Counter

import torch
import torch.nn.functional as F

from tileflash.bench import peers
from tileflash.bench.formulas import (
    BF16_GEMM_TFLOPS,
    COPY_TBPS,
    FP8_GEMM_TFLOPS,
    attn_bwd_flops,
    attn_fwd_flops,
    decode_kv_bytes,
    extend_flops,
    gbps,
    gemm_flops,
    gemm_weight_bytes,
    mla_decode_bytes,
    mla_decode_flops,
    nvfp4_weight_bytes,
    tflops,
)
from tileflash.bench.table import format_cell, format_table
from tileflash.bench.timing import bench_ms, graphed, rotating_graph_ms, rotation_copies
from tileflash.lowp.formats import e4m3_saturate

DEVICE = "cuda"
DTYPE = torch.bfloat16
TOL = 2e-2  # max abs error allowed for bf16 outputs
# FP8 attention's rows, against the fp32 reference of their dequantized inputs: P is rounded to e4m3 (steps of
# 2^-4 relative): rows that see a few keys (causal) carry that onto |v| (run 140: 0.049 at |v| ~ 3).
FP8_TOL = 0.1
# The fp32 reference covers a slice, so its [S, S] score matrix stays small at 16k tokens.
CHECK_KV_HEADS = 2  # prefill: batch 0, the q heads of the first 2 kv heads
CHECK_BATCH = 4  # decode: the first 4 sequences, all heads

# batch * seqlen = 16k tokens and nheads * d = 2048 in every row, so work grows only with seqlen.
PREFILL_SHAPES = [
    {
        "batch": 16384 // s, "seqlen": s, "nheads": 2048 // d, "d": d, "causal": causal,
        "label": f"d{d}-{'causal' if causal else 'full'}",
    }
    for d in (64, 128, 256)
    for causal in (False, True)
    for s in (1024, 2048, 4096, 8192, 16384)
] + [
    # DeepSeek-V3's prefill at tensor parallel 8: q, k 192 wide, v 128 (FA3's headdim_v), 16 heads
    {
        "batch": 16384 // s, "seqlen": s, "nheads": 16, "d": 192, "dv": 128, "causal": causal,
        "label": f"d192v128-{'causal' if causal else 'full'}",
    }
    for causal in (False, True)
    for s in (1024, 4096, 16384)
]

DECODE_GRID = (
    (1, 8192), (1, 32768), (1, 131072), (8, 8192), (8, 32768),
    (32, 2048), (32, 8192), (64, 4096), (128, 1024), (256, 2048),
)
# label, hq, hkv, d, page_size (None = contiguous cache). Labels are picked so that --only
# substrings don't collide: "d64" matches the head-dim rows, not "page64".
DECODE_SETS = (
    ("gqa", 32, 8, 128, None),
    ("gqa-page16", 32, 8, 128, 16),
    ("gqa-page64", 32, 8, 128, 64),
    ("mqa", 8, 1, 128, None),
    ("gqa-d64", 32, 8, 64, None),
)
DECODE_SHAPES = [
    {"batch": b, "ctx": ctx, "hq": hq, "hkv": hkv, "d": d, "page_size": ps, "label": label}
    for label, hq, hkv, d, ps in DECODE_SETS
    for b, ctx in DECODE_GRID
]

# Backward: d in (64, 128) x causal x s in (1k, 4k, 16k), same 16k-token / 2048-dim sizing as prefill.
BACKWARD_SHAPES = [
    {
        "batch": 16384 // s, "seqlen": s, "nheads": 2048 // d, "d": d, "causal": causal,
        "label": f"d{d}-{'causal' if causal else 'full'}",
    }
    for d in (64, 128)
    for causal in (False, True)
    for s in (1024, 4096, 16384)
]

# Low precision: the GQA decode grid with an FP8 (e4m3, per-KV-head scales) cache for tileflash; peers read the
# same values from a bf16 cache ("next to the best bf16 peer"). FP8 also over pages of 16 and 64 tokens (engines'
# FP8 caches are paged): labels gqa-fp8, gqa-fp8-page16, gqa-fp8-page64, gqa-nvfp4.
LOWP_DECODE_SHAPES = [{**s, "label": s["label"].replace("gqa", f"gqa-{fmt}"), "kv": fmt, "kind": "decode"}
                      for fmt in ("fp8", "nvfp4") for s in DECODE_SHAPES
                      if s["label"] == "gqa" or fmt == "fp8" and s["label"] in ("gqa-page16", "gqa-page64")]

# Low precision, GEMM half: bf16 activations a [M, K] times a weight w [N, K] (out = a @ w.T): N = K, M from one
# decode token through serving batches (64, 128) to a prefill-sized batch, and an MLP up-projection (N=28672
# K=4096, label "gemm-mlp") at serving M. One label per weight shape, so --quick keeps M in (1, 16, 64) of each,
# and --only gemm / --only 8k pick these rows (no other label contains "gemm" or "8k"; "fp8" matches only the
# decode rows above).
GEMM_SHAPES = [
    *({"kind": "gemm", "m": m, "n": nk, "k": nk, "label": f"gemm-{nk // 1024}k"}
      for nk in (4096, 8192) for m in (1, 16, 64, 128, 1024, 4096)),
    *({"kind": "gemm", "m": m, "n": 28672, "k": 4096, "label": "gemm-mlp"} for m in (1, 16, 64, 128)),
]
LOWP_SHAPES = LOWP_DECODE_SHAPES + GEMM_SHAPES

# Extend / chunked prefill over a paged cache (SGLang's flash_attn_with_kvcache with many new queries): batch 4,
# 32/8 heads d128, a 4096-token cached prefix, new queries causal after it; the same pages through
# flash_attn_varlen_func(block_table=...) alongside.
EXTEND_SHAPES = [
    {"batch": 4, "prefix": 4096, "sq": sq, "hq": 32, "hkv": 8, "d": 128, "page_size": ps, "label": f"page{ps}"}
    for ps in (16, 64)
    for sq in (64, 256, 1024, 2048)
]
EXTEND_BACKENDS = ("tileflash_kvcache", "tileflash_varlen")

# Attention sinks (issue 28): the same call with and without learnable_sink. Prefill d128 causal and gpt-oss's shape
# (d64, a 128-token sliding window), 16k tokens per batch; decode as CUDA-graph replay.
SINK_SHAPES = [
    {"kind": "prefill", "batch": 4, "seqlen": 4096, "nheads": 16, "hkv": 16, "d": 128, "window": None,
     "label": "sink-prefill-causal"},
    {"kind": "prefill", "batch": 4, "seqlen": 4096, "nheads": 64, "hkv": 8, "d": 64, "window": 127,
     "label": "sink-prefill-window"},
    {"kind": "decode", "batch": 1, "seqlen": 32768, "nheads": 32, "hkv": 8, "d": 128, "window": None,
     "label": "sink-decode-b1"},
    {"kind": "decode", "batch": 32, "seqlen": 8192, "nheads": 32, "hkv": 8, "d": 128, "window": None,
     "label": "sink-decode-b32"},
]
SINK_BACKENDS = ("tileflash", "tileflash_sink")

# Attention dropout (flash-attn 2.x's dropout_p): one training step's attention (forward + backward) with and without
# dropout, and SDPA's flash backend with the same dropout_p. Dropout runs on the Triton kernels, so its cost includes
# leaving the sm_90 warp-specialised ones.
DROPOUT_P = 0.1
DROPOUT_SHAPES = [
    {"batch": 4, "seqlen": 4096, "nheads": 16, "d": d, "causal": causal, "label": f"dropout-d{d}" + "-causal" * causal}
    for d in (64, 128) for causal in (False, True)
]
DROPOUT_BACKENDS = ("tileflash", "tileflash_dropout", "sdpa_flash_dropout")

# MLA decode (issue 28; DeepSeek-V2/V3: a 512-wide latent that is V and most of the key, a 64-wide rotary key, one
# KV head): H = 128 is compute-bound, H = 16 memory-bound; H = 8 (Kimi K2 at tensor parallel 8) and 32 (DeepSeek-V3
# at 4) are the narrow kernel's other tiles. Graph replay over input copies larger than the L2.
MLA_SHAPES = [
    {"kind": "mla", "hq": hq, "batch": b, "ctx": ctx, "page_size": ps,
     "label": f"mla-h{hq}" + (f"-page{ps}" if ps else "")}
    for hq, b, ctx, ps in ((128, 1, 4096, None), (128, 1, 32768, None), (128, 32, 4096, None), (128, 32, 16384, None),
                           (128, 128, 1024, None), (128, 128, 4096, None), (128, 32, 4096, 64),
                           (16, 1, 32768, None), (16, 8, 32768, None), (16, 32, 4096, None), (16, 128, 1024, None),
                           (16, 128, 4096, None), (16, 32, 4096, 64), (16, 8, 32768, 64),
                           (8, 1, 32768, None), (8, 8, 32768, None), (8, 128, 4096, None),
                           (32, 32, 4096, None), (32, 8, 32768, None))
] + [  # an e4m3 latent cache (per-tensor scales): half the bytes
    {"kind": "mla", "hq": hq, "batch": b, "ctx": ctx, "page_size": None, "kv": "fp8", "label": f"mla-h{hq}-fp8"}
    for hq, b, ctx in ((128, 32, 4096), (128, 1, 32768), (16, 8, 32768), (16, 128, 4096), (32, 32, 4096),
                      (32, 8, 32768))
]
# tileflash_triton_graph: the Triton MLA kernel (the sm_90 Gluon one declined), to show what the Gluon kernel gains
# flashinfer_mla_graph: FlashInfer's MLA wrapper over the same cache copies (where flashinfer imports)
MLA_BACKENDS = ("tileflash_graph", "tileflash", "tileflash_triton_graph", "sdpa_graph", "flashinfer_mla_graph")

PREFILL_BACKENDS = ("tileflash", "sdpa_flash", "sdpa_cudnn", "fa4")
BACKWARD_BACKENDS = ("tileflash", "tileflash_det", "sdpa_flash", "sdpa_cudnn")
TILEFLASH_DECODE = ("tileflash", "tileflash_sp", "tileflash_graph")
DECODE_PEERS = ("sdpa", "sdpa_graph", "flashinfer", "flashinfer_tc", "fa4")
# *_graph: the same call replayed from a CUDA graph. At decode-sized M an eager call is bound by the host (Python
# checks and launches), so the graph columns are the kernels' own speed; speedups take the best of either.
GEMM_BACKENDS = ("tileflash_nvfp4", "tileflash_nvfp4_graph", "torch_bf16", "torch_bf16_graph", "torch_fp8")
GEMM_OURS = ("tileflash_nvfp4", "tileflash_nvfp4_graph")
# Max relative error (max|out - ref| / max|ref|) per GEMM backend. tileflash is checked against a @ dequant(w).T,
# its own weights, so only bf16 output rounding separates them; the peers against a @ w.T, where torch_fp8 also
# carries the e4m3 rounding of a and w (~4% relative, measured on randn inputs; expected).
GEMM_TOL = {"tileflash_nvfp4": 2e-2, "tileflash_nvfp4_graph": 2e-2, "torch_bf16": 2e-2, "torch_bf16_graph": 2e-2,
            "torch_fp8": 0.1}


def select_shapes(shapes, quick=False, only=None):
    """Rows whose label contains ``only``; with ``quick``, the first 3 rows of each label."""
    picked = [s for s in shapes if only is None or only in s["label"]]
    if not quick:
        return picked
    seen = Counter()
    kept = []
    for s in picked:
        if seen[s["label"]] < 3:
            kept.append(s)
        seen[s["label"]] += 1
    return kept


def _tileflash():
    import tileflash

    return tileflash


def _randn(*shape):
    return torch.randn(*shape, device=DEVICE, dtype=DTYPE)


def reference_fp32(q, k, v, causal):
    """SDPA's math backend on fp32 copies; [B, S, H, D] in and out. For Sq == Sk, torch's
    top-left causal mask equals flash-attn's bottom-right one."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (x.float().transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=qt.shape[1] != kt.shape[1])
    return out.transpose(1, 2)


def max_abs_err(out, ref):
    return float((out.float() - ref).abs().max())


def rel_err(out, ref):
    """max|out - ref| / max|ref|, for outputs whose scale grows with the problem (GEMMs: ~sqrt(K))."""
    return max_abs_err(out, ref) / max(float(ref.abs().max()), 1e-30)


def _measure(name, build, check, note, tol=TOL, timer=None):
    """Build one backend's callable, check its output (error <= tol), time it (bench_ms, or timer(fn)). None when
    it is unavailable."""
    rec = {"ms": None, "max_err": None, "ok": False, "error": None}
    try:
        fn = build()
        if fn is None:
            return None
        rec["max_err"] = check(fn())
        rec["ok"] = rec["max_err"] <= tol
        if not rec["ok"]:
            note(f"  FAIL: {name} max err {rec['max_err']:.3g} > {tol} (timed anyway)")
        rec["ms"] = (timer or bench_ms)(fn)
    except Exception as e:
        rec["error"] = peers.short_error(e)
        note(f"  note: {name} failed: {rec['error']}")
    return rec


def _measure_tflops(builders, check, note, flops):
    """_measure each backend of builders, adding TFLOP/s for the given FLOP count."""
    results = {}
    for name, build in builders.items():
        rec = _measure(name, build, check, note)
        if rec is not None:
            rec["TFLOP/s"] = tflops(flops, rec["ms"]) if rec["ms"] else None
        results[name] = rec
    return results


def _best_ms(results, names):
    times = [results[n]["ms"] for n in names if results.get(n) and results[n]["ok"] and results[n]["ms"]]
    return min(times, default=None)


def speedup(results, ours):
    """Best peer time over best tileflash time, counting only runs that passed the check;
    above 1 means tileflash is faster."""
    mine = _best_ms(results, ours)
    theirs = _best_ms(results, [n for n in results if n not in ours])
    return theirs / mine if mine and theirs else None


def _field(row, backend, key):
    rec = row["backends"].get(backend)
    return rec.get(key) if rec else None


def _failed(row):
    return ", ".join(n for n, r in row["backends"].items() if r and not r["ok"]) or None


def _summary(results, key):
    return "  ".join(f"{n} {format_cell(r.get(key) if r else None)}" for n, r in results.items())


def _fp8_prefill(tf, q, k, v, causal, hk):
    """(tileflash's FP8 attention on e4m3 copies of q, k, v, quantized once outside the timing; the fp32 reference
    of those copies' values on the checked slice: batch 0, the q heads of the first hk kv heads)."""
    q8, k8, v8, qd, kd, vd = tf.fp8_quantize_qkv(q, k, v)
    group = q.shape[2] // k.shape[2]

    def values(x8, descale, g):
        return x8[:1, :, :hk * g].float() * descale[:1, :hk].repeat_interleave(g, 1)[:, None, :, None]

    ref = reference_fp32(values(q8, qd, group), values(k8, kd, 1), values(v8, vd, 1), causal)
    return lambda: tf.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd), ref


def _prefill_one(shape, tf, note):
    b, s, h, d, causal = (shape[k] for k in ("batch", "seqlen", "nheads", "d", "causal"))
    dv = shape.get("dv", d)
    q, k, v = (_randn(b, s, h, dim) for dim in (d, d, dv))
    hk = min(CHECK_KV_HEADS, k.shape[2])
    hq = hk * (q.shape[2] // k.shape[2])
    ref = reference_fp32(q[:1, :, :hq], k[:1, :, :hk], v[:1, :, :hk], causal)
    fp8 = {}

    def check(out):
        return max_abs_err(out[:1, :, :hq], ref)

    def fp8_build():  # FP8 attention takes V's head dim equal to q's only
        if dv != d:
            return None
        fn, fp8["ref"] = _fp8_prefill(tf, q, k, v, causal, hk)
        return fn

    builders = {
        "tileflash": lambda: lambda: tf.flash_attn_func(q, k, v, causal=causal),
        "sdpa_flash": lambda: peers.sdpa_prefill(q, k, v, causal, "flash", note),
        "sdpa_cudnn": lambda: peers.sdpa_prefill(q, k, v, causal, "cudnn", note),
        "fa4": lambda: peers.fa4_prefill(q, k, v, causal, note),
    }
    flops = attn_fwd_flops(b, h, s, s, d, causal, dv)
    results = _measure_tflops(builders, check, note, flops)
    bf16_speedup = speedup(results, ("tileflash",))  # no FP8 peer imports here: FP8 rows have no ratio to one
    rec = _measure("tileflash_fp8", fp8_build, lambda out: max_abs_err(out[:1, :, :hq], fp8["ref"]), note, FP8_TOL)
    if rec is not None:
        rec["TFLOP/s"] = tflops(flops, rec["ms"]) if rec["ms"] else None
    results["tileflash_fp8"] = rec
    tf_tflops, fp8_tflops = results["tileflash"]["TFLOP/s"], rec and rec["TFLOP/s"]
    return {
        **shape,
        "flops": flops,
        "backends": results,
        "speedup": bf16_speedup,
        "pct_bf16_gemm": 100 * tf_tflops / BF16_GEMM_TFLOPS if tf_tflops else None,
        "fp8_vs_bf16": fp8_tflops / tf_tflops if fp8_tflops and tf_tflops else None,
        "pct_fp8_gemm": 100 * fp8_tflops / FP8_GEMM_TFLOPS if fp8_tflops else None,
    }


def prefill_table(rows):
    headers = ["d", "causal", "seqlen", "tileflash", "SDPA-flash", "SDPA-cuDNN", "FA4", "tf/best", "%GEMM",
               "tf-FP8", "fp8/bf16", "%FP8GEMM", "failed"]
    body = [
        [f"{r['d']}/{r['dv']}" if "dv" in r else r["d"], r["causal"], r["seqlen"],
         *(_field(r, n, "TFLOP/s") for n in PREFILL_BACKENDS),
         r["speedup"], r["pct_bf16_gemm"], _field(r, "tileflash_fp8", "TFLOP/s"), r.get("fp8_vs_bf16"),
         r.get("pct_fp8_gemm"), _failed(r)]
        for r in rows
    ]
    title = (f"Prefill forward, bf16, TFLOP/s (BF16 GEMM ceiling {BF16_GEMM_TFLOPS:.0f}); "
             "tf/best > 1: tileflash faster than the best peer; tf-FP8: e4m3 q, k, v with descales (FP8 GEMM "
             f"ceiling {FP8_GEMM_TFLOPS:.0f})")
    return format_table(headers, body, title=title)


def progress(done, total, width=24):
    """An ASCII progress bar, e.g. [#########...............]  9/24."""
    filled = width * done // max(total, 1)
    return f"[{'#' * filled}{'.' * (width - filled)}] {done:>{len(str(total))}}/{total}"


def _run(shapes, measure_one, describe, table, out):
    """Measure each shape (fresh seed, cache emptied between shapes), print a progress line each, then the table."""
    tf = _tileflash()
    rows = []
    for i, shape in enumerate(shapes):
        torch.manual_seed(0)
        rows.append(measure_one(shape, tf, out))
        out(f"{progress(i + 1, len(shapes))} {describe(shape, rows[-1])}")
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    out(table(rows))
    return rows


def run_prefill(shapes=None, out=print):
    """Check and time tileflash.flash_attn_func and its peers on each shape; print a table and
    return one JSON-serialisable dict per shape."""
    return _run(PREFILL_SHAPES if shapes is None else shapes, _prefill_one,
                lambda s, r: f"prefill {s['label']} s={s['seqlen']} (TFLOP/s): {_summary(r['backends'], 'TFLOP/s')}",
                prefill_table, out)


def _grads_err(grads, refs, heads: int) -> float:
    """The largest error of gradients on the checked slice (batch 0, the first `heads` heads) against their fp32
    references, relative to each reference's largest value (at least 1)."""
    return max(max_abs_err(g[:1, :, :heads], r) / max(float(r.abs().max()), 1.0) for g, r in zip(grads, refs))


def _backward_one(shape, tf, note):
    """Time the backward alone (the forward graph is kept and re-differentiated) and record the peak memory of
    one forward + backward next to each backend's time."""
    b, s, h, d, causal = (shape[k] for k in ("batch", "seqlen", "nheads", "d", "causal"))
    q, k, v = (_randn(b, s, h, d).requires_grad_() for _ in range(3))
    dout = _randn(b, s, h, d)
    hs = min(CHECK_KV_HEADS, h)
    sl = [x[:1, :, :hs].detach().float().requires_grad_() for x in (q, k, v)]
    ref = torch.autograd.grad(reference_fp32(*sl, causal), sl, dout[:1, :, :hs].float())

    def check(grads):
        return _grads_err(grads, ref, hs)

    def backward_of(forward):
        if forward is None:
            return None
        on_gpu = DEVICE == "cuda"
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        out = forward()
        grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        if on_gpu:
            peak_mib[0] = (torch.cuda.max_memory_allocated() - base) / 2**20
        del grads
        return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    builders = {
        "tileflash": lambda: lambda: tf.flash_attn_func(q, k, v, causal=causal),
        "tileflash_det": lambda: lambda: tf.flash_attn_func(q, k, v, causal=causal, deterministic=True),
        "sdpa_flash": lambda: peers.sdpa_prefill(q, k, v, causal, "flash", note),
        "sdpa_cudnn": lambda: peers.sdpa_prefill(q, k, v, causal, "cudnn", note),
    }
    flops = attn_bwd_flops(b, h, s, s, d, causal)
    results = {}
    for name, build in builders.items():
        peak_mib = [None]
        rec = _measure(name, lambda build=build: backward_of(build()), check, note)
        if rec is not None:
            rec["TFLOP/s"] = tflops(flops, rec["ms"]) if rec["ms"] else None
            rec["peak MiB"] = peak_mib[0]
        results[name] = rec
    # tf/best compares the default (atomic dQ) backward; the deterministic one is shown, not counted as a peer
    default_vs_peers = {n: r for n, r in results.items() if n != "tileflash_det"}
    return {**shape, "flops": flops, "backends": results, "speedup": speedup(default_vs_peers, ("tileflash",))}


def backward_table(rows):
    headers = ["d", "causal", "seqlen", "tileflash", "tf determ.", "SDPA-flash", "SDPA-cuDNN", "tf/best", "tf MiB",
               "cuDNN MiB", "failed"]
    body = [
        [r["d"], r["causal"], r["seqlen"], *(_field(r, n, "TFLOP/s") for n in BACKWARD_BACKENDS), r["speedup"],
         _field(r, "tileflash", "peak MiB"), _field(r, "sdpa_cudnn", "peak MiB"), _failed(r)]
        for r in rows
    ]
    title = ("Backward (dq, dk, dv), bf16, TFLOP/s = 2.5 x forward FLOPs / t; MiB = peak memory of one forward + "
             "backward above the inputs; check = max relative grad error vs fp32; tf determ. = deterministic=True "
             "(dQ in its own pass, no atomics)")
    return format_table(headers, body, title=title)


def run_backward(shapes=None, out=print):
    """Check and time the backward of tileflash.flash_attn_func and SDPA's flash and cuDNN backends."""
    return _run(BACKWARD_SHAPES if shapes is None else shapes, _backward_one,
                lambda s, r: f"backward {s['label']} s={s['seqlen']} (TFLOP/s): {_summary(r['backends'], 'TFLOP/s')}",
                backward_table, out)


def _decode_one(shape, tf, note):
    b, ctx, hq, hkv, d, ps = (shape[k] for k in ("batch", "ctx", "hq", "hkv", "d", "page_size"))
    q = _randn(b, 1, hq, d)

    def logical(x):
        """The logical [B, ctx, Hkv, D] cache, for the reference and for SDPA (which has no paging)."""
        return x if block_table is None else x[block_table.long()].view(b, ctx, hkv, d)

    seqlens = torch.full((b,), ctx, dtype=torch.int32, device=DEVICE)
    if ps is None:
        k_cache, v_cache = _randn(b, ctx, hkv, d), _randn(b, ctx, hkv, d)
        block_table = None
        # FlashInfer takes only paged caches; a contiguous cache is already one with 16-token
        # pages in order, so it gets a view and an identity table, not a copy.
        fi_k, fi_v = (x.view(b * ctx // 16, 16, hkv, d) for x in (k_cache, v_cache))
        fi_table = torch.arange(b * ctx // 16, dtype=torch.int32, device=DEVICE).view(b, -1)
    else:
        num_pages = b * ctx // ps
        k_cache, v_cache = _randn(num_pages, ps, hkv, d), _randn(num_pages, ps, hkv, d)
        # Pages in random order, as an allocator hands them out after some churn.
        block_table = torch.randperm(num_pages, device=DEVICE).to(torch.int32).view(b, ctx // ps)
        fi_k, fi_v, fi_table = k_cache, v_cache, block_table

    tf_k, tf_v, scales = k_cache, v_cache, {}
    if shape.get("kv") == "fp8":
        # Quantize per KV head; every backend then sees the same (dequantized) values, peers in bf16.
        ks, vs = (x.float().abs().amax(dim=(0, 1, 3)) / 448.0 for x in (k_cache, v_cache))
        tf_k, tf_v = ((x.float() / s_[:, None]).to(torch.float8_e4m3fn) for x, s_ in ((k_cache, ks), (v_cache, vs)))
        k_cache, v_cache = ((x.float() * s_[:, None]).to(DTYPE) for x, s_ in ((tf_k, ks), (tf_v, vs)))
        scales = dict(k_scale=ks, v_scale=vs)
    elif shape.get("kv") == "nvfp4":
        # One global scale per tensor, e4m3 scales per 16 elements; peers see the dequantized values in bf16.
        (tf_k, ks, kg), (tf_v, vs, vg) = tf.nvfp4_quantize(k_cache), tf.nvfp4_quantize(v_cache)
        k_cache, v_cache = (tf.nvfp4_dequantize(x, s_, g_).to(DTYPE) for x, s_, g_ in ((tf_k, ks, kg), (tf_v, vs, vg)))
        scales = dict(k_scale=ks, v_scale=vs, k_global_scale=kg.reshape(1), v_global_scale=vg.reshape(1))
    k_seq, v_seq = logical(k_cache), logical(v_cache)  # peers see the (dequantized) values in DTYPE

    n = min(b, CHECK_BATCH)
    ref = reference_fp32(q[:n], k_seq[:n], v_seq[:n], causal=False)  # Sq = 1 sees the whole cache
    if DEVICE == "cuda":
        # The copies below come from fresh segments, as an engine's startup cache does: cloned into the reference's
        # freed blocks, our decode ran 13% slower (run 188; not reproduced in isolation, run 189: cause open).
        torch.cuda.empty_cache()

    def check(out):
        return max_abs_err(out[:n], ref)

    nbytes = decode_kv_bytes(b, ctx, hkv, d, DTYPE.itemsize)
    # Bytes per element as stored: 2 (bf16), 1 (fp8), 9/16 (nvfp4: half a byte plus one e4m3 scale per 16).
    tf_bytes = decode_kv_bytes(b, ctx, hkv, d, (tf_k.numel() * tf_k.element_size() + (
        scales["k_scale"].numel() if "k_global_scale" in scales else 0)) / k_cache.numel())
    # The *_graph columns replay back-to-back calls, each on its own copy of q and the cache (together more than
    # twice the L2): every call reads HBM, as an engine's layers do, and none pays the write-back of a flush.
    copies = rotation_copies(int(min(nbytes, tf_bytes)))

    def tileflash_call(overlap, q=q, tf_k=tf_k, tf_v=tf_v, scales=scales):
        return lambda: tf.flash_attn_with_kvcache(
            q, tf_k, tf_v, cache_seqlens=seqlens, block_table=block_table, causal=True, sp_overlap=overlap, **scales,
        )

    def rotating(make_calls):
        """(build, timer) for _measure: the first of make_calls()'s callables is checked, all are timed."""
        calls = []

        def build():
            calls[:] = make_calls()
            return calls[0] if calls else None

        return build, lambda fn: rotating_graph_ms(calls)

    def tileflash_copies():
        clone = lambda t: t.clone()  # noqa: E731
        return [tileflash_call(False)] + [
            tileflash_call(False, clone(q), clone(tf_k), clone(tf_v), {k: clone(t) for k, t in scales.items()})
            for _ in range(copies - 1)]

    def sdpa_copies():  # sdpa_decode stores each copy's cache in its own layout ([B, Hkv, ctx, D])
        fns = [peers.sdpa_decode(q if i == 0 else q.clone(), k_seq, v_seq, note) for i in range(copies)]
        return [] if None in fns else fns

    builders = {
        "tileflash": lambda: tileflash_call(False),
        "tileflash_sp": lambda: tileflash_call(True),
        "tileflash_graph": rotating(tileflash_copies),
        "sdpa": lambda: peers.sdpa_decode(q, k_seq, v_seq, note),
        "sdpa_graph": rotating(sdpa_copies),
        "flashinfer": lambda: peers.flashinfer_decode(q, fi_k, fi_v, fi_table, ctx, False, note),
        "flashinfer_tc": lambda: peers.flashinfer_decode(q, fi_k, fi_v, fi_table, ctx, True, note),
        "fa4": lambda: peers.fa4_decode(q, k_cache, v_cache, seqlens, block_table, note),
    }
    results = {}
    for name, build in builders.items():
        build, timer = build if isinstance(build, tuple) else (build, None)
        rec = _measure(name, build, check, note, timer=timer)
        if rec is not None:
            rec["us"] = rec["ms"] * 1e3 if rec["ms"] else None
            read = tf_bytes if name in TILEFLASH_DECODE else nbytes
            rec["GB/s"] = gbps(read, rec["ms"]) if rec["ms"] else None
        results[name] = rec
    graph = results["tileflash_graph"]
    return {
        **shape,
        "kv_bytes": nbytes,
        "copies": copies,
        "backends": results,
        "speedup": speedup(results, TILEFLASH_DECODE),
        "pct_copy": 100 * graph["GB/s"] / (COPY_TBPS * 1e3) if graph["GB/s"] else None,
    }


def decode_table(rows):
    headers = ["set", "B", "ctx", "tf us", "tf-S/P us", "tf-graph us", "graph GB/s", "%copy",
               "SDPA us", "SDPA-graph us", "FI us", "FI-TC us", "FA4 us", "tf/best", "failed"]
    body = [
        [r["label"], r["batch"], r["ctx"], *(_field(r, n, "us") for n in TILEFLASH_DECODE),
         _field(r, "tileflash_graph", "GB/s"), r["pct_copy"],
         *(_field(r, n, "us") for n in DECODE_PEERS), r["speedup"], _failed(r)]
        for r in rows
    ]
    title = (f"Decode (Sq=1), bf16, microseconds; *-graph: back-to-back replay over input copies > 2x L2; %copy = "
             f"tileflash graph GB/s over the {COPY_TBPS} TB/s copy ceiling; tf/best > 1: best tileflash faster than "
             "the best peer")
    return format_table(headers, body, title=title)


def run_decode(shapes=None, out=print):
    """Check and time tileflash.flash_attn_with_kvcache (eager, S/P-overlapped loop, CUDA graph) and its
    peers on each shape, then the MLA set (qv); print a table per set and return one JSON-serialisable dict per
    shape."""
    shapes = DECODE_SHAPES + MLA_SHAPES if shapes is None else shapes
    gqa, mla = [s for s in shapes if s.get("kind") != "mla"], [s for s in shapes if s.get("kind") == "mla"]
    rows = []
    if gqa:
        rows += _run(gqa, _decode_one, lambda s, r: f"decode {s['label']} b={s['batch']} ctx={s['ctx']} (us): "
                                                    f"{_summary(r['backends'], 'us')}", decode_table, out)
    if mla:
        rows += _run(mla, _mla_one, lambda s, r: f"decode {s['label']} b={s['batch']} ctx={s['ctx']} (us): "
                                                 f"{_summary(r['backends'], 'us')}", mla_table, out)
    return rows


def _mla_one(shape, tf, note):
    """tileflash's MLA decode (qv) over copies of the latent cache whose sum exceeds the L2, checked on the first
    two sequences against the fp32 reference of the concatenated query and key; SDPA on a cache stored as 576-wide
    keys and 512-wide values (what attention without qv reads)."""
    hq, b, ctx, ps = (shape[k] for k in ("hq", "batch", "ctx", "page_size"))
    fp8 = shape.get("kv") == "fp8"
    nbytes = mla_decode_bytes(b, ctx, dtype_bytes=1 if fp8 else 2)
    copies = rotation_copies(nbytes)
    seqlens = torch.full((b,), ctx, dtype=torch.int32, device=DEVICE)
    table = None
    if ps:  # pages in random order, as an allocator hands them out after some churn
        table = torch.randperm(b * ctx // ps, device=DEVICE).to(torch.int32).view(b, -1)
    inputs = []
    scales = {}
    if fp8:  # every backend sees the dequantized values (peers in bf16)
        scales = dict(k_scale=torch.full((1,), 4.5 / 448, device=DEVICE), v_scale=torch.full((1,), 4.5 / 448,
                                                                                              device=DEVICE))
    for _ in range(copies):
        q, qv = _randn(b, 1, hq, 64), _randn(b, 1, hq, 512)
        shape_kv = (b * ctx // ps, ps) if ps else (b, ctx)
        kc, vc = _randn(*shape_kv, 1, 64), _randn(*shape_kv, 1, 512)
        if fp8:
            kc, vc = (e4m3_saturate(x.float() / scales["k_scale"]) for x in (kc, vc))
        inputs.append((q, qv, kc, vc))

    def values(x):  # a cache as the attention sees it, in DTYPE
        return x if not fp8 else (x.float() * scales["k_scale"]).to(DTYPE)

    def logical(x):
        return x if table is None else x[table.long()].reshape(b, ctx, 1, x.shape[-1])

    q, qv, kc, vc = inputs[0]
    n = min(b, 2)
    k_seq, v_seq = logical(values(kc))[:n], logical(values(vc))[:n]
    ref = reference_fp32(torch.cat([q[:n], qv[:n]], -1), torch.cat([k_seq, v_seq], -1), v_seq, causal=False)

    def check(out):
        return max_abs_err(out[:n], ref)

    def call(x):
        return lambda: tf.flash_attn_with_kvcache(x[0], x[2], x[3], cache_seqlens=seqlens, block_table=table, qv=x[1],
                                                  **scales)

    def sdpa():
        k_full, v_full = torch.cat([logical(values(kc)), logical(values(vc))], -1), logical(values(vc))
        return peers.sdpa_decode(torch.cat([q, qv], -1), k_full, v_full, note)

    results = {}
    for name in MLA_BACKENDS:
        rec = {"us": None, "max_err": None, "ok": False, "error": None}
        try:
            if name == "sdpa_graph":
                fn = sdpa()
                if fn is None:
                    continue
                rec["max_err"] = check(fn())
                rec["us"] = bench_ms(graphed(fn)) * 1e3  # one copy (the peer's cache layout is not ours)
            elif name == "flashinfer_mla_graph":
                calls = peers.flashinfer_mla([(x[0], x[1], values(x[2]), values(x[3])) for x in inputs], seqlens,
                                             table, note)  # FP8 rows: the dequantized values, as SDPA's
                if calls is None:
                    continue
                rec["max_err"] = check(calls[0]())
                rec["us"] = rotating_graph_ms(calls) * 1e3
            elif name == "tileflash_triton_graph":
                from tileflash import config

                with config.override(mla_gluon=None):
                    rec["max_err"] = check(call(inputs[0])())
                    rec["us"] = rotating_graph_ms([call(x) for x in inputs]) * 1e3
            else:
                rec["max_err"] = check(call(inputs[0])())
                rec["us"] = (rotating_graph_ms([call(x) for x in inputs]) if name == "tileflash_graph"
                             else bench_ms(call(inputs[0]))) * 1e3
            rec["ok"] = rec["max_err"] <= TOL
            if not rec["ok"]:
                note(f"  FAIL: {name} max err {rec['max_err']:.3g} > {TOL}")
        except Exception as e:  # noqa: BLE001 - a failing backend is a result
            rec["error"] = peers.short_error(e)
            note(f"  note: {name} failed: {rec['error']}")
        results[name] = rec
    us = results["tileflash_graph"]["us"]
    flops = mla_decode_flops(b, hq, 1, ctx)
    return {**shape, "kv_bytes": nbytes, "copies": copies, "backends": results,
            "TB/s": nbytes / us / 1e6 if us else None, "TFLOP/s": flops / us / 1e6 if us else None}


def mla_table(rows):
    headers = ["set", "B", "ctx", "tf-graph us", "tf eager us", "TB/s", "%copy", "TFLOP/s", "%GEMM", "triton us",
               "triton/tf", "SDPA-graph us", "tf/SDPA", "FlashInfer us", "tf/FI", "failed"]
    body = []
    for r in rows:
        ours, sdpa = _field(r, "tileflash_graph", "us"), _field(r, "sdpa_graph", "us")
        tri, fi = _field(r, "tileflash_triton_graph", "us"), _field(r, "flashinfer_mla_graph", "us")
        body.append([r["label"], r["batch"], r["ctx"], ours, _field(r, "tileflash", "us"), r["TB/s"],
                     100 * r["TB/s"] / COPY_TBPS if r["TB/s"] else None, r["TFLOP/s"],
                     100 * r["TFLOP/s"] / BF16_GEMM_TFLOPS if r["TFLOP/s"] else None, tri,
                     tri / ours if ours and tri else None, sdpa, sdpa / ours if ours and sdpa else None, fi,
                     fi / ours if ours and fi else None, _failed(r)])
    title = ("MLA decode (qv: latent 512 + rotary 64, one KV head, Sq=1), bf16, microseconds; tf-graph: graph replay "
             "over input copies > 2x L2; roofline: bytes 576 x 2 per token, FLOPs 2 x H x (576 + 512) per token")
    return format_table(headers, body, title=title)


def _extend_one(shape, tf, note):
    """Check both calls on sequence 0 (heads of the first KV head) against the fp32 reference over the gathered
    keys, then time them."""
    from tileflash.reference import attention_ref, gather_cache

    b, prefix, sq, hq, hkv, d, ps = (shape[k] for k in ("batch", "prefix", "sq", "hq", "hkv", "d", "page_size"))
    total = prefix + sq
    pages_per_seq = -(-total // ps)
    pool_k, pool_v = (_randn(b * pages_per_seq, ps, hkv, d) for _ in range(2))
    table = torch.randperm(b * pages_per_seq, device=DEVICE).view(b, pages_per_seq).to(torch.int32)
    lens = torch.full((b,), total, dtype=torch.int32, device=DEVICE)
    q = _randn(b, sq, hq, d)
    cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=DEVICE)
    g = hq // hkv
    kk, vv = (gather_cache(x, table, total, 0)[None, :, :1] for x in (pool_k, pool_v))
    ref, _ = attention_ref(q[:1, :, :g], kk, vv, causal=True)

    def check(out):
        return max_abs_err(out.view(b, sq, hq, d)[:1, :, :g], ref.float())

    builders = {
        "tileflash_kvcache": lambda: lambda: tf.flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=lens,
                                                                        block_table=table, causal=True),
        "tileflash_varlen": lambda: lambda: tf.flash_attn_varlen_func(
            q.view(-1, hq, d), pool_k, pool_v, cu_q, cu_q, sq, total, seqused_k=lens, causal=True,
            block_table=table),
    }
    flops = extend_flops(b, hq, sq, prefix, d)
    results = _measure_tflops(builders, check, note, flops)
    kv_ms, vl_ms = (_field({"backends": results}, n, "ms") for n in EXTEND_BACKENDS)
    return {**shape, "flops": flops, "backends": results,
            "kvcache_vs_varlen": vl_ms / kv_ms if kv_ms and vl_ms else None}


def extend_table(rows):
    headers = ["page", "Sq", "prefix", "kvcache us", "varlen us", "kvcache TFLOP/s", "varlen TFLOP/s",
               "varlen/kvcache", "%GEMM", "failed"]
    body = [
        [r["page_size"], r["sq"], r["prefix"], *(1e3 * _field(r, n, "ms") if _field(r, n, "ms") else None
                                                 for n in EXTEND_BACKENDS),
         *(_field(r, n, "TFLOP/s") for n in EXTEND_BACKENDS), r["kvcache_vs_varlen"],
         100 * _field(r, "tileflash_kvcache", "TFLOP/s") / BF16_GEMM_TFLOPS
         if _field(r, "tileflash_kvcache", "TFLOP/s") else None, _failed(r)]
        for r in rows
    ]
    title = ("Extend over a paged cache (batch 4, 32/8 heads d128, causal after a 4096-token prefix), bf16: "
             "flash_attn_with_kvcache vs flash_attn_varlen_func on the same pages; > 1: kvcache faster")
    return format_table(headers, body, title=title)


def run_extend(shapes=None, out=print):
    """Check and time flash_attn_with_kvcache with many new queries against flash_attn_varlen_func(block_table)."""
    return _run(EXTEND_SHAPES if shapes is None else shapes, _extend_one,
                lambda s, r: f"extend {s['label']} sq={s['sq']} (TFLOP/s): {_summary(r['backends'], 'TFLOP/s')}",
                extend_table, out)


def _sinks_one(shape, tf, note):
    """One call with and without a sink, both checked against the fp32 reference with the sink on a slice."""
    from tileflash.reference import attention_ref

    b, s, h, hkv, d, window = (shape[k] for k in ("batch", "seqlen", "nheads", "hkv", "d", "window"))
    decode = shape["kind"] == "decode"
    q = _randn(b, 1 if decode else s, h, d)
    k, v = _randn(b, s, hkv, d), _randn(b, s, hkv, d)
    sink = torch.randn(h, device=DEVICE) * 2
    kw = dict(causal=True, window_size=(window, 0) if window else (-1, -1))
    g = h // hkv
    refs = [attention_ref(q[:1, :, :g], k[:1, :, :1], v[:1, :, :1], learnable_sink=x, **kw)[0].float()
            for x in (None, sink[:g])]
    lens = torch.full((b,), s, dtype=torch.int32, device=DEVICE)

    def call(with_sink):
        extra = dict(learnable_sink=sink) if with_sink else {}
        if decode:
            return graphed(lambda: tf.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, **kw, **extra))
        return lambda: tf.flash_attn_func(q, k, v, **kw, **extra)

    results = {name: _measure(name, lambda w=name.endswith("sink"): call(w),
                              lambda out, w=name.endswith("sink"): max_abs_err(out[:1, :, :g], refs[w]),
                              note)
               for name in SINK_BACKENDS}
    base, with_sink = (_field({"backends": results}, n, "ms") for n in SINK_BACKENDS)
    return {**shape, "backends": results, "sink_cost_pct": 100 * (with_sink / base - 1) if base and with_sink else None}


def sinks_table(rows):
    headers = ["shape", "B", "S", "H/Hkv", "d", "no sink us", "sink us", "cost %", "failed"]
    body = [[r["label"], r["batch"], r["seqlen"], f"{r['nheads']}/{r['hkv']}", r["d"],
             *(1e3 * _field(r, n, "ms") if _field(r, n, "ms") else None for n in SINK_BACKENDS), r["sink_cost_pct"],
             _failed(r)] for r in rows]
    return format_table(headers, body, title="Attention sinks: the same call with and without learnable_sink (bf16; "
                                             "decode as CUDA-graph replay); target cost <= 3%")


def run_sinks(shapes=None, out=print):
    """Time tileflash with and without learnable_sink (issue 28's <= 3% cost)."""
    return _run(SINK_SHAPES if shapes is None else shapes, _sinks_one,
                lambda s, r: f"sinks {s['label']}: cost {format_cell(r['sink_cost_pct'])} %", sinks_table, out)


def _dropout_one(shape, tf, note):
    """Forward + backward (d out = a fixed dout) of each backend. Checks: tileflash against the fp32 reference on a
    slice (batch 0, the first CHECK_KV_HEADS heads), with dropout the reference regenerating the call's pattern
    from its seed (tileflash.reference.dropout_keep); SDPA's pattern is its own, so it is checked by what any
    correct dropout keeps: out is linear in v, so sum(out * dout) = sum(v * dv) within bf16 rounding."""
    from tileflash import _utils
    from tileflash.reference import attention_ref

    b, s, h, d, causal = (shape[k] for k in ("batch", "seqlen", "nheads", "d", "causal"))
    q, k, v = (_randn(b, s, h, d).requires_grad_() for _ in range(3))
    dout = _randn(b, s, h, d)
    hs = min(CHECK_KV_HEADS, h)
    seed = 1234
    torch.manual_seed(seed)
    drawn = int(_utils.dropout_seed(q.device))  # the seed of a call made right after torch.manual_seed(seed)
    sl = [x[:1, :, :hs].detach().float().requires_grad_() for x in (q, k, v)]
    refs = {p: torch.autograd.grad(attention_ref(*sl, causal=causal, dropout_p=p, dropout_seed=drawn)[0], sl,
                                   dout[:1, :, :hs].float()) for p in (0.0, DROPOUT_P)}

    def step(forward):
        def fn():
            out = forward()
            return (out, *torch.autograd.grad(out, (q, k, v), dout))
        return fn

    def against(ref):
        return lambda res: _grads_err(res[1:], ref, hs)

    def linear_in_v(res):
        out, _, _, dv = res
        lhs, rhs = (out.float() * dout.float()).sum(), (v.detach().float() * dv.float()).sum()
        return float((lhs - rhs).abs() / max(float(lhs.abs()), 1.0))

    def seeded(fn):
        torch.manual_seed(seed)
        return fn()

    sdpa = peers.sdpa_prefill(q, k, v, causal, "flash", note, dropout_p=DROPOUT_P)
    builders = {
        "tileflash": (lambda: step(lambda: tf.flash_attn_func(q, k, v, causal=causal)), against(refs[0.0])),
        "tileflash_dropout": (lambda: step(lambda: seeded(lambda: tf.flash_attn_func(
            q, k, v, causal=causal, dropout_p=DROPOUT_P))), against(refs[DROPOUT_P])),
        "sdpa_flash_dropout": (lambda: step(sdpa) if sdpa else None, linear_in_v),
    }
    results = {name: _measure(name, build, check, note) for name, (build, check) in builders.items()}
    from tileflash import config

    with config.override(fwd_ws=None, bwd_ws=None):  # the kernels a dropout call takes, without the dropout
        results["tileflash_triton"] = _measure("tileflash_triton", *builders["tileflash"], note)
    base, drop, peer = (_field({"backends": results}, n, "ms") for n in DROPOUT_BACKENDS)
    return {**shape, "backends": results, "dropout_cost_pct": 100 * (drop / base - 1) if base and drop else None,
            "speedup": peer / drop if peer and drop and results["tileflash_dropout"]["ok"] else None}


def dropout_table(rows):
    headers = ["shape", "B", "S", "H", "d", "causal", "tf ms", "tf dropout ms", "SDPA-flash dropout ms", "cost %",
               "SDPA/tf", "tf Triton ms", "failed"]
    body = [[r["label"], r["batch"], r["seqlen"], r["nheads"], r["d"], r["causal"],
             *(_field(r, n, "ms") for n in DROPOUT_BACKENDS), r["dropout_cost_pct"], r["speedup"],
             _field(r, "tileflash_triton", "ms"), _failed(r)] for r in rows]
    return format_table(headers, body, title=f"Attention dropout: forward + backward, bf16, dropout_p={DROPOUT_P} "
                                             "(tileflash without it for the cost); SDPA/tf > 1: tileflash faster; "
                                             "tf Triton: without dropout on the Triton kernels a dropout call takes")


def run_dropout(shapes=None, out=print):
    """Time one training step's attention with and without dropout_p, and SDPA-flash with the same dropout."""
    return _run(DROPOUT_SHAPES if shapes is None else shapes, _dropout_one,
                lambda s, r: f"dropout {s['label']}: cost {format_cell(r['dropout_cost_pct'])} %", dropout_table, out)


def _gemm_one(shape, tf, note):
    """a [M, K] bf16 @ w [N, K]^T: tileflash on w quantized once to NVFP4, torch in bf16 and in FP8. The graph
    columns replay back-to-back calls over copies of the weight that together exceed the L2 (every call reads its
    weight from HBM, as a model's layers do; an NVFP4 8192 x 8192 weight alone would fit in the L2)."""
    m, n, k = (shape[x] for x in ("m", "n", "k"))
    a, w = _randn(m, k), _randn(n, k)
    w_q = tf.nvfp4_quantize(w)  # (data [N, K/2] uint8, scales [N, K/16] e4m3, global scale [])
    ref = a.float() @ w.float().T
    ref_q = a.float() @ tf.nvfp4_dequantize(*w_q).T  # what a correct NVFP4 GEMM computes

    def check_q(out):
        return rel_err(out, ref_q)

    def check(out):
        return rel_err(out, ref)

    w_qs = [w_q] + [tuple(t.clone() for t in w_q) for _ in range(rotation_copies(nvfp4_weight_bytes(n, k)) - 1)]
    ws = [w] + [w.clone() for _ in range(rotation_copies(gemm_weight_bytes(n, k, DTYPE.itemsize)) - 1)]
    tf_calls = [lambda c=c: tf.nvfp4_matmul(a, *c) for c in w_qs]
    bf16_calls = [lambda c=c: a @ c.T for c in ws]
    builders = {  # name: (build, check, timer: None for bench_ms)
        "tileflash_nvfp4": (lambda: tf_calls[0], check_q, None),
        "tileflash_nvfp4_graph": (lambda: tf_calls[0], check_q, lambda fn: rotating_graph_ms(tf_calls)),
        "torch_bf16": (lambda: bf16_calls[0], check, None),
        "torch_bf16_graph": (lambda: bf16_calls[0], check, lambda fn: rotating_graph_ms(bf16_calls)),
        "torch_fp8": (lambda: peers.scaled_mm_fp8(a, w, note), check, None),
    }
    weight_bytes = {
        "tileflash_nvfp4": nvfp4_weight_bytes(n, k),
        "tileflash_nvfp4_graph": nvfp4_weight_bytes(n, k),
        "torch_bf16": gemm_weight_bytes(n, k, DTYPE.itemsize),
        "torch_bf16_graph": gemm_weight_bytes(n, k, DTYPE.itemsize),
        "torch_fp8": gemm_weight_bytes(n, k, 1),
    }
    flops = gemm_flops(m, n, k)
    results = {}
    for name, (build, chk, timer) in builders.items():
        rec = _measure(name, build, chk, note, tol=GEMM_TOL[name], timer=timer)
        if rec is not None:
            rec["us"] = rec["ms"] * 1e3 if rec["ms"] else None
            rec["TFLOP/s"] = tflops(flops, rec["ms"]) if rec["ms"] else None
            rec["GB/s"] = gbps(weight_bytes[name], rec["ms"]) if rec["ms"] else None
        results[name] = rec
    ours = GEMM_OURS
    return {
        **shape,
        "flops": flops,
        "weight_bytes": weight_bytes,
        # The accuracy NVFP4 weights cost: a @ dequant(w).T against a @ w.T, both fp32.
        "nvfp4_weight_err": rel_err(ref_q, ref),
        "backends": results,
        "speedup_bf16": speedup({x: results[x] for x in (*ours, "torch_bf16", "torch_bf16_graph")}, ours),
        "speedup": speedup(results, ours),
    }


def gemm_table(rows):
    headers = ["M", "N", "K", "tileflash us", "tf-graph us", "bf16 us", "bf16-graph us", "fp8 us", "tf/bf16",
               "tf/best", "tf-graph weight GB/s", "failed"]
    body = [
        [r["m"], r["n"], r["k"], *(_field(r, x, "us") for x in GEMM_BACKENDS), r["speedup_bf16"], r["speedup"],
         _field(r, "tileflash_nvfp4_graph", "GB/s"), _failed(r)]
        for r in rows
    ]
    title = ("GEMM a [M, K] bf16 @ w [N, K]^T, microseconds: tileflash = nvfp4_matmul on an NVFP4 w, bf16 = a @ w.T, "
             "fp8 = torch._scaled_mm on e4m3 a and w (per-tensor scales); graph = CUDA-graph replay over weight "
             "copies larger than the L2; tf/bf16, "
             "tf/best > 1: best tileflash faster than the best peer; weight GB/s = NVFP4 weight bytes (N*K*9/16) / t, "
             f"copy ceiling {COPY_TBPS} TB/s")
    return format_table(headers, body, title=title)


def run_gemm(shapes=None, out=print):
    """Check and time tileflash.nvfp4_matmul (bf16 activations, NVFP4 weights) against torch's bf16 matmul and FP8
    torch._scaled_mm on each shape; print a table and return one JSON-serialisable dict per shape."""
    return _run(GEMM_SHAPES if shapes is None else shapes, _gemm_one,
                lambda s, r: f"gemm M={s['m']} N={s['n']} K={s['k']} (us): {_summary(r['backends'], 'us')}",
                gemm_table, out)


def run_lowp(shapes=None, out=print):
    """The low-precision suite: the FP8-cache decode rows through run_decode, then the GEMM rows (kind "gemm")
    through run_gemm; one list back, decode rows first, every row keeping its shape's "kind"."""
    shapes = LOWP_SHAPES if shapes is None else shapes
    decode = [s for s in shapes if s.get("kind") != "gemm"]
    gemm = [s for s in shapes if s.get("kind") == "gemm"]
    return (run_decode(decode, out) if decode else []) + (run_gemm(gemm, out) if gemm else [])
