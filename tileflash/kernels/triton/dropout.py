"""Attention dropout (flash-attn 2.x's dropout_p): which probabilities of a [rows, keys] block are kept.

The pattern is a pure function of (seed, sequence, query head, query row, key), so the forward and both backward
kernels regenerate it for any block in any order and no mask is stored. One Philox4x32 call (Triton's tl.philox,
PHILOX_ROUNDS rounds, key = the 64-bit seed) gives four 32-bit words for keys 4c .. 4c + 3 of a row:
  counter = (c, row, sequence * num_heads_q + head_q, 0),  word k -> key 4c + k,
and key j is kept iff (word >> 1) >= threshold, threshold = floor(p * 2^31) (so P(drop) = p to within 2^-31).
Rows and keys count from each sequence's first (varlen: its own positions). reference.dropout_keep is the same
function written in torch, independently, for the tests. Kept probabilities are scaled by 1 / (1 - p) in the
epilogue (forward) or the products (backward); the row sums and the lse stay those of the undropped softmax,
as in flash-attn.
"""
import triton
import triton.language as tl

PHILOX_ROUNDS = tl.constexpr(7)  # flash-attn's; Random123 finds 7 rounds of Philox4x32 free of known bias


@triton.jit
def dropout_keep(rng_ptr, rows, bh, start_n, threshold, BLOCK_N: tl.constexpr):
    """[len(rows), BLOCK_N] bool: probability (row, start_n + n) of head row bh (sequence * Hq + head) is kept.
    rows: the block's query rows (int32 [M], the sequence's own positions); start_n a multiple of 4; the seed is
    the int64 at rng_ptr (drawn per forward call, passed again to the backward)."""
    tl.static_assert(BLOCK_N % 4 == 0, "dropout takes four keys per Philox call")
    seed = tl.load(rng_ptr)
    zeros = tl.zeros([rows.shape[0], BLOCK_N // 4], dtype=tl.int32)
    c0 = zeros + (start_n // 4 + tl.arange(0, BLOCK_N // 4))[None, :]
    c1 = zeros + rows[:, None]
    c2 = zeros + bh
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, zeros, PHILOX_ROUNDS)
    # join(join(r0, r2), join(r1, r3))[m, c, a, b] is word 2a + b: row-major, key 4c + 2a + b
    words = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [rows.shape[0], BLOCK_N])
    return (words >> 1).to(tl.int32, bitcast=True) >= threshold
