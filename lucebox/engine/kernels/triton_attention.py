"""Paged attention in Triton: keys and values read straight through the block tables.

The simple path (attention.py) gathers every sequence's keys and values into a
padded tensor and runs masked `scaled_dot_product_attention`: a dense mask and
a full copy of the context per layer. These kernels read K/V in place through
the block table and keep the GQA group's query heads together (one K/V load
serves all of them):
- `decode_attention`: one query row per sequence; long contexts are split
  across programs (flash-decoding) and a second small kernel merges the splits;
- `prefill_attention`: q_len rows per sequence (a prefill chunk after a cached
  prefix, a draft block or tree, a DFlash drafter's block: every row sees every
  key, `bidirectional`), flash attention with an online softmax over
  BLOCK_M query x BLOCK_N key tiles; key tiles outside the causal / window
  range are skipped, tiles wholly inside it run without masks; when the query
  tiles alone do not fill the GPU (a short turn after a long cached prefix, a
  verify batch) the keys are split across programs and merged as in decode.
Both are tested against the simple path (tests/test_triton_attention.py,
tests/test_paged_attention.py).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the simple path is used
    triton = None
else:
    from lucebox.engine.kernels import pdl
    from lucebox.engine.kernels.triton_qmm import q8_store_run


LOG2E = 1.4426950408889634


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


def supports(head_dim: int) -> bool:
    """Head dims the kernels take (power-of-two tiles); others use the simple path."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


if triton is not None:

    # Nothing a step varies may change the compiled kernel, or a request waits for a JIT: the split count's
    # strides (n_splits x heads) and the per-step metadata, whose tensors are views into one packed buffer
    # at any offset (Triton specialises pointers on 16-byte alignment and ints on % 16).
    @triton.jit(do_not_specialize=["stride_btb", "window", "stride_ab", "stride_as", "stride_lb"],
                do_not_specialize_on_alignment=["BT", "POS"])
    def _decode_split(
        Q, K, V, KS, VS, BT, POS, ACC, LSE,
        stride_qb, stride_qh, stride_ks, stride_kh, stride_kss, stride_ksh, stride_btb,
        stride_ab, stride_as, stride_ah, stride_lb, stride_ls,
        scale, window,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_N: tl.constexpr, SLIDING: tl.constexpr, PRECISION: tl.constexpr, Q8: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        pdl.enter(PDL)
        # Q8: K/V are int8 rows with an fp16 scale each (KS/VS: the caches seen as fp16, the scale at
        # HEAD_DIM // 2): the key scale multiplies the scores, the value scale the probabilities.
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        ctx = tl.load(POS + b) + 1  # the new token's K/V is already in the cache
        # The keys this row sees, [first, ctx), in equal runs of whole tiles, one a split: balanced on the
        # row's real context, not the graph bucket's (a context just past half its bucket fills every split).
        first = ctx * 0
        if SLIDING:
            first = tl.maximum(ctx - window, 0)
        base = (first // BLOCK_N) * BLOCK_N
        per = tl.cdiv(ctx - base, tl.num_programs(2) * BLOCK_N) * BLOCK_N
        lo = tl.maximum(base + split * per, first)
        hi = tl.minimum(base + (split + 1) * per, ctx)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        heads = kvh * GROUP + g
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=(g < GROUP)[:, None], other=0.0)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        denom = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        start = (lo // BLOCK_N) * BLOCK_N
        for n0 in range(start, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            valid = (n >= lo) & (n < hi)
            block = tl.load(BT + b * stride_btb + n // PAGE, mask=valid, other=0)
            slot = block.to(tl.int64) * PAGE + n % PAGE
            k = tl.load(K + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=valid[:, None], other=0.0)
            if Q8:
                k = k.to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
            if Q8:
                ks = tl.load(KS + slot * stride_kss + kvh * stride_ksh + HEAD_DIM // 2, mask=valid, other=0.0)
                s = s * ks.to(tl.float32)[None, :]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            # Rows with nothing seen yet keep m = -inf: guard the exponent.
            alpha = tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new))
            p = tl.where(m_new[:, None] == float("-inf"), 0.0, tl.exp(s - m_new[:, None]))
            denom = denom * alpha + tl.sum(p, 1)
            v = tl.load(V + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=valid[:, None], other=0.0)
            if Q8:
                vs = tl.load(VS + slot * stride_kss + kvh * stride_ksh + HEAD_DIM // 2, mask=valid, other=0.0)
                pv = (p * vs.to(tl.float32)[None, :]).to(q.dtype)
                v = v.to(q.dtype)
            else:
                pv = p.to(v.dtype)
            acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=PRECISION).to(tl.float32)
            m = m_new
        out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
        lse = tl.where(denom == 0.0, float("-inf"), m + tl.log(tl.where(denom == 0.0, 1.0, denom)))
        rows = g < GROUP
        tl.store(ACC + b * stride_ab + split * stride_as + heads[:, None] * stride_ah + d[None, :], out,
                 mask=rows[:, None])
        tl.store(LSE + b * stride_lb + split * stride_ls + heads, lse, mask=rows)

    @triton.jit
    def _merge_splits(
        ACC, LSE, OUT, WS, stride_ab, stride_as, stride_ah, stride_lb, stride_ls, stride_ob, stride_oh, stride_wsb,
        n_cols, N_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, Q8: tl.constexpr, PDL: tl.constexpr = False,
    ):
        pdl.enter(PDL)
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, N_SPLITS)
        d = tl.arange(0, HEAD_DIM)
        lse = tl.load(LSE + b * stride_lb + s * stride_ls + h)
        top = tl.max(lse, 0)
        w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - top))
        acc = tl.load(ACC + b * stride_ab + s[:, None] * stride_as + h * stride_ah + d[None, :])
        out = (tl.sum(acc * w[:, None], 0) / tl.sum(w, 0)).to(OUT.dtype.element_ty)
        tl.store(OUT + b * stride_ob + h * stride_oh + d, out)
        if Q8:  # this head's 32-column blocks of the row's int8 workspace (the output projection's input)
            q8_store_run(WS + b * stride_wsb, out.to(tl.float32), h * (HEAD_DIM // 32), n_cols, HEAD_DIM // 32)

    @triton.jit
    def _prefill_tile(
        acc, m_i, l_i, q, n0, K, V, KS, VS, bt_row, qpos_seq, kvh, stride_ks, stride_kh, stride_kss, stride_ksh,
        ctx, start, kidx, qpos, bits, qk_scale, window, d,
        BLOCK_N: tl.constexpr, PAGE: tl.constexpr, MASKED: tl.constexpr, HAS_TREE: tl.constexpr,
        SLIDING: tl.constexpr, PRECISION: tl.constexpr, Q8: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):
        """One BLOCK_N key tile of the online softmax; MASKED=False for tiles every row sees whole."""
        n = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            kv_ok = n < ctx
            block = tl.load(bt_row + n // PAGE, mask=kv_ok, other=0)
        else:
            block = tl.load(bt_row + n // PAGE)
        slot = block.to(tl.int64) * PAGE + n % PAGE
        k_ptr = K + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :]
        v_ptr = V + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :]
        if MASKED:
            k = tl.load(k_ptr, mask=kv_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptr)
        if Q8:
            k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * qk_scale
        if Q8:  # the rows' fp16 scales (the caches seen as fp16: element HEAD_DIM // 2 of a row)
            ks_ptr = KS + slot * stride_kss + kvh * stride_ksh + HEAD_DIM // 2
            vs_ptr = VS + slot * stride_kss + kvh * stride_ksh + HEAD_DIM // 2
            if MASKED:
                k_sc = tl.load(ks_ptr, mask=kv_ok, other=0.0).to(tl.float32)
                v_sc = tl.load(vs_ptr, mask=kv_ok, other=0.0).to(tl.float32)
            else:
                k_sc = tl.load(ks_ptr).to(tl.float32)
                v_sc = tl.load(vs_ptr).to(tl.float32)
            s = s * k_sc[None, :]
        if MASKED:
            ok = kv_ok[None, :] & (n[None, :] <= kidx[:, None])
            rel = n - start
            if HAS_TREE:
                shift = tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)
                bit = (bits[:, None] >> shift[None, :]) & 1
                ok = ok & ((rel < 0)[None, :] | (bit != 0))
            if SLIDING:
                if HAS_TREE:  # a tree row's key position is that row's position
                    k_pos = tl.where(rel >= 0, tl.load(qpos_seq + rel, mask=(rel >= 0) & kv_ok, other=0), n)
                else:
                    k_pos = n
                ok = ok & ((qpos[:, None] - k_pos[None, :]) < window)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # Rows with nothing seen yet keep m = -inf: subtract 0 instead (their alpha and p are 0).
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_sub)
            p = tl.exp2(s - m_sub[:, None])
            v = tl.load(v_ptr, mask=kv_ok[:, None], other=0.0)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            v = tl.load(v_ptr)
        l_i = l_i * alpha + tl.sum(p, 1)
        if Q8:
            pv = (p * v_sc[None, :]).to(q.dtype)
            v = v.to(q.dtype)
        else:
            pv = p.to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=PRECISION).to(tl.float32)
        return acc, m_new, l_i

    @triton.jit(do_not_specialize=["stride_btb", "q_len", "window", "n_splits", "stride_ab", "stride_as",
                                   "stride_lb", "stride_ls"],
                do_not_specialize_on_alignment=["BT", "CTX", "QPOS", "TREE", "QLENS", "QSTART", "TILES"])
    def _prefill(
        Q, K, V, KS, VS, OUT, BT, CTX, QPOS, TREE, ACC, LSE, QLENS, QSTART, TILES,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_ks, stride_kh, stride_kss, stride_ksh, stride_btb,
        stride_ab, stride_as, stride_ah, stride_lb, stride_ls,
        q_len, qk_scale, window, n_splits,
        GROUP: tl.constexpr, QT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, HAS_TREE: tl.constexpr, SLIDING: tl.constexpr,
        SPLIT_KV: tl.constexpr, PRECISION: tl.constexpr, Q8: tl.constexpr, RAGGED: tl.constexpr,
        BIDIR: tl.constexpr,
    ):
        # A tile is QT query rows x the GROUP query heads of one KV head: m = row * GROUP + head.
        # SPLIT_KV: program (tile, seq * n_splits + split) covers the split-th of n_splits runs of the tile's
        # keys and writes a partial result for `_merge_splits` (long contexts with few query tiles fill the GPU).
        # RAGGED: sequence s brings QLENS[s] rows from row QSTART[s]; program (i, split, kvh) runs the query
        # tile TILES[i] = seq << 32 | tile, listed by the host for every tile of every sequence (-1: padding,
        # for a grid fixed by a CUDA graph), so no program is spent on a short sequence's missing tiles.
        kvh = tl.program_id(2)
        if RAGGED:
            item = tl.load(TILES + tl.program_id(0))
            if item < 0:
                return
            seq = (item >> 32).to(tl.int32)
            tile = (item & 0xFFFFFFFF).to(tl.int32)
            split = tl.program_id(1)
            q_len = tl.load(QLENS + seq)
            row0 = tl.load(QSTART + seq)
        else:
            tile = tl.program_id(0)
            seq = tl.program_id(1) // n_splits
            split = tl.program_id(1) % n_splits
            row0 = seq * q_len
        m = tl.arange(0, BLOCK_M)
        r = tile * QT + m // GROUP
        row_ok = (m // GROUP < QT) & (r < q_len)
        t = (row0 + r).to(tl.int64)
        heads = kvh * GROUP + m % GROUP
        d = tl.arange(0, HEAD_DIM)
        ctx = tl.load(CTX + seq)
        start = ctx - q_len  # slot index of the sequence's first new row
        if BIDIR:  # every row sees every key of the sequence, the block's later rows too
            kidx = ctx - 1 + r * 0
        else:
            kidx = start + r  # each row sees key indices <= its own
        q = tl.load(Q + t[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=row_ok[:, None],
                    other=0.0)
        r_lo = tile * QT
        hi = start + tl.minimum(r_lo + QT, q_len)  # keys [0, hi) cover every row of the tile
        full_hi = start + r_lo + 1  # keys < full_hi: causally visible to every row of the tile
        if BIDIR:
            hi = ctx
            full_hi = ctx
        bits = tl.zeros([BLOCK_M], tl.int64)
        if HAS_TREE:
            full_hi = tl.minimum(full_hi, start)
            bits = tl.load(TREE + t, mask=row_ok, other=0)
        qpos = kidx.to(tl.int64)
        lo = start * 0
        full_lo = start * 0
        if SLIDING:
            qpos = tl.load(QPOS + t, mask=row_ok, other=0)
            lo = tl.maximum(tl.min(tl.where(row_ok, qpos, ctx + window), 0) - window + 1, 0)
            full_lo = tl.maximum(tl.max(tl.where(row_ok, qpos, 0), 0) - window + 1, 0)
        # Masked tiles [lo_t, a), whole tiles [a, b), masked tiles [b, hi).
        lo_t = (lo // BLOCK_N) * BLOCK_N
        a = tl.minimum(((full_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, hi)
        b = tl.maximum((full_hi // BLOCK_N) * BLOCK_N, a)
        if SPLIT_KV:  # the tile's keys [lo_t, hi) in equal runs of whole tiles (aligned), one a split: balanced
            # on the real context, not the bucket's max_ctx the grid was sized for
            per = tl.cdiv(hi - lo_t, n_splits * BLOCK_N) * BLOCK_N
            k_lo = lo_t + split * per
            k_hi = k_lo + per
            lo_t = tl.minimum(tl.maximum(lo_t, k_lo), k_hi)
            a = tl.minimum(tl.maximum(a, k_lo), k_hi)
            b = tl.minimum(tl.maximum(b, k_lo), k_hi)
            hi = tl.minimum(tl.maximum(hi, k_lo), k_hi)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        bt_row = BT + seq * stride_btb
        qpos_seq = QPOS + row0
        for n0 in range(lo_t, a, BLOCK_N):
            acc, m_i, l_i = _prefill_tile(acc, m_i, l_i, q, n0, K, V, KS, VS, bt_row, qpos_seq, kvh, stride_ks,
                                          stride_kh, stride_kss, stride_ksh,
                                          ctx, start, kidx, qpos, bits, qk_scale, window, d, BLOCK_N, PAGE, True,
                                          HAS_TREE, SLIDING, PRECISION, Q8, HEAD_DIM)
        for n0 in range(a, b, BLOCK_N):
            acc, m_i, l_i = _prefill_tile(acc, m_i, l_i, q, n0, K, V, KS, VS, bt_row, qpos_seq, kvh, stride_ks,
                                          stride_kh, stride_kss, stride_ksh,
                                          ctx, start, kidx, qpos, bits, qk_scale, window, d, BLOCK_N, PAGE, False,
                                          HAS_TREE, SLIDING, PRECISION, Q8, HEAD_DIM)
        for n0 in range(b, hi, BLOCK_N):
            acc, m_i, l_i = _prefill_tile(acc, m_i, l_i, q, n0, K, V, KS, VS, bt_row, qpos_seq, kvh, stride_ks,
                                          stride_kh, stride_kss, stride_ksh,
                                          ctx, start, kidx, qpos, bits, qk_scale, window, d, BLOCK_N, PAGE, True,
                                          HAS_TREE, SLIDING, PRECISION, Q8, HEAD_DIM)
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        if SPLIT_KV:
            lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)  # natural log
            tl.store(ACC + t[:, None] * stride_ab + split * stride_as + heads[:, None] * stride_ah + d[None, :], out,
                     mask=row_ok[:, None])
            tl.store(LSE + t * stride_lb + split * stride_ls + heads, lse, mask=row_ok)
        else:
            tl.store(OUT + t[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                     out.to(OUT.dtype.element_ty), mask=row_ok[:, None])


def _scale_args(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int, bool]:
    """The scale pointers and strides of a q8_0 cache (its fp16 view), or placeholders for a float cache."""
    if k_cache.dtype != torch.int8:
        return k_cache, v_cache, 0, 0, False
    ks, vs = k_cache.view(torch.float16), v_cache.view(torch.float16)
    return ks, vs, ks.stride(0), ks.stride(1), True


def decode_splits(max_ctx: int, programs: int = 1, target: int = 256, max_splits: int = 64,
                  min_split: int = 64) -> int:
    """Key splits (a power of two) for contexts up to `max_ctx`, when `programs` (batch x KV heads) each
    take one: split until about `target` programs run (the H200 has 132 SMs) or a split of `max_ctx` is
    down to `min_split` tokens (the kernel divides each row's real context among the splits). A decode step
    is a chain of dependent key tiles per program, so few long programs are slow: a Qwen3-30B-A3B step
    (4 KV heads, batch 1, a 512-token bucket) took 12 us a layer in 2 splits of 256 tokens (the old rule,
    splits of at least 256 tokens whatever the batch). One split in the 256-token bucket (no merge launch; the
    kernel writing its output directly) made a SmolLM2 step 0.96 -> 0.90 ms at 32 tokens but 0.96 -> 1.04 ms at
    200 (H100, stop 57), and writing directly where this rule gives one split (batch 128) gained nothing
    measurable: the merge stays."""
    n = 1
    while n < max_splits and max_ctx / (2 * n) >= min_split and programs * n < target:
        n *= 2
    return n


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    *,
    page: int,
    scale: float,
    max_ctx: int,
    window: int | None = None,
    ws: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] (the newest row of each sequence, at `positions`), caches [slots, Hkv, D],
    block_tables [B, blocks] (int64). Returns [B, Hq, D]. Shapes depend only on (B, max_ctx),
    so it can be captured in a CUDA graph. A q8_0 cache is int8 [slots, Hkv, D + 2] (kv_quant).
    `ws` (triton_qmm.workspace of B rows of Hq * D; D a multiple of 32): also filled with the output rows'
    int8 workspace by the merge kernel, for an output projection on the int8-activation kernels."""
    bsz, hq, dim = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    n_splits = decode_splits(max_ctx, programs=bsz * hkv)
    acc = torch.empty(bsz, n_splits, hq, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(bsz, n_splits, hq, dtype=torch.float32, device=q.device)
    block_n = 64 if dim <= 128 else 32
    ks, vs, stride_kss, stride_ksh, q8 = _scale_args(k_cache, v_cache)
    _decode_split[(bsz, hkv, n_splits)](
        q, k_cache, v_cache, ks, vs, block_tables, positions, acc, lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), stride_kss, stride_ksh,
        block_tables.stride(0),
        acc.stride(0), acc.stride(1), acc.stride(2), lse.stride(0), lse.stride(1),
        scale, window or 0,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=dim, PAGE=page,
        BLOCK_N=block_n, SLIDING=window is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 models get exact fp32 dots
        Q8=q8, **pdl.launch(q, bsz),
    )
    out = torch.empty_like(q)
    if ws is not None and (dim % 32 or ws.shape != (bsz, hq * dim // 4 + hq * dim // 8) or ws.stride(1) != 1):
        raise ValueError(f"decode_attention: an int8 workspace {tuple(ws.shape)} for {bsz} rows of {hq} x {dim}")
    _merge_splits[(bsz, hq)](
        acc, lse, out, out if ws is None else ws, acc.stride(0), acc.stride(1), acc.stride(2), lse.stride(0),
        lse.stride(1), out.stride(0), out.stride(1), 0 if ws is None else ws.stride(0), hq * dim,
        N_SPLITS=n_splits, HEAD_DIM=dim, Q8=ws is not None, **pdl.launch(q, bsz),
    )
    return out


def _prefill_config(dim: int, dtype: torch.dtype, rows: int, group: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): fixed per shape so nothing autotunes while serving.

    Measured on the H200 (bf16, 32/8 heads, dim 128): 128x128 tiles, 8 warps, 3 stages run a 2048-row
    chunk after 16K cached tokens in 1.73 ms a layer (128x64: 2.08 ms); short groups use 64-row tiles."""
    if dtype == torch.float32 or dim > 128:  # fp32 or 256-wide heads: smaller tiles, same shared memory
        block_m, block_n, warps, stages = (32 if dtype == torch.float32 and dim > 128 else 64), 32, 4, 2
    else:
        block_m, block_n, warps, stages = 128, 128, 8, 3
    block_m = max(16, triton.next_power_of_2(group), min(block_m, triton.next_power_of_2(rows)))
    if block_m < 128 and block_n == 128:
        block_n, warps = 64, 4
    return block_m, block_n, warps, stages


def ragged_config(dim: int, dtype: torch.dtype, group: int) -> tuple[int, int, int, int]:
    """The ragged group's tile config: one per (dim, dtype, group), whatever the chunks' lengths, so the host
    can list the tiles (`ragged_tiles`) before the launch and a CUDA graph can hold the launch."""
    return _prefill_config(dim, dtype, 1 << 20, group)


def ragged_tiles(q_lens: Sequence[int], tile_rows: int, pad_to: int = 0) -> np.ndarray:
    """[max(tiles, pad_to)] int64 `seq << 32 | tile` for every query tile of every sequence, -1 after them.
    `tile_rows`: query rows per tile, ragged_config's BLOCK_M // group."""
    items = [(s << 32) | t for s, n in enumerate(q_lens) for t in range(-(-n // tile_rows))]
    out = np.full(max(len(items), pad_to), -1, dtype=np.int64)
    out[: len(items)] = items
    return out


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def kv_splits(device: torch.device, programs: int, max_ctx: int, warps: int) -> int:
    """Key splits (a power of two) for a grid of `programs`: split only when the query tiles leave SMs idle
    and splitting shortens the last wave by a quarter or more (the merge is not free), never below 128 keys
    a split of the bucket's shortest context (half of `max_ctx`; the kernel divides each tile's real keys):
    a 16-row verify block in the 2K-token bucket runs 8 splits (~130 keys each at 1K tokens), in the
    256-token bucket none (a merge launch a layer costs more than the split saves there). One on the CPU
    (the interpreter)."""
    if device.type != "cuda":
        return 1
    slots = _sm_count(device) * (1 if warps >= 8 else 2)  # programs resident at once
    best, best_cost, n = 1, 1.0, 2
    while n <= 16 and max_ctx / (2 * n) >= 128:
        cost = -(-programs * n // slots) / n / -(-programs // slots)  # waves x work per program, vs no split
        if cost < 0.75 * best_cost:
            best, best_cost = n, cost
        n *= 2
    return best


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    q_pos: torch.Tensor,
    tree: torch.Tensor | None,
    *,
    q_len: int,
    max_ctx: int,
    page: int,
    scale: float,
    window: int | None = None,
    splits: int | None = None,
    q_lens: torch.Tensor | None = None,
    q_starts: torch.Tensor | None = None,
    tiles: torch.Tensor | None = None,
    bidirectional: bool = False,
) -> torch.Tensor:
    """q [n_seqs * q_len, Hq, D]: q_len new rows per sequence, sequence s's rows in cache slot indices
    ctx_lens[s] - q_len ..; caches [slots, Hkv, D]; block_tables [n_seqs, blocks] int64; q_pos [rows]
    positions; tree [rows] int64 ancestor bits or None (causal); `bidirectional`: no tree, every row sees
    every key < ctx_lens[s] (a DFlash drafter's block); max_ctx >= every ctx_lens. `splits`
    (a power of two) overrides `kv_splits`. Returns [rows, Hq, D]. The grid depends only on
    (n_seqs, q_len, max_ctx), so it can be captured in a CUDA graph.

    Ragged (every prefill chunk of a step in one launch): `q_lens` [n_seqs] rows of each sequence, from row
    `q_starts` [n_seqs] of q, and `tiles` (`ragged_tiles`) its query tiles; q_len is then the longest, and
    the grid depends only on len(tiles) and max_ctx (no tree)."""
    rows, hq, dim = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    ragged = q_lens is not None
    assert not (ragged and tree is not None), "draft trees are never ragged"
    assert not (bidirectional and (ragged or tree is not None)), "a bidirectional group is one block per sequence"
    assert ragged == (tiles is not None) == (q_starts is not None), "a ragged group needs q_lens, q_starts, tiles"
    n_seqs = 1 if ragged else rows // q_len
    block_m, block_n, warps, stages = (ragged_config(dim, q.dtype, group) if ragged
                                       else _prefill_config(dim, q.dtype, q_len * group, group))
    qt = block_m // group
    n_tiles = tiles.shape[0] if ragged else triton.cdiv(q_len, qt)
    n_splits = splits or kv_splits(q.device, n_tiles * n_seqs * hkv, max_ctx, warps)
    out = torch.empty(rows, hq, dim, dtype=q.dtype, device=q.device)
    if n_splits > 1:
        acc = torch.empty(rows, n_splits, hq, dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(rows, n_splits, hq, dtype=torch.float32, device=q.device)
    else:
        acc, lse = out, out  # unused
    ks, vs, stride_kss, stride_ksh, q8 = _scale_args(k_cache, v_cache)
    _prefill[(n_tiles, n_seqs * n_splits, hkv)](
        q, k_cache, v_cache, ks, vs, out, block_tables, ctx_lens, q_pos, tree if tree is not None else q_pos, acc,
        lse, q_lens if ragged else ctx_lens, q_starts if ragged else ctx_lens, tiles if ragged else ctx_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        stride_kss, stride_ksh,
        block_tables.stride(0), acc.stride(0), acc.stride(1), acc.stride(2), lse.stride(0), lse.stride(1),
        q_len, scale * LOG2E, window or 0, n_splits,
        GROUP=group, QT=qt, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=dim, PAGE=page,
        HAS_TREE=tree is not None, SLIDING=window is not None, SPLIT_KV=n_splits > 1,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", Q8=q8, RAGGED=ragged, BIDIR=bidirectional,
        num_warps=warps, num_stages=stages,
    )
    if n_splits > 1:
        _merge_splits[(rows, hq)](
            acc, lse, out, out, acc.stride(0), acc.stride(1), acc.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1), 0, hq * dim, N_SPLITS=n_splits, HEAD_DIM=dim, Q8=False,
        )
    return out


def warm_up(k_cache: torch.Tensor, v_cache: torch.Tensor, *, num_heads: int, page: int, scale: float,
            max_rows: int, window: int | None = None, tree: bool = False, context: int = 8192,
            dtype: torch.dtype | None = None, bidirectional: bool = False) -> int:
    """Compile every `prefill_attention` variant a step can reach for this model, at start-up.

    A variant is fixed by the tile config (`_prefill_config` of the group's rows: one query length per
    config it can return for 2..max_rows), whether the keys are split (and the split count's power of two),
    the tree bits and the window; runtime ints and metadata pointers are not specialised. Synthetic groups
    read scratch block 0 only. Returns the number of launches. `dtype`: the compute dtype (default the
    cache's; required for a q8_0 cache). `bidirectional`: instead, a DFlash drafter's block attention, blocks
    of `max_rows` rows."""
    dev, dtype = k_cache.device, dtype or k_cache.dtype
    dim = k_cache.shape[2] - (2 if k_cache.dtype == torch.int8 else 0)
    group = num_heads // k_cache.shape[1]
    by_config: dict[tuple[int, int, int, int], int] = {}
    for q_len in range(max_rows if bidirectional else 2, max(2, max_rows) + 1):
        by_config.setdefault(_prefill_config(dim, dtype, q_len * group, group), q_len)
    lens = sorted(by_config.values())
    max_ctx = max_rows + context  # keys behind the longest chunk
    tables = torch.zeros(1, -(-max_ctx // page), dtype=torch.long, device=dev)
    launches = 0
    for q_len in lens:
        q = torch.zeros(q_len, num_heads, dim, dtype=dtype, device=dev)
        pos = torch.arange(max_ctx - q_len, max_ctx, device=dev)
        ctx = torch.tensor([max_ctx], device=dev)
        bits = [None]
        if tree and q_len <= 64 and not bidirectional:
            bits.append(torch.full((q_len,), -1, dtype=torch.long, device=dev))
        for w in ([None, window] if window else [None]):
            for t in bits:
                for splits in (1, 2, 4, 8, 16):  # SPLIT_KV, and _merge_splits per split count
                    prefill_attention(q, k_cache, v_cache, tables, ctx, pos, t, q_len=q_len, max_ctx=max_ctx,
                                      page=page, scale=scale, window=w, splits=splits, bidirectional=bidirectional)
                    launches += 1
    if bidirectional:
        return launches
    # The ragged group (a step's prefill chunks in one launch): one tile config, each window and split count.
    one = torch.tensor([q_len], device=dev)
    tiles = torch.from_numpy(ragged_tiles([q_len], ragged_config(dim, dtype, group)[0] // group)).to(dev)
    for w in ([None, window] if window else [None]):
        for splits in (1, 2, 4, 8, 16):
            prefill_attention(q, k_cache, v_cache, tables, ctx, pos, None, q_len=q_len, max_ctx=max_ctx, page=page,
                              scale=scale, window=w, splits=splits, q_lens=one, q_starts=one * 0, tiles=tiles)
            launches += 1
    return launches
