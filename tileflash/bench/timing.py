"""GPU timers. triton and torch.cuda are imported inside the functions so this imports on CPU."""


def bench_ms(fn, warmup=25, rep=100):
    """Median milliseconds of ``fn()``. do_bench zeroes a 256 MB buffer before every timed call,
    which evicts the 50 MB L2, so each call reads its inputs from HBM."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


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


def bench_graph_ms(fn, warmup=25, rep=100):
    """Median milliseconds of one replay of ``fn`` captured in a CUDA graph (no launch overhead)."""
    return bench_ms(graphed(fn), warmup=warmup, rep=rep)
