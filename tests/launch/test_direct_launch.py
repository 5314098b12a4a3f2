"""The direct launch path (tileflash/launch/direct.py): on the CPU against Triton's JIT launch through the sm_90
stand-in driver (direct_launch_check.py, in a subprocess); on a GPU bitwise against the plain launch, under CUDA-graph
capture, and through tileflash.decode_plan."""
import pytest
import torch

import tileflash
from helpers import ON_GPU, attention_inputs, run_standin_script
from tileflash.launch import direct
from tileflash.reference import kvcache_ref


@pytest.mark.skipif(ON_GPU, reason="on a GPU the tests below compare real launches")
def test_replayed_launches_equal_triton_launches():
    proc = run_standin_script("direct_launch_check.py")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def _decode_inputs(b=3, ctx=300, hq=8, hkv=2, d=64, page=16, seed=0):
    """q [b, 1, hq, d], a paged cache in random page order, cache_seqlens (values < ctx - 1), new k/v rows."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    dev = "cuda" if ON_GPU else "cpu"
    pages = b * -(-ctx // page)
    mk = lambda *s: torch.randn(*s, generator=g).to(dev, torch.bfloat16)  # noqa: E731
    table = torch.randperm(pages, generator=g).view(b, -1).to(dev, torch.int32)
    lens = torch.randint(1, ctx - 2, (b,), generator=g).to(dev, torch.int32)
    return mk(b, 1, hq, d), mk(pages, page, hkv, d), mk(pages, page, hkv, d), table, lens, mk(b, 1, hkv, d), \
        mk(b, 1, hkv, d)


def test_decode_plan_run_equals_flash_attn_with_kvcache():
    q, kc, vc, table, lens, kn, vn = _decode_inputs()
    kc2, vc2 = kc.clone(), vc.clone()
    plan = tileflash.decode_plan(q, kc, vc, lens, block_table=table, k=kn, v=vn, causal=True, num_splits=3,
                                 return_lse=True)
    for _ in range(2):  # the first run records, the second replays
        out, lse = plan.run(q, kc, vc, kn, vn)
    ref, ref_lse = tileflash.flash_attn_with_kvcache(q, kc2, vc2, kn, vn, cache_seqlens=lens, block_table=table,
                                                     causal=True, num_splits=3, return_lse=True)
    # the second run appended the same rows at the same positions, so both caches hold the same tokens
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert plan.refused is None


def test_decode_plan_takes_a_shape_and_out():
    q, kc, vc, table, lens, _, _ = _decode_inputs(seed=1)
    plan = tileflash.decode_plan(tuple(q.shape), kc, vc, lens, block_table=table, dtype=q.dtype)
    out = torch.empty_like(q)
    assert plan.run(q, kc, vc, out=out) is out
    assert torch.equal(out, tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table,
                                                              causal=False))


def test_decode_plan_run_refuses_other_layouts():
    q, kc, vc, table, lens, kn, vn = _decode_inputs(seed=2)
    plan = tileflash.decode_plan(q, kc, vc, lens, block_table=table)
    with pytest.raises(ValueError, match="must match the plan"):
        plan.run(q.transpose(0, 2).contiguous().transpose(0, 2), kc, vc)  # other strides
    with pytest.raises(ValueError, match="must match the plan"):  # new tokens the plan was not made for
        plan.run(q, kc, vc, kn, vn)
    with pytest.raises(ValueError, match="must match the plan"):
        plan.run(q, kc, vc, k_scale=torch.ones(1, device=q.device))
    with pytest.raises(ValueError, match="must match the plan"):
        plan.run(q.half(), kc, vc)
    with pytest.raises(ValueError, match="out"):
        plan.run(q, kc, vc, out=torch.empty(1, device=q.device))
    with pytest.raises(ValueError, match="cache_seqlens"):  # the planning call checks like flash_attn_with_kvcache
        tileflash.decode_plan(q, kc, vc, lens[:1], block_table=table)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_direct_launch_is_bitwise_the_plain_launch():
    """Each call twice (record, replay) and once with direct launches off: equal bits."""
    q, k, v = attention_inputs(2, 333, 333, 8, 2, 128, torch.bfloat16)
    qd, kd, vd, table, lens, kn, vn = _decode_inputs(b=4, ctx=5000, hq=32, hkv=8, d=128, page=64)
    a = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    w = tileflash.nvfp4_quantize(torch.randn(4096, 4096, device="cuda"))
    calls = {
        "prefill causal": lambda: tileflash.flash_attn_func(q, k, v, causal=True),
        "prefill window": lambda: tileflash.flash_attn_func(q, k, v, window_size=(100, 0), return_lse=True),
        "decode paged": lambda: tileflash.flash_attn_with_kvcache(qd, kd, vd, cache_seqlens=lens, block_table=table),
        "decode contiguous": lambda: tileflash.flash_attn_with_kvcache(qd, kd.view(4, -1, 8, 128)[:, :4096],
                                                                       vd.view(4, -1, 8, 128)[:, :4096],
                                                                       cache_seqlens=lens, return_lse=True),
        "gemm M=16": lambda: tileflash.nvfp4_matmul(a, *w),
    }

    def fwd_bwd():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        tileflash.flash_attn_func(qq, kk, vv, causal=True, deterministic=True).sum().backward()
        return qq.grad, kk.grad, vv.grad

    calls["forward + backward"] = fwd_bwd
    for name, fn in calls.items():
        direct.clear_all()
        fn()
        replayed = fn()
        direct.ENABLED = False
        try:
            plain = fn()
        finally:
            direct.ENABLED = True
        for r, p in zip(*(x if isinstance(x, tuple) else (x,) for x in (replayed, plain))):
            assert torch.equal(r, p), name
        assert not [p.refused for c in direct.PlanCache.registry for p in c.values() if p.refused], name


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_graph_captured_plan_run_follows_new_lengths_and_pages():
    """A captured plan.run replays new lengths and page tables; it merges its splits in a second launch
    (direct.Counters), so it equals, bit for bit, the eager call made without the in-launch merge."""
    import dataclasses

    from tileflash import config

    q, kc, vc, table, lens, _, _ = _decode_inputs(b=4, ctx=2000, hq=16, hkv=4, d=128, page=16)
    plan = tileflash.decode_plan(q, kc, vc, lens, block_table=table, causal=True)
    plan.run(q, kc, vc)  # record outside the capture (any warm-up works)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = plan.run(q, kc, vc)
    g = torch.Generator(device="cpu").manual_seed(5)
    for _ in range(3):
        lens.copy_(torch.randint(1, 2000, (4,), generator=g))
        table.copy_(table.flatten()[torch.randperm(table.numel(), generator=g)].view_as(table))
        graph.replay()
        ref, *_ = kvcache_ref(q, kc, vc, cache_seqlens=lens, block_table=table, causal=True)
        with config.override(decode=lambda cfg: dataclasses.replace(cfg, fused_combine=False)):
            want = tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, causal=True)
        assert torch.equal(out, want)
        assert (out.float() - ref).abs().max() < 2e-2


def test_launch_drops_stages_that_overflow_shared_memory():
    """A variant over the target's shared memory is launched again with one stage fewer (down to one); other
    resource errors, and an overflow at one stage, reach the caller."""
    from triton.runtime.errors import OutOfResources

    class Kernel:
        def __init__(self, fits_at, resource="shared memory"):
            self.fits_at, self.resource, self.tried = fits_at, resource, []

        def __getitem__(self, grid):
            def run(*args, num_stages=direct.TRITON_DEFAULT_STAGES, **kwargs):
                self.tried.append(num_stages)
                if num_stages > self.fits_at:
                    raise OutOfResources(100, 99, self.resource)
                return "compiled"
            return run

    k = Kernel(fits_at=1)
    assert direct.launch(k, (1,), 7, num_stages=3) == "compiled" and k.tried == [3, 2, 1]
    k = Kernel(fits_at=2)
    assert direct.launch(k, (1,)) == "compiled" and k.tried == [3, 2]
    for kernel in (Kernel(fits_at=0), Kernel(fits_at=1, resource="registers")):
        with pytest.raises(OutOfResources):
            direct.launch(kernel, (1,), num_stages=2)


def test_plan_keys_tell_optional_tensors_apart():
    """A plan key holds the optional tensors' keys only when one is given (direct.optional_keys); a call with an
    extra after the same shapes without it (and back) gets the extra's plan, not the cached plain one."""
    t = torch.zeros(2, dtype=torch.int32)
    assert direct.optional_keys(None, None) == ()
    assert direct.optional_keys(None, t) == (None, direct.tensor_key(t))
    q, k, v = attention_inputs(1, 5, 40, 4, 2, 32, torch.float16)
    lens = torch.tensor([40], dtype=torch.int32, device=q.device)
    slopes = torch.full((4,), 0.5, device=q.device)
    plain = tileflash.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)
    biased = tileflash.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, alibi_slopes=slopes)
    assert not torch.allclose(plain, biased)
    assert torch.equal(tileflash.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens), plain)
    dense = tileflash.flash_attn_func(q, k, v)
    assert not torch.allclose(dense, tileflash.flash_attn_func(q, k, v, alibi_slopes=slopes))
    assert torch.equal(tileflash.flash_attn_func(q, k, v), dense)
