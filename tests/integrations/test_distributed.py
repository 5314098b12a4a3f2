"""Context parallelism with 2 processes against the pure-PyTorch reference of the whole sequence, with the 2x rule.
On the CPU: gloo, kernels through the interpreter (the environment, including TRITON_INTERPRET, is inherited from
this process). With 2 GPUs: NCCL, one GPU per rank. With one GPU: skipped (gloo moves no CUDA tensors in
all_gather or point-to-point)."""
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


ON_GPU = torch.cuda.is_available()
needs_ranks = pytest.mark.skipif(ON_GPU and torch.cuda.device_count() < WORLD, reason="needs 2 GPUs for NCCL")


def _init(rank, init_file):
    """Join the group; return the device this rank's tensors live on."""
    if ON_GPU:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if ON_GPU else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    torch.set_num_threads(1)
    return torch.device("cuda", rank) if ON_GPU else torch.device("cpu")


def _decode_worker(rank, init_file, paged, sq):
    dev = _init(rank, init_file)
    try:
        import tileflash.distributed as tfd
        from helpers import check_2x, check_lse
        from tileflash.reference import kvcache_ref

        g = torch.Generator().manual_seed(0)
        b, hq, hkv, d, cap = 2, 8, 2, 32, 40
        k_full = torch.randn(b, 2 * cap, hkv, d, generator=g).half()
        v_full = torch.randn(b, 2 * cap, hkv, d, generator=g).half()
        q = torch.randn(b, sq, hq, d, generator=g).half()
        k_new = torch.randn(b, sq, hkv, d, generator=g).half()
        v_new = torch.randn(b, sq, hkv, d, generator=g).half()
        lens0 = torch.tensor([cap, 29], dtype=torch.int32)  # rank 0's shard: a full one and a shorter one
        lens1 = torch.tensor([17, 3], dtype=torch.int32)  # the tail shard, before the append
        # Whole sequences for the reference: rank 0's tokens then rank 1's.
        whole_k = torch.zeros(b, 2 * cap, hkv, d, dtype=torch.float16)
        whole_v = torch.zeros_like(whole_k)
        for i in range(b):
            n0, n1 = int(lens0[i]), int(lens1[i])
            whole_k[i, :n0], whole_k[i, n0:n0 + n1] = k_full[i, :n0], k_full[i, cap:cap + n1]
            whole_v[i, :n0], whole_v[i, n0:n0 + n1] = v_full[i, :n0], v_full[i, cap:cap + n1]
        ref, ref_lse, _, _ = kvcache_ref(q, whole_k, whole_v, k_new, v_new, lens0 + lens1, causal=True)
        ref_lowp, _, _, _ = kvcache_ref(q, whole_k, whole_v, k_new, v_new, lens0 + lens1, causal=True, upcast=False)

        mine = slice(0, cap) if rank == 0 else slice(cap, 2 * cap)
        k_shard, v_shard = k_full[:, mine].contiguous(), v_full[:, mine].contiguous()
        lens = lens0 if rank == 0 else lens1
        table = None
        if paged:  # 8-token pages in reverse order
            pages = cap // 8
            k_shard = k_shard.reshape(b * pages, 8, hkv, d).flip(0).contiguous()
            v_shard = v_shard.reshape(b * pages, 8, hkv, d).flip(0).contiguous()
            table = (b * pages - 1 - torch.arange(b * pages, dtype=torch.int32)).reshape(b, pages)
        on = lambda t: None if t is None else t.to(dev)  # noqa: E731
        out, lse = tfd.cp_decode(on(q), on(k_shard), on(v_shard), on(lens), k=on(k_new), v=on(v_new),
                                 block_table=on(table), num_splits=2, return_lse=True)
        out, lse = out.cpu(), lse.cpu()
        check_2x(out, ref, ref_lowp)
        check_lse(lse, ref_lse)
    finally:
        dist.destroy_process_group()


def _prefill_worker(rank, init_file, causal):
    dev = _init(rank, init_file)
    try:
        import tileflash.distributed as tfd
        from helpers import check_2x, check_lse
        from tileflash.reference import attention_ref

        g = torch.Generator().manual_seed(1)
        b, s, hq, hkv, d = 1, 48, 4, 2, 32
        q = torch.randn(b, s, hq, d, generator=g).half()
        k = torch.randn(b, s, hkv, d, generator=g).half()
        v = torch.randn(b, s, hkv, d, generator=g).half()
        shard = [tfd.zigzag_shard(x, rank, WORLD).to(dev) for x in (q, k, v)]
        out, lse = tfd.ring_attention(*shard, causal=causal, return_lse=True)
        outs = [torch.empty_like(out) for _ in range(WORLD)]
        lses = [torch.empty_like(lse) for _ in range(WORLD)]
        dist.all_gather(outs, out)
        dist.all_gather(lses, lse)
        full_out, full_lse = tfd.zigzag_unshard(outs, WORLD).cpu(), tfd.zigzag_unshard(lses, WORLD, dim=2).cpu()
        ref, ref_lse = attention_ref(q, k, v, causal=causal)
        ref_lowp, _ = attention_ref(q, k, v, causal=causal, upcast=False)
        check_2x(full_out, ref, ref_lowp)
        check_lse(full_lse, ref_lse)
    finally:
        dist.destroy_process_group()


def _ring_backward_worker(rank, init_file, causal, softcap):
    dev = _init(rank, init_file)
    try:
        import tileflash.distributed as tfd
        from helpers import check_2x, grads
        from tileflash.reference import attention_ref

        g = torch.Generator().manual_seed(2)
        b, s, hq, hkv, d = 1, 40, 4, 2, 32
        q, k, v = (torch.randn(b, s, h, d, generator=g).half() for h in (hq, hkv, hkv))
        dout = torch.randn(b, s, hq, d, generator=g)
        dlse = torch.randn(b, hq, s, generator=g)  # a gradient through the returned lse too
        kw = dict(causal=causal, softcap=softcap)
        ref32 = grads(lambda *a: attention_ref(*a, **kw), [x.float().requires_grad_() for x in (q, k, v)], dout, dlse)
        ref_lowp = grads(lambda *a: attention_ref(*a, upcast=False, **kw),
                         [x.clone().requires_grad_() for x in (q, k, v)], dout, dlse)
        shard = [tfd.zigzag_shard(x, rank, WORLD).to(dev).requires_grad_() for x in (q, k, v)]
        mine = grads(lambda *a: tfd.ring_attention(*a, return_lse=True, **kw), shard,
                     tfd.zigzag_shard(dout, rank, WORLD).to(dev), tfd.zigzag_shard(dlse, rank, WORLD, dim=2).to(dev))
        for name, gr, r32, rlow in zip(("dq", "dk", "dv"), mine, ref32, ref_lowp):
            parts = [torch.empty_like(gr) for _ in range(WORLD)]
            dist.all_gather(parts, gr.contiguous())
            full = tfd.zigzag_unshard(parts, WORLD).cpu()
            assert full.dtype == torch.float16
            check_2x(full, r32, rlow, name)
    finally:
        dist.destroy_process_group()


def _exit_when_done(rank, fn, *args):
    """fn(rank, *args), then the process ends without running interpreter teardown: on the CPU machine a rank that
    had passed every check was seen to abort in teardown now and then (gloo's threads: "terminate called without an
    active exception", SIGABRT), failing the test after the fact. A failing check still raises from fn as before."""
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(fn, tmp_path, *args):
    init_file = tmp_path / "dist_init"
    here = os.path.dirname(__file__)  # children import this module and tests/helpers.py
    os.environ["PYTHONPATH"] = os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")])
    mp.spawn(_exit_when_done, args=(fn, str(init_file), *args), nprocs=WORLD, join=True)


@needs_ranks
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("sq", [1, 3])
def test_cp_decode_two_ranks(tmp_path, paged, sq):
    _spawn(_decode_worker, tmp_path, paged, sq)


@needs_ranks
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ring_attention_two_ranks(tmp_path, causal):
    _spawn(_prefill_worker, tmp_path, causal)


@needs_ranks
@pytest.mark.parametrize("causal, softcap", [(False, 0.0), (True, 0.0), (True, 5.0)],
                         ids=["full", "causal", "causal-softcap"])
def test_ring_attention_backward_two_ranks(tmp_path, causal, softcap):
    _spawn(_ring_backward_worker, tmp_path, causal, softcap)
