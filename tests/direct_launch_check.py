"""The direct launch path (tileflash/launch/direct.py) against Triton's own JIT launch, without a GPU.

With the sm_90 stand-in driver (tileflash/bench/standin.py: real compiler, launches that only collect their
arguments), each case calls a public op three times on the same tensors: the first call records its launches, the
second replays them, the third runs with direct launches off (Triton's `kernel[grid](...)` on every launch). The
replay must hand every compiled kernel's launcher the same arguments as the plain launch (pointers, integers,
descriptors field by field; output buffers are fresh allocations in each call and compare as such). Then the
cache behaviour: a call with new tensors of the same signature replays without Triton's JIT; a misaligned view or
a stride of 1 where there was none makes another plan and Triton another variant. Usage:
`python tests/direct_launch_check.py` (exit status 1 on any failure); run by tests/launch/test_direct_launch.py in a
subprocess, since it replaces the process's active Triton driver.
"""
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import tileflash  # noqa: E402
from tileflash.bench.standin import NoLaunch, Sm90CompileOnly  # noqa: E402
from tileflash.launch import direct  # noqa: E402

bf, fp16 = torch.bfloat16, torch.float16


def _normalise(args, names):
    """Launcher arguments with pointers named by the input tensor (and offset) they point into; other pointers
    (this call's fresh outputs) become 'fresh'; descriptors become their fields."""
    def ptr(p):
        for base, size, name in names:
            if base <= p < base + max(size, 1):
                return f"{name}+{p - base}"
        return "fresh"

    out = []
    for a in args:
        if isinstance(a, torch.Tensor) or (hasattr(a, "data_ptr") and not hasattr(a, "block_shape")):
            out.append(ptr(a.data_ptr()))
        elif isinstance(a, tuple) and a and a[0] == "tensormap":  # an encoded descriptor (bench/standin.py)
            out.append(("tensormap", ptr(a[1]), *a[2:]))
        elif isinstance(a, int) and a > 1 << 32:  # a pointer passed as an int (a workspace view's offset)
            out.append(ptr(a))
        else:
            out.append(a)
    return out


class _Named:
    """Tensors that one name stands for in _launches (each call's own dropout seed: _seeded_calls)."""

    def __init__(self, name, tensors):
        self.name, self.tensors = name, tensors


def _launches(fn, tensors):
    """Collected launches of fn(): grid, stream, function, and normalised arguments."""
    names = [(x.untyped_storage().data_ptr(), x.untyped_storage().nbytes(), t.name if isinstance(t, _Named)
              else f"input{i}") for i, t in enumerate(tensors) for x in (t.tensors if isinstance(t, _Named) else [t])]
    names += [(b.data_ptr(), b.numel() * 4, "workspace") for b in direct.WORKSPACE.buffers.values()]
    NoLaunch.calls = []
    fn()
    calls, NoLaunch.calls = NoLaunch.calls, None
    return [(head, _normalise(args, names)) for head, args in calls]


def _plans_ok():
    bad = [p.refused for cache in direct.PlanCache.registry for p in cache.values() if p.refused]
    assert not bad, f"launches not recordable: {bad}"


def check_equivalence(name, fn, tensors, record=None):
    """fn() (or record()) records, a second fn() replays; both must launch what Triton's JIT launches for the same
    call."""
    direct.clear_all()
    (record or fn)()
    _plans_ok()
    replayed = _launches(fn, tensors)
    direct.ENABLED = False
    try:
        plain = _launches(fn, tensors)
    finally:
        direct.ENABLED = True
    assert replayed, f"{name}: no launch collected"
    assert len(replayed) == len(plain), f"{name}: {len(replayed)} replayed launches, {len(plain)} plain"
    for i, (r, p) in enumerate(zip(replayed, plain)):
        assert r[0] == p[0], f"{name}: launch {i}: grid/stream/function {r[0]} != {p[0]}"
        diff = [(j, x, y) for j, (x, y) in enumerate(zip(r[1], p[1])) if x != y]
        assert len(r[1]) == len(p[1]) and not diff, f"{name}: launch {i}: arguments differ: {diff[:5]}"
    return len(replayed)


def _tensor_kwargs(kw) -> list:
    """The tensors among a call's keyword arguments (alibi_slopes, learnable_sink, rotary tables, ...), so launches
    name their pointers too."""
    return [t for t in kw.values() if isinstance(t, torch.Tensor)]


def _decode(fmt="16bit", paged=False, append=False, page=16, d=128, b=2, ctx=512, same_kv=False, **kw):
    hq, hkv = 32, 8
    q = torch.randn(b, 1, hq, d, dtype=bf)
    lens = torch.full((b,), ctx - 1, dtype=torch.int32)
    shape = (b, ctx, hkv) if not paged else (b * ctx // page, page, hkv)
    table = torch.randperm(b * ctx // page).to(torch.int32).view(b, -1) if paged else None
    extra = {}
    if fmt == "16bit":
        kc, vc = torch.randn(*shape, d, dtype=bf), torch.randn(*shape, d, dtype=bf)
    elif fmt == "fp8":
        kc, vc = (torch.randn(*shape, d).to(torch.float8_e4m3fn) for _ in range(2))
        extra = dict(k_scale=torch.ones(hkv), v_scale=torch.ones(hkv))
    else:
        kc, vc = (torch.randint(0, 255, (*shape, d // 2), dtype=torch.uint8) for _ in range(2))
        sc = torch.ones(*shape, d // 16).to(torch.float8_e4m3fn)
        extra = dict(k_scale=sc, v_scale=sc.clone(), k_global_scale=torch.ones(1), v_global_scale=torch.ones(1))
    new = [torch.randn(b, 1, hkv, d, dtype=bf) for _ in range(2)] if append else [None, None]
    if same_kv:  # one tensor for both caches and both new rows (slots must still be told apart)
        vc, new = kc, [new[0], new[0]]
    tensors = [t for t in (q, kc, vc, lens, table, *new, *extra.values(), *_tensor_kwargs(kw)) if t is not None]

    def fn():
        tileflash.flash_attn_with_kvcache(q, kc, vc, *new, cache_seqlens=lens, block_table=table, **extra, **kw)

    return fn, tensors


def _prefill(b, s, hq, hkv, d, dtype=bf, backward=False, **kw):
    q = torch.randn(b, s, hq, d, dtype=dtype, requires_grad=backward)
    k, v = (torch.randn(b, s, hkv, d, dtype=dtype, requires_grad=backward) for _ in range(2))
    dout = torch.randn(b, s, hq, d, dtype=dtype)

    def fn():
        out = tileflash.flash_attn_func(q, k, v, **kw)
        if backward:
            out.backward(dout)

    return fn, [q, k, v, dout, *_tensor_kwargs(kw)]


def _varlen(d=64, backward=False, paged=False, **kw):
    cu = torch.tensor([0, 100, 100, 250], dtype=torch.int32)
    q, k, v = (torch.randn(250, 4, d, dtype=bf, requires_grad=backward) for _ in range(3))
    if paged:
        kc, vc = (torch.randn(40, 16, 4, d, dtype=bf) for _ in range(2))
        table = torch.randperm(39)[:36].to(torch.int32).view(3, 12)
        used = torch.tensor([150, 0, 190], dtype=torch.int32)
        return (lambda: tileflash.flash_attn_varlen_func(q, kc, vc, cu, None, 150, 0, seqused_k=used,
                                                         block_table=table, **kw)), [q, kc, vc, cu, table, used]

    def fn():
        out = tileflash.flash_attn_varlen_func(q, k, v, cu, cu, 150, 150, **kw)
        if backward:
            out.sum().backward()

    return fn, [q, k, v, cu]


def _seeded_calls(make):
    """make()'s call with tileflash's dropout seed taken from three tensors in turn (the recording call's, the
    replay's, the plain launch's), the last two named "seed": a replay that kept the recording call's seed would
    pass a pointer named "fresh" where the plain launch passes "seed"."""
    import tileflash._utils as utils

    fn, tensors = make()
    named = [torch.full((1,), 100 + i, dtype=torch.int64) for i in range(3)]
    seeds = iter(named)

    def call():
        draw, utils.dropout_seed = utils.dropout_seed, lambda device: next(seeds)
        try:
            fn()
        finally:
            utils.dropout_seed = draw

    return call, [*tensors, _Named("seed", named[1:])]


def _merge(three_d):
    shape, lse_shape = ((50, 4, 64), (4, 50)) if three_d else ((2, 25, 4, 64), (2, 4, 25))
    oa, ob = torch.randn(*shape, dtype=bf), torch.randn(*shape, dtype=bf)
    la, lb = torch.randn(*lse_shape), torch.randn(*lse_shape)
    return (lambda: tileflash.merge_attn_states(oa, la, ob, lb)), [oa, la, ob, lb]


def _gemm(m, n, k):
    a = torch.randn(m, k, dtype=bf)
    b = tileflash.nvfp4_quantize(torch.randn(n, k))
    return (lambda: tileflash.nvfp4_matmul(a, *b)), [a, *b]


CASES = {
    "decode 16-bit contiguous (splits, PDL combine)": lambda: _decode(),
    "decode 16-bit contiguous, return_lse, no split": lambda: _decode(num_splits=1, return_lse=True),
    "decode 16-bit paged 16 (pointer gathers), append, k is v": lambda: _decode(paged=True, append=True,
                                                                                          same_kv=True),
    "decode 16-bit paged 64 (TMA tiles)": lambda: _decode(paged=True, page=64),
    "decode fp8 append": lambda: _decode("fp8", append=True),
    "decode nvfp4 paged append (register operands)": lambda: _decode("nvfp4", paged=True, append=True, ctx=4096),
    "decode window softcap": lambda: _decode(window_size=(100, 0), softcap=5.0),
    "prefill d128 causal (Gluon)": lambda: _prefill(1, 300, 4, 2, 128, causal=True),
    "prefill d80 window softcap (Triton)": lambda: _prefill(2, 100, 4, 4, 80, window_size=(20, 5), softcap=3.0),
    "prefill fwd+bwd d64 causal (Triton backward)": lambda: _prefill(2, 200, 4, 2, 64, backward=True, causal=True),
    "prefill fwd+bwd d128 fp16 (Gluon backward, atomic dQ)": lambda: _prefill(1, 300, 2, 2, 128, fp16, True),
    "prefill fwd+bwd d128 deterministic": lambda: _prefill(1, 200, 2, 1, 128, backward=True, deterministic=True),
    "prefill fwd+bwd d128 causal alibi [B, Hq] (slopes a slot)": lambda: _prefill(
        2, 150, 4, 2, 128, backward=True, causal=True, alibi_slopes=torch.rand(2, 4)),
    "decode paged append, split, alibi [Hq]": lambda: _decode(paged=True, append=True, num_splits=3,
                                                              alibi_slopes=torch.rand(32)),
    "prefill fwd+bwd d128 causal dropout (each call's seed a slot)": lambda: _seeded_calls(lambda: _prefill(
        2, 150, 4, 2, 128, backward=True, causal=True, dropout_p=0.1)),
    "varlen fwd+bwd d64 dropout": lambda: _seeded_calls(lambda: _varlen(backward=True, causal=True, dropout_p=0.2)),
    "prefill fwd+bwd d128 causal learnable_sink (sink and d sink slots)": lambda: _prefill(
        2, 150, 4, 2, 128, backward=True, causal=True, learnable_sink=torch.randn(4, requires_grad=True)),
    "decode append, split, sink, rotary, cache_batch_idx, cache_leftpad": lambda: _decode(
        append=True, num_splits=3, causal=True, learnable_sink=torch.randn(32), cache_batch_idx=torch.tensor(
            [1, 0], dtype=torch.int32), cache_leftpad=torch.tensor([3, 100], dtype=torch.int32),
        rotary_cos=torch.randn(512, 32, dtype=bf), rotary_sin=torch.randn(512, 32, dtype=bf)),
    "varlen fwd+bwd d64 causal": lambda: _varlen(backward=True, causal=True),
    "varlen paged": lambda: _varlen(paged=True, causal=True),
    "merge [B, S, H, D]": lambda: _merge(False),
    "merge [T, H, D]": lambda: _merge(True),
    "gemm M=1 split-K (register operands)": lambda: _gemm(1, 512, 1024),
    "gemm M=128 (Triton)": lambda: _gemm(128, 256, 512),
}


def check_cache_behaviour():
    """New tensors of one signature replay without Triton's JIT; a misaligned q or a unit batch stride does not."""
    jit_runs = []
    run = JITFunction.run

    def counting(self, *args, **kwargs):
        jit_runs.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    direct.clear_all()
    JITFunction.run = counting
    try:
        fn, _ = _decode()
        fn()
        assert jit_runs, "the first call did not go through Triton's JIT"
        jit_runs.clear()
        fn2, tensors = _decode()  # new tensors, same signature
        fn2()
        assert not jit_runs, f"a call with new pointers went through Triton's JIT: {jit_runs}"
        # q misaligned by 8 bytes: another plan, and Triton binds (and compiles) again
        buf = torch.randn(2 * 32 * 128 + 4, dtype=bf)
        q_mis = buf[4:].view(2, 1, 32, 128)
        _, kc, vc, lens = tensors[:4]
        call = lambda: tileflash.flash_attn_with_kvcache(q_mis, kc, vc, cache_seqlens=lens)  # noqa: E731
        call()
        assert jit_runs, "a misaligned q reused the aligned call's launches"
        check_equivalence("decode, misaligned q", call, [buf, kc, vc, lens])
        # a batch stride of 1 (Triton specialises integers equal to 1): the same shape, q's stride(0) 1
        k, v = (torch.randn(1, 64, 2, 64, dtype=bf) for _ in range(2))
        q = torch.randn(1, 64, 2, 64, dtype=bf)
        tileflash.flash_attn_func(q, k, v, window_size=(8, 8))
        jit_runs.clear()
        q_unit = torch.empty_strided((1, 64, 2, 64), (1, 128, 64, 1), dtype=bf).copy_(q)
        call = lambda: tileflash.flash_attn_func(q_unit, k, v, window_size=(8, 8))  # noqa: E731
        call()
        assert jit_runs, "a unit batch stride reused another call's launches"
        check_equivalence("prefill, unit batch stride", call, [q_unit, k, v])
        # recorded with one tensor for k_cache and v_cache (and k and v), replayed with two
        fn_same, _ = _decode(paged=True, append=True, same_kv=True)
        fn_two, tensors = _decode(paged=True, append=True)
        check_equivalence("decode recorded with k is v, replayed with two tensors", fn_two, tensors, record=fn_same)
    finally:
        JITFunction.run = run


def check_optional_tensors():
    """A call with an optional tensor (ALiBi slopes, a sink) after the same shapes without it gets a plan of its
    own, and the plain call's plan serves the plain call again (plan keys hold the optional tensors' keys only when
    one is given: direct.optional_keys)."""
    from tileflash.ops import kvcache, prefill

    direct.clear_all()
    fn, (q, kc, vc, lens) = _decode()
    fn()
    plain = set(map(id, kvcache._PLANS.values()))
    tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, alibi_slopes=torch.rand(q.shape[2]))
    assert len(kvcache._PLANS) == 2, "a call with alibi_slopes reused the plain call's plan"
    fn()
    assert len(kvcache._PLANS) == 2 and plain <= set(map(id, kvcache._PLANS.values()))
    q, k, v = (torch.randn(1, 64, 2, 64, dtype=bf) for _ in range(3))
    tileflash.flash_attn_func(q, k, v, causal=True)
    tileflash.flash_attn_func(q, k, v, causal=True, learnable_sink=torch.zeros(2))
    tileflash.flash_attn_func(q, k, v, causal=True)
    assert len(prefill._PUBLIC_DENSE) == 2, f"{len(prefill._PUBLIC_DENSE)} plans for a plain and a sink call"


def check_empty_calls():
    """Calls with nothing to launch (an empty GEMM dimension, an empty batch) return empty results through the
    plans on an sm_90 target (an empty GEMM once divided by zero choosing its tiles on the H200)."""
    for m, n in ((0, 16), (3, 0), (0, 0)):
        a = torch.randn(m, 32, dtype=bf)
        out = tileflash.nvfp4_matmul(a, *tileflash.nvfp4_quantize(torch.randn(n, 32)))
        assert out.shape == (m, n), (m, n, out.shape)
    q = torch.randn(2, 0, 4, 64, dtype=bf)
    assert tileflash.flash_attn_func(q, q, q).shape == q.shape


def main() -> int:
    driver.set_active(Sm90CompileOnly())
    checks = {name: (lambda name=name, make=make: check_equivalence(name, *make())) for name, make in CASES.items()}
    checks.update({"cache behaviour": check_cache_behaviour, "empty calls": check_empty_calls,
                   "optional tensors": check_optional_tensors})
    failed = 0
    for name, check in checks.items():
        try:
            launches = check()
            print(f"ok    {name}" + (f" ({launches} launches)" if launches else ""))
        except Exception as exc:  # noqa: BLE001 - report every case
            failed += 1
            print(f"FAIL  {name}: {type(exc).__name__}: {str(exc)[-800:]}")
    print(f"{failed} of {len(checks)} direct-launch checks failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
