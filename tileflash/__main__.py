"""`python -m tileflash` runs the self-check (and a short benchmark on a GPU);
`python -m tileflash bench {prefill,decode,backward,lowp,all}` runs the benchmark suites;
`python -m tileflash sweep FAMILY ...` tunes tiles (tileflash/bench/sweep.py);
the serving demo is an example: `python -m examples.serving [--help]` from the repository root."""
import os
import sys

import torch


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "report"]:  # pure Python: docs/performance.md from benchmarks/results
        from tileflash.bench.report import main as report_main
        return report_main(argv[2:])
    if argv[:2] == ["bench", "cp"]:  # launched by torchrun, one process per GPU
        from tileflash.bench.cp import main as cp_main
        return cp_main(argv[2:])
    if argv and argv[0] == "bench":
        from tileflash.bench.cli import main as bench_main
        return bench_main(argv[1:]) or 0
    if argv and argv[0] == "sweep":
        from tileflash.bench.sweep import main as sweep_main
        return sweep_main(argv[1:])
    if argv and argv[0] != "check":
        print(__doc__)
        return 2
    from tileflash.selfcheck import main as check_main
    return check_main()


if __name__ == "__main__":
    # bench host times the host path with the sm_90 stand-in (not interpreted); bench report launches nothing.
    no_interpreter = sys.argv[1:3] in (["bench", "host"], ["bench", "report"])
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" and not no_interpreter:
        # The package (and its @triton.jit kernels) was imported before this line ran; the interpreter switch is
        # read at decoration time, so start again with it set.
        os.execve(sys.executable, [sys.executable, "-m", "tileflash", *sys.argv[1:]],
                  {**os.environ, "TRITON_INTERPRET": "1"})
    sys.exit(main())
