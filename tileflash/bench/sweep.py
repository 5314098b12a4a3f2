"""`python -m tileflash sweep FAMILY [--vary FIELD=A,B ...] [--shapes SPEC ...] [--json PATH]`: the tile sweep (GPU).

One CLI over the kernels' config dataclasses (tileflash.plan): every variant is the planner's own choice for the
shape with the --vary fields replaced (the cartesian product of their values; a field that is not the config's is a
call argument, e.g. num_splits for decode), forced through tileflash.config.override. Each variant's output is
compared with the default's ("diff X%" when it differs by more than 2% of the largest value: a difference from the
default, which need not be the variant's error, e.g. FP8 variants rounding P differently; an error while compiling or
running shows as its exception type), then timed: prefill / backward with do_bench, decode and the GEMM as
CUDA-graph replay over input copies larger than the L2. `default` is the planner's choice unchanged.

Families: see FAMILY_HELP below (`--help` lists them).

Examples: `python -m tileflash sweep decode --shapes 1,32768,32,8,128,0 --vary block_n=32,64 num_stages=2,3`,
`python -m tileflash sweep decode --shapes 1,8192,32,8,128,64 --vary num_stages=2,3 combine_pdl=0,1` (another
planner's choice, tileflash.config.KINDS, varied beside the tiles),
`python -m tileflash sweep backward-ws --shapes 64,0,4096 --vary one_fence=0,1 dq_by_rows=0,1`,
`python -m tileflash sweep decode --vary num_splits=0,4,8,16`. The winners go into tileflash/plan with the numbers.
"""
import argparse
import dataclasses
import itertools
import json
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from tileflash import config, plan
from tileflash.bench.formulas import attn_bwd_flops, attn_fwd_flops, decode_kv_bytes, gbps, gemm_flops, tflops
from tileflash.bench.table import format_table
from tileflash.bench.timing import bench_ms, rotating_graph_ms, rotation_copies

BF16 = torch.bfloat16
FAMILY_HELP = {
    "prefill": "fwd / FwdConfig: the Triton forward; shapes d,causal,seqlen[,dv] (16k tokens, 2048/d heads, bf16; dv: "
               "V's head dim, e.g. 192,1,4096,128)",
    "prefill-ws": "fwd_ws / WsFwdConfig: the sm_90 Gluon forward; same shapes",
    "prefill-fp8": "fwd / FwdConfig: the Triton forward on e4m3 q, k, v with descales; same shapes",
    "prefill-fp8-ws": "fwd_ws / WsFwdConfig: the sm_90 Gluon forward on e4m3 inputs (the planner's from 8k keys at "
                      "d128 and at d256; elsewhere give block_n, k_stages and v_stages); same shapes",
    "backward": "bwd / BwdConfig: the Triton backward; same shapes (deterministic via --vary deterministic=1)",
    "backward-ws": "bwd_ws / WsBwdConfig: the sm_90 Gluon dK/dV; same shapes",
    "decode": "decode / DecodeConfig: shapes batch,ctx,hq,hkv,d,page[,fp8] (page 0: contiguous), a bf16 cache (an "
              "e4m3 one with fp8), one token",
    "decode-mla": "mla_decode / DecodeConfig: the Triton MLA decode; shapes batch,ctx,hq[,fp8] (latent 512 + rotary "
                  "64, one KV head; e4m3 latents with scales 1 with fp8)",
    "decode-mla-gluon": "mla_gluon / MlaGluonConfig: the sm_90 Gluon MLA decode; same shapes (fp8: the narrow "
                        "kernel's tiles only)",
    "decode-quant": "quant_decode / QuantDecodeConfig: shapes batch,ctx,hq,hkv,d,nvfp4 (the register-operand decode)",
    "gemm": "gemm / GemmConfig: the Triton NVFP4 GEMM; shapes m,n,k (bf16 activations) or m,n,k,w4a4 (NVFP4 ones)",
    "gemm-mma": "gemm_mma / GemmMmaConfig: the sm_90 register-operand GEMM (m <= 16); same shapes",
    "gemm-wgmma": "gemm_wgmma / GemmWgmmaConfig: the sm_90 wgmma GEMM (m <= 1024); same shapes",
    "gemm-decoded": "gemm_decoded / GemmDecodedConfig: large M, decoded operands + cuBLAS; same shapes",
}


@dataclass(frozen=True)
class Family:
    kind: str  # tileflash.config kind
    config: type  # its dataclass
    shapes: tuple  # default shape tuples
    make: Callable  # (shape, call_kw) -> (fn or [fn per input copy], metric(ms) -> (value, unit)); fn() -> output
    rotate: bool = False  # time as graph replay over input copies (decode-sized calls)
    also: tuple = ()  # kinds forced to None (declined) in every variant, e.g. the Gluon path a Triton sweep bypasses


def _prefill_inputs(d, seqlen, requires_grad=False, dv=None):
    """q, k [b, seqlen, h, d] and v [.., dv or d]: 16k tokens, 2048 / d heads."""
    b, h = 16384 // seqlen, 2048 // d
    return [torch.randn(b, seqlen, h, width, device="cuda", dtype=BF16, requires_grad=requires_grad)
            for width in (d, d, dv or d)], b, h


def _prefill(shape, kw):
    import tileflash

    d, causal, s, *dv = shape  # an optional fourth: V's head dim (DeepSeek-V3's 192,c,s,128)
    dv = dv[0] if dv else None
    (q, k, v), b, h = _prefill_inputs(d, s, dv=dv)
    flops = attn_fwd_flops(b, h, s, s, d, bool(causal), headdim_v=dv)
    return (lambda: tileflash.flash_attn_func(q, k, v, causal=bool(causal), **kw)), \
        lambda ms: (tflops(flops, ms), "TFLOP/s")


def _prefill_fp8(shape, kw):
    import tileflash

    d, causal, s = shape
    (q, k, v), b, h = _prefill_inputs(d, s)
    q8, k8, v8, qd, kd, vd = tileflash.fp8_quantize_qkv(q, k, v)
    flops = attn_fwd_flops(b, h, s, s, d, bool(causal))
    return (lambda: tileflash.flash_attn_func(q8, k8, v8, causal=bool(causal), q_descale=qd, k_descale=kd,
                                              v_descale=vd, **kw)), lambda ms: (tflops(flops, ms), "TFLOP/s")


def _backward(shape, kw):
    import tileflash

    d, causal, s = shape
    (q, k, v), b, h = _prefill_inputs(d, s, requires_grad=True)
    deterministic = bool(kw.pop("deterministic", 0))
    out = tileflash.flash_attn_func(q, k, v, causal=bool(causal), deterministic=deterministic, **kw)
    dout = torch.randn_like(out)
    flops = attn_bwd_flops(b, h, s, s, d, bool(causal))
    return (lambda: torch.cat([g.flatten() for g in torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)])), \
        lambda ms: (tflops(flops, ms), "TFLOP/s")


def _decode_cache(batch, ctx, hkv, d, page, dtype=BF16):
    if page:
        pages = batch * ctx // page
        kc, vc = (torch.randn(pages, page, hkv, d, device="cuda").to(dtype) for _ in range(2))
        table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(batch, -1)
    else:
        kc, vc = (torch.randn(batch, ctx, hkv, d, device="cuda").to(dtype) for _ in range(2))
        table = None
    return kc, vc, table


def _cache_format(family: str, shape, fields: int, kw):
    """(the shape's first `fields` fields, the cache dtype, the call's keywords): a bf16 cache, or an e4m3 one with
    unit scales where the shape ends in "fp8"."""
    head, fmt = shape[:fields], shape[fields:]
    if fmt not in ((), ("fp8",)):
        raise SystemExit(f"{family} shape {shape}: field {fields + 1} may only be fp8")
    if not fmt:
        return head, BF16, kw
    return head, torch.float8_e4m3fn, {**kw, "k_scale": torch.ones(1, device="cuda"),
                                       "v_scale": torch.ones(1, device="cuda")}


def _decode(shape, kw):
    """batch,ctx,hq,hkv,d,page[,fp8]: a bf16 cache, or an e4m3 one (scales 1) with "fp8"."""
    import tileflash

    (batch, ctx, hq, hkv, d, page), dtype, kw = _cache_format("decode", shape, 6, kw)
    nbytes = decode_kv_bytes(batch, ctx, hkv, d, dtype.itemsize)
    copies = []
    for _ in range(rotation_copies(nbytes)):
        kc, vc, table = _decode_cache(batch, ctx, hkv, d, page, dtype)
        copies.append((torch.randn(batch, 1, hq, d, device="cuda", dtype=BF16), kc, vc, table))
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    fns = [lambda c=c: tileflash.flash_attn_with_kvcache(c[0], c[1], c[2], cache_seqlens=lens, block_table=c[3],
                                                         **kw) for c in copies]
    return fns, lambda ms: (gbps(nbytes, ms) / 1000, "TB/s")


def _decode_mla(shape, kw):
    """batch,ctx,hq[,fp8]: bf16 latents, or e4m3 ones (scales 1) with "fp8"."""
    import tileflash
    from tileflash.bench.formulas import mla_decode_bytes

    (batch, ctx, hq), dtype, kw = _cache_format("decode-mla", shape, 3, kw)
    nbytes = mla_decode_bytes(batch, ctx, dtype_bytes=dtype.itemsize)
    copies = []
    for _ in range(rotation_copies(nbytes)):
        kc, vc = (torch.randn(batch, ctx, 1, w, device="cuda").to(dtype) for w in (64, 512))
        copies.append((torch.randn(batch, 1, hq, 64, device="cuda", dtype=BF16),
                       torch.randn(batch, 1, hq, 512, device="cuda", dtype=BF16), kc, vc))
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    fns = [lambda c=c: tileflash.flash_attn_with_kvcache(c[0], c[2], c[3], qv=c[1], cache_seqlens=lens, **kw)
           for c in copies]
    return fns, lambda ms: (gbps(nbytes, ms) / 1000, "TB/s")


def _decode_quant(shape, kw):
    import tileflash

    batch, ctx, hq, hkv, d, fmt = shape
    if fmt != "nvfp4":  # FP8 caches take the Triton kernel: the decode family sweeps them
        raise ValueError(f"decode-quant: the register-operand decode reads NVFP4 caches only, not {fmt}")
    nbytes = int(decode_kv_bytes(batch, ctx, hkv, d, dtype_bytes=0.5625))
    copies = []
    for _ in range(rotation_copies(nbytes)):
        kv = [torch.randn(batch, ctx, hkv, d, device="cuda") for _ in range(2)]
        (kc, ks, kg), (vc, vs, vg) = (tileflash.nvfp4_quantize(t) for t in kv)
        extra = dict(k_scale=ks, v_scale=vs, k_global_scale=kg.reshape(1), v_global_scale=vg.reshape(1))
        copies.append((torch.randn(batch, 1, hq, d, device="cuda", dtype=BF16), kc, vc, extra))
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    fns = [lambda c=c: tileflash.flash_attn_with_kvcache(c[0], c[1], c[2], cache_seqlens=lens, **c[3], **kw)
           for c in copies]
    return fns, lambda ms: (gbps(nbytes, ms) / 1000, "TB/s")


def _gemm(shape, kw):
    import tileflash

    m, n, k, *w4a4 = shape  # m,n,k,w4a4: a quantized too
    nbytes = n * k // 2 + n * k // 16
    copies = [(torch.randn(m, k, device="cuda", dtype=BF16),
               *tileflash.nvfp4_quantize(torch.randn(n, k, device="cuda"))) for _ in range(rotation_copies(nbytes))]
    if w4a4:
        copies = [(a_q[0], *c[1:], *a_q[1:]) for c in copies for a_q in [tileflash.nvfp4_quantize(c[0])]]
    fns = [lambda c=c: tileflash.nvfp4_matmul(*c, **kw) for c in copies]
    return fns, lambda ms: (tflops(gemm_flops(m, n, k), ms), "TFLOP/s")


_MLA_SHAPES = ((1, 32768, 128), (32, 4096, 128), (8, 32768, 16), (128, 4096, 16))
_PREFILL_SHAPES = tuple((d, c, s) for d in (64, 128, 256) for c in (0, 1) for s in (1024, 4096, 16384))
FAMILIES = {
    "prefill": Family("fwd", plan.FwdConfig, _PREFILL_SHAPES, _prefill, also=("fwd_ws",)),
    "prefill-ws": Family("fwd_ws", plan.WsFwdConfig, _PREFILL_SHAPES, _prefill),
    "prefill-fp8": Family("fwd", plan.FwdConfig, _PREFILL_SHAPES, _prefill_fp8, also=("fwd_ws",)),
    "prefill-fp8-ws": Family("fwd_ws", plan.WsFwdConfig, tuple((128, c, s) for c in (0, 1) for s in (8192, 16384)),
                             _prefill_fp8),
    "backward": Family("bwd", plan.BwdConfig, _PREFILL_SHAPES, _backward, also=("bwd_ws",)),
    "backward-ws": Family("bwd_ws", plan.WsBwdConfig, tuple(s for s in _PREFILL_SHAPES if s[0] != 256), _backward),
    "decode": Family("decode", plan.DecodeConfig, ((1, 8192, 32, 8, 128, 0), (1, 32768, 32, 8, 128, 0),
                                                  (32, 2048, 32, 8, 128, 0), (128, 1024, 8, 1, 128, 0),
                                                  (32, 2048, 32, 8, 64, 0), (1, 32768, 32, 8, 128, 16),
                                                  (8, 8192, 32, 8, 128, 64)), _decode, rotate=True),
    "decode-mla": Family("mla_decode", plan.DecodeConfig, _MLA_SHAPES, _decode_mla, rotate=True, also=("mla_gluon",)),
    "decode-mla-gluon": Family("mla_gluon", plan.MlaGluonConfig, _MLA_SHAPES, _decode_mla, rotate=True),
    "decode-quant": Family("quant_decode", plan.QuantDecodeConfig,
                           ((1, 32768, 32, 8, 128, "nvfp4"), (64, 4096, 32, 8, 128, "nvfp4")), _decode_quant,
                           rotate=True),
    "gemm": Family("gemm", plan.GemmConfig, ((1, 8192, 8192), (16, 8192, 8192), (64, 8192, 8192),
                                             (128, 8192, 8192), (128, 28672, 4096)), _gemm, rotate=True,
                   also=("gemm_mma", "gemm_wgmma", "gemm_decoded")),
    "gemm-mma": Family("gemm_mma", plan.GemmMmaConfig, ((1, 8192, 8192), (16, 8192, 8192), (16, 28672, 4096)),
                       _gemm, rotate=True, also=("gemm_wgmma", "gemm_decoded")),
    "gemm-wgmma": Family("gemm_wgmma", plan.GemmWgmmaConfig, ((1, 8192, 8192), (16, 8192, 8192), (1, 28672, 4096),
                                                               (16, 28672, 4096), (64, 8192, 8192), (128, 8192, 8192),
                                                               (256, 8192, 8192), (1024, 8192, 8192),
                                                               (64, 28672, 4096),
                                                               (128, 28672, 4096)), _gemm, rotate=True,
                         also=("gemm_decoded",)),
    "gemm-decoded": Family("gemm_decoded", plan.GemmDecodedConfig, ((2048, 8192, 8192), (4096, 8192, 8192),
                                                                   (2048, 28672, 4096)),
                           _gemm, rotate=True),
}


def _value(text: str):
    """A --vary value: int, float, a bool as 0/1 or true/false, else the string."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_vary(items, config_type) -> list[tuple[dict, dict]]:
    """--vary FIELD=A,B items -> [(config field replacements, call keywords)] over the cartesian product; fields
    of config_type replace the planner's choice, any other name is a call argument (or, named after a config kind,
    forces that planner's choice: run_variant). Bools given as 0/1 become bools for config fields typed bool."""
    fields = {f.name: f for f in dataclasses.fields(config_type)}
    names, values = [], []
    for item in items:
        name, _, vals = item.partition("=")
        if not vals:
            raise SystemExit(f"--vary {item!r}: expected FIELD=A,B,...")
        names.append(name)
        parsed = [_value(v) for v in vals.split(",")]
        if name in fields and fields[name].type in ("bool", bool):
            parsed = [bool(v) for v in parsed]
        values.append(parsed)
    out = []
    for combo in itertools.product(*values):
        cfg = {n: v for n, v in zip(names, combo) if n in fields}
        call = {n: v for n, v in zip(names, combo) if n not in fields}
        out.append((cfg, call))
    return out


def parse_shape(text: str) -> tuple:
    return tuple(_value(x) for x in text.split(","))


def _label(cfg: dict, call: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in {**cfg, **call}.items()) or "default"


def run_variant(family: Family, shape, cfg: dict, call: dict):
    """(ms, output, metric) of one variant, forced through config.override. A call name that is another planner's
    kind (tileflash.config.KINDS, e.g. combine_pdl=0,1) forces that planner's choice instead of reaching the call."""
    forced = dict.fromkeys(family.also)
    call = dict(call)
    forced.update({kind: call.pop(kind) for kind in list(call) if kind in config.KINDS})
    if cfg:  # the planner's choice with cfg's fields replaced; where it declines the kernel, cfg must be complete
        forced[family.kind] = lambda chosen: (dataclasses.replace(chosen, **cfg) if chosen is not None
                                              else family.config(**cfg))
    with config.override(**forced):
        torch.manual_seed(0)  # every variant sees the same inputs, so outputs compare
        fns, metric = family.make(shape, call)
        out = (fns[0] if family.rotate else fns)().float()
        ms = rotating_graph_ms(fns) if family.rotate else bench_ms(fns)
    return ms, out, metric


def sweep(name: str, shapes, vary) -> list[dict]:
    family = FAMILIES[name]
    variants = [({}, {})] + [v for v in parse_vary(vary, family.config) if v != ({}, {})]
    rows = []
    for shape in shapes or family.shapes:
        base = None
        for cfg, call in variants:
            row = {"family": name, "shape": list(shape), "variant": _label(cfg, call)}
            try:
                ms, out, metric = run_variant(family, shape, cfg, call)
                if base is None:
                    base = out
                err = ((out - base).abs().max() / base.abs().max().clamp_min(1e-6)).item()
                value, unit = metric(ms)
                row.update(us=ms * 1e3, metric=value, unit=unit, ok=err <= 0.02, diff=err)
            except Exception as e:  # a config that does not compile or fit: reported, the sweep goes on
                row.update(us=None, metric=None, unit=None, ok=False, error=type(e).__name__, message=str(e)[:300])
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            torch.cuda.empty_cache()
    return rows


def check_cell(row: dict) -> str:
    """The table's check column: ok, how far the output is from the default's, or the exception's type."""
    if row["ok"]:
        return "ok"
    return row.get("error") or f"diff {100 * row['diff']:.1f}%"


def main(argv=None) -> int:
    families = "\n".join(f"  {k:12s} {v}" for k, v in FAMILY_HELP.items())
    p = argparse.ArgumentParser(prog="python -m tileflash sweep", description=__doc__,
                                epilog=f"families (config kind / dataclass: shapes):\n{families}",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("family", choices=sorted(FAMILIES))
    p.add_argument("--vary", nargs="*", default=[], metavar="FIELD=A,B", help="config fields or call arguments")
    p.add_argument("--shapes", nargs="*", default=[], metavar="A,B,...", help="shape tuples (see the family)")
    p.add_argument("--json", metavar="PATH", help="write the rows here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m tileflash sweep times kernels: it needs a GPU", file=sys.stderr)
        return 2
    rows = sweep(args.family, [parse_shape(s) for s in args.shapes], args.vary)
    table = [[",".join(map(str, r["shape"])), r["variant"], r["us"], r["metric"], r["unit"], check_cell(r)]
             for r in rows]
    print(format_table(["shape", "variant", "us", "metric", "unit", "check"], table,
                       title=f"sweep {args.family} ({FAMILIES[args.family].config.__name__})"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"family": args.family, "vary": args.vary, "rows": rows}, f, indent=1)
    return 0
