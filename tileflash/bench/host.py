"""`python -m tileflash bench host`: what an eager call costs on the host, per public op at small shapes.

For each op: the eager wall time per call (back-to-back calls, one sync at the end, median over repeats), the host's
own cost per call (the same calls timed until the last returns, before the sync), the GPU time of the same call
replayed from a CUDA graph (no host work), and the same three for every installed peer (SDPA flash / cuDNN / default,
FA4, FlashInfer, torch.matmul). tileflash also runs with direct launches off (`tileflash plain`: Triton's JIT launch
and the Python launchers on every call, what every call cost before the launch layer), so one run shows the layer's
effect. A call whose eager time is well above its graph time is host-bound; one whose host time is below its graph
time is GPU-bound. Each callable's output is checked against an fp32 reference before it is timed. Forward + backward
rows also time an empty Python autograd.Function (`autograd.Function floor`: it allocates the output and the
gradients, launches nothing): what any attention op written in Python pays in eager autograd before it does any
work (its backward runs in autograd's device thread and takes the GIL there). The same rows run tileflash and
SDPA-flash once more with that thread off (`..., 1-thread autograd`: torch.autograd.set_multithreading_enabled(False),
the backward in the calling thread): work handed to that thread right after the main thread's forward costs about
twice its main-thread time (run 314), and a Python backward hands it more work than SDPA's C++ one.

Without a GPU (or with --no-launch), the host path alone: CPU tensors through Triton's real compiler with launches
made no-ops (bench/standin.py), so a host-time regression shows on any machine.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from tileflash.bench import peers
from tileflash.bench.table import format_table

CALLS = 100  # back-to-back calls per timed repeat
REPEATS = 7
TOL = 3e-2  # max abs error of bf16 outputs (fp32 reference of the same inputs)
FLOOR = "autograd.Function floor"  # a row of no output to check (see the module docstring)
ONE_THREAD = ", 1-thread autograd"  # a fwd+bwd backend's name with this suffix runs its backward in the calling thread


def eager_us(fns: dict, device, calls=CALLS, repeats=REPEATS, context=None) -> dict:
    """{name: median over repeats of (wall time of `calls` back-to-back calls of fns[name], synchronised once) /
    calls}. The callables take turns within each repeat, so a slow spell of the host (this machine's eager times
    drift by tens of microseconds between runs) falls on every backend of a row alike. context(name): entered
    around each timed batch (an SDPA backend choice), or None."""
    return eager_and_host_us(fns, device, calls, repeats, context)[0]


def eager_and_host_us(fns: dict, device, calls=CALLS, repeats=REPEATS, context=None) -> tuple[dict, dict]:
    """eager_us's medians, and beside them the host's own cost per call: the time until the last of the `calls`
    returns, before the sync (launches are asynchronous, and `calls` x a few launches stay far below the stream's
    queue depth, so no call waits for the GPU). Where the GPU time exceeds it, the eager time is the GPU's."""
    from contextlib import nullcontext

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    context = context or (lambda name: nullcontext())
    for name, fn in fns.items():
        with context(name):
            for _ in range(3):
                fn()
    sync()
    times = {name: [] for name in fns}
    host = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            with context(name):
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                host[name].append((time.perf_counter() - t0) / calls * 1e6)
                sync()
                times[name].append((time.perf_counter() - t0) / calls * 1e6)
    median = lambda ts: {name: statistics.median(v) for name, v in ts.items()}  # noqa: E731
    return median(times), median(host)


def graph_us(fn) -> float:
    from tileflash.bench.timing import bench_graph_ms

    return bench_graph_ms(fn) * 1000


def _ref_attention(q, k, v, causal):
    qt, kt, vt = (x.float().transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=qt.shape[1] != kt.shape[1])
    return out.transpose(1, 2)


def _cases(device, with_peers: bool):
    """(op, shape, {backend: fn}, check) per row; check(out) -> max abs error of a backend's output."""
    import tileflash

    bf = torch.bfloat16
    rnd = lambda *s: torch.randn(*s, device=device, dtype=bf)  # noqa: E731
    note = lambda msg: print(msg, flush=True)  # noqa: E731
    rows = []

    # decode: b=1, ctx 8k, 32/8 heads, d128 (contiguous); paged 16 with a one-token append; plan.run
    qd, kc, vc = rnd(1, 1, 32, 128), rnd(1, 8192, 8, 128), rnd(1, 8192, 8, 128)
    lens = torch.full((1,), 8192, dtype=torch.int32, device=device)
    ref = _ref_attention(qd, kc, vc, False)
    check = lambda out, ref=ref: float((out.float() - ref).abs().max())  # noqa: E731
    plan = tileflash.decode_plan(qd, kc, vc, lens)
    backends = {"tileflash": lambda: tileflash.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens),
                "tileflash plan.run": lambda: plan.run(qd, kc, vc)}
    if with_peers:
        backends["sdpa"] = peers.sdpa_decode(qd, kc, vc, note=note)
        backends["fa4"] = peers.fa4_decode(qd, kc, vc, lens, note=note)
        if peers.available_peers()["flashinfer"]:
            backends["flashinfer"] = peers.flashinfer_decode(qd, kc.view(128, 64, 8, 128), vc.view(128, 64, 8, 128),
                                                             torch.arange(128, device=device,
                                                                          dtype=torch.int32).view(1, -1),
                                                             8192, use_tensor_cores=False, note=note)
    rows.append(("flash_attn_with_kvcache", "b=1 ctx=8k 32/8 d128", backends, check))

    pool_k, pool_v = kc.view(512, 16, 8, 128).clone(), vc.view(512, 16, 8, 128).clone()
    table = torch.arange(512, dtype=torch.int32, device=device).view(1, 512)
    kn, vn = kc[:, -1:].clone(), vc[:, -1:].clone()
    lens_append = lens - 1  # the append rewrites the last token with its own values: the same attention
    rows.append(("flash_attn_with_kvcache", "paged 16 + 1-token append", {
        "tileflash": lambda: tileflash.flash_attn_with_kvcache(qd, pool_k, pool_v, kn, vn, cache_seqlens=lens_append,
                                                               block_table=table)}, check))

    # prefill (and forward + backward): b=1, 32 heads, d128, causal
    for s in (128, 512, 2048):
        q, k, v = rnd(1, s, 32, 128), rnd(1, s, 32, 128), rnd(1, s, 32, 128)
        ref = _ref_attention(q, k, v, True)
        check = lambda out, ref=ref: float((out.float() - ref).abs().max())  # noqa: E731
        backends = {"tileflash": lambda q=q, k=k, v=v: tileflash.flash_attn_func(q, k, v, causal=True)}
        if with_peers:
            for name in ("flash", "cudnn"):
                backends[f"sdpa_{name}"] = _sdpa(q, k, v)
            backends["fa4"] = peers.fa4_prefill(q, k, v, True, note=note)
        rows.append(("flash_attn_func", f"s={s} 32 heads d128 causal", backends, check))

        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        dout = rnd(1, s, 32, 128)
        grads = _fwd_bwd(lambda qg=qg, kg=kg, vg=vg: tileflash.flash_attn_func(qg, kg, vg, causal=True),
                         (qg, kg, vg), dout)
        backends = {"tileflash": grads}
        if with_peers:
            for name in ("flash", "cudnn"):
                backends[f"sdpa_{name}"] = _fwd_bwd(_sdpa(qg, kg, vg), (qg, kg, vg), dout)
        backends["tileflash" + ONE_THREAD] = grads
        if with_peers:
            backends["sdpa_flash" + ONE_THREAD] = backends["sdpa_flash"]
        backends[FLOOR] = _fwd_bwd(lambda qg=qg, kg=kg, vg=vg: _Floor.apply(qg, kg, vg), (qg, kg, vg), dout)
        leaves32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
        refs = torch.autograd.grad(_ref_attention(*leaves32, True), leaves32, dout.float())
        rows.append(("flash_attn_func fwd+bwd", f"s={s} 32 heads d128 causal", backends,
                     lambda grads, refs=refs: max(float((g.float() - r).abs().max() / r.abs().max())
                                                  for g, r in zip(grads, refs))))

    # NVFP4 GEMM M=1 N=K=8192 against a bf16 matmul; merge of two partial decode results
    a = rnd(1, 8192)  # names below are not reused: the callables read them when timed
    w = torch.randn(8192, 8192, device=device) / 8
    wq = tileflash.nvfp4_quantize(w)
    w_deq = tileflash.nvfp4_dequantize(*wq).to(bf)
    ref = a.float() @ w_deq.float().T
    scale = float(ref.abs().max())
    backends = {"tileflash": lambda: tileflash.nvfp4_matmul(a, *wq)}
    if with_peers:
        backends["torch.matmul bf16"] = lambda: a @ w_deq.T
    rows.append(("nvfp4_matmul", "M=1 N=K=8192", backends,
                 lambda out, ref=ref, scale=scale: float((out.float() - ref).abs().max()) / max(scale, 1e-30)))

    oa, ob = rnd(8, 1, 32, 128), rnd(8, 1, 32, 128)
    la, lb = (torch.randn(8, 32, 1, device=device) for _ in range(2))
    wa = torch.sigmoid(la - lb).transpose(1, 2).unsqueeze(-1)
    ref = oa.float() * wa + ob.float() * (1 - wa)
    rows.append(("merge_attn_states", "8 x 32 heads d128", {
        "tileflash": lambda: tileflash.merge_attn_states(oa, la, ob, lb)[0]},
        lambda out, ref=ref: float((out.float() - ref).abs().max())))
    return rows


def _sdpa(q, k, v):
    """SDPA as a user calls it ([B, S, H, D] views transposed once, causal); the backend is chosen around the
    measurement (SDPA_BACKENDS), not inside the timed call."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).transpose(1, 2)


def _backend_context(name):
    """Around a backend's timed calls: SDPA's backend choice, and for a name ending in ONE_THREAD autograd without
    its device thread (torch.autograd.set_multithreading_enabled(False): the backward runs in the calling thread)."""
    from contextlib import ExitStack

    from torch.nn.attention import SDPBackend, sdpa_kernel

    base = name.removesuffix(ONE_THREAD)
    chosen = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}.get(base)
    stack = ExitStack()
    if chosen is not None:
        stack.enter_context(sdpa_kernel(chosen))
    if base != name:
        stack.enter_context(torch.autograd.set_multithreading_enabled(False))
    return stack


def _fwd_bwd(forward, leaves, dout):
    """A callable running forward and torch.autograd.grad of it (graph-capturable: no .grad accumulation)."""
    def fn():
        out = forward()
        return torch.autograd.grad(out, leaves, dout)

    return fn


class _Floor(torch.autograd.Function):
    """An attention op's eager autograd with the attention left out (FLOOR)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        ctx.save_for_backward(q, k, v, out)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _plain(fn):
    """fn with direct launches off (every call through Triton's JIT launch and the Python launchers)."""
    from tileflash.launch import direct

    def plain():
        direct.ENABLED = False
        try:
            return fn()
        finally:
            direct.ENABLED = True

    return plain


def run_host(no_launch: bool = False) -> list[dict]:
    """Measure every row; print a table; return one record per (op, backend)."""
    device = "cpu" if no_launch else "cuda"
    if no_launch:
        from triton.runtime import driver

        from tileflash.bench.standin import Sm90CompileOnly

        driver.set_active(Sm90CompileOnly())
    results, table = [], []
    for op, shape, backends, check in _cases(device, with_peers=not no_launch):
        rows, timed = [], {}
        for name, fn in list(backends.items()) + [("tileflash plain", _plain(backends["tileflash"]))]:
            if fn is None:
                continue
            rec = {"op": op, "shape": shape, "backend": name, "eager_us": None, "host_us": None, "graph_us": None,
                   "max_err": None, "error": None}
            try:
                with _backend_context(name):
                    result = fn()  # a backend that fails here is left out of the timing
                    if not no_launch and name != FLOOR:
                        rec["max_err"] = check(result)
                    # (a backward captured in a graph broke the capture on the H200: eager only)
                    if not no_launch and name != "tileflash plain" and "fwd+bwd" not in op:
                        rec["graph_us"] = graph_us(fn)
                timed[name] = fn
            except Exception as e:  # a failing backend is reported, the run goes on
                rec["error"] = peers.short_error(e)
                print(f"  note: {op} {shape} {name} failed: {rec['error']}", flush=True)
            rows.append(rec)
        eager, host = eager_and_host_us(timed, device, context=_backend_context)
        for name, us in eager.items():
            rec = next(r for r in rows if r["backend"] == name)
            rec["eager_us"], rec["host_us"] = us, host[name]
        results += rows
        if not no_launch:
            torch.cuda.empty_cache()
        ours = next((r["eager_us"] for r in rows if r["backend"] == "tileflash"), None)
        for r in rows:
            ok = r["max_err"] is None or r["max_err"] <= TOL
            ratio = r["eager_us"] / ours if ours and r["eager_us"] else None
            table.append([op, shape, r["backend"], r["eager_us"], r["host_us"], r["graph_us"],
                          r["eager_us"] / r["graph_us"] if r["eager_us"] and r["graph_us"] else None,
                          ratio, "no" if not ok else None])
    title = ("Host path: eager wall time per call (us, median of back-to-back calls, one sync), the host's part of it "
             "(until the last call returns) and CUDA-graph replay (GPU time); peer/tf > 1: tileflash's eager call is "
             "faster" if not no_launch else
             "Host path alone (CPU tensors, sm_90 stand-in driver, launches are no-ops): us per call")
    print(format_table(["op", "shape", "backend", "eager us", "host us", "graph us", "eager/graph", "eager vs tf",
                        "ok"], table, title=title), flush=True)
    return results


HF_CONFIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096)


def run_hf_generate(prompt: int = 128, new_tokens: int = 128) -> list[dict]:
    """Greedy `generate` of a Llama (HF_CONFIG, random weights, bf16, eager, batch 1) with attn_implementation
    "sdpa" and "tileflash": tokens/s of each and how many generated tokens agree."""
    try:
        import transformers
    except ImportError:
        print("bench host: transformers is not installed; no generate row", flush=True)
        return []
    from tileflash.integrations.transformers import register

    name = register()
    ids = torch.randint(0, HF_CONFIG["vocab_size"], (1, prompt), generator=torch.Generator().manual_seed(0))
    results, tokens = [], {}
    for impl in ("sdpa", name):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = transformers.LlamaForCausalLM._from_config(transformers.LlamaConfig(**HF_CONFIG),
                                                               attn_implementation=impl, dtype=torch.bfloat16)
        model.eval()
        kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        with torch.no_grad():
            model.generate(ids.cuda(), **{**kw, "max_new_tokens": 8, "min_new_tokens": 8})  # compile, warm up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model.generate(ids.cuda(), **kw)
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        tokens[impl] = out[0, prompt:].cpu()
        results.append({"impl": impl, "tokens_per_s": new_tokens / seconds})
        del model
    same = int((tokens["sdpa"] == tokens[name]).cumprod(0).sum())
    for r in results:
        r["tokens_agreeing"] = same
    sdpa = results[0]["tokens_per_s"]
    print(format_table(["attn_implementation", "tokens/s", "vs sdpa", "leading tokens equal"],
                       [[r["impl"], r["tokens_per_s"], r["tokens_per_s"] / sdpa, same] for r in results],
                       title=f"HF generate, Llama {HF_CONFIG['num_hidden_layers']} layers "
                             f"{HF_CONFIG['num_attention_heads']}/{HF_CONFIG['num_key_value_heads']} heads d128, "
                             f"bf16, eager, prompt {prompt}, {new_tokens} new tokens"), flush=True)
    return results
