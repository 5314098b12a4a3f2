#!/usr/bin/env bash
# A triton 3.6.0 virtual environment on the CPU machine: the GPU machine's triton, so that Gluon and Triton kernels
# compile for sm_90 here as they will there (run 191 lost a device call to a kernel that compiled under triton 3.7.1
# and asserted in 3.6's ConvertTritonGPUToLLVM). torch's CPU wheel does not pin triton, so the two install side by side.
# Usage: bash benchmarks/tools/triton36_venv.sh [DIR]   (default /tmp/v36), then
#        PYTHONPATH=$PWD DIR/bin/python tests/sm90_compile_check.py [--only NAME] [--res-usage]
set -eu
DIR=${1:-/tmp/v36}
python3 -m venv "$DIR"
"$DIR/bin/pip" install -q "torch==2.13.0" numpy
"$DIR/bin/pip" download -q "triton==3.6.0" --no-deps -d "$DIR/wheels"
"$DIR/bin/pip" install -q "$DIR"/wheels/triton-3.6.0-*.whl
"$DIR/bin/python" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
