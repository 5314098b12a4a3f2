"""Comparison rules shared by the kernel tests (the "2x rule" of the project conventions), for outputs and for
gradients."""
import dataclasses

import torch

import tileflash
from tileflash.reference import error_and_bound, kvcache_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
ON_SM90 = ON_GPU and torch.cuda.get_device_capability() == (9, 0)  # where the Gluon kernels run
E4M3 = torch.float8_e4m3fn


def attention_inputs(b, sq, sk, hq, hkv, d, dtype, seed=0):
    """Seeded q [b, sq, hq, d] and k, v [b, sk, hkv, d] on DEVICE (drawn on the CPU, so both machines get the same
    values)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEVICE, dtype)  # noqa: E731
    return mk(b, sq, hq, d), mk(b, sk, hkv, d), mk(b, sk, hkv, d)


def packed_inputs(lens_q, lens_k, hq, hkv, d, dtype, seed=0):
    """Seeded packed sequences on DEVICE: q [sum(lens_q), hq, d], k, v [sum(lens_k), hkv, d] and their int32
    cu_seqlens_q, cu_seqlens_k."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEVICE, dtype)  # noqa: E731
    cu = lambda lens: torch.tensor([0, *lens]).cumsum(0).to(DEVICE, torch.int32)  # noqa: E731
    return mk(sum(lens_q), hq, d), mk(sum(lens_k), hkv, d), mk(sum(lens_k), hkv, d), cu(lens_q), cu(lens_k)


def check_2x(out, ref32, ref_lowp, name="out") -> tuple[float, float]:
    """Pass iff max|out - ref32| <= 2 * max|ref_lowp - ref32| + atol, with no NaN anywhere (outputs are poisoned
    with NaN before launch, so an unwritten element fails here)."""
    assert out.shape == ref32.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref32.shape)}"
    err, bound = error_and_bound(out, ref32, ref_lowp)
    assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e} (inf = NaN in the output)"
    return err, bound


def check_lse(lse, ref_lse, atol=1e-3):
    """LSE is float32 in both; -inf rows must match exactly (positions), finite ones to atol (relative to scale)."""
    assert not torch.isnan(lse).any(), "lse: NaN (unwritten?)"
    ref_lse = ref_lse.float()
    inf_ref = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), inf_ref), "lse: -inf rows differ from the reference"
    if (~inf_ref).any():
        err = (lse[~inf_ref] - ref_lse[~inf_ref]).abs().max().item()
        assert err <= atol, f"lse: max error {err:.3e} > {atol}"


def check_out_lse(got, ref_fn):
    """got = (out, lse) against ref_fn(upcast) -> (out, lse): the 2x rule on out, check_lse on lse."""
    out, lse = got
    ref32, ref_lse = ref_fn(upcast=True)
    check_2x(out, ref32, ref_fn(upcast=False)[0])
    check_lse(lse, ref_lse)


def grads(fn, inputs, dout, dlse):
    """Gradients of sum(out * dout) + sum(lse * dlse) (rows with lse = -inf, which saw no key, contribute nothing)
    with respect to inputs, where fn(*inputs) returns (out, lse)."""
    out, lse = fn(*inputs)
    loss = (out.float() * dout.float()).sum() + (torch.where(torch.isinf(lse), 0.0, lse) * dlse).sum()
    return torch.autograd.grad(loss, inputs)


def check_grads(run, ref_run, inputs, dout, dlse):
    """dq, dk, dv of run(q, k, v) -> (out, lse) against ref_run(q, k, v, upcast) with the 2x rule; inputs are
    leaves that require grad, in the kernel's dtype."""
    got = grads(run, inputs, dout, dlse)
    ups = [x.detach().float().requires_grad_() for x in inputs]
    ref32 = grads(lambda *a: ref_run(*a, upcast=True), ups, dout, dlse)
    lows = [x.detach().clone().requires_grad_() for x in inputs]
    ref_lowp = grads(lambda *a: ref_run(*a, upcast=False), lows, dout, dlse)
    for name, g, r32, rlow in zip(("dq", "dk", "dv"), got, ref32, ref_lowp):
        assert g.dtype == inputs[0].dtype
        check_2x(g, r32, rlow, name)



def run_standin_script(name: str, *args: str, timeout: int = 600):
    """Run tests/<name> (with command-line args) in a subprocess without TRITON_INTERPRET (it installs the
    stand-in driver, which replaces the process's active Triton driver); returns the completed process."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(__file__)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, os.path.join(here, name), *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def decode_inputs(b, ctx, hkv, page, seed):
    """q [b, 3, 4, 32] (pack-GQA rows of 3 tokens x 2 heads per KV head), caches [b, ctx] or pages of `page` in
    reversed order, a 2-token append."""
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEVICE, torch.float16)  # noqa: E731
    q, kn, vn = mk(b, 3, 4, 32), mk(b, 2, hkv, 32), mk(b, 2, hkv, 32)
    if page is None:
        return q, mk(b, ctx, hkv, 32), mk(b, ctx, hkv, 32), None, kn, vn
    pages = b * ctx // page
    table = torch.arange(pages - 1, -1, -1, dtype=torch.int32).view(b, -1).to(DEVICE)
    return q, mk(pages, page, hkv, 32), mk(pages, page, hkv, 32), table, kn, vn


KERNEL_ONLY = ("num_splits", "sp_overlap")  # flash_attn_with_kvcache arguments that do not change the result


def check_kvcache_call(q, k, v, kc, vc, lse_atol=2e-2, **kw):
    """flash_attn_with_kvcache (on copies of the caches) against kvcache_ref: the 2x rule on out, lse within
    lse_atol, the appended V exactly and K too, unless rotated (rotated keys are computed in fp32 and rounded once
    like the reference's, but an FMA may move the last bit). Returns out."""
    import tileflash
    from tileflash.reference import kvcache_ref

    kc_got, vc_got = kc.clone(), vc.clone()
    out, lse = tileflash.flash_attn_with_kvcache(q, kc_got, vc_got, k, v, return_softmax_lse=True, **kw)
    ref_kw = {n: a for n, a in kw.items() if n not in KERNEL_ONLY}
    ref, ref_lse, kc_ref, vc_ref = kvcache_ref(q, kc, vc, k, v, **ref_kw)
    ref_lowp, *_ = kvcache_ref(q, kc, vc, k, v, upcast=False, **ref_kw)
    check_2x(out, ref, ref_lowp)
    check_lse(lse, ref_lse, atol=lse_atol)
    if kw.get("rotary_cos") is None:
        assert torch.equal(kc_got, kc_ref)
    else:
        assert torch.allclose(kc_got.float(), kc_ref.float(), atol=1e-2, rtol=1e-2)
    assert torch.equal(vc_got, vc_ref)
    return out


def make_cache(batch, capacity, hkv, d, dtype, page_size, gen, spare_pages=3):
    """Contiguous [B, capacity, Hkv, D] (page_size None) or a paged pool in random order with unused pages."""
    if page_size is None:
        k = torch.randn(batch, capacity, hkv, d, generator=gen)
        return k.to(DEVICE, dtype), torch.randn_like(k).to(DEVICE, dtype), None
    pages_per_seq = -(-capacity // page_size)
    num_pages = batch * pages_per_seq + spare_pages
    k = torch.randn(num_pages, page_size, hkv, d, generator=gen)
    v = torch.randn(num_pages, page_size, hkv, d, generator=gen)
    perm = torch.randperm(num_pages, generator=gen)[: batch * pages_per_seq]
    table = perm.reshape(batch, pages_per_seq).to(torch.int32)
    return k.to(DEVICE, dtype), v.to(DEVICE, dtype), table.to(DEVICE)


def draw_queries_and_new_kv(g, b, sq, s_new, hq, hkv, d, dtype):
    """q [B, Sq, Hq, D] and, when s_new > 0, the new k, v [B, Snew, Hkv, D] to append (else None, None)."""
    q = torch.randn(b, sq, hq, d, generator=g).to(DEVICE, dtype)
    if not s_new:
        return q, None, None
    k = torch.randn(b, s_new, hkv, d, generator=g).to(DEVICE, dtype)
    return q, k, torch.randn(b, s_new, hkv, d, generator=g).to(DEVICE, dtype)


def check_quantized_decode(g, seqlens, sq, s_new, hq, hkv, d, dtype, table, k_cache, v_cache, num_splits, scales,
                            **mask):
    """Draw q (and k, v when s_new) from g, run flash_attn_with_kvcache on the quantized caches (appending in
    place; mask: window_size / softcap) and check out and lse against kvcache_ref with the 2x rule; returns the
    reference's appended caches."""
    b = len(seqlens)
    q, k, v = draw_queries_and_new_kv(g, b, sq, s_new, hq, hkv, d, dtype)
    cache_seqlens = torch.tensor(seqlens, dtype=torch.int32, device=DEVICE)
    kw = dict(cache_seqlens=cache_seqlens, block_table=table, **scales, **mask)
    ref, ref_lse, ref_k, ref_v = kvcache_ref(q, k_cache, v_cache, k, v, **kw)
    ref_lowp, _, _, _ = kvcache_ref(q, k_cache, v_cache, k, v, upcast=False, **kw)
    out, lse = tileflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, num_splits=num_splits, return_lse=True,
                                                 **kw)
    check_2x(out, ref, ref_lowp)
    check_lse(lse, ref_lse)
    return ref_k, ref_v


def force_trans(override, trans: bool):
    """Run decode with the transposed products (attn_inner's TRANS) on or off, whatever the heuristic picks."""
    override(decode=lambda cfg: dataclasses.replace(cfg, trans=trans))


def dequantize(x8, descale, cu_seqlens=None):
    """float(x8) * the descale of each element's (sequence, KV head); x8 [B, S, H, D] or packed [total, H, D]."""
    hkv = descale.shape[1]
    x = x8.float()
    if cu_seqlens is None:
        scale = descale.repeat_interleave(x.shape[2] // hkv, dim=1)[:, None, :, None]
        return x * scale
    out = x.clone()
    cu = cu_seqlens.tolist()
    for b in range(len(cu) - 1):
        out[cu[b]:cu[b + 1]] *= descale[b].repeat_interleave(x.shape[1] // hkv)[None, :, None]
    return out


def check_fp8(out, lse, ref_fn, out_dtype=torch.bfloat16):
    """ref_fn(upcast, intermediate_dtype) -> (out, lse) on the dequantized inputs. lse to 1e-2: sm_90's FP8 MMAs
    add q8 k8^T up in reduced precision (FA3 keeps that too; 6.8e-3 seen with ALiBi's large logits, run 139)."""
    ref32, ref_lse = ref_fn(True, None)
    ref_lowp = ref_fn(True, E4M3)[0].to(out_dtype)
    assert out.dtype == out_dtype and lse.dtype == torch.float32
    check_2x(out, ref32, ref_lowp)
    check_lse(lse, ref_lse, atol=1e-2)
