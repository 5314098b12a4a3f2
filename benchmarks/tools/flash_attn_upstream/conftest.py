"""flash-attn's own test files against tileflash (GPU), through tileflash.integrations.flash_attn:

    cp <flash-attn checkout>/tests/test_flash_attn.py benchmarks/tools/flash_attn_upstream/   # git-ignored
    python -m pytest benchmarks/tools/flash_attn_upstream/test_flash_attn.py -k "<subset>"

(on the device machine: name the copied file in `carry`). The shim is installed before the test module imports
flash_attn; flash_attn.layers.rotary, which the kvcache tests use for their reference, is provided here in torch
(tileflash.reference.rotary_ref). Tests of what tileflash does not take (flash-attn's raw C++ entry points, its
package internals) fail at the call by name, as they would against any other implementation.
Without a GPU (a few cases, through Triton's interpreter, einops installed): copy the file with its device
replaced, `sed 's/device = "cuda"/device = "cpu"/'`; the GPU queries it makes at import answer sm_90 here."""
import os
import sys
import types

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before tileflash imports triton
    torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)

from tileflash.integrations import flash_attn as compat  # noqa: E402
from tileflash.reference import rotary_ref  # noqa: E402

compat.install()


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    """flash_attn.layers.rotary.apply_rotary_emb for padded x [B, S, H, D] (the tests' use): position of token s of
    batch b is seqlen_offsets[b] (or the int) + s."""
    if cu_seqlens is not None:
        raise NotImplementedError("apply_rotary_emb: packed x (cu_seqlens) is not provided here")
    b, s = x.shape[:2]
    offsets = seqlen_offsets if isinstance(seqlen_offsets, torch.Tensor) else torch.full((b,), int(seqlen_offsets))
    out = torch.stack([rotary_ref(x[i], cos, sin, int(offsets[i]) + torch.arange(s, device=x.device), interleaved)
                       for i in range(b)])
    if inplace:
        x.copy_(out)
        return x
    return out


_layers = types.ModuleType("flash_attn.layers")
_rotary = types.ModuleType("flash_attn.layers.rotary")
_rotary.apply_rotary_emb = apply_rotary_emb
_layers.rotary = _rotary
sys.modules.setdefault("flash_attn.layers", _layers)
sys.modules.setdefault("flash_attn.layers.rotary", _rotary)
