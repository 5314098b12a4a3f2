"""A stand-in for Triton's CUDA driver: an sm_90 target, CPU tensors, launches that do nothing.

With it installed (`triton.runtime.driver.set_active(Sm90CompileOnly())`, before any kernel is launched, in a
process without TRITON_INTERPRET), every public op called on CPU tensors goes through Triton's real compiler and
ptxas for sm_90 and through tileflash's whole host path, and nothing runs: tests/sm90_compile_check.py compiles
every kernel this way, and `bench host --no-launch` times the host path of each op on any machine. Results are
garbage; only compilation and host work are real.
"""
import inspect

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import CudaDriver, CudaLauncher

from tileflash.plan.target import SHARED_MEM_PER_BLOCK


class _Utils:
    """Device properties of the target (kernels over its shared memory fail to load, as they would on that GPU)."""

    def __init__(self, max_shared_mem: int = SHARED_MEM_PER_BLOCK[90]):
        self.max_shared_mem = max_shared_mem

    def get_device_properties(self, device):
        return {"max_shared_mem": self.max_shared_mem, "multiprocessor_count": 132, "max_num_regs": 65536,
                "warpSize": 32}

    def load_binary(self, name, kernel, shared, device):
        return 1, 1, 0, 0, 1024  # module, function, n_regs, n_spills, max threads

    @staticmethod
    def fill_tma_descriptor(ptr, swizzle, elem_size, elem_type, block, shape, strides, padding):
        """An 'encoded' descriptor that is its inputs (compared by the equivalence tests)."""
        return ("tensormap", ptr, swizzle, elem_size, elem_type, tuple(block), tuple(shape), tuple(strides),
                padding)

    fill_tma_descriptor_tiled = fill_tma_descriptor  # triton 3.7's name


_TRITON_37 = "kernel_metadata" in inspect.signature(CudaLauncher.__call__).parameters


class NoLaunch:
    """A compiled kernel's launcher shaped like Triton's CudaLauncher (its TMA-descriptor wrapper in front of a C
    launcher), whose C launcher launches nothing; `calls`, when a list, collects every launch's grid, stream,
    function and final kernel arguments (descriptors encoded by _Utils' stand-in), as the C launcher gets them.
    The equivalence tests of the direct launch path compare these."""
    calls = None

    def __init__(self, src, metadata):
        from triton.backends.nvidia import driver as nvidia_driver

        self.global_scratch_size = metadata.global_scratch_size
        self.profile_scratch_size = metadata.profile_scratch_size
        self.launch_cooperative_grid = metadata.launch_cooperative_grid
        self.launch_pdl = metadata.launch_pdl
        if _TRITON_37:
            self.arg_annotations = self.kernel_signature = None
        signature = dict(src.signature)
        self.launch = nvidia_driver.wrap_handle_tensordesc(self._c_launcher, signature,
                                                           getattr(metadata, "tensordesc_meta", None))

    @staticmethod
    def _c_launcher(*args):
        if NoLaunch.calls is None:
            return
        # 3.7: (grid x3, stream, function, coop, pdl, metadata, launch metadata, hooks x2, scratch x2, annotations,
        # signature, kernel arguments); 3.6: (grid x3, stream, function, coop, pdl, scratch x2, metadata, launch
        # metadata, hooks x2, *kernel arguments)
        kernel_args = list(args[-1]) if _TRITON_37 else list(args[13:])
        NoLaunch.calls.append((args[:5], kernel_args))

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        if _TRITON_37:
            kernel_metadata, launch_metadata, enter, leave, *kernel_args = args
            self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                        kernel_metadata, launch_metadata, enter, leave, None, None, None, None, kernel_args)
        else:
            self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, None,
                        None, *args)


class Sm90CompileOnly(CudaDriver):
    """Triton's CUDA driver minus the GPU; `arch` picks another target (80, 100, 120: the compile check's --arch)."""

    launcher_cls = NoLaunch

    def __init__(self, arch: int = 90):  # the real one loads libcuda
        self.arch = arch
        self.utils = _Utils(SHARED_MEM_PER_BLOCK[arch])

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", self.arch, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")
