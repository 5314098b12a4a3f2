"""A stand-in for Triton's CUDA driver: an sm_90 target, CPU tensors, launches that do nothing.

With it installed (`triton.runtime.driver.set_active(Sm90CompileOnly())`, before any kernel is launched, in a
process without TRITON_INTERPRET), every public op called on CPU tensors goes through Triton's real compiler and
ptxas for sm_90 and through tileflash's whole host path, and nothing runs: tests/sm90_compile_check.py compiles
every kernel this way, and `bench host --no-launch` times the host path of each op on any machine. Results are
garbage; only compilation and host work are real.
"""
import torch
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import CudaDriver


class _Utils:
    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}

    def load_binary(self, name, kernel, shared, device):
        return 1, 1, 0, 0, 1024  # module, function, n_regs, n_spills, max threads


class NoLaunch:
    """A compiled kernel's launcher that launches nothing; `calls`, when a list, collects every launch's arguments
    (the equivalence tests of the direct launch path)."""
    calls = None

    def __init__(self, src, metadata):
        pass

    def __call__(self, *args, **kwargs):
        if NoLaunch.calls is not None:
            NoLaunch.calls.append(args)


class Sm90CompileOnly(CudaDriver):
    """Triton's CUDA driver minus the GPU."""

    utils = _Utils()
    launcher_cls = NoLaunch

    def __init__(self):  # the real one loads libcuda
        pass

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")
