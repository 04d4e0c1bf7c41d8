"""Triton kernels: y = x @ W.T (+ b) straight from GGUF blocks, for every type in dequant.FORMATS.

Three paths, by the number of activation rows M (qmatmul picks):
- M = 1 (decode at batch 1): gemv kernels that multiply and reduce in fp32 with no tensor cores; Q4_K and
  Q4_1 read their blocks as int32 words (_gemv_q4k_kernel, _gemv_q4_1_kernel), the other types byte-wise
  through `_part` (_gemv_kernel).
- 1 < M < PREFILL_ROWS: the fused tile kernel (_qmm_kernel): a 16-row activation tile against a few weight
  blocks at a time, dequantized in registers and fed to tensor-core dots.
- M >= PREFILL_ROWS: slices of at most SCRATCH_ELEMS weight elements are dequantized (_dequant_kernel) into
  one reused scratch and multiplied by cuBLAS: tensor-core speed with a bounded buffer, never a dense copy
  of a whole weight.

The bytes are read in the file's layout. Within a block, ggml stores element j and element j + 16 (or
j + 32) in the low and high nibble of one byte; rather than shuffling nibbles back into order, each nibble
plane is multiplied with the matching activation columns (the reduction order is free), so every weight
byte is loaded once. Every launch is shape-only (no host syncs), so decode steps capture into CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lucebox.engine.quant.dequant import FORMATS
from lucebox.engine.quant.qtensor import QuantWeight

# Type id (constexpr in the kernels), elements per chunk (the unit a program steps through), chunks per step,
# elements per part (see _part).
_TYPES = {"Q4_0": (0, 32, 8, 16), "Q4_1": (1, 32, 8, 16), "Q5_0": (2, 32, 8, 16), "Q5_1": (3, 32, 8, 16),
          "Q8_0": (4, 32, 8, 32), "Q4_K": (5, 64, 4, 32), "Q5_K": (6, 64, 4, 32), "Q6_K": (7, 128, 2, 32)}
assert set(_TYPES) == set(FORMATS)


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
def _gemv_q4k_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, n_sb, row_words, HAS_BIAS: tl.constexpr, BN: tl.constexpr,
                     NSB: tl.constexpr):
    """Batch-1 Q4_K: the 144-byte super-blocks read as 36 int32 words (d|dmin, 3 scale words, 32 of nibbles),
    tiles [BN rows, NSB super-blocks, 4 chunks, 8 words]; each word gives 8 nibbles (4 bytes x low/high)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    n_mask = rn < N
    w32 = w_ptr.to(tl.pointer_type(tl.int32))
    row = w32 + rn.to(tl.int64)[:, None, None, None] * row_words
    ci = tl.arange(0, 4)[None, None, :, None]
    wi = tl.arange(0, 8)[None, None, None, :]
    acc = tl.zeros((BN, NSB, 4, 8), dtype=tl.float32)
    for g in range(0, n_sb, NSB):
        sb = g + tl.arange(0, NSB)[None, :, None, None]
        sm = sb < n_sb
        m = n_mask[:, None, None, None] & sm
        base = row + sb * 36
        w0 = tl.load(base, mask=m, other=0)
        d = _h16(w0, 0)
        dmin = _h16(w0, 16)
        s0 = tl.load(base + 1, mask=m, other=0)
        s1 = tl.load(base + 2, mask=m, other=0)
        s2 = tl.load(base + 3, mask=m, other=0)
        q = tl.load(base + 4 + ci * 8 + wi, mask=m, other=0)
        xb = x_ptr + sb * 256 + ci * 64 + wi * 4
        for s in tl.static_range(2):
            idx = 2 * ci + s
            sh = 8 * (idx & 3)
            low = idx < 4
            sc = tl.where(low, (s0 >> sh) & 63, ((s2 >> sh) & 15) | (((s0 >> (sh + 6)) & 3) << 4))
            mn = tl.where(low, (s1 >> sh) & 63, ((s2 >> (sh + 4)) & 15) | (((s1 >> (sh + 6)) & 3) << 4))
            dsc = d * sc.to(tl.float32)
            dmn = dmin * mn.to(tl.float32)
            for b in tl.static_range(4):
                x = tl.load(xb + 32 * s + b, mask=sm, other=0.0).to(tl.float32)
                nib = ((q >> (8 * b + 4 * s)) & 15).to(tl.float32)
                acc += (dsc * nib - dmn) * x
    y = tl.sum(tl.reshape(acc, (BN, NSB * 32)), axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)


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


# Rows from which qmatmul dequantizes bounded slices for cuBLAS instead of running the fused tile kernel.
# Measured on the H200 (Qwen3-8B Q4_K projections): at 2, 4 and 16 rows the slice path streams 274-278 GB/s
# of weights, the fused tl.dot kernel 241-245, so only batch-1 rows (the gemv kernels) stay fused there.
PREFILL_ROWS = 2
SCRATCH_ELEMS = 1 << 25  # 64 MiB of bf16: a few thousand weight rows at a time, never the whole of a big weight


# Batch-1 kernels that read whole int32 words (their blocks are 4-byte aligned): kernel, weight rows per
# program, steps per loop iteration, warps.
# Tuned on the H200 over Qwen3-8B projections (about 790 GB/s each; the byte-wise _gemv_kernel gives 560 for
# Q6_K and ~1.1-1.3 TB/s for Q8_0).
WORD_GEMV = {"Q4_K": (_gemv_q4k_kernel, 2, {"NSB": 1}, 1), "Q4_1": (_gemv_q4_1_kernel, 4, {"NB": 16}, 1)}


def _tiles(m: int, n: int) -> tuple[int, int, int]:
    """(rows per tile, weight rows per tile, warps) of the fused kernel; for m == 1 only BN and warps count."""
    if m == 1:
        return 1, 4, 1
    return 16, (16 if n <= 8192 else 32), 4


def _launch_fused(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    qtype_id, chunk, nb, part = _TYPES[w.qtype]
    m, k = x.shape
    n = w.data.shape[0]
    bm, bn, warps = _tiles(m, n)
    b = bias if bias is not None else x
    if m == 1 and w.qtype in WORD_GEMV and out.stride(1) == 1:
        kernel, rows, steps, nwarps = WORD_GEMV[w.qtype]
        blocks = k // (256 if w.qtype == "Q4_K" else 32)
        kernel[(triton.cdiv(n, rows),)](x, w.data, b, out, n, blocks, w.data.shape[1] // 4,
                                        HAS_BIAS=bias is not None, BN=rows, num_warps=nwarps, **steps)
        return
    if m == 1 and out.stride(1) == 1:
        _gemv_kernel[(triton.cdiv(n, bn),)](x, w.data, b, out, n, k // chunk, w.data.shape[1], QTYPE=qtype_id,
                                           CHUNK=chunk, NB=nb, L=part, HAS_BIAS=bias is not None, BN=bn,
                                           num_warps=warps)
        return
    bm = max(bm, 16)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _qmm_kernel[grid](x, w.data, b, out, m, n, k // chunk, x.stride(0), out.stride(0), w.data.shape[1],
                      QTYPE=qtype_id, CHUNK=chunk, NB=nb, L=part, HAS_BIAS=bias is not None, BM=bm, BN=bn,
                      num_warps=warps)


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
            out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequantize(w).T (+ bias) -> [M, N] in x's dtype; `out` may be a column slice of a wider
    [M, *] tensor (written through its row stride).

    Up to PREFILL_ROWS rows: the fused kernel (weight bytes read once, dequantized in registers). Above:
    slices of at most SCRATCH_ELEMS weight elements are dequantized into a reused scratch and multiplied by
    cuBLAS, so prefill runs at tensor-core speed with a bounded extra buffer instead of a dense copy.
    """
    m, k = x.shape
    n = w.data.shape[0]
    if k != w.cols:
        raise ValueError(f"x has {k} columns, weight {w.cols}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m < PREFILL_ROWS or x.device.type != "cuda":
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
