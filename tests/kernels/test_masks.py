"""The block ranges the kernels iterate (kernels/triton/masks.py) against brute force over every query and key.

kv_block_range (forward, dQ) and q_block_range (dK/dV) decide which blocks a program visits and which of those
run without per-element masks; an unmasked block that holds an invisible pair, or a row past the sequence (the
dK/dV interior loads without row predicates), would be a silent wrong answer or an out-of-bounds read.
"""
import itertools

import pytest
import torch
import triton
import triton.language as tl

from helpers import DEVICE
from tileflash.kernels.triton.masks import kv_block_range, q_block_range


@triton.jit
def _ranges_kernel(params_ptr, out_ptr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BLOCK: tl.constexpr,
                   KV: tl.constexpr):
    """One parameter set per program: (seqlen_q, seqlen_k, window_left, window_right, lo, hi) -> 4 block indices.
    KV: kv_block_range for query tokens [lo, hi]; else q_block_range for keys [lo, hi)."""
    pid = tl.program_id(0)
    p = params_ptr + pid * 6
    seqlen_q, seqlen_k = tl.load(p), tl.load(p + 1)
    window_left, window_right = tl.load(p + 2), tl.load(p + 3)
    lo, hi = tl.load(p + 4), tl.load(p + 5)
    diag = seqlen_k - seqlen_q
    if KV:
        a, b, c, d = kv_block_range(lo, hi, diag, seqlen_k, window_left, window_right, HAS_LEFT, HAS_RIGHT, BLOCK)
    else:
        a, b, c, d = q_block_range(lo, tl.minimum(hi, seqlen_k), hi > seqlen_k, diag, seqlen_q, window_left,
                                   window_right, HAS_LEFT, HAS_RIGHT, BLOCK)
    tl.store(out_ptr + pid * 4, a)
    tl.store(out_ptr + pid * 4 + 1, b)
    tl.store(out_ptr + pid * 4 + 2, c)
    tl.store(out_ptr + pid * 4 + 3, d)


def _visible(i, j, diag, left, right, has_left, has_right):
    return (not has_right or j <= i + diag + right) and (not has_left or j >= i + diag - left)


def _cases(block, kv):
    """Parameter sets: odd lengths around the block size, Sq <> Sk, windows of 0, 1, a block and more."""
    out = []
    for sq, sk in [(1, 1), (5, 40), (40, 5), (33, 33), (47, 29), (16, 64), (64, 16)]:
        for left, right in itertools.product([0, 3, block, 2 * block + 1], [0, 1, block + 2]):
            if kv:  # query token ranges of one program: [start, min(start + block, sq) - 1]
                spans = [(s, min(s + block, sq) - 1) for s in range(0, sq, block)]
            else:  # key blocks of one program: [start, start + block)
                spans = [(s, s + block) for s in range(0, sk, block)]
            out += [(sq, sk, left, right, lo, hi) for lo, hi in spans]
    return out


@pytest.mark.parametrize("kv", [True, False], ids=["kv_block_range", "q_block_range"])
@pytest.mark.parametrize("has_left, has_right", [(False, False), (False, True), (True, False), (True, True)])
def test_block_ranges_match_brute_force(kv, has_left, has_right):
    block = 8
    cases = _cases(block, kv)
    params = torch.tensor(cases, dtype=torch.int32, device=DEVICE)
    out = torch.full((len(cases), 4), -1, dtype=torch.int32, device=DEVICE)
    _ranges_kernel[(len(cases),)](params, out, HAS_LEFT=has_left, HAS_RIGHT=has_right, BLOCK=block, KV=kv)
    for (sq, sk, left, right, lo, hi), (a, b, c, d) in zip(cases, out.tolist()):
        diag = sk - sq
        assert a <= b <= c <= d, (sq, sk, left, right, lo, hi, a, b, c, d)
        if kv:  # blocks of keys for queries [lo, hi]
            rows, n_cols = range(lo, hi + 1), sk
            cols_of = lambda blk: range(blk * block, min(blk * block + block, sk))  # noqa: E731
            pairs = lambda blk: [(i, j) for i in rows for j in cols_of(blk)]  # noqa: E731
            needed = {j // block for i in rows for j in range(n_cols)
                      if _visible(i, j, diag, left, right, has_left, has_right)}
        else:  # blocks of queries for keys [lo, min(hi, sk))
            keys = range(lo, min(hi, sk))
            pairs = lambda blk: [(i, j) for i in range(blk * block, blk * block + block) for j in keys]  # noqa: E731
            needed = {i // block for i in range(sq) for j in keys
                      if _visible(i, j, diag, left, right, has_left, has_right)}
        assert needed <= set(range(a, d)), ("a needed block is skipped", sq, sk, left, right, lo, hi, a, b, c, d)
        for blk in range(b, c):  # unmasked blocks: every pair visible and in range
            for i, j in pairs(blk):
                assert i < sq and j < sk and _visible(i, j, diag, left, right, has_left, has_right), \
                    ("an unmasked block needs a mask", sq, sk, left, right, lo, hi, a, b, c, d, blk, i, j)
