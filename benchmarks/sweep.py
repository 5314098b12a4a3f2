"""Tile-config sweep on the GPU: checks each config against SDPA, times it, reports SASS facts (HGMMA, spills).

Run on the GPU machine: `python benchmarks/sweep.py [--json PATH]`. The winners go into tileflash/heuristics.py
with the measurement in a comment; this script is how they were chosen.
"""
import argparse
import dataclasses
import itertools
import json
import sys

import torch
import torch.nn.functional as F

from tileflash.bench.formulas import attn_fwd_flops, decode_kv_bytes, gbps, tflops
from tileflash.bench.table import format_table
from tileflash.bench.timing import bench_ms
from tileflash.heuristics import FwdConfig
from tileflash.ops import decode as decode_ops
from tileflash.ops._launch import Mask, launch_attn_fwd
from tileflash.ops import direct

direct.ENABLED = False  # this script swaps heuristics and launchers, which cached plans would outlive

# The current picks (first) against one-warpgroup tiles (64 query rows, 4 warps): small enough for two or more
# programs per SM, so one program's softmax can run while another's MMAs do (FA3's ping-pong, left to the warp
# schedulers). The S/P-overlapped loop lost everywhere (run 17: d64 302 vs 410 TFLOP/s, d128 472 vs 486); so did a
# PV-lagged loop (runs 31-32, commit 37f1ef7: PV of block j-1 in flight during the softmax of block j).
# Three programs per SM for d128 (not yet measured): 64x32 tiles with 3 stages compile to 126 registers and 64 KB of
# shared memory (sm_90, triton 3.6, on the CPU), against 159 / 112 KB (two per SM) for 64x64: the softmax of one
# program needs MMAs of others to hide under, and fewer instructions per step did not help (run 46).
# d64 (run 48 chose 128x64 with TMA, and 64x64 for causal rows up to 4k keys; 0.86-0.87x cuDNN remained at causal
# 2k / 4k in run 49): 128 keys per step (fewer softmax passes per MMA) and two stages.
PREFILL_CONFIGS = {
    64: [FwdConfig(128, 64, 8, 3, tma=True), FwdConfig(64, 64, 4, 3, tma=True), FwdConfig(64, 128, 4, 2, tma=True),
         FwdConfig(64, 128, 4, 3, tma=True), FwdConfig(128, 128, 8, 2, tma=True), FwdConfig(128, 64, 8, 2, tma=True),
         FwdConfig(64, 64, 4, 2, tma=True)],
    # d128: 128 rows on one warpgroup with 32 keys per step (252 registers, 82 KB) lost everywhere in run 57: 415.4 /
    # 419.5 / 436.0 TFLOP/s non-causal at s = 2k / 4k / 16k against 481.4 / 486.7 / 498.5 (64x64) and 452.9 / 489.3
    # / 504.7 (128x128); 64x32 lost too (run 48). Kept as the record of what was measured.
    128: [FwdConfig(128, 128, 8, 3, tma=True), FwdConfig(64, 64, 4, 3, tma=True), FwdConfig(128, 32, 4, 3, tma=True)],
    256: [FwdConfig(128, 64, 8, 2, tma=True), FwdConfig(64, 32, 4, 3, tma=True)],
}
# (block_n, warps, stages, tma)
DECODE_CONFIGS = [(bn, 4, st, tma) for bn in (64, 128) for st in (2, 3, 4) for tma in (False, True)]


def sass_facts(compiled) -> str:
    try:
        ptx = compiled.asm.get("ptx", "")
    except Exception:  # noqa: BLE001 - best effort, never fail the sweep
        return "?"
    n_regs = getattr(compiled, "n_regs", "?")
    n_spills = getattr(compiled, "n_spills", "?")
    return (f"wgmma={'wgmma' in ptx} cp.async={'cp.async' in ptx} tma={'cp.async.bulk.tensor' in ptx} "
            f"regs={n_regs} spills={n_spills}")


def sweep_prefill(rows, out, dims=(64, 128, 256), seqlens=(4096,)):
    for d, causal, s in itertools.product(dims, (False, True), seqlens):
        h = 2048 // d
        b = 16384 // s
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal)
        ref = ref.transpose(1, 2)
        for cfg in PREFILL_CONFIGS[d]:
            o = torch.empty_like(q)
            lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)

            def run():
                return launch_attn_fwd(q, k, v, o, lse, q_batch_stride0=False, k_batch_stride0=False,
                                       num_batches=b, seqlen_q=s, seqlen_k=s, m_rows=s,
                                       softmax_scale=d ** -0.5, mask=Mask.make(causal, (-1, -1), 0.0),
                                       config=cfg, sp_overlap=cfg.sp_overlap)
            try:
                compiled = run()
                err = (o.float() - ref.float()).abs().max().item()
                ms = bench_ms(run)
                facts = sass_facts(compiled)
            except Exception as e:  # noqa: BLE001
                err, ms, facts = float("nan"), None, f"error: {str(e)[:80]}"
            tf = tflops(attn_fwd_flops(b, h, s, s, d, causal), ms) if ms else None
            rows.append(dict(kind="prefill", d=d, causal=causal, ctx=s, cfg=str(cfg), err=err, tflops=tf,
                             facts=facts))
            out(f"prefill d={d} causal={causal} s={s} {cfg}: err={err:.2e} TFLOP/s={tf} {facts}")


def sweep_decode(rows, out):
    import tileflash
    from tileflash.bench.timing import graphed

    shapes = [(1, 8192, 32, 8, 128, None), (1, 32768, 32, 8, 128, None), (1, 131072, 32, 8, 128, None),
              (8, 32768, 32, 8, 128, None), (32, 8192, 32, 8, 128, None), (128, 1024, 32, 8, 128, None),
              (1, 32768, 32, 8, 128, 16), (1, 32768, 32, 8, 128, 64), (1, 8192, 8, 1, 128, None),
              (1, 32768, 8, 1, 128, None)]
    for b, ctx, hq, hkv, d, ps in shapes:
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
        if ps is None:
            kc, vc = (torch.randn(b, ctx, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            table = None
            ks, vs = kc, vc
        else:
            n = b * ctx // ps
            kc, vc = (torch.randn(n, ps, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            table = torch.randperm(n, device="cuda").to(torch.int32).view(b, -1)
            ks, vs = (x[table.long()].view(b, ctx, hkv, d) for x in (kc, vc))
        lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
        ref = F.scaled_dot_product_attention(q.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2),
                                             enable_gqa=True).transpose(1, 2)
        nbytes = decode_kv_bytes(b, ctx, hkv, d)
        original = decode_ops.decode_config
        for bn, w, st, tma in DECODE_CONFIGS:
            if tma and ps is not None:
                continue
            for overlap in (True, False):
                decode_ops.decode_config = lambda *a, **kw: dataclasses.replace(  # noqa: E731
                    original(*a, **kw), block_n=bn, num_warps=w, num_stages=st, tma=tma)
                try:
                    fn = lambda: tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens,  # noqa: E731
                                                                   block_table=table, sp_overlap=overlap)
                    err = (fn().float() - ref.float()).abs().max().item()
                    ms = bench_ms(graphed(fn))
                except Exception as e:  # noqa: BLE001
                    err, ms = float("nan"), None
                    out(f"decode error {bn},{w},{st},{tma}: {str(e)[:100]}")
                finally:
                    decode_ops.decode_config = original
                rows.append(dict(kind="decode", b=b, ctx=ctx, hq=hq, hkv=hkv, d=d, ps=ps, bn=bn, warps=w,
                                 stages=st, tma=tma, overlap=overlap, err=err, us=ms * 1e3 if ms else None,
                                 gbps=gbps(nbytes, ms) if ms else None))
                out(f"decode b={b} ctx={ctx} hq={hq} hkv={hkv} d={d} ps={ps} bn={bn} w={w} st={st} tma={tma} "
                    f"overlap={overlap}: err={err:.2e} graph us={rows[-1]['us']}")


def best_table(rows):
    body = []
    keys = sorted({(r["kind"], r.get("d"), r.get("causal"), r.get("b"), r.get("ctx"), r.get("hkv"), r.get("ps"))
                   for r in rows}, key=str)
    for key in keys:
        group = [r for r in rows if (r["kind"], r.get("d"), r.get("causal"), r.get("b"), r.get("ctx"), r.get("hkv"),
                                     r.get("ps")) == key and (r.get("tflops") or r.get("us"))]
        if not group:
            continue
        if key[0] == "prefill":
            best = max(group, key=lambda r: r["tflops"])
            body.append([f"prefill d{key[1]} causal={key[2]} s={key[4]}", best["cfg"],
                         f"{best['tflops']:.0f} TFLOP/s", best["facts"]])
        else:
            best = min(group, key=lambda r: r["us"])
            body.append([f"decode b{key[3]} ctx{key[4]} hkv{key[5]} d{key[1]} ps{key[6]}",
                         f"bn={best['bn']} w={best['warps']} st={best['stages']} tma={best['tma']} "
                         f"ov={best['overlap']}",
                         f"{best['us']:.1f} us", f"{best['gbps']:.0f} GB/s"])
    return format_table(["shape", "best config", "result", "notes"], body, title="Best config per shape")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--skip", choices=["prefill", "decode"])
    ap.add_argument("--dims", default="64,128,256", help="prefill head dims to sweep")
    ap.add_argument("--seqlens", default="4096", help="prefill sequence lengths (16k tokens per batch)")
    args = ap.parse_args(argv)
    rows = []
    if args.skip != "prefill":
        sweep_prefill(rows, print, dims=[int(x) for x in args.dims.split(",")],
                      seqlens=[int(x) for x in args.seqlens.split(",")])
    if args.skip != "decode":
        sweep_decode(rows, print)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    print(best_table(rows))


if __name__ == "__main__":
    sys.exit(main())
