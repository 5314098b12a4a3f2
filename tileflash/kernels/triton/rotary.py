"""Rotary position embedding of a tile of head vectors, applied where the vectors are loaded (flash-attn's
rotary_cos / rotary_sin in flash_attn_with_kvcache: q in the attention kernel, the new k in the append kernel).

cos, sin: [seqlen_ro, ROTARY_DIM / 2] (row stride stride_ro, unit column stride). Columns c < ROTARY_DIM rotate
in pairs, the rest pass through. GPT-NeoX (INTERLEAVED False) pairs c with c + ROTARY_DIM / 2 at frequency
c % (ROTARY_DIM / 2); GPT-J (INTERLEAVED True) pairs 2i with 2i + 1 at frequency i. A pair (x1, x2) at position p
becomes (x1 cos - x2 sin, x2 cos + x1 sin), in fp32.
"""
import triton
import triton.language as tl


@triton.jit
def rotate_rows(x, row_ptrs, pos, row_ok, offs_d, cos_ptr, sin_ptr, stride_ro, seqlen_ro,
                ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """x [R, DP] as loaded from row_ptrs[:, None] + offs_d[None, :] (row r at position pos[r]), rotated, fp32.
    Each row's partner columns are loaded again from memory (a gather would need a register shuffle Triton does
    not express); positions past the table are clamped to its last row (callers check the table's length)."""
    half: tl.constexpr = ROTARY_DIM // 2
    if INTERLEAVED:
        partner = offs_d ^ 1
        freq = offs_d // 2
        first = offs_d % 2 == 0
    else:
        first = offs_d < half
        partner = tl.where(first, offs_d + half, offs_d - half)
        freq = tl.where(first, offs_d, offs_d - half)
    rot = row_ok[:, None] & (offs_d < ROTARY_DIM)[None, :]
    x2 = tl.load(row_ptrs[:, None] + partner[None, :], mask=rot, other=0.0).to(tl.float32)
    cs = tl.minimum(pos, seqlen_ro - 1).to(tl.int64)[:, None] * stride_ro + freq[None, :]
    cos = tl.load(cos_ptr + cs, mask=rot, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + cs, mask=rot, other=0.0).to(tl.float32)
    x = x.to(tl.float32)
    return tl.where(rot, x * cos + tl.where(first[None, :], -x2, x2) * sin, x)
