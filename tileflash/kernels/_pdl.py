"""Programmatic dependent launch (sm_90+) between the split-KV attention kernel and its combine.

The combine is launched with the PDL attribute and may become resident while the attention kernel still runs; its
first instruction waits (griddepcontrol.wait) until the attention kernel has finished and its writes are visible,
so the launch latency of the second kernel overlaps the first one's tail. The attention kernel lets it launch early
(griddepcontrol.launch_dependents) once all of its programs are resident. Off in the interpreter (inline PTX), on
triton builds without the feature, and with TILEFLASH_PDL=0.
"""
import os

import triton
import triton.language as tl


def _supported() -> bool:
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or os.environ.get("TILEFLASH_PDL", "1") == "0":
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra import cuda
    except ImportError:  # a triton without the NVIDIA backend
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(cuda, "gdc_wait")


PDL = tl.constexpr(_supported())


if PDL:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
else:
    @triton.jit
    def gdc_wait():
        """No PDL: the combine starts after the attention kernel like any stream-ordered launch."""
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass
