"""Every public op's kernels compile for sm_90 (H100/H200), checked on a machine without a GPU: the interpreter
never runs Triton's GPU compiler (see sm90_compile_check.py). Other targets (A100, B200, consumer Blackwell) compile
a case per fix that keeps them compiling, and spill no more than the same case does on sm_90: the full lists
(`python tests/sm90_compile_check.py --arch N --res-usage`, a few minutes each) are run by hand, their results in
benchmarks/NEXT.md."""
import re

import pytest
import torch

from helpers import run_standin_script

CUDA = torch.cuda.is_available()

# Per target, the cases whose compilation a target-specific rule keeps working: sm_100's dK/dV tile in tensor memory,
# its pure NVFP4 decode PTX, FP8 caches' widening by Triton's cast (inner._pin_widening) and MLA tile; the sub-200 KB
# targets' shared-memory tiles (backward, d256 forward, MLA, qv's 512-wide values); the mma.sync targets' 8-warp,
# pointer-loaded tiles (plan/target.py); everywhere off sm_90, the dispatch declining the Gluon kernels; on Blackwell
# the W4A4 GEMM's block-scaled MMA in the SASS (the case checks it).
OTHER_TARGETS = {
    100: "prefill fwd+bwd d128 window softcap|decode nvfp4 split learnable_sink|decode fp8 append|decode MLA H=128|"
         "gemm W4A4 M=1 ",
    120: "prefill fwd+bwd d256|decode MLA H=128|prefill d64 causal fp16, warp-specialised forward|gemm W4A4 M=200|"
         "prefill qv d64 v512",
    80: "prefill fwd+bwd d128 window softcap|decode nvfp4 append|nvfp4_quantize|decode 16-bit contiguous",
}


def _stack_per_case(stdout: str) -> dict:
    """(case, kernel) -> the largest stack (spill) bytes of that kernel's variants the case compiled (--res-usage
    lines); kernels per case, since a case may take a Gluon kernel on sm_90 and a Triton one elsewhere."""
    cases, case = {}, None
    for line in stdout.splitlines():
        if line.startswith("ok    "):
            case = line[6:].strip()
        elif case and line.startswith("      "):
            m = re.search(r"^\s*(\S+) .*STACK:(\d+)", line)
            if m:
                key = (case, m.group(1))
                cases[key] = max(cases.get(key, 0), int(m.group(2)))
        else:
            case = None
    return cases


@pytest.mark.skipif(CUDA, reason="on a GPU the other tests compile and run every kernel")
def test_kernels_compile_for_sm90():
    proc = run_standin_script("sm90_compile_check.py")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


@pytest.fixture(scope="module")
def sm90_stacks():
    """The spills of every OTHER_TARGETS case on sm_90 (one run for all targets)."""
    proc = run_standin_script("sm90_compile_check.py", "--only", "|".join(OTHER_TARGETS.values()), "--res-usage")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return _stack_per_case(proc.stdout)


@pytest.mark.skipif(CUDA, reason="compiles through a stand-in driver that replaces the GPU's")
@pytest.mark.parametrize("arch", sorted(OTHER_TARGETS))
def test_kernels_compile_for_other_targets(arch, sm90_stacks):
    proc = run_standin_script("sm90_compile_check.py", "--arch", str(arch), "--only", OTHER_TARGETS[arch],
                              "--res-usage")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("ok") for line in lines)
    if arch < 89:  # FP8 / NVFP4 cases are skipped there (the ops refuse such GPUs)
        assert any(line.startswith("skip") and "nvfp4" in line for line in lines)
    base, target = sm90_stacks, _stack_per_case(proc.stdout)
    shared = set(target) & set(base)  # kernels both targets compiled for a case
    assert shared and {case for case, _ in target} <= {case for case, _ in base}
    worse = {key: (target[key], base[key]) for key in shared if target[key] > base[key]}
    assert not worse, f"sm_{arch} spills more than sm_90 (bytes, sm_{arch} vs sm_90): {worse}"
