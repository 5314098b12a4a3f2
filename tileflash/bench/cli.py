"""Command line: ``python -m tileflash bench {prefill,decode,backward,lowp,extend,sinks,dropout,all} [--quick]
[--only LABEL] [--json PATH] [--plot DIR]``, ``python -m tileflash bench host [--no-launch] [--json PATH]``
(and ``torchrun ... -m tileflash bench cp``, see bench/cp.py)."""

import argparse
import datetime
import json
import os
import sys

import torch

from tileflash.bench import peers, suites, timing

SUITES = {
    "prefill": (suites.PREFILL_SHAPES, suites.run_prefill),
    "decode": (suites.DECODE_SHAPES + suites.MLA_SHAPES, suites.run_decode),  # GQA grid, then MLA (qv)
    "backward": (suites.BACKWARD_SHAPES, suites.run_backward),
    "lowp": (suites.LOWP_SHAPES, suites.run_lowp),  # FP8-cache decode grid, then the NVFP4 GEMM grid
    "extend": (suites.EXTEND_SHAPES, suites.run_extend),  # many new queries over a paged cache
    "sinks": (suites.SINK_SHAPES, suites.run_sinks),  # the same calls with and without learnable_sink
    "dropout": (suites.DROPOUT_SHAPES, suites.run_dropout),  # training steps with and without dropout_p
}


def build_parser():
    p = argparse.ArgumentParser(prog="python -m tileflash bench", description=__doc__)
    p.add_argument("suite", choices=[*SUITES, "all", "host"])
    p.add_argument("--no-launch", action="store_true",
                   help="host: time the host path alone on CPU tensors, launches made no-ops (the default "
                        "without a GPU)")
    p.add_argument("--json", metavar="PATH", help="write the results here (rewritten after each suite); keep them "
                   "as benchmarks/results/DATE-runN-SUITE.json and run `bench report`")
    p.add_argument("--run", type=int, help="the device run number recorded with the results")
    p.add_argument("--notes", help="the reading recorded with the results (shown by `bench report`)")
    p.add_argument("--quick", action="store_true", help="only the first 3 shapes of each label")
    p.add_argument("--only", metavar="LABEL",
                   help="only shapes whose label contains LABEL, e.g. d64, causal, page16, gqa-fp8, gemm, 8k")
    p.add_argument("--plot", metavar="DIR", help="write one PNG chart per suite into DIR (needs matplotlib)")
    p.add_argument("--flush", choices=timing.FLUSH_MODES, default="zero",
                   help="how the L2 is emptied before each timed call: zero (triton's do_bench, the default: leaves "
                        "dirty lines whose write-back the call pays) or read (leaves clean lines)")
    return p


def _commit():
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(args=None):
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "command": "python -m tileflash bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else
                                                           sys.argv[1:]),
        "commit": _commit(),
        "run": getattr(args, "run", None),
        "notes": getattr(args, "notes", None),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "peers": peers.available_peers(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.suite == "host":
        from tileflash.bench.host import run_hf_generate, run_host

        no_launch = args.no_launch or not torch.cuda.is_available()
        results = {"env": environment(args), "host": run_host(no_launch=no_launch)}
        if not no_launch:
            results["hf_generate"] = run_hf_generate()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return 0
    if not torch.cuda.is_available():
        print("tileflash bench needs a CUDA GPU; none is visible", file=sys.stderr)
        return 1
    timing.flush_mode = args.flush
    results = {"env": {**environment(args), "flush": args.flush}}
    print(f"env: {json.dumps(results['env'])}")
    for name in SUITES if args.suite == "all" else [args.suite]:
        registry, runner = SUITES[name]
        shapes = suites.select_shapes(registry, quick=args.quick, only=args.only)
        if not shapes:
            print(f"{name}: no shape label contains {args.only!r}")
            continue
        results[name] = runner(shapes)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    if args.plot:
        from tileflash.bench.plots import write_charts

        for path in write_charts({k: v for k, v in results.items() if k != "env"}, args.plot):
            print(f"wrote {path}")
    return 0
