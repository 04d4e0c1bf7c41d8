"""Paged decode attention in Triton: one query row per sequence, keys read straight from the block tables.

The simple path (attention.py) gathers every sequence's keys and values into a
padded tensor and runs `scaled_dot_product_attention`: ~10 kernels and two
full copies of the context per layer. This kernel reads K/V in place through
the block table, keeps the GQA group's query heads together (one K/V load
serves all of them), and splits long contexts across programs
(flash-decoding); a second small kernel merges the splits. It is the CUDA
decode fast path and is tested against the simple path (tests/test_triton_attention.py).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the simple path is used
    triton = None


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _decode_split(
        Q, K, V, BT, POS, ACC, LSE,
        stride_qb, stride_qh, stride_ks, stride_kh, stride_btb,
        stride_ab, stride_as, stride_ah, stride_lb, stride_ls,
        scale, window,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, SLIDING: tl.constexpr, PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        ctx = tl.load(POS + b) + 1  # the new token's K/V is already in the cache
        lo = split * SPLIT
        hi = tl.minimum(lo + SPLIT, ctx)
        if SLIDING:
            lo = tl.maximum(lo, ctx - window)
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
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            # Rows with nothing seen yet keep m = -inf: guard the exponent.
            alpha = tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new))
            p = tl.where(m_new[:, None] == float("-inf"), 0.0, tl.exp(s - m_new[:, None]))
            denom = denom * alpha + tl.sum(p, 1)
            v = tl.load(V + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
            m = m_new
        out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
        lse = tl.where(denom == 0.0, float("-inf"), m + tl.log(tl.where(denom == 0.0, 1.0, denom)))
        rows = g < GROUP
        tl.store(ACC + b * stride_ab + split * stride_as + heads[:, None] * stride_ah + d[None, :], out,
                 mask=rows[:, None])
        tl.store(LSE + b * stride_lb + split * stride_ls + heads, lse, mask=rows)

    @triton.jit
    def _merge_splits(
        ACC, LSE, OUT, stride_ab, stride_as, stride_ah, stride_lb, stride_ls, stride_ob, stride_oh,
        N_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, N_SPLITS)
        d = tl.arange(0, HEAD_DIM)
        lse = tl.load(LSE + b * stride_lb + s * stride_ls + h)
        top = tl.max(lse, 0)
        w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - top))
        acc = tl.load(ACC + b * stride_ab + s[:, None] * stride_as + h * stride_ah + d[None, :])
        out = tl.sum(acc * w[:, None], 0) / tl.sum(w, 0)
        tl.store(OUT + b * stride_ob + h * stride_oh + d, out.to(OUT.dtype.element_ty))


def split_len(max_ctx: int, max_splits: int = 32, min_split: int = 256) -> tuple[int, int]:
    """Tokens per split and number of splits (a power of two) for contexts up to `max_ctx`."""
    n = 1
    while n < max_splits and max_ctx / (2 * n) >= min_split:
        n *= 2
    per = -(-max_ctx // n)
    return per, n


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
) -> torch.Tensor:
    """q [B, Hq, D] (the newest row of each sequence, at `positions`), caches [slots, Hkv, D],
    block_tables [B, blocks] (int64). Returns [B, Hq, D]. Shapes depend only on (B, max_ctx),
    so it can be captured in a CUDA graph."""
    bsz, hq, dim = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    per, n_splits = split_len(max_ctx)
    acc = torch.empty(bsz, n_splits, hq, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(bsz, n_splits, hq, dtype=torch.float32, device=q.device)
    block_n = 64 if dim <= 128 else 32
    _decode_split[(bsz, hkv, n_splits)](
        q, k_cache, v_cache, block_tables, positions, acc, lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        acc.stride(0), acc.stride(1), acc.stride(2), lse.stride(0), lse.stride(1),
        scale, window or 0,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=dim, PAGE=page,
        BLOCK_N=block_n, SPLIT=per, SLIDING=window is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 models get exact fp32 dots
    )
    out = torch.empty_like(q)
    _merge_splits[(bsz, hq)](
        acc, lse, out, acc.stride(0), acc.stride(1), acc.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), N_SPLITS=n_splits, HEAD_DIM=dim,
    )
    return out
