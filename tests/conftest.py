"""Test setup: without a GPU, kernels run through Triton's interpreter. TRITON_INTERPRET must be set before any
@triton.jit decorator runs, i.e. before tileflash is imported."""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    # Small CPU matmuls between interpreter launches ran ~1000x slower with spinning OpenMP threads on the 2-core
    # CI machine (seen by the demo test: 30 ms instead of 9 us); one thread is the fast setting there.
    torch.set_num_threads(1)

import pytest  # noqa: E402

import tileflash._utils as tf_utils  # noqa: E402
from tileflash.ops import direct  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _poison_outputs():
    tf_utils.POISON_OUTPUTS = True
    yield
    tf_utils.POISON_OUTPUTS = False


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Tests monkeypatch heuristics, which cached plans would outlive: every test starts without plans."""
    direct.clear_all()
    yield
    direct.clear_all()


@pytest.fixture
def device():
    return DEVICE
