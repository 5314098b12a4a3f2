"""Attention dropout (flash-attn 2.x's dropout_p): which probabilities of a [rows, keys] block are kept.

The pattern is a pure function of (seed, sequence, query head, query row, key), so the forward and both backward
kernels regenerate it for any block in any order and no mask is stored. One Philox4x32 call (Triton's tl.philox,
PHILOX_ROUNDS rounds, key = the 64-bit seed) decides eight probabilities, 16 bits each: rows i, i + 8 x keys j,
j + 1, j + 8, j + 9 (i with bit 3 clear, j with bits 0 and 3 clear):
  counter = (j, i, sequence * num_heads_q + head_q, 0),  word 2 * bit3(row) + bit3(key),  half bit0(key) (low first),
and a probability is kept iff its 16-bit half >= threshold = floor(p * 2^16) (so P(drop) is p to within 2^-16;
flash-attn 2.x compares 8-bit values). In a rows-major MMA accumulator (the forward's S, the dQ kernel's dS) one
thread holds all eight, so the words need no shuffle; the keys-major dK/dV kernel moves key bit 0's pairs between
threads (a layout conversion through shared memory). Against one 32-bit word per probability (four per call, no
shuffle in either orientation) this halves the Philox work: run 216 (H100, `bench dropout`, d64 / d128 at 4k,
p = 0.1) 4.73 -> 4.03 / 6.28 -> 5.98 ms, causal 2.72 -> 2.23 / 3.65 -> 3.41, now 1.01-1.16x SDPA-flash with the
same dropout. Rows and keys count from each sequence's first (varlen: its own positions). reference.dropout_keep
is the same function written in torch, independently, for the tests. Kept probabilities are scaled by 1 / (1 - p)
in the epilogue (forward) or the products (backward); the row sums and the lse stay those of the undropped
softmax, as in flash-attn.
"""
import triton
import triton.language as tl

PHILOX_ROUNDS = tl.constexpr(7)  # flash-attn's; Random123 finds 7 rounds of Philox4x32 free of known bias


@triton.jit
def _halves_kept(word, t):
    """[.., 2]: whether each 16-bit half of word is >= t, the low half first."""
    return tl.join((word & 0xFFFF) >= t, word >= (t << 16))


@triton.jit
def dropout_keep(rng_ptr, rows, bh, start_n, threshold, BLOCK_N: tl.constexpr):
    """[len(rows), BLOCK_N] bool: probability (row, start_n + n) of head row bh (sequence * Hq + head) is kept.
    rows: the block's query rows (int32 [M], the sequence's own positions, consecutive from a multiple of 16);
    start_n a multiple of 16; threshold floor(p * 2^16); the seed is the int64 at rng_ptr (drawn per forward call,
    passed again to the backward)."""
    M: tl.constexpr = rows.shape[0]
    tl.static_assert(M % 16 == 0 and BLOCK_N % 16 == 0, "dropout takes 16 x 16 groups of rows and keys")
    seed = tl.load(rng_ptr)
    # Call (r, c) covers rows r, r + 8 and keys c, c + 1, c + 8, c + 9.
    call_rows, _ = tl.split(tl.permute(tl.reshape(rows, [M // 16, 2, 8]), [0, 2, 1]))
    i = tl.arange(0, BLOCK_N // 4)
    call_keys = start_n + (i // 4) * 16 + (i % 4) * 2
    zeros = tl.zeros([M // 2, BLOCK_N // 4], dtype=tl.int32)
    r0, r1, r2, r3 = tl.philox(seed, zeros + call_keys[None, :], zeros + tl.reshape(call_rows, [M // 2])[:, None],
                               zeros + bh, zeros, PHILOX_ROUNDS)
    t = tl.full([], threshold, tl.uint32)
    # join appends a last dimension: [.., half, word bit 0, word bit 1] -> key bit 0, key bit 3, row bit 3
    keep = tl.join(tl.join(_halves_kept(r0, t), _halves_kept(r1, t)), tl.join(_halves_kept(r2, t), _halves_kept(r3, t)))
    keep = tl.reshape(keep, [M // 16, 8, BLOCK_N // 16, 4, 2, 2, 2])
    return tl.reshape(tl.permute(keep, [0, 6, 1, 2, 5, 3, 4]), [M, BLOCK_N])
