"""Bad input raises ValueError/TypeError before any launch, naming the argument."""
import pytest
import torch

import tileflash
from helpers import DEVICE

F16 = dict(dtype=torch.float16, device=DEVICE)


def qkv(b=1, sq=4, sk=4, hq=4, hkv=2, d=64):
    return torch.randn(b, sq, hq, d, **F16), torch.randn(b, sk, hkv, d, **F16), torch.randn(b, sk, hkv, d, **F16)


def _noncontig_last(t):
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


FUNC_CASES = [
    ("q", TypeError, lambda q, k, v: (q.float(), k, v)),  # dtype
    ("q", TypeError, lambda q, k, v: (q.to(torch.int32), k, v)),  # integer tensor
    ("k", TypeError, lambda q, k, v: (q, k.bfloat16(), v)),  # dtype mismatch
    ("q", ValueError, lambda q, k, v: (q[0], k, v)),  # rank
    ("KV heads", ValueError, lambda q, k, v: (q[:, :, :3], k, v)),  # Hq % Hkv != 0
    ("head dim", ValueError, lambda q, k, v: (q[..., :0], k[..., :0], v[..., :0])),  # empty
    ("k, v", ValueError, lambda q, k, v: (q, k, v[:, :3])),  # k/v shape mismatch
    ("last dimension", ValueError, lambda q, k, v: (_noncontig_last(q), k, v)),
    ("batch", ValueError, lambda q, k, v: (q, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1))),
]


@pytest.mark.parametrize("needle, exc, mutate", FUNC_CASES, ids=[str(i) for i in range(len(FUNC_CASES))])
def test_flash_attn_func_errors(needle, exc, mutate):
    with pytest.raises(exc, match=needle):
        tileflash.flash_attn_func(*mutate(*qkv()))


def test_head_dim_too_large():
    q, k, v = qkv(d=264)
    with pytest.raises(ValueError, match="head dim"):
        tileflash.flash_attn_func(q, k, v)


@pytest.mark.parametrize("kw, needle", [(dict(softcap=float("nan")), "softcap"), (dict(window_size=3), "window_size"),
                                        (dict(window_size=(0.5, 0)), "window_size"),
                                        (dict(softmax_scale=torch.tensor([5.0])), "softmax_scale")])
def test_option_errors(kw, needle):
    with pytest.raises((ValueError, TypeError), match=needle):
        tileflash.flash_attn_func(*qkv(), **kw)


@pytest.mark.parametrize("kw, same", [(dict(window_size=(-2, 0)), dict(window_size=(-1, 0))),
                                      (dict(window_size=(1, -5)), dict(window_size=(1, -1))),
                                      (dict(softcap=-1.0), dict(softcap=0.0))])
def test_negative_options_are_off(kw, same):
    """flash-attn takes any negative window bound as unbounded and a softcap <= 0 as off; so does tileflash, to the
    bit."""
    q, k, v = qkv(sq=5, sk=9)
    assert torch.equal(tileflash.flash_attn_func(q, k, v, **kw), tileflash.flash_attn_func(q, k, v, **same))


def test_cpu_tensor_outside_the_interpreter(monkeypatch):
    """Without Triton's interpreter a CPU tensor gets a clear error before any launch (it used to fail in triton's
    launcher: '0 active drivers' without a GPU, a pointer error with one)."""
    import tileflash._utils as tf_utils

    monkeypatch.setattr(tf_utils, "is_interpreter", lambda: False)
    q = torch.randn(1, 4, 2, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="expected a CUDA tensor, got one on cpu"):
        tileflash.flash_attn_func(q, q, q)
    with pytest.raises(ValueError, match="out_a: expected a CUDA tensor"):
        tileflash.merge_attn_states(q, torch.zeros(1, 2, 4), q, torch.zeros(1, 2, 4))


def test_varlen_errors():
    q, k, v = (t[0] for t in qkv())
    cu = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        tileflash.flash_attn_varlen_func(q, k, v, cu.long(), cu, 4, 4)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        tileflash.flash_attn_varlen_func(q, k, v, cu, torch.tensor([0, 2, 4], dtype=torch.int32, device=DEVICE), 4, 4)
    with pytest.raises(TypeError, match="seqused_k"):
        tileflash.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, seqused_k=torch.tensor([4], device=DEVICE))


def kvcache_args(paged=True):
    q = torch.randn(2, 1, 4, 64, **F16)
    if paged:
        kc = torch.randn(10, 16, 2, 64, **F16)
        table = torch.arange(8, dtype=torch.int32, device=DEVICE).reshape(2, 4)
    else:
        kc, table = torch.randn(2, 64, 2, 64, **F16), None
    seqlens = torch.tensor([3, 60], dtype=torch.int32, device=DEVICE)
    return dict(q=q, k_cache=kc, v_cache=kc.clone(), cache_seqlens=seqlens, block_table=table)


KVCACHE_CASES = [
    ("cache_seqlens", TypeError, lambda a: a.update(cache_seqlens=a["cache_seqlens"].long())),
    ("cache_seqlens", ValueError, lambda a: a.update(cache_seqlens=None, k=torch.randn(2, 1, 2, 64, **F16),
                                                     v=torch.randn(2, 1, 2, 64, **F16))),  # None: only without k, v
    ("block_table", TypeError, lambda a: a.update(block_table=a["block_table"].long())),
    ("k, v", ValueError, lambda a: a.update(k=torch.randn(2, 1, 2, 64, **F16))),
    ("query token", ValueError, lambda a: a.update(q=torch.randn(2, 0, 4, 64, **F16))),
    ("page size", ValueError, lambda a: a.update(k_cache=torch.randn(2, 0, 2, 64, **F16),
                                                 v_cache=torch.randn(2, 0, 2, 64, **F16))),
    ("capacity", ValueError, lambda a: a.update(cache_seqlens=torch.full((2,), 64, dtype=torch.int32, device=DEVICE),
                                                k=torch.randn(2, 1, 2, 64, **F16), v=torch.randn(2, 1, 2, 64, **F16))),
    ("page indices in \\[0, 10\\)", ValueError, lambda a: a["block_table"].__setitem__((1, 0), 10)),
    ("num_splits", ValueError, lambda a: a.update(num_splits=-1)),
    ("k_cache", TypeError, lambda a: a.update(k_cache=a["k_cache"].bfloat16())),
    ("k_scale: not used with a torch.float16 cache", ValueError,
     lambda a: a.update(k_scale=torch.ones(1, device=DEVICE), v_scale=torch.ones(1, device=DEVICE))),
    ("k_scale: required with a torch.float8_e4m3fn cache", ValueError,
     lambda a: a.update(k_cache=a["k_cache"].to(torch.float8_e4m3fn), v_cache=a["v_cache"].to(torch.float8_e4m3fn))),
    ("k_global_scale: required with a torch.uint8 cache", ValueError,
     lambda a: a.update(k_cache=torch.zeros(10, 16, 2, 32, dtype=torch.uint8, device=DEVICE),
                        v_cache=torch.zeros(10, 16, 2, 32, dtype=torch.uint8, device=DEVICE),
                        k_scale=torch.zeros(10, 16, 2, 4, device=DEVICE).to(torch.float8_e4m3fn),
                        v_scale=torch.zeros(10, 16, 2, 4, device=DEVICE).to(torch.float8_e4m3fn))),
    ("k_scale: expected e4m3 block scales", ValueError,
     lambda a: a.update(k_cache=torch.zeros(10, 16, 2, 32, dtype=torch.uint8, device=DEVICE),
                        v_cache=torch.zeros(10, 16, 2, 32, dtype=torch.uint8, device=DEVICE),
                        k_scale=torch.zeros(10, 16, 2, 8, device=DEVICE).to(torch.float8_e4m3fn),
                        v_scale=torch.zeros(10, 16, 2, 4, device=DEVICE).to(torch.float8_e4m3fn),
                        k_global_scale=torch.ones(1, device=DEVICE), v_global_scale=torch.ones(1, device=DEVICE))),
    ("head dim", ValueError,  # NVFP4 cache of 48 bytes = 96 values per head for q's 64
     lambda a: a.update(k_cache=torch.zeros(10, 16, 2, 48, dtype=torch.uint8, device=DEVICE),
                        v_cache=torch.zeros(10, 16, 2, 48, dtype=torch.uint8, device=DEVICE))),
    ("v_scale", ValueError, lambda a: a.update(k_cache=a["k_cache"].to(torch.float8_e4m3fn),
                                               v_cache=a["v_cache"].to(torch.float8_e4m3fn),
                                               k_scale=torch.ones(2, device=DEVICE),
                                               v_scale=torch.ones(3, device=DEVICE))),
    ("k_scale", TypeError, lambda a: a.update(k_cache=a["k_cache"].to(torch.float8_e4m3fn),
                                              v_cache=a["v_cache"].to(torch.float8_e4m3fn),
                                              k_scale=torch.ones(1, device=DEVICE, dtype=torch.float16),
                                              v_scale=torch.ones(1, device=DEVICE))),
]


@pytest.mark.parametrize("needle, exc, mutate", KVCACHE_CASES, ids=[str(i) for i in range(len(KVCACHE_CASES))])
def test_kvcache_errors(needle, exc, mutate):
    args = kvcache_args()
    mutate(args)
    with pytest.raises(exc, match=needle):
        tileflash.flash_attn_with_kvcache(validate=True, **args)


def test_kvcache_contiguous_batch_mismatch():
    args = kvcache_args(paged=False)
    args["k_cache"] = args["k_cache"][:1]
    args["v_cache"] = args["v_cache"][:1]
    with pytest.raises(ValueError, match="k_cache"):
        tileflash.flash_attn_with_kvcache(**args)


def test_merge_errors():
    o = torch.randn(1, 3, 2, 16, **F16)
    lse = torch.randn(1, 2, 3, device=DEVICE)
    with pytest.raises(ValueError, match="lse_b"):
        tileflash.merge_attn_states(o, lse, o, lse.transpose(1, 2))
    with pytest.raises(TypeError, match="lse_a"):
        tileflash.merge_attn_states(o, lse.half(), o, lse)


def test_every_error_names_the_argument_and_what_was_given():
    """Each ValueError/TypeError above starts with the argument's name and says what was given ('got ...')."""
    messages = []
    for needle, exc, mutate in FUNC_CASES:
        with pytest.raises(exc) as info:
            tileflash.flash_attn_func(*mutate(*qkv()))
        messages.append(str(info.value))
    for needle, exc, mutate in KVCACHE_CASES:
        args = kvcache_args()
        mutate(args)
        with pytest.raises(exc) as info:
            tileflash.flash_attn_with_kvcache(validate=True, **args)
        messages.append(str(info.value))
    for msg in messages:
        arg = msg.split(":")[0]
        assert arg and " " not in arg.replace(", ", ",").replace(" + ", "+").replace("head dim", "head_dim"), msg
        assert "got" in msg or "exceed" in msg, msg


def test_varlen_paged_errors():
    q = torch.randn(6, 4, 32, **F16)
    pool = torch.randn(8, 16, 2, 32, **F16)
    cu = torch.tensor([0, 6], dtype=torch.int32, device=DEVICE)
    table = torch.arange(4, dtype=torch.int32, device=DEVICE).reshape(1, 4)
    used = torch.tensor([30], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="seqused_k: required"):
        tileflash.flash_attn_varlen_func(q, pool, pool, cu, None, 6, 30, block_table=table)
    with pytest.raises(ValueError, match="block_table: expected a \\[1, max_pages\\]"):
        tileflash.flash_attn_varlen_func(q, pool, pool, cu, None, 6, 30, seqused_k=used, block_table=table.repeat(2, 1))
    # Inputs that require grad are accepted (flash-attn's behaviour); the backward says it does not exist rather
    # than give gradients that ignore the pages.
    out = tileflash.flash_attn_varlen_func(q.requires_grad_(), pool, pool, cu, None, 6, 30, seqused_k=used,
                                           block_table=table)
    assert torch.equal(out, tileflash.flash_attn_varlen_func(q.detach(), pool, pool, cu, None, 6, 30,
                                                             seqused_k=used, block_table=table))
    with pytest.raises(RuntimeError, match="paged keys have no backward"):
        out.sum().backward()


def test_fp8_and_nvfp4_refuse_gpus_older_than_sm89(monkeypatch):
    """e4m3 conversions need compute capability 8.9+: an A100 gets a named error, not a GPU-compiler failure."""
    from types import SimpleNamespace

    import tileflash._utils as tf_utils

    class FakeCudaTensor:
        is_cuda = True
        device = torch.device("cuda", 0)

    monkeypatch.setattr(tf_utils, "_cuda_properties", lambda device: SimpleNamespace(major=8, minor=0))
    with pytest.raises(ValueError, match=r"k_cache: .*8\.9 or newer.*got 8\.0"):
        tf_utils.check_fp8_hardware("k_cache", FakeCudaTensor())
    monkeypatch.setattr(tf_utils, "_cuda_properties", lambda device: SimpleNamespace(major=9, minor=0))
    tf_utils.check_fp8_hardware("k_cache", FakeCudaTensor())  # Hopper: fine
