"""The main job: check every public op on small shapes against the pure-PyTorch reference on this machine's
device (the Triton interpreter on a CPU-only machine) and print a table of errors; on a GPU, then a short benchmark.
"""
from __future__ import annotations

import sys
import time


def _cases(device):
    import torch

    import tileflash
    from tileflash.reference import attention_ref, attention_varlen_ref, kvcache_ref, merge_ref

    g = torch.Generator().manual_seed(0)

    def rnd(*shape, dtype):
        return torch.randn(*shape, generator=g).to(device, dtype)

    for dtype in (torch.float16, torch.bfloat16):
        name = str(dtype).replace("torch.", "")
        q, k, v = rnd(2, 37, 8, 64, dtype=dtype), rnd(2, 53, 2, 64, dtype=dtype), rnd(2, 53, 2, 64, dtype=dtype)
        yield ("flash_attn_func causal GQA-4", name, "q[2,37,8,64] k[2,53,2,64]",
               lambda: tileflash.flash_attn_func(q, k, v, causal=True),
               lambda up: attention_ref(q, k, v, causal=True, upcast=up)[0])

        qv, kv, vv = rnd(40, 4, 80, dtype=dtype), rnd(50, 4, 80, dtype=dtype), rnd(50, 4, 80, dtype=dtype)
        cu_q = torch.tensor([0, 13, 13, 40], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, 20, 25, 50], dtype=torch.int32, device=device)
        yield ("flash_attn_varlen_func window", name, "3 seqs (one empty), d=80",
               lambda: tileflash.flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, 27, 25, window_size=(8, 0)),
               lambda up: attention_varlen_ref(qv, kv, vv, cu_q, cu_k, window_size=(8, 0), upcast=up)[0])

        qd = rnd(2, 2, 8, 128, dtype=dtype)
        kc, vc = rnd(12, 16, 2, 128, dtype=dtype), rnd(12, 16, 2, 128, dtype=dtype)
        kn, vn = rnd(2, 2, 2, 128, dtype=dtype), rnd(2, 2, 2, 128, dtype=dtype)
        table = torch.randperm(12, generator=g)[:10].reshape(2, 5).to(device, torch.int32)
        lens = torch.tensor([30, 77], dtype=torch.int32, device=device)
        yield ("flash_attn_with_kvcache paged+append", name, "page 16, 4 splits, GQA-4",
               lambda: tileflash.flash_attn_with_kvcache(qd, kc.clone(), vc.clone(), kn, vn, cache_seqlens=lens,
                                                         block_table=table, num_splits=4),
               lambda up: kvcache_ref(qd, kc, vc, kn, vn, lens, table, upcast=up)[0])

        oa, ob = rnd(2, 5, 3, 64, dtype=dtype), rnd(2, 5, 3, 64, dtype=dtype)
        la, lb = rnd(2, 3, 5, dtype=torch.float32), rnd(2, 3, 5, dtype=torch.float32)
        yield ("merge_attn_states", name, "out[2,5,3,64]",
               lambda: tileflash.merge_attn_states(oa, la, ob, lb)[0],
               lambda up: merge_ref(oa.float() if up else oa, la, ob.float() if up else ob, lb)[0])


def run_checks(device) -> bool:
    from tileflash.bench.table import format_table
    from tileflash.reference import error_and_bound

    rows, ok_all = [], True
    for op, dtype, shape, run, ref in _cases(device):
        t0 = time.perf_counter()
        try:
            err, bound = error_and_bound(run(), ref(True), ref(False))
            ok = err <= bound
        except Exception as exc:  # a failing op is reported in the table, not a traceback
            err, bound, ok = float("nan"), float("nan"), False
            print(f"{op} [{dtype}]: {type(exc).__name__}: {exc}", file=sys.stderr)
        ok_all &= ok
        rows.append([op, dtype, shape, f"{err:.2e}", f"{bound:.2e}", "pass" if ok else "FAIL",
                     f"{time.perf_counter() - t0:.2f}"])
    print(format_table(["op", "dtype", "shape", "max err", "2x bound", "result", "s"], rows,
                       title=f"tileflash self-check on {device}"))
    return ok_all


def main(argv=None) -> int:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        print("No GPU: running the kernels through Triton's interpreter (correctness only, no timings).")
    ok = run_checks(device)
    if ok and device == "cuda":
        from tileflash.bench.cli import main as bench_main
        # A short table: "all" now also runs backward and low precision, minutes rather than seconds.
        bench_main(["prefill", "--quick", "--only", "d128"])
        bench_main(["decode", "--quick", "--only", "gqa"])
    return 0 if ok else 1
