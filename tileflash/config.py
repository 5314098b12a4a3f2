"""Explicit config overrides, for sweeps and tests: replace what the planners choose, for every call in a block.

    from tileflash import config
    from tileflash.plan.decode import DecodeConfig
    with config.override(decode=DecodeConfig(block_m=16, block_n=64, num_warps=4, num_stages=2)):
        tileflash.flash_attn_with_kvcache(...)
    with config.override(decode=lambda cfg: dataclasses.replace(cfg, num_stages=3)):  # edit the planner's choice
        ...

A value is the config to use, or a function from the planner's choice to the one to use. The optional kernels take
None to decline them (fwd_ws=None: the Triton forward). What the call's tensors and masks allow is still checked:
an override changes tiles, never which inputs a kernel accepts. Cached plans are dropped on entering and leaving a
block, so calls inside it plan again. `python -m tileflash sweep` is built on this.
"""
from __future__ import annotations

import contextlib

# key: what the planner it replaces returns
KINDS = {
    "fwd": "plan.prefill.FwdConfig: the Triton forward's tiles (prefill, varlen, extend)",
    "fwd_ws": "plan.prefill.WsFwdConfig or None: the sm_90 Gluon forward's tiles",
    "bwd": "plan.backward.BwdConfig: the Triton backward's tiles",
    "bwd_ws": "plan.backward.WsBwdConfig or None: the sm_90 Gluon dK/dV kernel's tiles",
    "decode": "plan.decode.DecodeConfig: the Triton decode's tiles (16-bit, FP8 and NVFP4 caches)",
    "mla_decode": "plan.decode.DecodeConfig: MLA (qv) decode tiles (the Triton kernel)",
    "mla_gluon": "plan.decode.MlaGluonConfig or None: the sm_90 Gluon MLA decode",
    "quant_decode": "plan.decode.QuantDecodeConfig or None: the sm_90 register-operand NVFP4 decode",
    "combine_pdl": "bool: the split combine launched as a programmatic dependent (sm_90)",
    "decode_after_prior": "bool: the decode kernel (Triton, or Gluon MLA) launched as a programmatic dependent of "
                          "the kernel before it on the stream (sm_90)",
    "gemm": "plan.gemm.GemmConfig: the Triton NVFP4 GEMM's tiles",
    "gemm_mma": "plan.gemm.GemmMmaConfig or None: the sm_90 register-operand NVFP4 GEMM (M <= 16, K not for wgmma)",
    "gemm_wgmma": "plan.gemm.GemmWgmmaConfig or None: the sm_90 wgmma NVFP4 GEMM (M <= 1024, K % 256 == 0)",
    "gemm_decoded": "plan.gemm.GemmDecodedConfig or None: W4A16 above 1024 rows (256 without wgmma) and W4A4 above "
                    "256 off Blackwell, decoded operands + cuBLAS (taken before the other GEMM kinds: force None to "
                    "time those there)",
}
_FORCED: dict = {}


def chosen(kind: str, default):
    """The config a call uses: the planner's choice (default) unless an override block replaces it."""
    if kind not in _FORCED:
        return default
    value = _FORCED[kind]
    return value(default) if callable(value) else value


@contextlib.contextmanager
def override(**forced):
    """Replace the planners' choices named by the keywords (see KINDS) inside the block; blocks nest."""
    unknown = sorted(set(forced) - set(KINDS))
    if unknown:
        raise ValueError(f"config.override: unknown kinds {unknown}; known: {sorted(KINDS)}")
    from .launch import direct

    saved = dict(_FORCED)
    _FORCED.update(forced)
    direct.clear_all()
    try:
        yield
    finally:
        _FORCED.clear()
        _FORCED.update(saved)
        direct.clear_all()
