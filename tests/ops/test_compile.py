"""Each public op is a torch.library custom op with a fake implementation: torch.compile(fullgraph=True) traces
through it (aot_eager: checks the fake shapes and the op call without code generation) and matches eager."""
import pytest
import torch

import tileflash
from helpers import DEVICE


def _block(q, k, v, k_cache, v_cache, cache_seqlens, table):
    out, lse = tileflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    dec, dec_lse = tileflash.flash_attn_with_kvcache(q[:, :1], k_cache, v_cache, cache_seqlens=cache_seqlens,
                                                     block_table=table, num_splits=2, return_lse=True)
    merged, _ = tileflash.merge_attn_states(out[:, :1], lse[:, :, :1], dec, dec_lse)
    return out.sum(-1), merged


def test_compile_fullgraph_matches_eager():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 9, 4, 32, generator=g).to(DEVICE, torch.float16)
    k = torch.randn(2, 9, 2, 32, generator=g).to(DEVICE, torch.float16)
    v = torch.randn(2, 9, 2, 32, generator=g).to(DEVICE, torch.float16)
    k_cache = torch.randn(6, 8, 2, 32, generator=g).to(DEVICE, torch.float16)
    v_cache = torch.randn(6, 8, 2, 32, generator=g).to(DEVICE, torch.float16)
    table = torch.tensor([[3, 1, 5], [0, 2, 4]], dtype=torch.int32, device=DEVICE)
    seqlens = torch.tensor([20, 7], dtype=torch.int32, device=DEVICE)
    args = (q, k, v, k_cache, v_cache, seqlens, table)
    eager = _block(*args)
    compiled = torch.compile(_block, fullgraph=True, backend="aot_eager")(*args)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_varlen_compiles():
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=DEVICE)
    q = torch.randn(12, 2, 16, device=DEVICE, dtype=torch.float16)
    fn = lambda q: tileflash.flash_attn_varlen_func(q, q, q, cu, cu, 7, 7, causal=True)  # noqa: E731
    assert torch.equal(torch.compile(fn, fullgraph=True, backend="aot_eager")(q), fn(q))


@pytest.mark.parametrize("dv", [32, 48], ids=["dv=d", "dv!=d"])
def test_compile_backward_matches_eager(dv):
    """The custom ops' fake shapes hold when V's head dim differs from q's (out and dv take it)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 11, 2, d, generator=g).to(DEVICE, torch.float16).requires_grad_() for d in (32, 32, dv))

    def loss(q, k, v):
        return tileflash.flash_attn_func(q, k, v, causal=True).float().square().sum()

    eager = torch.autograd.grad(loss(q, k, v), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(q, k, v), (q, k, v))
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_forward_only_calls_run_eagerly_under_compile():
    """Calls without a backward (here FP8 inputs) take no custom op under torch.compile: a graph break to the eager
    call (disabled for dynamo at its first use, _utils.compiler_disabled), dense and varlen."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 13, 2, 32, generator=g).to(DEVICE, torch.bfloat16) for _ in range(3))
    q8, k8, v8, qd, kd, vd = tileflash.fp8_quantize_qkv(q, k, v)
    cu = torch.tensor([0, 6, 13], dtype=torch.int32, device=DEVICE)

    def dense(q8, k8, v8):
        return tileflash.flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd) * 2

    def varlen(q8, k8, v8):
        return tileflash.flash_attn_varlen_func(q8[0], k8[0], v8[0], cu, cu, 7, 7, causal=True) * 2

    for fn in (dense, varlen):
        assert torch.equal(torch.compile(fn, backend="eager")(q8, k8, v8), fn(q8, k8, v8))


def test_import_does_not_load_dynamo():
    """`import tileflash` leaves torch._dynamo unloaded (~2 s of every import); torch.compile loads it."""
    import subprocess
    import sys

    code = "import sys, tileflash; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
