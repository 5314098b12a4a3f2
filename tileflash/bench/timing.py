"""GPU timers. triton and torch.cuda are imported inside the functions so this imports on CPU."""


# How the L2 is emptied before each timed call: "zero" (triton's do_bench: zeroing a 256 MB buffer leaves the 50 MB
# L2 full of dirty lines, whose write-back the timed call pays, ~8 us at b=1 ctx 32k decode: notebook, run 20) or
# "read" (reading the buffer instead leaves the L2 full of clean lines; inputs still come from HBM).
FLUSH_MODES = ("zero", "read")
flush_mode = "zero"


def bench_ms(fn, warmup=100, rep=100):
    """Median milliseconds of ``fn()`` over ~rep ms of calls after ~warmup ms, the L2 emptied before each call as
    flush_mode says. The warm-up is 100 ms, not do_bench's 25, for the reason rotating_graph_ms gives."""
    if flush_mode == "zero":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    return _bench_read_flush_ms(fn, warmup, rep)


def _bench_read_flush_ms(fn, warmup, rep):
    """do_bench's schedule (a 5-call estimate sets the warm-up and repeat counts) with a read flush."""
    import torch

    buf = torch.ones(64 * 2 ** 20, dtype=torch.int32, device="cuda")  # 256 MB, as do_bench's
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        buf.max()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup / estimate))):
        fn()
    n = max(1, int(rep / estimate))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        buf.max()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return float(torch.tensor([s.elapsed_time(e) for s, e in zip(starts, ends)]).median())


def graphed(fn, warmup_iters=3):
    """Capture ``fn`` in a CUDA graph; return a callable that replays it and returns the
    output captured with it (written in place by each replay). ``fn`` runs ``warmup_iters`` + 1 times before the
    first replay, so a call with side effects (a decode step that appends K/V) applies them that often."""
    import torch

    # torch's documented recipe: warm up on a side stream so lazy init, autotuning and
    # allocator growth happen outside the capture.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup_iters):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay():
        graph.replay()
        return out

    replay.captured_fn = fn  # the graph reads fn's tensors: they live as long as the replay callable
    return replay


def bench_graph_ms(fn, warmup=100, rep=100):
    """Median milliseconds of one replay of ``fn`` captured in a CUDA graph (no launch overhead)."""
    return bench_ms(graphed(fn), warmup=warmup, rep=rep)


L2_BYTES = 50 * 2 ** 20  # the H200's L2


def rotation_copies(nbytes: int, l2_bytes: int = L2_BYTES) -> int:
    """How many copies of a call's inputs (nbytes each) together hold at least twice the L2."""
    return max(2, -(-2 * l2_bytes // max(nbytes, 1)))


def rotating_graph_ms(fns, warmup=100, rep=50) -> float:
    """Milliseconds per call of the callables fns, each reading its own copy of the inputs (together larger than the
    L2, so every call reads HBM), captured back to back in one CUDA graph and replayed without a flush in between:
    how an engine calls decode, layer after layer. Median over rep replays after ~warmup ms of replays.

    The warm-up is timed, not counted, and long: the clocks must come back first. After a peer's heavy GEMMs the
    card sits at its power cap (H100: 1305 MHz, 690 W); ten replays (~2.5 ms at b=8 ctx 32k) had the next backend
    measured 8-20% slow (runs 217 and 222, `bench decode` MLA rows: 127.6 vs 110.7 us, the same calls with the
    backends' order swapped), 25 ms of replays 3% slow, 100 ms as after idling (run 224: an H=16 MLA decode after
    3 s of 8k x 8k bf16 GEMMs, 110.8 / 107.7 / 107.4 us at 25 / 100 / 300 ms)."""
    import torch

    replay = graphed(lambda: [fn() for fn in fns])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    replay()
    end.record()
    torch.cuda.synchronize()
    for _ in range(max(1, int(warmup / max(start.elapsed_time(end), 1e-3)))):
        replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    for s, e in zip(starts, ends):
        s.record()
        replay()
        e.record()
    torch.cuda.synchronize()
    return float(torch.tensor([s.elapsed_time(e) for s, e in zip(starts, ends)]).median()) / len(fns)
