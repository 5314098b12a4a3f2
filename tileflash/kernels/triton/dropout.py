"""Attention dropout (flash-attn 2.x's dropout_p): which probabilities of a [rows, keys] block are kept.

The pattern is a pure function of (seed, sequence, query head, query row, key), so the forward and both backward
kernels regenerate it for any block in any order and no mask is stored. One Philox4x32 call (Triton's tl.philox,
PHILOX_ROUNDS rounds, key = the 64-bit seed) gives four 32-bit words for rows i, i + 8 and keys j, j + 8 (i and j
with bit 3 clear):
  counter = (j, i, sequence * num_heads_q + head_q, 0),  word 2 * bit3(row) + bit3(key),
and a probability is kept iff (word >> 1) >= threshold, threshold = floor(p * 2^31) (so P(drop) = p to within
2^-31). An MMA accumulator (wgmma, mma.sync; rows- or keys-major) keeps those four elements in one thread, so the
words need no shuffle through shared memory (a call over 4 consecutive keys did: 879 vs 742 SASS instructions in
the forward's d128 loop, 1171 vs 1027 in dK/dV's; probe/dropout_sass.py). Rows and keys count from each
sequence's first (varlen: its own positions). reference.dropout_keep is the same function written in torch,
independently, for the tests. Kept probabilities are scaled by 1 / (1 - p) in the epilogue (forward) or the
products (backward); the row sums and the lse stay those of the undropped softmax, as in flash-attn.
"""
import triton
import triton.language as tl

PHILOX_ROUNDS = tl.constexpr(7)  # flash-attn's; Random123 finds 7 rounds of Philox4x32 free of known bias


@triton.jit
def dropout_keep(rng_ptr, rows, bh, start_n, threshold, BLOCK_N: tl.constexpr):
    """[len(rows), BLOCK_N] bool: probability (row, start_n + n) of head row bh (sequence * Hq + head) is kept.
    rows: the block's query rows (int32 [M], the sequence's own positions, consecutive from a multiple of 16);
    start_n a multiple of 16; the seed is the int64 at rng_ptr (drawn per forward call, passed again to the
    backward)."""
    M: tl.constexpr = rows.shape[0]
    tl.static_assert(M % 16 == 0 and BLOCK_N % 16 == 0, "dropout takes 16 x 16 groups of rows and keys")
    seed = tl.load(rng_ptr)
    # Call (r, c) covers rows r, r + 8 and keys c, c + 8: an MMA accumulator keeps those four in one thread, rows-
    # or keys-major, so the words reach it without a shuffle.
    call_rows, _ = tl.split(tl.permute(tl.reshape(rows, [M // 16, 2, 8]), [0, 2, 1]))
    i = tl.arange(0, BLOCK_N // 2)
    call_keys = start_n + (i // 8) * 16 + i % 8
    zeros = tl.zeros([M // 2, BLOCK_N // 2], dtype=tl.int32)
    r0, r1, r2, r3 = tl.philox(seed, zeros + call_keys[None, :], zeros + tl.reshape(call_rows, [M // 2])[:, None],
                               zeros + bh, zeros, PHILOX_ROUNDS)
    # join appends a last dimension: [.., word bit 0, word bit 1] -> key bit 3, row bit 3
    words = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [M // 16, 8, BLOCK_N // 16, 8, 2, 2])
    words = tl.reshape(tl.permute(words, [0, 5, 1, 2, 4, 3]), [M, BLOCK_N])
    return words >= tl.full([], threshold, tl.uint32) * 2  # (word >> 1) >= threshold, without the shift
