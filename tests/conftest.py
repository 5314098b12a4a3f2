"""Test setup: without a GPU, kernels run through Triton's interpreter. TRITON_INTERPRET must be set before any
@triton.jit decorator runs, i.e. before tileflash is imported."""
import contextlib
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    # Small CPU matmuls between interpreter launches ran ~1000x slower with spinning OpenMP threads on the 2-core
    # CI machine (seen by the demo test: 30 ms instead of 9 us); one thread is the fast setting there.
    torch.set_num_threads(1)

import pytest  # noqa: E402

import tileflash._utils as tf_utils  # noqa: E402
from tileflash import config  # noqa: E402
from tileflash.launch import direct  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _poison_outputs():
    tf_utils.POISON_OUTPUTS = True
    yield
    tf_utils.POISON_OUTPUTS = False


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Every test starts without cached plans (a test may patch what planning sees, e.g. the target)."""
    direct.clear_all()
    yield
    direct.clear_all()


@pytest.fixture
def override():
    """override(kind=config, ...): tileflash.config.override for the rest of the test (see tileflash/config.py)."""
    with contextlib.ExitStack() as stack:
        yield lambda **forced: stack.enter_context(config.override(**forced))


@pytest.fixture
def device():
    return DEVICE
