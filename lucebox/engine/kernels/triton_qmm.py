"""Triton kernels: y = x @ W.T (+ b) straight from GGUF blocks, for every type in dequant.FORMATS.

Paths, by type and the number of activation rows M (qmatmul picks):
- Q4_K, Q6_K, Q8_0 (the types of Q4_K_M / Q6_K / Q8_0 files), rows a whole number of int32 words:
  M = 1: _gemv_words_kernel (rows read as 16-byte vectors where the layout allows, nibbles and bytes made
  fp32 by mantissa tricks, bf16 x read 4 columns per word, fp32 FMAs), or the int8-activation gemvs
  (_gemv_*_q8x_kernel: x quantized once per call by _quant_x_kernel, 4 weights a dp4a); 2 <= M <= SMALL_MAX:
  _qmm_words_kernel (the same word loads, each bit plane fed to a bf16 tensor-core dot with SMALL_BM rows) or,
  _qmm_q4k/q6k/q80_q8x_kernel (int8 tensor-core dots with int8 x, one tile of 16 or 32 rows: a DDTree's 23
  verified rows, a decode batch of 24 or 32, read the weights once). All split
  the columns over `split` programs when that fills the GPU better (fp32 partials, then _splitk_sum_kernel:
  no atomics). The int8 gemvs also run a decode step's routed experts (MOE: one (row, expert) pair a
  program_id(2), `pair_gemv`, for triton_moe), and take rows of any whole number of blocks.
  Launch configs: GEMV_DEFAULT / SMALL_DEFAULT, or the fastest correct candidate `warm_up` measured for the
  shape (at start-up only).
- Other types at M = 1: byte-wise gemv (_gemv_kernel; Q4_1 reads words, _gemv_q4_1_kernel).
- Everything else (prefill, other types' small batches): slices of at most SCRATCH_ELEMS weight elements
  are dequantized (_dequant_kernel) into one reused scratch and multiplied by cuBLAS: tensor-core speed
  with a bounded buffer, never a dense copy of a whole weight. (_qmm_kernel, a fused tile kernel for any
  type, serves small batches only when PREFILL_ROWS is raised: measured slower than the slice path.)

The bytes are read in the file's layout. Within a block, ggml stores element j and element j + 16 (or
j + 32) in the low and high nibble of one byte; rather than shuffling nibbles back into order, each nibble
plane is multiplied with the matching activation columns (the reduction order is free), so every weight
byte is loaded once. Every launch is shape-only (no host syncs), so decode steps capture into CUDA graphs.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from lucebox.engine.kernels import pdl
from lucebox.engine.weights.quant.dequant import FORMATS
from lucebox.engine.weights.quant.qtensor import QuantWeight, row_bytes

# Type id (constexpr in the kernels), elements per chunk (the unit a program steps through), chunks per step,
# elements per part (see _part).
_TYPES = {"Q4_0": (0, 32, 8, 16), "Q4_1": (1, 32, 8, 16), "Q5_0": (2, 32, 8, 16), "Q5_1": (3, 32, 8, 16),
          "Q8_0": (4, 32, 8, 32), "Q4_K": (5, 64, 4, 32), "Q5_K": (6, 64, 4, 32), "Q6_K": (7, 128, 2, 32)}
assert set(_TYPES) == set(FORMATS)
log = logging.getLogger(__name__)


@triton.jit
def _f16(ptr, mask):
    """fp16 stored little-endian at byte pointers `ptr`, as fp32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _u8(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _i8(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def _kscale(sb, s, mask):
    """Q4_K/Q5_K scale and min of sub-block `s` (0..7) from the 12 packed bytes at `sb`, as fp32."""
    a = _u8(sb + s, mask)
    b = _u8(sb + s + 4, mask)
    c = _u8(sb + (s & 3), mask)
    low = s < 4
    sc = tl.where(low, a & 63, (b & 15) | ((c >> 6) << 4))
    mn = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _part(wrow, c, cm, QTYPE: tl.constexpr, P: tl.constexpr):
    """Part P of chunks `c` of weight rows `wrow`, dequantized to fp32 [BN, NB, L]: the elements at columns
    c * CHUNK + P * L + j (j < L; L = 16 for the 32-element types but Q8_0, else 32)."""
    if QTYPE <= 3:  # Q4_0 Q4_1 Q5_0 Q5_1: part 0 = low nibbles (elements 0..15), part 1 = high (16..31)
        j = tl.arange(0, 16)[None, None, :]
        if QTYPE == 0:
            base = wrow + c * 18
            q = _u8(base + 2 + j, cm)
        elif QTYPE == 1:
            base = wrow + c * 20
            q = _u8(base + 4 + j, cm)
        elif QTYPE == 2:
            base = wrow + c * 22
            q = _u8(base + 6 + j, cm)
        else:
            base = wrow + c * 24
            q = _u8(base + 8 + j, cm)
        q = (q >> (4 * P)) & 15
        d = _f16(base, cm)
        if QTYPE == 2:
            q = q | (((_u8(base + 2 + 2 * P + (j >> 3), cm) >> (j & 7)) & 1) << 4)
        if QTYPE == 3:
            q = q | (((_u8(base + 4 + 2 * P + (j >> 3), cm) >> (j & 7)) & 1) << 4)
        if QTYPE == 0:
            w = d * (q - 8).to(tl.float32)
        elif QTYPE == 2:
            w = d * (q - 16).to(tl.float32)
        else:
            w = d * q.to(tl.float32) + _f16(base + 2, cm)
    elif QTYPE == 4:  # Q8_0: one part of 32
        j = tl.arange(0, 32)[None, None, :]
        base = wrow + c * 34
        w = _i8(base + 2 + j, cm) * _f16(base, cm)
    elif QTYPE <= 6:  # Q4_K / Q5_K, 64-element chunks: part 0 = sub-block 2ci (low nibbles), 1 = 2ci + 1
        j = tl.arange(0, 32)[None, None, :]
        ci = c & 3
        if QTYPE == 5:
            base = wrow + (c >> 2) * 144
            q = _u8(base + 16 + ci * 32 + j, cm)
        else:
            base = wrow + (c >> 2) * 176
            q = _u8(base + 48 + ci * 32 + j, cm)
        q = (q >> (4 * P)) & 15
        if QTYPE == 6:
            q = q | (((_u8(base + 16 + j, cm) >> (2 * ci + P)) & 1) << 4)
        sc, mn = _kscale(base + 4, 2 * ci + P, cm)
        w = (_f16(base, cm) * sc) * q.to(tl.float32) - _f16(base + 2, cm) * mn
    else:  # Q6_K, 128-element halves: part P = elements 32P..32P+31 of the half
        j = tl.arange(0, 32)[None, None, :]
        h = c & 1
        base = wrow + (c >> 1) * 210
        ql = (_u8(base + h * 64 + (P % 2) * 32 + j, cm) >> (4 * (P // 2))) & 15
        qh = (_u8(base + 128 + h * 32 + j, cm) >> (2 * P)) & 3
        sc = _i8(base + 192 + h * 8 + 2 * P + (j >> 4), cm)
        w = (_f16(base + 208, cm) * sc) * ((ql | (qh << 4)) - 32).to(tl.float32)
    return w


@triton.jit
def _qmm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, n_chunks, stride_xm, stride_ym, row_bytes,
                QTYPE: tl.constexpr, CHUNK: tl.constexpr, NB: tl.constexpr, L: tl.constexpr,
                HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Tiles of BM activation rows x BN weight rows: each part of each step is one tensor-core dot."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    m_mask = rm < M
    n_mask = rn < N
    xrow = x_ptr + rm.to(tl.int64)[:, None, None] * stride_xm
    wrow = w_ptr + rn.to(tl.int64)[:, None, None] * row_bytes  # [BN, 1, 1]
    j = tl.arange(0, L)[None, None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for g in range(0, n_chunks, NB):
        c = g + tl.arange(0, NB)[None, :, None]  # [1, NB, 1] chunk indices
        cm = n_mask[:, None, None] & (c < n_chunks)
        for p in tl.static_range(CHUNK // L):
            w = _part(wrow, c, cm, QTYPE, p)
            x = tl.load(xrow + c * CHUNK + p * L + j, mask=m_mask[:, None, None] & (c < n_chunks), other=0.0)
            x = tl.reshape(x, (BM, NB * L))
            acc = tl.dot(x, tl.trans(tl.reshape(w, (BN, NB * L)).to(x.dtype)), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    yp = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, n_chunks, row_bytes,
                 QTYPE: tl.constexpr, CHUNK: tl.constexpr, NB: tl.constexpr, L: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BN: tl.constexpr):
    """One activation row (decode at batch 1): multiply-and-reduce in fp32, no tensor cores, no relayout."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    n_mask = rn < N
    wrow = w_ptr + rn.to(tl.int64)[:, None, None] * row_bytes
    j = tl.arange(0, L)[None, None, :]
    acc = tl.zeros((BN, NB, L), dtype=tl.float32)
    for g in range(0, n_chunks, NB):
        c = g + tl.arange(0, NB)[None, :, None]
        cm = n_mask[:, None, None] & (c < n_chunks)
        for p in tl.static_range(CHUNK // L):
            w = _part(wrow, c, cm, QTYPE, p)
            x = tl.load(x_ptr + c * CHUNK + p * L + j, mask=c < n_chunks, other=0.0).to(tl.float32)
            acc += w * x
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _h16(word, shift):
    """The fp16 in bits shift..shift+15 of int32 `word`, as fp32."""
    return ((word >> shift) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _gemv_q4_1_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, n_blk, row_words, HAS_BIAS: tl.constexpr, BN: tl.constexpr,
                      NB: tl.constexpr):
    """Batch-1 Q4_1: the 20-byte blocks read as 5 int32 words (d|m, then 16 bytes of nibbles)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    n_mask = rn < N
    w32 = w_ptr.to(tl.pointer_type(tl.int32))
    row = w32 + rn.to(tl.int64)[:, None, None] * row_words
    wi = tl.arange(0, 4)[None, None, :]
    acc = tl.zeros((BN, NB, 4), dtype=tl.float32)
    for g in range(0, n_blk, NB):
        blk = g + tl.arange(0, NB)[None, :, None]
        bm = blk < n_blk
        m = n_mask[:, None, None] & bm
        base = row + blk * 5
        w0 = tl.load(base, mask=m, other=0)
        d = _h16(w0, 0)
        mn = _h16(w0, 16)
        q = tl.load(base + 1 + wi, mask=m, other=0)
        xb = x_ptr + blk * 32 + wi * 4
        for s in tl.static_range(2):
            for b in tl.static_range(4):
                x = tl.load(xb + 16 * s + b, mask=bm, other=0.0).to(tl.float32)
                nib = ((q >> (8 * b + 4 * s)) & 15).to(tl.float32)
                acc += (d * nib + mn) * x
    y = tl.sum(tl.reshape(acc, (BN, NB * 4)), axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)


# ----- word-wise kernels: Q4_K, Q6_K, Q8_0 (the types of Q4_K_M / Q6_K / Q8_0 files) ------------------------
# A row of these types is read as int32 words (16-byte vectors where the block layout allows). Q6_K (210-byte)
# and Q8_0 (34-byte) blocks sit at 2 mod 4 bytes in every other block: those blocks' words are funnel-shifted
# from two aligned words (the second load hits L1). Nibbles and bytes become fp32 by OR-ing them into the
# mantissa of 2**23 and subtracting it (exact, and no int->float conversions, which are slow on the GPU).
# Each kernel is one `_*_load` (the raw words of NB blocks of BN rows) and a `_*_plane` per plane: the weight
# elements held at one bit position of every word, dequantized, with the offsets of their activation columns.
# The gemv multiplies planes with fp32 FMAs; the small-batch kernel feeds each plane to a tensor-core dot.

MAGIC = tl.constexpr(8388608.0)  # 2**23: bitcast(0x4B000000 | v) == 2**23 + v for 0 <= v < 2**23


@triton.jit
def _field(word, shift: tl.constexpr, mask: tl.constexpr, bias: tl.constexpr):
    """(word >> shift) & mask as exact fp32, minus `bias`."""
    v = ((word >> shift) & mask) | 0x4B000000
    return v.to(tl.float32, bitcast=True) - (MAGIC + bias)


@triton.jit
def _h16w(word, hi):
    """The fp16 in the high (where `hi`) or low half of int32 `word`, as fp32."""
    return _h16(tl.where(hi, word >> 16, word), 0)


@triton.jit
def _vword(row, st, j):
    """Words j of the block at byte `st` of word-aligned rows `row`, where st is 0 or 2 mod 4."""
    a = row + (st >> 2) + j
    lo = tl.load(a)
    hi = tl.load(a + 1, mask=(st & 2) != 0, other=0)
    return tl.where((st & 2) != 0, ((lo >> 16) & 0xFFFF) | (hi << 16), lo)


@triton.jit
def _q4k_lane_scales(s0, s1, s2, ci):
    """The 6-bit scales and mins (sc0, mn0, sc1, mn1) of sub-blocks 2ci and 2ci + 1, as int32, for a tensor of
    chunks `ci` (_q4k_chunk_scales for a compile-time one), from a Q4_K block's three scale words: byte
    (2ci + s) & 3 of them; chunks 0-1 take 6 bits of s0 / s1, chunks 2-3 4 bits of s2 and the top 2 of s0 / s1
    (blended by `hi`, no selects)."""
    hi = ci >> 1
    sh = 8 * ((2 * ci) & 3)
    sc0 = (1 - hi) * ((s0 >> sh) & 63) + hi * (((s2 >> sh) & 15) | (((s0 >> (sh + 6)) & 3) << 4))
    mn0 = (1 - hi) * ((s1 >> sh) & 63) + hi * (((s2 >> (sh + 4)) & 15) | (((s1 >> (sh + 6)) & 3) << 4))
    sh1 = sh + 8
    sc1 = (1 - hi) * ((s0 >> sh1) & 63) + hi * (((s2 >> sh1) & 15) | (((s0 >> (sh1 + 6)) & 3) << 4))
    mn1 = (1 - hi) * ((s1 >> sh1) & 63) + hi * (((s2 >> (sh1 + 4)) & 15) | (((s1 >> (sh1 + 6)) & 3) << 4))
    return sc0, mn0, sc1, mn1


@triton.jit
def _q4k_scales(base):
    """The per-sub-block d * scale and dmin * min of super-blocks at int32 pointers `base` [BN, NSB, 1, 1], as
    [BN, NSB, 4, 1] for s = 0, 1: sub-blocks 2ci + s of chunk ci (dim 2)."""
    ci = tl.arange(0, 4)[None, None, :, None]
    w0 = tl.load(base)
    s0 = tl.load(base + 1)
    s1 = tl.load(base + 2)
    s2 = tl.load(base + 3)
    d = _h16(w0, 0)
    dmin = _h16(w0, 16)
    sc0, mn0, sc1, mn1 = _q4k_lane_scales(s0, s1, s2, ci)
    return d * sc0.to(tl.float32), dmin * mn0.to(tl.float32), d * sc1.to(tl.float32), dmin * mn1.to(tl.float32)


@triton.jit
def _q4k_load(row, sb):
    """Super-blocks sb [1, NSB, 1, 1] of rows `row` [BN, 1, 1, 1] (int32 pointers): words [BN, NSB, 4, 8] of
    nibbles (chunk ci = dim 2), and the per-sub-block d * scale and dmin * min, [BN, NSB, 4, 1] for s = 0, 1."""
    ci = tl.arange(0, 4)[None, None, :, None]
    wi = tl.arange(0, 8)[None, None, None, :]
    base = row + sb * 36
    q = tl.load(base + 4 + ci * 8 + wi)
    ds0, dm0, ds1, dm1 = _q4k_scales(base)
    return q, ds0, dm0, ds1, dm1


@triton.jit
def _q4k_plane(q, ds0, dm0, ds1, dm1, sb, P: tl.constexpr):
    """Plane P = 4 s + b: nibble s of byte b of every word, i.e. elements sb*256 + ci*64 + 32s + 4wi + b."""
    s: tl.constexpr = P // 4
    b: tl.constexpr = P % 4
    nib = _field(q, 8 * b + 4 * s, 15, 0.0)
    if s == 0:
        w = ds0 * nib - dm0
    else:
        w = ds1 * nib - dm1
    return w


@triton.jit
def _q4k_cols(sb, s: tl.constexpr):
    """Column of byte 0 of each word's plane s (bytes 1-3: the next columns)."""
    ci = tl.arange(0, 4)[None, None, :, None]
    wi = tl.arange(0, 8)[None, None, None, :]
    return sb * 256 + ci * 64 + 32 * s + 4 * wi


@triton.jit
def _q6k_load(row, sb):
    """Super-blocks sb [1, NSB, 1, 1, 1] of rows `row` [BN, 1, 1, 1, 1]: ql words [BN, NSB, 2 (half h),
    2 (tq), 8 (v)], qh words already shifted by 2 tq, the two scale words of each half (s = 0, 1), d."""
    h = tl.arange(0, 2)[None, None, :, None, None]
    tq = tl.arange(0, 2)[None, None, None, :, None]
    v = tl.arange(0, 8)[None, None, None, None, :]
    st = sb * 210
    ql = _vword(row, st, h * 16 + tq * 8 + v)
    qh = _vword(row, st, 32 + h * 8 + v) >> (2 * tq)
    sw0 = _vword(row, st, 48 + 2 * h)
    sw1 = _vword(row, st, 49 + 2 * h)
    d = _h16w(tl.load(row + (st >> 2) + 52), (st & 2) != 0)
    return ql, qh, sw0, sw1, d


@triton.jit
def _q6k_plane(ql, qh, sw0, sw1, d, sb, P: tl.constexpr):
    """Plane P = 4 s + b: elements sb*256 + h*128 + 64s + 32tq + 4v + b (6 bits: nibble s of ql byte b, bits
    4s + 2tq of qh byte b), scale byte 2tq + v // 4 of scale word s of half h."""
    tq = tl.arange(0, 2)[None, None, None, :, None]
    v = tl.arange(0, 8)[None, None, None, None, :]
    s: tl.constexpr = P // 4
    b: tl.constexpr = P % 4
    q = ((ql >> (8 * b + 4 * s)) & 15) | (((qh >> (8 * b + 4 * s)) & 3) << 4)
    q = (q | 0x4B000000).to(tl.float32, bitcast=True) - (MAGIC + 32.0)
    k = 8 * (2 * tq + v // 4)
    if s == 0:
        sc = ((sw0 << (24 - k)) >> 24).to(tl.float32)
    else:
        sc = ((sw1 << (24 - k)) >> 24).to(tl.float32)
    return (d * sc) * q


@triton.jit
def _q6k_cols(sb, s: tl.constexpr):
    h = tl.arange(0, 2)[None, None, :, None, None]
    tq = tl.arange(0, 2)[None, None, None, :, None]
    v = tl.arange(0, 8)[None, None, None, None, :]
    return sb * 256 + h * 128 + 64 * s + 32 * tq + 4 * v


@triton.jit
def _q80_load(row, blk, off=0):
    """Blocks blk [1, NB, 1] of rows `row` [BN, 1, 1] (int32 pointers; the rows start `off` bytes on, 0 or 2):
    the 8 words of int8s [BN, NB, 8] and d [BN, NB, 1]."""
    v = tl.arange(0, 8)[None, None, :]
    st = off + blk * 34
    q = _vword(row, st + 2, v)  # the int8s start 2 bytes in
    d = _h16w(tl.load(row + (st >> 2)), (st & 2) != 0)
    return q, d


@triton.jit
def _q80_plane(q, d, blk, P: tl.constexpr):
    """Plane P: byte P of every word, elements blk*32 + 4v + P."""
    u = (((q >> (8 * P)) & 255) ^ 128) | 0x4B000000  # the int8 + 128, in the mantissa of 2**23
    return d * (u.to(tl.float32, bitcast=True) - (MAGIC + 128.0))


@triton.jit
def _q80_cols(blk):
    v = tl.arange(0, 8)[None, None, :]
    return blk * 32 + 4 * v


@triton.jit
def _x4(x_ptr, col, XBF16: tl.constexpr):
    """x at columns col + 0..3 (col % 4 == 0) as fp32: bf16 x as one 8-byte load per word, its halves widened
    by shifts (bf16 is the top half of an fp32); other dtypes element by element."""
    if XBF16:
        v = tl.load(x_ptr.to(tl.pointer_type(tl.int64)) + (col >> 2))
        lo = v.to(tl.int32)
        hi = (v >> 32).to(tl.int32)
        x0 = (lo << 16).to(tl.float32, bitcast=True)
        x1 = (lo & -65536).to(tl.float32, bitcast=True)
        x2 = (hi << 16).to(tl.float32, bitcast=True)
        x3 = (hi & -65536).to(tl.float32, bitcast=True)
    else:
        x0 = tl.load(x_ptr + col).to(tl.float32)
        x1 = tl.load(x_ptr + col + 1).to(tl.float32)
        x2 = tl.load(x_ptr + col + 2).to(tl.float32)
        x3 = tl.load(x_ptr + col + 3).to(tl.float32)
    return x0, x1, x2, x3


@triton.jit
def _store_rows(y_ptr, b_ptr, y, rn, n_mask, N, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr):
    """A one-row gemv's outputs `y` for weight rows `rn`: fp32 partial sums of split program_id(1) (PARTIAL,
    added up by _splitk_sum_kernel), else plus the bias, in the output's dtype."""
    if PARTIAL:
        tl.store(y_ptr + tl.program_id(1) * N + rn, y, mask=n_mask)
    else:
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _store_tile(y_ptr, b_ptr, acc, rm, rn, m_ok, n_mask, M, N, stride_ym, HAS_BIAS: tl.constexpr,
                PARTIAL: tl.constexpr):
    """A small-batch kernel's [BM, BN] outputs: fp32 partial sums [j, M, N] of split program_id(2) (PARTIAL,
    added up by _splitk_sum_kernel), else plus the bias, in the output's dtype through its row stride."""
    mask = m_ok & n_mask[None, :]
    if PARTIAL:
        tl.store(y_ptr + (tl.program_id(2) * M + rm.to(tl.int64))[:, None] * N + rn[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _gemv_words_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, n_split, row_words, QTYPE: tl.constexpr,
                       XBF16: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BN: tl.constexpr,
                       NB: tl.constexpr):
    """One activation row: BN weight rows per program, NB blocks per step, fp32 FMAs; the warps of a program
    split its columns (reduced by the final tl.sum). Program (i, j) covers blocks j * n_split ..
    (j + 1) * n_split (n_split % NB == 0); with several j (PARTIAL) each writes fp32 sums [j, N] that
    _splitk_sum_kernel adds up (no atomics: deterministic, and CUDA-graph safe)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    lo = tl.program_id(1) * n_split
    n_mask = rn < N
    rows = tl.minimum(rn, N - 1).to(tl.int64)
    w32 = w_ptr.to(tl.pointer_type(tl.int32))
    if QTYPE == 5:
        row = w32 + rows[:, None, None, None] * row_words
        acc = tl.zeros((BN, NB, 4, 8), dtype=tl.float32)
        for g in range(lo, lo + n_split, NB):
            sb = g + tl.arange(0, NB)[None, :, None, None]
            q, ds0, dm0, ds1, dm1 = _q4k_load(row, sb)
            for s in tl.static_range(2):
                x0, x1, x2, x3 = _x4(x_ptr, _q4k_cols(sb, s), XBF16)
                acc += _q4k_plane(q, ds0, dm0, ds1, dm1, sb, 4 * s) * x0
                acc += _q4k_plane(q, ds0, dm0, ds1, dm1, sb, 4 * s + 1) * x1
                acc += _q4k_plane(q, ds0, dm0, ds1, dm1, sb, 4 * s + 2) * x2
                acc += _q4k_plane(q, ds0, dm0, ds1, dm1, sb, 4 * s + 3) * x3
        y = tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)
    elif QTYPE == 7:
        row = w32 + rows[:, None, None, None, None] * row_words
        acc = tl.zeros((BN, NB, 2, 2, 8), dtype=tl.float32)
        for g in range(lo, lo + n_split, NB):
            sb = g + tl.arange(0, NB)[None, :, None, None, None]
            ql, qh, sw0, sw1, d = _q6k_load(row, sb)
            for s in tl.static_range(2):
                x0, x1, x2, x3 = _x4(x_ptr, _q6k_cols(sb, s), XBF16)
                acc += _q6k_plane(ql, qh, sw0, sw1, d, sb, 4 * s) * x0
                acc += _q6k_plane(ql, qh, sw0, sw1, d, sb, 4 * s + 1) * x1
                acc += _q6k_plane(ql, qh, sw0, sw1, d, sb, 4 * s + 2) * x2
                acc += _q6k_plane(ql, qh, sw0, sw1, d, sb, 4 * s + 3) * x3
        y = tl.sum(tl.sum(tl.sum(tl.sum(acc, axis=4), axis=3), axis=2), axis=1)
    else:
        row = w32 + rows[:, None, None] * row_words
        acc = tl.zeros((BN, NB, 8), dtype=tl.float32)
        for g in range(lo, lo + n_split, NB):
            blk = g + tl.arange(0, NB)[None, :, None]
            q, d = _q80_load(row, blk)
            x0, x1, x2, x3 = _x4(x_ptr, _q80_cols(blk), XBF16)
            acc += _q80_plane(q, d, blk, 0) * x0
            acc += _q80_plane(q, d, blk, 1) * x1
            acc += _q80_plane(q, d, blk, 2) * x2
            acc += _q80_plane(q, d, blk, 3) * x3
        y = tl.sum(tl.sum(acc, axis=2), axis=1)
    _store_rows(y_ptr, b_ptr, y, rn, n_mask, N, HAS_BIAS, PARTIAL)


# ----- one row with int8 activations: 4 weights a dp4a ------------------------------------------------------
# The float gemv above spends ~6 ALU operations on every weight (the nibble made a float, scaled, multiplied).
# As llama.cpp's MMVQ does, the activation row is quantized to int8 per 32 columns (scale absmax / 127, rounded
# half away from zero), once per call by _quant_x_kernel into a small workspace, and four weights of a word
# (masked, not shifted apart) meet four int8 activations in one dp4a: per 32 columns
#   sum_j (d*sc*q_j - dmin*m) * x_j  ~=  d*sc*dx * sum_j q_j*xq_j  -  dmin*m * sum_j x_j   (the last sum exact).
# The int8 rounding costs ~0.3% relative error per dot product, about bf16's; the start-up tuner keeps these
# kernels for a shape only where they beat the float gemv and pass the same exactness check.
# Layout matters more than arithmetic here: in the K-quant kernels each thread owns one (weight row,
# super-block) pair and reads it as 4-word vectors ([R, 4] tensors, R = BN * NB pairs a step), so the block's
# scales are decoded once per thread and every sum stays in its registers (no layout conversions, no shuffles
# in the loop): ~1.5 instructions a weight for Q4_K, ~2.9 for Q6_K, measured from the SASS.
# Workspace for K columns, int32 words: [K/4 words of int8 x | K/32 fp32 dx | K/32 fp32 exact sums of x per 32
# columns | K/16 int32 sums of the int8 x per 16 columns]. Integer sums become fp32 through the mantissa of
# 1.5 * 2**23 (an add, not a slow I2F).

ISUM = tl.constexpr(12582912.0)  # 1.5 * 2**23: bitcast(0x4B400000 + v) == 1.5 * 2**23 + v for |v| < 2**22


@triton.jit
def _dp4a(a, b, ASM: tl.constexpr):
    """sum_i a.byte[i] * b.byte[i] of int32 words as signed bytes: the dp4a instruction, or (ASM False: the
    interpreter) the same sum by shifts."""
    if ASM:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, a * 0],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        s = ((a << 24) >> 24) * ((b << 24) >> 24)
        s += ((a << 16) >> 24) * ((b << 16) >> 24)
        s += ((a << 8) >> 24) * ((b << 8) >> 24)
        return s + (a >> 24) * (b >> 24)


@triton.jit
def _ifloat(v):
    """int32 v (|v| < 2**22) as exact fp32."""
    return (v + 0x4B400000).to(tl.float32, bitcast=True) - ISUM


@triton.jit
def q8_store(ws_ptr, x, blk, half, col, K):
    """Write rows' values x [B, 2, 16] (fp32, at columns col = blk * 32 + half * 16 + j, blk [B, 1, 1], half
    [1, 2, 1]) into their int8 workspace at ws_ptr (K columns): per 32-column block the int8 values (absmax
    scaled to 127, rounded half away from zero), the scale, the exact fp32 sum of x and the int8 sums of both
    halves. The one quantization of x for the *_q8x kernels: _quant_x_kernel and the norm kernels that write
    their output's workspace (triton_ops) call it, so both give the same bytes."""
    mask = col < K
    amax = tl.max(tl.max(tl.abs(x), axis=2, keep_dims=True), axis=1, keep_dims=True)  # [B, 1, 1]
    v = x * tl.where(amax > 0, 127.0 / amax, 0.0)
    q = tl.where(v >= 0, v + 0.5, v - 0.5).to(tl.int32)
    tl.store(ws_ptr.to(tl.pointer_type(tl.int8)) + col, q.to(tl.int8), mask=mask)
    bmask = blk < K // 32
    tl.store((ws_ptr + K // 4).to(tl.pointer_type(tl.float32)) + blk, amax / 127.0, mask=bmask)
    tl.store((ws_ptr + K // 4 + K // 32).to(tl.pointer_type(tl.float32)) + blk,
             tl.sum(tl.sum(x, axis=2, keep_dims=True), axis=1, keep_dims=True), mask=bmask)
    tl.store(ws_ptr + K // 4 + K // 16 + blk * 2 + half, tl.sum(q, axis=2, keep_dims=True), mask=bmask & (half < 2))


@triton.jit
def q8_store_run(ws_ptr, y, blk0, K, B: tl.constexpr):
    """q8_store for B whole 32-column blocks of one row side by side: values y [B * 32] (fp32) of columns
    blk0 * 32 on (a normed row, an attention head's output), into the row's workspace at ws_ptr."""
    blk = blk0 + tl.arange(0, B)[:, None, None]
    half = tl.arange(0, 2)[None, :, None]
    col = blk * 32 + half * 16 + tl.arange(0, 16)[None, None, :]
    q8_store(ws_ptr, tl.reshape(y, (B, 2, 16)), blk, half, col, K)


@triton.jit
def _quant_x_kernel(x_ptr, ws_ptr, K, stride_xm, BLOCKS: tl.constexpr, ACT: tl.constexpr = 0,
                    PDL: tl.constexpr = False):
    """Row program_id(1) of x [M, K] -> its workspace (row m's at word m * (K/4 + K/8)). ACT 1 (silu) or 2
    (gelu_tanh): x is gate_up [M, 2K] and the row quantized is triton_ops.act_mul's, rounded as it rounds."""
    pdl.enter(PDL)
    m = tl.program_id(1)
    x_ptr += m.to(tl.int64) * stride_xm
    ws_ptr += m.to(tl.int64) * (K // 4 + K // 8)
    blk = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)[:, None, None]  # 32-column blocks [BLOCKS, 1, 1]
    half = tl.arange(0, 2)[None, :, None]
    j = tl.arange(0, 16)[None, None, :]
    col = blk * 32 + half * 16 + j
    mask = col < K
    x = tl.load(x_ptr + col, mask=mask, other=0.0).to(tl.float32)
    if ACT != 0:
        dt = x_ptr.dtype.element_ty
        u = tl.load(x_ptr + K + col, mask=mask, other=0.0).to(tl.float32)
        if ACT == 2:
            a = x * tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))
        else:
            a = x * tl.sigmoid(x)
        x = (a.to(dt).to(tl.float32) * u).to(dt).to(tl.float32)
    q8_store(ws_ptr, x, blk, half, col, K)


def workspace(m: int, k: int, device: torch.device | str) -> torch.Tensor:
    """An unfilled int8 workspace for m rows of k columns (k % 32 == 0): [m, k/4 + k/8] int32 words, each row
    its int8 values, then k/32 fp32 scales, k/32 fp32 sums and k/16 int32 half-block sums (q8_store)."""
    return torch.empty(m, k // 4 + k // 8, device=device, dtype=torch.int32)


def quantize_x(x: torch.Tensor, act: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Activation rows [M, K] (K % 32 == 0) as the int8 workspace of the *_q8x kernels, [M, K/4 + K/8] words
    (into `out` if given: a workspace, or rows of one). With `act` ("silu" or "gelu_tanh"), x is gate_up [M, 2K]
    and the rows are triton_ops.act_mul(x, act)'s, bit for bit, in the same launch (the MoE down's input: one
    launch and one write of the rows fewer)."""
    m, k = x.shape
    code = {None: 0, "silu": 1, "gelu_tanh": 2}[act]
    if code:
        k //= 2
    ws = workspace(m, k, x.device) if out is None else out
    if ws.shape != (m, k // 4 + k // 8) or ws.dtype != torch.int32 or not ws.is_contiguous():
        raise ValueError(f"quantize_x: a workspace {tuple(ws.shape)} {ws.dtype} for {m} rows of {k}")
    _quant_x_kernel[(triton.cdiv(k // 32, 8), m)](x, ws, k, x.stride(0), BLOCKS=8, ACT=code, num_warps=2,
                                                  **pdl.launch(x, m))
    return ws


@triton.jit
def _q4k_chunk_scales(s0, s1, s2, ci: tl.constexpr):
    """The 6-bit scales and mins of sub-blocks 2ci and 2ci + 1 (chunk ci, a compile-time constant) from a Q4_K
    block's three scale words, as int32: (sc0, mn0, sc1, mn1). `_q4k_scales` is the same decode for a tensor
    of chunks."""
    if ci < 2:
        sc0 = (s0 >> (16 * ci)) & 63
        mn0 = (s1 >> (16 * ci)) & 63
        sc1 = (s0 >> (16 * ci + 8)) & 63
        mn1 = (s1 >> (16 * ci + 8)) & 63
    else:
        sh = 16 * (ci - 2)
        sc0 = ((s2 >> sh) & 15) | (((s0 >> (sh + 6)) & 3) << 4)
        mn0 = ((s2 >> (sh + 4)) & 15) | (((s1 >> (sh + 6)) & 3) << 4)
        sc1 = ((s2 >> (sh + 8)) & 15) | (((s0 >> (sh + 14)) & 3) << 4)
        mn1 = ((s2 >> (sh + 12)) & 15) | (((s1 >> (sh + 14)) & 3) << 4)
    return sc0, mn0, sc1, mn1


@triton.jit
def _prefetch_rows(w_ptr, rn, N, row_bytes, first, nbytes, PDL: tl.constexpr):
    """PDL: ask L2 for bytes first .. first + nbytes of weight rows rn (a program's share of them), before the
    program waits for the kernel before it (pdl.prefetch_l2)."""
    if PDL:
        pdl.prefetch_l2(w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * row_bytes + first, nbytes, PDL)


@triton.jit
def _pair(ws_ptr, y_ptr, ids_ptr, P, N, K, stride_y, w2_off, X_PER_ROW: tl.constexpr, MOE: tl.constexpr,
          PDL: tl.constexpr = False):
    """This program's (workspace row, output row, first weight row, weight byte offset). MOE (the routed experts
    of a decode step, `pair_gemv`): program_id(2) is pair q of P, or pair q = p - P of the second weight (at
    w2_off bytes from the first, its type and shape); the pair's expert ids[q] is weight rows ids[q] * N on,
    its activations workspace row q // X_PER_ROW, its outputs row q of y (row stride stride_y), the second
    weight's N columns on. Else one problem: rows from 0, nothing moved. PDL: waits (pdl.enter) first, as the
    ids and everything after them may come from the kernel before."""
    pdl.enter(PDL)
    if MOE:
        p = tl.program_id(2)
        second = (p >= P).to(tl.int64)
        q = p - P * second
        row0 = tl.load(ids_ptr + q).to(tl.int64) * N
        ws_ptr += (q // X_PER_ROW).to(tl.int64) * (K // 4 + K // 8)
        y_ptr += q.to(tl.int64) * stride_y + second * N
        w_off = second * w2_off
    else:
        row0 = tl.program_id(0).to(tl.int64) * 0
        w_off = row0
    return ws_ptr, y_ptr, row0, w_off


@triton.jit
def _gemv_q4k_q8x_kernel(ws_ptr, w_ptr, b_ptr, y_ptr, N, K, n_split, row_bytes, ids_ptr, P, stride_y, w2_off,
                         X_PER_ROW: tl.constexpr, MOE: tl.constexpr, HAS_BIAS: tl.constexpr,
                         PARTIAL: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, ASM: tl.constexpr,
                         PDL: tl.constexpr = False):
    """One row of a Q4_K weight against the int8 workspace, BN rows x NB super-blocks a step, a super-block's
    128 bytes of nibbles spread over 8 threads (tile [BN * NB, 4 chunks, 8 words]: a warp's loads are whole
    128-byte runs of a row). Per 32-column sub-block 8 dp4a summed, times d * scale * dx, less dmin * min * (exact
    sum of x). Each of a block's threads loads its 16-byte header (one transaction: the same address). Programs
    and splits as _gemv_words_kernel; MOE: one pair of routed experts a program_id(2) (see _pair). One thread a
    super-block (loads 144 bytes apart) ran 1.04-1.11x slower over Qwen3-8B's Q4_K matrices (H100, 2026-12-07)."""
    R: tl.constexpr = BN * NB
    r = tl.arange(0, R)[:, None, None]
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    n_mask = rn < N
    ci = tl.arange(0, 4)[None, :, None]
    wi = tl.arange(0, 8)[None, None, :]
    lo = tl.program_id(1) * n_split
    _prefetch_rows(w_ptr, rn, N, row_bytes, lo * 144, NB * 144, PDL and not MOE)
    ws_ptr, y_ptr, row0, w_off = _pair(ws_ptr, y_ptr, ids_ptr, P, N, K, stride_y, w2_off, X_PER_ROW, MOE, PDL)
    rows = row0 + tl.minimum(tl.program_id(0) * BN + r // NB, N - 1).to(tl.int64)
    w32 = (w_ptr + w_off).to(tl.pointer_type(tl.int32))
    row = rows * (row_bytes // 4)  # [R, 1, 1] word offsets of rows of 36-word blocks
    dxp = (ws_ptr + K // 4).to(tl.pointer_type(tl.float32))
    sxp = (ws_ptr + K // 4 + K // 32).to(tl.pointer_type(tl.float32))
    acc = tl.zeros((R, 4, 1), dtype=tl.float32)
    for g in range(lo, lo + n_split, NB):
        sb = g + r % NB  # [R, 1, 1]
        base = w32 + row + sb * 36
        quad = (row + sb * 36 + 4) >> 2  # the nibbles' 16-byte unit: x 4 tells the compiler they are aligned
        q = tl.load(w32 + quad * 4 + ci * 8 + wi)  # chunk ci: sub-blocks 2ci (low nibbles), 2ci + 1 (high)
        xw = sb * 64 + ci * 16 + wi  # x word of the low nibbles' columns sb*256 + 64ci + 4wi
        i0 = tl.sum(_dp4a(q & 0x0F0F0F0F, tl.load(ws_ptr + xw), ASM), axis=2, keep_dims=True)
        i1 = tl.sum(_dp4a((q >> 4) & 0x0F0F0F0F, tl.load(ws_ptr + xw + 8), ASM), axis=2, keep_dims=True)
        w0 = tl.load(base)
        d = _h16(w0, 0)
        dmin = _h16(w0, 16)
        sc0, mn0, sc1, mn1 = _q4k_lane_scales(tl.load(base + 1), tl.load(base + 2), tl.load(base + 3), ci)
        sub = sb * 8 + 2 * ci
        acc += d * (_ifloat(sc0) * tl.load(dxp + sub) * _ifloat(i0) + _ifloat(sc1) * tl.load(dxp + sub + 1)
                    * _ifloat(i1))
        acc -= dmin * (_ifloat(mn0) * tl.load(sxp + sub) + _ifloat(mn1) * tl.load(sxp + sub + 1))
    y = tl.sum(tl.reshape(tl.sum(tl.sum(acc, axis=2), axis=1), (BN, NB)), axis=1)
    _store_rows(y_ptr, b_ptr, y, rn, n_mask, N, HAS_BIAS, PARTIAL)


@triton.jit
def _gemv_q6k_q8x_kernel(ws_ptr, w_ptr, b_ptr, y_ptr, N, K, n_split, row_bytes, ids_ptr, P, stride_y, w2_off,
                         X_PER_ROW: tl.constexpr, MOE: tl.constexpr, HAS_BIAS: tl.constexpr,
                         PARTIAL: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, ASM: tl.constexpr,
                         PDL: tl.constexpr = False):
    """One row of a Q6_K weight against the int8 workspace, a super-block spread over 4 threads, one quarter (h, a)
    each (tile [BN * NB, 4 quarters, 4 words]). Element 128h + 32g + 16a + 4k + b of a block is nibble g >> 1 of
    ql byte 64h + 32(g & 1) + 16a + 4k + b with bits 2g..2g+1 of qh byte 32h + 16a + 4k + b; per 16 columns 4
    dp4a summed, less 32 x the int8 sum, times d * scale * dx. Words are funnel-shifted (_vword): every other
    210-byte block starts 2 bytes into a word, as does a row of an odd number of blocks; the scales and d are
    read as bytes and fp16. Programs and splits as _gemv_words_kernel; MOE as _gemv_q4k_q8x_kernel. One thread a
    super-block ran 1.13-1.27x slower over Qwen3-8B's Q6_K matrices (H100, 2026-12-07)."""
    R: tl.constexpr = BN * NB
    r = tl.arange(0, R)[:, None, None]
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    n_mask = rn < N
    hq = tl.arange(0, 4)[None, :, None]  # quarter 2h + a
    h = hq >> 1
    a = hq & 1
    k = tl.arange(0, 4)[None, None, :]
    lo = tl.program_id(1) * n_split
    _prefetch_rows(w_ptr, rn, N, row_bytes, lo * 210, NB * 210, PDL and not MOE)
    ws_ptr, y_ptr, row0, w_off = _pair(ws_ptr, y_ptr, ids_ptr, P, N, K, stride_y, w2_off, X_PER_ROW, MOE, PDL)
    rows = row0 + tl.minimum(tl.program_id(0) * BN + r // NB, N - 1).to(tl.int64)
    roff = rows * row_bytes  # [R, 1, 1]
    row = (w_ptr + w_off).to(tl.pointer_type(tl.int32)) + roff // 4
    wb = w_ptr + w_off + roff
    dxp = (ws_ptr + K // 4).to(tl.pointer_type(tl.float32))
    sqp = ws_ptr + K // 4 + K // 16
    acc = tl.zeros((R, 4, 1), dtype=tl.float32)
    for g in range(lo, lo + n_split, NB):
        sb = g + r % NB  # [R, 1, 1]
        st = (roff & 2) + sb * 210
        blk = wb + sb * 210
        d = tl.load((blk + 208).to(tl.pointer_type(tl.float16))).to(tl.float32)
        qla = _vword(row, st, 16 * h + 4 * a + k)
        qlb = _vword(row, st, 16 * h + 8 + 4 * a + k)
        qhv = _vword(row, st, 32 + 8 * h + 4 * a + k)
        for gq in tl.static_range(4):
            if gq == 0:
                u = (qla & 0x0F0F0F0F) | ((qhv << 4) & 0x30303030)
            elif gq == 1:
                u = (qlb & 0x0F0F0F0F) | ((qhv << 2) & 0x30303030)
            elif gq == 2:
                u = ((qla >> 4) & 0x0F0F0F0F) | (qhv & 0x30303030)
            else:
                u = ((qlb >> 4) & 0x0F0F0F0F) | ((qhv >> 2) & 0x30303030)
            xw = sb * 64 + h * 32 + 8 * gq + 4 * a + k
            dot = (tl.sum(_dp4a(u, tl.load(ws_ptr + xw), ASM), axis=2, keep_dims=True)
                   - 32 * tl.load(sqp + sb * 16 + h * 8 + 2 * gq + a))
            sc = tl.load((blk + 192 + 8 * h + 2 * gq + a).to(tl.pointer_type(tl.int8))).to(tl.int32)
            acc += (d * tl.load(dxp + sb * 8 + h * 4 + gq)) * (_ifloat(sc) * _ifloat(dot))
    y = tl.sum(tl.reshape(tl.sum(tl.sum(acc, axis=2), axis=1), (BN, NB)), axis=1)
    _store_rows(y_ptr, b_ptr, y, rn, n_mask, N, HAS_BIAS, PARTIAL)


@triton.jit
def _gemv_q80_q8x_kernel(ws_ptr, w_ptr, b_ptr, y_ptr, N, K, n_split, row_bytes, ids_ptr, P, stride_y, w2_off,
                         X_PER_ROW: tl.constexpr, MOE: tl.constexpr, HAS_BIAS: tl.constexpr,
                         PARTIAL: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, ASM: tl.constexpr,
                         PDL: tl.constexpr = False):
    """One row of a Q8_0 weight against the int8 workspace: 8 dp4a a 32-column block, times d * dx. MOE and rows
    starting 2 bytes into a word as _gemv_q6k_q8x_kernel."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    lo = tl.program_id(1) * n_split
    n_mask = rn < N
    _prefetch_rows(w_ptr, rn, N, row_bytes, lo * 34, NB * 34, PDL and not MOE)
    ws_ptr, y_ptr, row0, w_off = _pair(ws_ptr, y_ptr, ids_ptr, P, N, K, stride_y, w2_off, X_PER_ROW, MOE, PDL)
    rows = row0 + tl.minimum(rn, N - 1).to(tl.int64)
    roff = (rows * row_bytes)[:, None, None]
    row = (w_ptr + w_off).to(tl.pointer_type(tl.int32)) + roff // 4
    zero = (rn * 0)[:, None, None]  # x loads take the weights' shape: no layout conversions
    v = tl.arange(0, 8)[None, None, :]
    dxp = (ws_ptr + K // 4).to(tl.pointer_type(tl.float32))
    acc = tl.zeros((BN, NB, 1), dtype=tl.float32)
    for g in range(lo, lo + n_split, NB):
        blk = g + tl.arange(0, NB)[None, :, None]
        q, d = _q80_load(row, blk, roff & 2)
        dot = tl.sum(_dp4a(q, tl.load(ws_ptr + zero + blk * 8 + v), ASM), axis=2, keep_dims=True)
        acc += (d * tl.load(dxp + zero + blk)) * _ifloat(dot)
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    _store_rows(y_ptr, b_ptr, y, rn, n_mask, N, HAS_BIAS, PARTIAL)


@triton.jit
def _ws_rows(ws_ptr, rm, M, K):
    """Pointers [BM, 1] to activation rows rm's workspaces (rows past M read row M - 1; their outputs are
    masked): the int8 x (bytes), dx, and the exact sums of x per 32 columns."""
    row = tl.minimum(rm, M - 1).to(tl.int64)[:, None] * (K // 4 + K // 8)  # workspace words a row
    return ((ws_ptr + row).to(tl.pointer_type(tl.int8)), (ws_ptr + row + K // 4).to(tl.pointer_type(tl.float32)),
            (ws_ptr + row + K // 4 + K // 32).to(tl.pointer_type(tl.float32)))


@triton.jit
def _nibbles(q, HIGH: tl.constexpr, ASM: tl.constexpr):
    """The low (HIGH False) or high nibble of every byte of uint8 tensor q, as int8: with ASM four bytes an
    instruction (pack=4: each 32-bit register masked and shifted whole; the ops are bytewise, so any grouping of
    four elements gives the same values), else (the interpreter) element by element."""
    if ASM:
        if HIGH:
            return tl.inline_asm_elementwise("{.reg .b32 t; shr.u32 t, $1, 4; and.b32 $0, t, 0x0F0F0F0F;}", "=r,r",
                                             [q], dtype=tl.int8, is_pure=True, pack=4)
        return tl.inline_asm_elementwise("and.b32 $0, $1, 0x0F0F0F0F;", "=r,r", [q], dtype=tl.int8, is_pure=True,
                                         pack=4)
    return ((q.to(tl.int32) >> (4 if HIGH else 0)) & 15).to(tl.int8)


@triton.jit
def _q4k_tile_block(acc, sb, w32, w8, xrow, dxrow, sxrow, j, ASM: tl.constexpr):
    """acc [BM, BN] += super-block sb of the weight rows (w32 / w8: int32 and byte pointers [1, BN]) against the
    activation rows' workspaces: one int8 tensor-core dot per 32-column sub-block (low nibbles: sub-block 2ci,
    high: 2ci + 1), scaled by dx per row and d * scale per weight row, less the dmin term on the exact sums of x.
    Each header word is loaded as its own [1, BN] row (L1 hits after the first): the scales are then computed
    in the dot's layout, where one [4, BN] load reduced per word had cost two shared-memory layout conversions
    per sub-block (1.23x slower on Qwen3-8B's gate|up at 16 rows, H200)."""
    w0 = tl.load(w32 + sb * 36)  # d | dmin, then the 12 bytes of 6-bit scales and mins
    s0 = tl.load(w32 + sb * 36 + 1)
    s1 = tl.load(w32 + sb * 36 + 2)
    s2 = tl.load(w32 + sb * 36 + 3)
    d = _h16(w0, 0)
    dmin = _h16(w0, 16)
    for ci in tl.static_range(4):
        sc0, mn0, sc1, mn1 = _q4k_chunk_scales(s0, s1, s2, ci)
        qb = tl.load(w8 + (sb * 144 + 16 + ci * 32) + j[:, None])  # [32, BN] bytes
        xc = xrow + (sb * 256 + ci * 64) + j[None, :]
        dlo = tl.dot(tl.load(xc), _nibbles(qb, False, ASM))  # [BM, BN] int32
        dhi = tl.dot(tl.load(xc + 32), _nibbles(qb, True, ASM))
        sub = sb * 8 + 2 * ci
        acc += _ifloat(dlo) * (tl.load(dxrow + sub) * (d * _ifloat(sc0)))
        acc += _ifloat(dhi) * (tl.load(dxrow + sub + 1) * (d * _ifloat(sc1)))
        acc -= tl.load(sxrow + sub) * (dmin * _ifloat(mn0)) + tl.load(sxrow + sub + 1) * (dmin * _ifloat(mn1))
    return acc


@triton.jit
def _qmm_q4k_q8x_kernel(ws_ptr, w_ptr, b_ptr, y_ptr, M, N, K, n_split, row_words, stride_ym,
                        HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        NB: tl.constexpr, ASM: tl.constexpr):
    """A few activation rows (batched decode, verify blocks) of a Q4_K weight against their int8 workspaces
    (_q4k_tile_block), NB super-blocks a loop step (more loads in flight per program). Program (i, 0, j) covers
    super-blocks j * n_split .. (j + 1) * n_split (n_split % NB == 0)."""
    rm = tl.arange(0, BM)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    lo = tl.program_id(2) * n_split
    m_ok = (rm < M)[:, None]
    n_mask = rn < N
    rows = tl.minimum(rn, N - 1).to(tl.int64)
    xrow, dxrow, sxrow = _ws_rows(ws_ptr, rm, M, K)
    w32 = w_ptr.to(tl.pointer_type(tl.int32)) + rows[None, :] * row_words  # [1, BN]
    w8 = w_ptr + rows[None, :] * (4 * row_words)
    j = tl.arange(0, 32)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for g in range(lo, lo + n_split, NB):
        for u in tl.static_range(NB):
            acc = _q4k_tile_block(acc, g + u, w32, w8, xrow, dxrow, sxrow, j, ASM)
    _store_tile(y_ptr, b_ptr, acc, rm, rn, m_ok, n_mask, M, N, stride_ym, HAS_BIAS, PARTIAL)


@triton.jit
def _q6k_tile_block(acc, sb, w8, xrow, dxrow, j, first):
    """acc [BM, BN] += super-block sb of the weight rows (byte pointers w8 [1, BN]) against the activation rows'
    int8 x: per 32 columns (group g of half h: ql byte 64h + 32(g & 1) + l, nibble g >> 1, with bits 2g..2g+1 of
    qh byte 32h + l) the 6-bit values less 32 as int8, one int8 tensor-core dot per 16-column scale (the other 16
    columns zeroed: a dot is 32 deep), times dx per row and d * scale per weight row. d and the scales are loaded
    unmasked (rows are clamped to N - 1), which keeps them in the dot's layout."""
    blk = w8 + sb * 210
    d = _f16(blk + 208, True)  # [1, BN]
    for h in tl.static_range(2):
        qh = tl.load(blk + 128 + 32 * h + j).to(tl.int32)  # [32, BN]
        for g in tl.static_range(4):
            ql = tl.load(blk + 64 * h + 32 * (g & 1) + j).to(tl.int32)
            v = (((ql >> (4 * (g >> 1))) & 15) | (((qh >> (2 * g)) & 3) << 4)) - 32
            xg = tl.load(xrow + (sb * 256 + 128 * h + 32 * g) + tl.arange(0, 32)[None, :])  # [BM, 32]
            dlo = tl.dot(xg, tl.where(first, v, 0).to(tl.int8))
            dhi = tl.dot(xg, tl.where(first, 0, v).to(tl.int8))
            sc0 = _i8(blk + 192 + 8 * h + 2 * g, True)  # [1, BN]
            sc1 = _i8(blk + 193 + 8 * h + 2 * g, True)
            dx = tl.load(dxrow + (sb * 8 + 4 * h + g))  # [BM, 1]
            acc += (_ifloat(dlo) * sc0 + _ifloat(dhi) * sc1) * (dx * d)
    return acc


@triton.jit
def _qmm_q6k_q8x_kernel(ws_ptr, w_ptr, b_ptr, y_ptr, M, N, K, n_split, row_words, stride_ym,
                        HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        NB: tl.constexpr):
    """A few activation rows of a Q6_K weight against their int8 workspaces (_q6k_tile_block), NB super-blocks a
    loop step. Programs as _qmm_q4k_q8x_kernel."""
    rm = tl.arange(0, BM)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    lo = tl.program_id(2) * n_split
    m_ok = (rm < M)[:, None]
    n_mask = rn < N
    rows = tl.minimum(rn, N - 1).to(tl.int64)
    xrow, dxrow, _ = _ws_rows(ws_ptr, rm, M, K)
    w8 = w_ptr + rows[None, :] * (4 * row_words)  # [1, BN]
    j = tl.arange(0, 32)[:, None]  # [32, 1]: l
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for g in range(lo, lo + n_split, NB):
        for u in tl.static_range(NB):
            acc = _q6k_tile_block(acc, g + u, w8, xrow, dxrow, j, j < 16)
    _store_tile(y_ptr, b_ptr, acc, rm, rn, m_ok, n_mask, M, N, stride_ym, HAS_BIAS, PARTIAL)


@triton.jit
def _qmm_q80_q8x_kernel(ws_ptr, w_ptr, b_ptr, y_ptr, M, N, K, n_split, row_words, stride_ym,
                        HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """A few activation rows of a Q8_0 weight against their int8 workspaces: per 32-column block one int8
    tensor-core dot of the rows' int8 x with the block's int8 weights, times dx per row and d per weight row.
    Programs as _qmm_q4k_q8x_kernel (n_split counts 32-column blocks)."""
    rm = tl.arange(0, BM)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    lo = tl.program_id(2) * n_split
    m_ok = (rm < M)[:, None]
    n_mask = rn < N
    rows = tl.minimum(rn, N - 1).to(tl.int64)
    xrow, dxrow, _ = _ws_rows(ws_ptr, rm, M, K)
    w8 = w_ptr + rows[None, :] * (4 * row_words)  # [1, BN]
    j = tl.arange(0, 32)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for blk in range(lo, lo + n_split):
        q = tl.load((w8 + blk * 34 + 2) + j[:, None]).to(tl.int8, bitcast=True)  # [32, BN]
        dot = tl.dot(tl.load(xrow + blk * 32 + j[None, :]), q)  # [BM, BN] int32
        d = _f16(w8 + blk * 34, n_mask[None, :])  # [1, BN]
        acc += dot.to(tl.float32) * (tl.load(dxrow + blk) * d)
    _store_tile(y_ptr, b_ptr, acc, rm, rn, m_ok, n_mask, M, N, stride_ym, HAS_BIAS, PARTIAL)


@triton.jit
def _dot_plane(acc, w, xrow, xo, m_mask, BM: tl.constexpr, BN: tl.constexpr, E: tl.constexpr):
    """acc [BM, BN] += x[:, xo] @ w.T for one plane: w [BN, ...] and offsets xo [1, ...] of E elements."""
    x = tl.load(xrow + tl.reshape(xo, (1, E)), mask=m_mask, other=0.0)
    return tl.dot(x, tl.trans(tl.reshape(w, (BN, E)).to(x.dtype)), acc)


@triton.jit
def _qmm_words_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, n_split, stride_xm, stride_ym, row_words,
                      QTYPE: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, NB: tl.constexpr):
    """A few activation rows (batched decode, verify blocks): each weight word is loaded once per program
    and every plane of it goes through one tensor-core dot with all BM rows. Program (i, r, j) covers blocks
    j * n_split .. (j + 1) * n_split; with several j (PARTIAL) it writes fp32 sums [j, M, N]."""
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    lo = tl.program_id(2) * n_split
    m_mask = (rm < M)[:, None]
    n_mask = rn < N
    rows = tl.minimum(rn, N - 1).to(tl.int64)
    xrow = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w32 = w_ptr.to(tl.pointer_type(tl.int32))
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if QTYPE == 5:
        row = w32 + rows[:, None, None, None] * row_words
        for g in range(lo, lo + n_split, NB):
            sb = g + tl.arange(0, NB)[None, :, None, None]
            q, ds0, dm0, ds1, dm1 = _q4k_load(row, sb)
            for p in tl.static_range(8):
                w = _q4k_plane(q, ds0, dm0, ds1, dm1, sb, p)
                acc = _dot_plane(acc, w, xrow, _q4k_cols(sb, p // 4) + p % 4, m_mask, BM, BN, NB * 32)
    elif QTYPE == 7:
        row = w32 + rows[:, None, None, None, None] * row_words
        for g in range(lo, lo + n_split, NB):
            sb = g + tl.arange(0, NB)[None, :, None, None, None]
            ql, qh, sw0, sw1, d = _q6k_load(row, sb)
            for p in tl.static_range(8):
                w = _q6k_plane(ql, qh, sw0, sw1, d, sb, p)
                acc = _dot_plane(acc, w, xrow, _q6k_cols(sb, p // 4) + p % 4, m_mask, BM, BN, NB * 32)
    else:
        row = w32 + rows[:, None, None] * row_words
        for g in range(lo, lo + n_split, NB):
            blk = g + tl.arange(0, NB)[None, :, None]
            q, d = _q80_load(row, blk)
            for p in tl.static_range(4):
                w = _q80_plane(q, d, blk, p)
                acc = _dot_plane(acc, w, xrow, _q80_cols(blk) + p, m_mask, BM, BN, NB * 8)
    _store_tile(y_ptr, b_ptr, acc, rm, rn, m_mask, n_mask, M, N, stride_ym, HAS_BIAS, PARTIAL)


@triton.jit
def _splitk_sum_kernel(p_ptr, b_ptr, y_ptr, M, N, stride_ym, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """y[m, :] = sum over j of the fp32 partials p[j, m, :] (+ bias), in y's dtype."""
    pdl.enter(PDL)
    m = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = rn < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(SPLIT):
        acc += tl.load(p_ptr + (j * M + m) * N + rn, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + rn, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_kernel(w_ptr, y_ptr, N, n_chunks, row_bytes, QTYPE: tl.constexpr, CHUNK: tl.constexpr,
                    NB: tl.constexpr, L: tl.constexpr, BN: tl.constexpr):
    """Rows of the weight dequantized into y [N, n_chunks * CHUNK] (the prefill path's bounded scratch)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    g = tl.program_id(1) * NB
    n_mask = rn < N
    wrow = w_ptr + rn.to(tl.int64)[:, None, None] * row_bytes
    yrow = y_ptr + rn.to(tl.int64)[:, None, None] * (n_chunks * CHUNK)
    j = tl.arange(0, L)[None, None, :]
    c = g + tl.arange(0, NB)[None, :, None]
    cm = n_mask[:, None, None] & (c < n_chunks)
    for p in tl.static_range(CHUNK // L):
        w = _part(wrow, c, cm, QTYPE, p)
        tl.store(yrow + c * CHUNK + p * L + j, w.to(y_ptr.dtype.element_ty), mask=cm)


# Rows from which qmatmul dequantizes bounded slices for cuBLAS instead of running a fused kernel (the
# word-wise types run their small-batch kernel up to SMALL_BM rows).
PREFILL_ROWS = 2
SCRATCH_ELEMS = 1 << 25  # 64 MiB of bf16: a few thousand weight rows at a time, never the whole of a big weight

# Q4_1 batch-1 gemv reading int32 words: weight rows per program, blocks per step, warps.
Q4_1_GEMV = (4, 16, 1)

# The word-wise kernels: type -> (QTYPE id, elements per block). A type's rows must be a whole number of words.
WORD_TYPES = {"Q4_K": (5, 256), "Q6_K": (7, 256), "Q8_0": (4, 32)}
# Launch configs of the word-wise kernels, (BN, NB, num_warps, split): defaults by type, and the ones `warm_up`
# measured for a (kernel, type, rows, cols) shape (fixed from then on: nothing is tuned while serving).
# Measured on the H200 over Qwen3-8B matrices in CUDA graphs (2026-12-03; `bench qmm` reruns it), best float / int8
# config: one row Q4_K 4096x4096 9.9 / 8.3 us, 24576x4096 45.7 / 27.4 us (1.24 / 2.07 TB/s), Q6_K 151936x4096
# 290 / 236 us, Q8_0 24576x4096 68 / 31 us (1.58 / 3.41 TB/s); 16 rows Q4_K 24576x4096 117 / 76 us, Q6_K
# 151936x4096 1,607 / 717 us. bf16 cuBLAS on the dense weight: 3.3-4.1 TB/s. The int8 tiles since 2026-12-04
# (header words per row, nibbles four a register, int32 dots made fp32 by _ifloat): 16 rows Q4_K 24576x4096
# 75.4 -> 61.1 us and 4096x4096 19.6 -> 16.0 us in one run; 32 rows 133.1 -> 100.5 us across two runs; Q6_K
# 151936x4096 16 / 32 rows 635 / 867 -> 601 / 815 us in one run.
GEMV_DEFAULT = {"Q4_K": (16, 1, 4, 4), "Q6_K": (8, 2, 4, 4), "Q8_0": (8, 2, 4, 1)}
SMALL_DEFAULT = {"Q4_K": (64, 1, 4, 4), "Q6_K": (64, 1, 4, 4), "Q8_0": (64, 1, 4, 4)}
GEMV_CANDIDATES = [(16, 1, 4, 4), (16, 1, 2, 4), (8, 2, 4, 4), (8, 2, 4, 1), (16, 1, 4, 1), (4, 2, 4, 1)]
# The int8-activation gemvs (BN, NB, warps, split, "q8x"), tried beside the float ones and kept where faster. For
# Q4_K / Q6_K, BN * NB is the number of (row, super-block) pairs a step, 8 / 4 threads each. The K-quants' are the
# configs within 2% of the best of a 76-config sweep on some Qwen3-8B matrix (H100, 2026-12-07, `time_candidates`
# as the tuner times them: one row, CUDA graphs, quant_x and split sums included): Q4_K 4096x4096 6.4 us,
# 1024x4096 4.3, 24576x4096 27.1 (70% of copy bandwidth), 4096x12288 12.6 (75%); Q6_K 1024x4096 5.5, 4096x12288
# 22.9, 151936x4096 202 (85%).
Q8X_CANDIDATES = {
    "Q4_K": [(4, 16, 1, 2, "q8x"), (4, 16, 1, 1, "q8x"), (8, 16, 2, 2, "q8x"), (8, 16, 1, 1, "q8x"),
             (8, 16, 1, 2, "q8x"), (2, 4, 1, 1, "q8x"), (4, 2, 1, 1, "q8x"), (1, 8, 1, 1, "q8x")],
    "Q6_K": [(2, 4, 1, 1, "q8x"), (2, 4, 1, 2, "q8x"), (4, 2, 1, 1, "q8x"), (4, 2, 1, 2, "q8x"), (1, 8, 1, 1, "q8x"),
             (1, 16, 1, 2, "q8x"), (4, 4, 1, 2, "q8x")],
    "Q8_0": [(4, 2, 4, 1, "q8x"), (2, 4, 4, 1, "q8x"), (4, 4, 4, 1, "q8x"), (8, 2, 4, 1, "q8x"), (8, 1, 4, 4, "q8x"),
             (16, 1, 4, 4, "q8x")],
}
INT8_VARIANTS = ("q8x",)  # the configs' fifth element where the kernel reads x as its int8 workspace
SMALL_CANDIDATES = [(64, 1, 4, 4), (64, 1, 4, 1), (64, 1, 4, 8), (32, 1, 4, 4)]
# The int8 tensor-core small-batch kernels (Q4_K, Q6_K, Q8_0): (BN, 1, warps, split, "q8x").
# The K-quant tiles' NB is super-blocks a loop step (2: twice the loads in flight per program; not yet timed).
_TILES = [(64, 1, 4, 4, "q8x"), (32, 1, 4, 4, "q8x"), (64, 1, 4, 2, "q8x"), (128, 1, 4, 4, "q8x"),
          (32, 1, 4, 8, "q8x"), (64, 1, 8, 4, "q8x"), (32, 1, 2, 4, "q8x")]
SMALL_Q8X_CANDIDATES = {"Q8_0": _TILES, "Q6_K": _TILES + [(64, 2, 4, 2, "q8x")],
                        # Q4_K's also without a split: its fastest at 16 rows on 24576 x 4096 (61 us, H200)
                        "Q4_K": _TILES + [(64, 1, 4, 1, "q8x"), (128, 1, 4, 1, "q8x"), (64, 2, 4, 1, "q8x"),
                                          (64, 2, 4, 2, "q8x")]}
Config = tuple  # (BN, NB, num_warps, split), with a fifth "q8x" for the int8-activation gemvs
TUNED: dict[tuple[str, str, int, int], Config] = {}
SMALL_BM = 16
# Rows up to which the small-batch kernels serve (the int8 ones as one 32-row tile past SMALL_BM, its config the
# 16-row one `warm_up` chose once it matched the reference at 32 rows too: TUNED["wide", ...]).
SMALL_MAX = 2 * SMALL_BM
X_PAIRS = True


def _blocks_per_step(qtype: str, n_blk: int, nb: int) -> int:
    """nb scaled to the type (Q8_0 blocks hold 32 values, K blocks 256) and cut to a divisor of n_blk."""
    nb = nb * 8 if qtype == "Q8_0" else nb
    while n_blk % nb:
        nb //= 2
    return max(nb, 1)


def _word_ok(x: torch.Tensor, w: QuantWeight, out: torch.Tensor) -> bool:
    """Whether the word-wise kernels serve this call. On CUDA only for shapes `warm_up` checked against the
    exact reference: on the H200 (Triton 3.6) some launch configs were seen to compile to wrong results, so
    an unchecked shape keeps the older kernels rather than trust a config blindly."""
    if w.qtype not in WORD_TYPES or w.data.shape[1] % 4 or w.data.data_ptr() % 4 or out.stride(1) != 1:
        return False
    return x.device.type != "cuda" or (_kind(x.shape[0]), w.qtype, *w.shape) in TUNED


def _kind(m: int) -> str:
    """The word-wise kernel for m activation rows: "gemv" (1), "small" (up to SMALL_BM), "wide" (SMALL_MAX)."""
    return "gemv" if m == 1 else "small" if m <= SMALL_BM else "wide"


def dense_serves(m: int, w: QuantWeight) -> bool:
    """Whether qmatmul runs m rows of `w` on its dense copy (cuBLAS), where it keeps one (`--weights both`):
    everything but up to SMALL_BM rows on a shape the tuner checked. The blocks win at a few rows, the dense
    copy at many (H100, Qwen3-8B-shaped Q4_K_M, one run of `bench decode --compare-dense`, tok/s blocks /
    dense: batch 1 339 / 171, batch 16 2,483 / 2,566, batch 32 3,430 / 5,054)."""
    return w.dense is not None and not (m <= SMALL_BM and (_kind(m), w.qtype, *w.shape) in TUNED)


def int8_x(m: int, w: QuantWeight) -> bool:
    """Whether qmatmul runs `w` at m activation rows on the int8-activation kernels, which read x as its
    quantize_x workspace. A caller that has the rows' workspace already (one x for several weights, or
    quantize_x's fused activation) passes it as `ws` and saves a launch and a pass over x."""
    if not 1 <= m <= SMALL_MAX or w.qtype not in WORD_TYPES or w.data.shape[1] % 4 or w.data.data_ptr() % 4:
        return False
    if dense_serves(m, w):
        return False
    cfg = TUNED.get((_kind(m), w.qtype, *w.shape))
    return cfg is not None and cfg[-1] in INT8_VARIANTS


def _launch_words(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None, out: torch.Tensor,
                  cfg: Config | None = None, ws: torch.Tensor | None = None) -> None:
    """The word-wise gemv (one row) or small-batch tile kernel (SMALL_BM rows per program), split over the
    columns in `split` parts when that fills the GPU better (then one more small kernel sums the parts).
    `ws`: x's int8 workspace (quantize_x), given when the config is an int8-activation one (int8_x)."""
    qid, block = WORD_TYPES[w.qtype]
    m, k = x.shape
    n = w.data.shape[0]
    n_blk = k // block
    kind = _kind(m)
    if cfg is None:
        cfg = TUNED.get((kind, w.qtype, n, k)) or (GEMV_DEFAULT if m == 1 else SMALL_DEFAULT)[w.qtype]
    bn, nb, warps, split, *variant = cfg  # variant ("q8x",): an int8-activation kernel
    int8 = bool(variant) and variant[0] in INT8_VARIANTS
    if ws is not None and not int8:
        raise ValueError(f"an int8 workspace was given for {w.qtype} {n}x{k} at {m} rows, whose kernel reads x")
    if int8 and ws is None:
        ws = quantize_x(x)
    nb = _blocks_per_step(w.qtype, n_blk, nb)
    while split > 1 and (n_blk // nb) % split:
        split -= 1
    b = bias if bias is not None else x
    y = torch.empty(split, m, n, device=x.device, dtype=torch.float32) if split > 1 else out
    common = dict(QTYPE=qid, HAS_BIAS=bias is not None, PARTIAL=split > 1, BN=bn, NB=nb, num_warps=warps)
    if m == 1 and variant == ["q8x"]:
        kernel = {"Q4_K": _gemv_q4k_q8x_kernel, "Q6_K": _gemv_q6k_q8x_kernel, "Q8_0": _gemv_q80_q8x_kernel}[w.qtype]
        del common["QTYPE"]
        kernel[(triton.cdiv(n, bn), split)](ws, w.data, b, y, n, k, n_blk // split, w.data.shape[1], x, 1,
                                            0, 0, X_PER_ROW=1, MOE=False, ASM=x.is_cuda, **common, **pdl.launch(x, m))
    elif m == 1:
        _gemv_words_kernel[(triton.cdiv(n, bn), split)](x, w.data, b, y, n, n_blk // split, w.data.shape[1] // 4,
                                                        XBF16=X_PAIRS and x.dtype == torch.bfloat16, **common)
    elif variant == ["q8x"]:  # 2 <= m <= SMALL_MAX: one tile of all the rows
        kernel = {"Q4_K": _qmm_q4k_q8x_kernel, "Q6_K": _qmm_q6k_q8x_kernel, "Q8_0": _qmm_q80_q8x_kernel}[w.qtype]
        extra = {"Q4_K": {"ASM": x.is_cuda, "NB": nb}, "Q6_K": {"NB": nb}}.get(w.qtype, {})
        kernel[(triton.cdiv(n, bn), 1, split)](
            ws, w.data, b, y, m, n, k, n_blk // split, w.data.shape[1] // 4, out.stride(0),
            HAS_BIAS=bias is not None, PARTIAL=split > 1, BM=SMALL_BM if m <= SMALL_BM else SMALL_MAX, BN=bn,
            num_warps=warps, **extra)
    else:
        grid = (triton.cdiv(n, bn), triton.cdiv(m, SMALL_BM), split)
        _qmm_words_kernel[grid](x, w.data, b, y, m, n, n_blk // split, x.stride(0), out.stride(0),
                                w.data.shape[1] // 4, BM=SMALL_BM, **common)
    if split > 1:
        _splitk_sum_kernel[(m, triton.cdiv(n, 1024))](y, b, out, m, n, out.stride(0), SPLIT=split,
                                                      HAS_BIAS=bias is not None, BLOCK=1024, num_warps=4,
                                                      **pdl.launch(x, m))


# The routed experts' per-pair gemvs (pair_gemv): (BN, NB, num_warps) by type. The K-quants' is the fastest of 4
# configs on Qwen3-30B-A3B's experts (gate and up 768 x 2048 Q4_K, down 2048 x 768 Q4_K or Q6_K; `bench moe`, 1 and 4
# rows, CUDA graphs, H100, 2026-12-07): 16.3 / 46.0 us (down Q4_K) and 19.0 / 54.4 us (Q6_K), against 16.9 / 48.5
# and 19.2 / 57.5 for the one-thread-a-super-block kernels at their (16, 8, 1) in the same lease. Q8_0's is the
# dense gemv's default, not measured for experts.
PAIR_CONFIG = {"Q4_K": (8, 4, 1), "Q6_K": (8, 4, 1), "Q8_0": (8, 2, 4)}


def pair_ok(w: object) -> bool:
    """Whether `pair_gemv` takes this stacked expert weight (Q4_K, Q6_K or Q8_0 blocks, any row length)."""
    return (isinstance(w, QuantWeight) and w.qtype in WORD_TYPES and w.data.is_contiguous()
            and w.data.data_ptr() % 4 == 0)


def pair_gemv(ws: torch.Tensor, w: QuantWeight, ids: torch.Tensor, rows: int, out: torch.Tensor, x_per_row: int,
              second: QuantWeight | None = None) -> None:
    """out[q, :rows] = x[q // x_per_row] @ W_{ids[q]}.T for every pair q of `ids` (flat), W_e being rows
    e * rows .. (e + 1) * rows of the stacked weight `w` and x given as its int8 workspace `ws` (quantize_x):
    a decode step's routed experts, one gemv per pair (an expert's weight is read once per pair that routes to
    it, the least a step of one row can read). With `second` (w's type and shape, e.g. up beside gate),
    out[q, rows:2 * rows] likewise from it, in the same launch."""
    qid, block = WORD_TYPES[w.qtype]
    pairs, k = ids.numel(), w.cols
    n_blk = k // block
    bn, nb, warps = PAIR_CONFIG[w.qtype]
    w2_off = 0 if second is None else second.data.data_ptr() - w.data.data_ptr()
    if w2_off % 4:
        raise ValueError("the second weight must start a whole number of words from the first")
    kernel = {"Q4_K": _gemv_q4k_q8x_kernel, "Q6_K": _gemv_q6k_q8x_kernel, "Q8_0": _gemv_q80_q8x_kernel}[w.qtype]
    kernel[(triton.cdiv(rows, bn), 1, pairs * (1 if second is None else 2))](
        ws, w.data, out, out, rows, k, n_blk, w.data.shape[1], ids, pairs, out.stride(0), w2_off,
        X_PER_ROW=x_per_row, MOE=True, HAS_BIAS=False, PARTIAL=False, BN=bn,
        NB=_blocks_per_step(w.qtype, n_blk, nb), ASM=ws.is_cuda, num_warps=warps)


def random_weight(qtype: str, n: int, k: int, device: torch.device | str, dtype: torch.dtype) -> QuantWeight:
    """Random blocks of a [n, k] weight with finite fp16 scales (2**-10): what the tuner and `bench qmm` time."""
    data = torch.randint(0, 256, (n, row_bytes(qtype, k)), dtype=torch.uint8, device=device)
    scale = {"Q4_K": (0, 4), "Q6_K": (208, 210), "Q8_0": (0, 2)}[qtype]
    blocks = data.view(-1, FORMATS[qtype][1])
    blocks[:, scale[0]:scale[1]] = torch.tensor([0, 0x14], dtype=torch.uint8, device=device).repeat(
        (scale[1] - scale[0]) // 2)
    return QuantWeight(data, qtype, k, dtype)


def candidates(qtype: str, m: int) -> list[Config]:
    """The launch configs the tuner tries for `m` activation rows: the float kernels', then the int8 ones'."""
    if m == 1:
        return GEMV_CANDIDATES + Q8X_CANDIDATES.get(qtype, [])
    return SMALL_CANDIDATES + SMALL_Q8X_CANDIDATES.get(qtype, [])


def time_candidates(x: torch.Tensor, w: QuantWeight, configs: list[Config], timing: bool = True
                    ) -> list[tuple[Config, float]]:
    """(config, milliseconds) of each config that builds and matches the exact dequantized product (within 2%
    relative, on at most 2,048 weight rows), timed as a CUDA graph replays it, as decode runs: eager timing
    would charge the int8 kernels' second launch (the x quantization) ~20 us of Python and never pick them.
    `timing` False: only checked (0.0 ms)."""
    from triton.testing import do_bench_cudagraph

    n = w.data.shape[0]
    check = min(n, 2048)  # rows compared with the exact reference (bounded memory for an LM head)
    ref = x.float() @ QuantWeight(w.data[:check], w.qtype, w.cols).dequantize().T
    out = torch.empty(x.shape[0], n, device=x.device, dtype=x.dtype)
    timed = []
    for cfg in configs:
        try:
            _launch_words(x, w, None, out, cfg)
        except (CompilationError, OutOfResources):  # a config this GPU / Triton cannot build
            continue
        except Exception as e:  # an internal compiler error: that candidate is skipped
            log.warning("quantized kernel config %s for %s %dx%d failed to build (%s: %s); skipped",
                        cfg, w.qtype, n, w.cols, type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
            continue
        if ((out[:, :check].float() - ref).norm() / ref.norm()).item() > 2e-2:
            continue
        if timing:
            timed.append((cfg, do_bench_cudagraph(lambda c=cfg: _launch_words(x, w, None, out, c), rep=20)))
        else:
            timed.append((cfg, 0.0))
    return timed


def warm_up(shapes: list[tuple[str, int, int]], rows: tuple[int, ...] = (1, SMALL_BM),
            device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16
            ) -> dict[tuple[str, str, int, int], Config]:
    """Compile and tune the word-wise kernels for weights (qtype, out rows, in cols) at `rows` activation rows
    (1: the gemv; more: the small-batch kernel). Call it at start-up, before any CUDA graph is captured: each
    candidate launch config runs on random blocks of the shape, is checked against the exact dequantized
    matmul (a config the compiler got wrong is never kept) and timed; the fastest stays in TUNED, fixed from
    then on. Returns the configs chosen for these shapes."""
    done = {}
    for qtype, n, k in dict.fromkeys(shapes):
        if qtype not in WORD_TYPES or row_bytes(qtype, k) % 4:
            continue
        w = random_weight(qtype, n, k, device, dtype)
        for m in rows:
            timed = time_candidates(torch.randn(m, k, device=device, dtype=dtype), w, candidates(qtype, m))
            if timed:
                kind = _kind(m)
                TUNED[kind, qtype, n, k] = done[kind, qtype, n, k] = min(timed, key=lambda ct: ct[1])[0]
        small = TUNED.get(("small", qtype, n, k))
        if small is not None and time_candidates(torch.randn(SMALL_MAX, k, device=device, dtype=dtype), w, [small],
                                                 timing=False):  # the same config as one 32-row tile
            TUNED["wide", qtype, n, k] = done["wide", qtype, n, k] = small
        del w
    return done


def _launch_fused(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    qtype_id, chunk, nb, part = _TYPES[w.qtype]
    m, k = x.shape
    n = w.data.shape[0]
    b = bias if bias is not None else x
    if m <= SMALL_MAX and _word_ok(x, w, out):
        _launch_words(x, w, bias, out)
        return
    if m == 1 and w.qtype == "Q4_1" and out.stride(1) == 1:
        rows, steps, nwarps = Q4_1_GEMV
        _gemv_q4_1_kernel[(triton.cdiv(n, rows),)](x, w.data, b, out, n, k // 32, w.data.shape[1] // 4,
                                                   HAS_BIAS=bias is not None, BN=rows, NB=steps, num_warps=nwarps)
        return
    if m == 1 and out.stride(1) == 1:
        bn = 4
        _gemv_kernel[(triton.cdiv(n, bn),)](x, w.data, b, out, n, k // chunk, w.data.shape[1], QTYPE=qtype_id,
                                           CHUNK=chunk, NB=nb, L=part, HAS_BIAS=bias is not None, BN=bn,
                                           num_warps=1)
        return
    bm, bn = 16, (16 if n <= 8192 else 32)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _qmm_kernel[grid](x, w.data, b, out, m, n, k // chunk, x.stride(0), out.stride(0), w.data.shape[1],
                      QTYPE=qtype_id, CHUNK=chunk, NB=nb, L=part, HAS_BIAS=bias is not None, BM=bm, BN=bn,
                      num_warps=4)


def dequantize_rows(w: QuantWeight, start: int, stop: int, dtype: torch.dtype,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows start:stop of the weight dequantized on the GPU, [stop - start, cols] in `dtype`."""
    qtype_id, chunk, nb, part = _TYPES[w.qtype]
    rows = stop - start
    y = out if out is not None else torch.empty(rows, w.cols, device=w.data.device, dtype=dtype)
    n_chunks = w.cols // chunk
    grid = (triton.cdiv(rows, 16), triton.cdiv(n_chunks, nb))
    _dequant_kernel[grid](w.data[start:stop], y, rows, n_chunks, w.data.shape[1], QTYPE=qtype_id, CHUNK=chunk,
                          NB=nb, L=part, BN=16, num_warps=4)
    return y


def qmatmul(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
            out: torch.Tensor | None = None, ws: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequantize(w).T (+ bias) -> [M, N] in x's dtype; `out` may be a column slice of a wider
    [M, *] tensor (written through its row stride). `ws`: the rows' int8 workspace, only where int8_x(M, w)
    (then x gives the shape, dtype and device; its values are not read).

    Fused kernels (weight bytes read once, dequantized in registers) for one row, and for up to SMALL_MAX
    rows of the word-wise types; otherwise slices of at most SCRATCH_ELEMS weight elements are dequantized
    into a reused scratch and multiplied by cuBLAS (prefill at tensor-core speed, bounded extra memory).
    A weight that keeps a dense copy runs it where `dense_serves` says (cuBLAS, no dequantizing).
    """
    m, k = x.shape
    n = w.data.shape[0]
    if k != w.cols:
        raise ValueError(f"x has {k} columns, weight {w.cols}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:  # a step with no logit rows: the int8 kernels would read row M - 1 = -1 (an illegal access)
        return out
    if dense_serves(m, w):
        if out.is_contiguous():
            return torch.addmm(bias, x, w.dense.T, out=out) if bias is not None else torch.mm(x, w.dense.T, out=out)
        out.copy_(F.linear(x, w.dense, bias))
        return out
    if ws is not None:
        if not int8_x(m, w):
            raise ValueError(f"an int8 workspace was given for {w.qtype} {n}x{k} at {m} rows, whose kernel reads x")
        _launch_words(x, w, bias, out, ws=ws)
        return out
    if m < PREFILL_ROWS or x.device.type != "cuda" or (m <= SMALL_MAX and _word_ok(x, w, out)):
        _launch_fused(x, w, bias, out)
        return out
    step = max(256, SCRATCH_ELEMS // k // 256 * 256)
    scratch = torch.empty(min(step, n) * k, device=x.device, dtype=x.dtype)
    for start in range(0, n, step):
        stop = min(n, start + step)
        wd = dequantize_rows(w, start, stop, x.dtype, scratch[: (stop - start) * k].view(stop - start, k))
        if stop - start == n and out.is_contiguous():
            torch.mm(x, wd.T, out=out)
        else:
            out[:, start:stop] = x @ wd.T
    if bias is not None:
        out += bias
    return out
