"""`python -m examples.serving`: serve random prompts with a small Llama through the paged engine, check every
request's greedy tokens against the fp32 reference, and compare tokens/s with tileflash vs SDPA attention.

On the CPU the model runs in fp32 (attention and KV cache in fp16, tileflash through the Triton interpreter, so
its tokens/s measure the interpreter); on a GPU the model runs in fp16, decode steps replay CUDA graphs, and the
throughput comes from a second run after a warm-up run (the checked one) has compiled kernels and captured graphs.
Exit status 1 if any token differs from the reference by more than rounding can explain.
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from tileflash._utils import cdiv
from tileflash.bench.table import format_table

from .check import check_request, describe
from .engine import Engine, Request
from .model import PRESETS, build_model, fp32_copy

# Per-preset workload defaults. The page pool is half the total demand, so admissions wait for finished requests.
WORKLOADS = {
    "tiny": dict(requests=6, max_new_tokens=8, page_size=4, prompt_lens=(2, 24), max_batch=4),
    "small": dict(requests=64, max_new_tokens=128, page_size=16, prompt_lens=(16, 512), max_batch=32),
}


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), help="model size (default: tiny on CPU, small on GPU)")
    p.add_argument("--requests", type=_positive, help="number of requests")
    p.add_argument("--max-new-tokens", type=_positive, help="tokens generated per request")
    p.add_argument("--page-size", type=_positive, help="KV cache page size in tokens")
    p.add_argument("--num-pages", type=_positive, help="KV pool size in pages (default: half of the total demand)")
    p.add_argument("--seed", type=int, default=0, help="seed for the weights, prompts and arrivals")
    p.add_argument("--weights", metavar="PATH",
                   help="local state dict (.safetensors or torch.save) with the preset's shapes and Hugging Face "
                        "Llama names (model.layers.0.self_attn.q_proj.weight, ...); random weights otherwise")
    p.add_argument("--backend", choices=["tileflash", "sdpa", "both"], default="both")
    return p


def make_requests(n: int, max_new_tokens: int, prompt_lens: tuple[int, int], vocab: int, seed: int) -> list[Request]:
    """Random prompts; the first half arrive at step 0, the rest at random later steps (continuous batching)."""
    rng = random.Random(seed)
    arrivals = sorted([0] * ((n + 1) // 2) + [rng.randint(1, 2 * max_new_tokens) for _ in range(n // 2)])
    return [Request(i, [rng.randrange(vocab) for _ in range(rng.randint(*prompt_lens))], max_new_tokens, arrival)
            for i, arrival in enumerate(arrivals)]


def serve(engine: Engine, make):
    """(checked requests, stats, seconds): the timed run is the checked one on the CPU, a second run of the same
    requests on a GPU (after compilation and graph capture; its tokens must repeat the first run's)."""
    requests = make()
    t0 = time.perf_counter()
    stats = engine.run(requests)
    seconds = time.perf_counter() - t0
    if torch.cuda.is_available():
        engine.record_logits = False
        again = make()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        stats = engine.run(again)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        if [r.output for r in again] != [r.output for r in requests]:
            raise RuntimeError("the timed run's tokens differ from the checked run's")
    if engine.allocator.num_free != engine.allocator.num_pages:
        raise RuntimeError(f"{engine.allocator.num_pages - engine.allocator.num_free} pages were not returned")
    return requests, stats, seconds


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    on_gpu = torch.cuda.is_available()
    preset = args.preset or ("small" if on_gpu else "tiny")
    work = dict(WORKLOADS[preset])
    for key in ("requests", "max_new_tokens", "page_size"):
        if getattr(args, key) is not None:
            work[key] = getattr(args, key)
    cfg = PRESETS[preset]
    device, dtype = ("cuda", torch.float16) if on_gpu else ("cpu", torch.float32)
    if not on_gpu:
        # The CPU model is tiny: torch's OpenMP workers buy nothing and, spinning next to the interpreter on a
        # loaded machine, made each small matmul ~1000x slower (ms instead of us).
        torch.set_num_threads(1)
    model = build_model(cfg, seed=args.seed, weights=args.weights, device=device, dtype=dtype)
    model32 = fp32_copy(model)

    def make():
        return make_requests(work["requests"], work["max_new_tokens"], work["prompt_lens"], cfg.vocab, args.seed)

    demand = [cdiv(r.lifetime_tokens, work["page_size"]) for r in make()]
    num_pages = args.num_pages or max(max(demand), sum(demand) // 2)
    max_seq_len = max(r.lifetime_tokens for r in make())
    print(f"preset {preset}: {cfg}")
    print(f"device {device}, model {str(dtype).replace('torch.', '')}, attention/KV fp16; {work['requests']} requests, "
          f"{work['max_new_tokens']} new tokens each, page size {work['page_size']}, pool {num_pages} pages "
          f"(demand {sum(demand)}), max batch {work['max_batch']}, CUDA graphs {'on' if on_gpu else 'off'}")

    backends = ["tileflash", "sdpa"] if args.backend == "both" else [args.backend]
    runs, checks = {}, {}
    for b in backends:
        engine = Engine(model, num_pages, work["page_size"], work["max_batch"], max_seq_len, b, record_logits=True)
        runs[b] = serve(engine, make)
        checks[b] = [check_request(model, model32, engine.attn_dtype, r) for r in runs[b][0]]
    print_checks(runs[backends[0]][0], checks, work["page_size"])
    print_throughput(runs, checks, on_gpu)
    return 0 if all(c.ok for b in backends for c in checks[b]) else 1


def print_checks(requests: list[Request], checks: dict, page_size: int) -> None:
    """The per-request table (schedule and check per backend), then a line for each token that differs."""
    rows = []
    for i, r in enumerate(requests):
        first = next(iter(checks.values()))[i]
        row = [r.rid, len(r.prompt), len(r.output), r.arrival, r.admitted, r.finished,
               cdiv(r.lifetime_tokens, page_size), f"{first.max_lowp_diff:.1e}"]
        for results in checks.values():
            row += [results[i].status, f"{results[i].max_logit_diff:.1e}"]
        rows.append(row)
    headers = ["req", "prompt", "new", "arrived", "admitted", "finished", "pages", "lowp ref |dlogit|"]
    for b in checks:
        headers += [f"{b} tokens = ref", f"{b} |dlogit|"]
    print(format_table(headers, rows, title="\nper request: schedule (engine steps) and greedy tokens vs the fp32 "
                                            "full-recompute reference; |dlogit| = max |logits - fp32 reference|"))
    for b, results in checks.items():
        for c in results:
            for line in describe(b, c):
                print(line)
            if not c.logits_within_bound:
                print(f"request {c.rid} ({b}): logits exceed 2x the low-precision reference's error somewhere "
                      f"(max |dlogit| {c.max_logit_diff:.3g}, lowp ref {c.max_lowp_diff:.3g})")


def print_throughput(runs: dict, checks: dict, on_gpu: bool) -> None:
    rows = []
    for b, (_, stats, seconds) in runs.items():
        mean_batch = sum(stats.decode_batch_sizes) / max(1, len(stats.decode_batch_sizes))
        rows.append([b, stats.prompt_tokens, stats.new_tokens, stats.steps, mean_batch, seconds,
                     stats.new_tokens / seconds, (stats.prompt_tokens + stats.new_tokens) / seconds,
                     all(c.ok for c in checks[b])])
    note = "GPU, second run, CUDA-graph decode" if on_gpu else "CPU: tileflash runs in the Triton interpreter"
    print(format_table(["backend", "prompt tok", "new tok", "steps", "mean batch", "seconds", "new tok/s",
                        "all tok/s", "tokens ok"], rows, title=f"\nthroughput ({note})"))
