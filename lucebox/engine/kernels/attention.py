"""Attention over the paged KV cache: the one function every model layer calls.

A step's tokens are laid out flat ([T, heads, head_dim]) and split into
groups. A group is `n_seqs` sequences that each bring `q_len` new rows:
- the batched group: every decoding sequence (q_len 1), or every sequence
  verifying a draft block / tree (q_len = block or tree size);
- one group per prefill chunk (n_seqs 1, q_len = chunk length), or, where
  the Triton kernels run, one ragged group of every prefill chunk of the step
  (`q_lens` rows each, from row `q_starts`, its query tiles listed in
  `tiles`): one launch per layer instead of one per chunk, which a step
  admitting many prompts needs, and a grid a CUDA graph can hold.
A group is described compactly, the same way on every path: each sequence's
block table and context length, each row's position, and for draft trees a
bitmask of each row's ancestors within the block. Row i of sequence s sits in
cache slot index `ctx[s] - q_len + i` and sees key index k when k <= that
index (index-causal), k is an ancestor of the row or before the block (trees),
and `q_pos - k_pos < window` on sliding layers (a key's position is its
index, or for a tree row in the block that row's position). A bidirectional
group (a DFlash drafter's block) is not causal: every row sees every key index
< ctx, and its `q_pos` is the position the window is measured from.

On CUDA (with Triton) the kernels in triton_attention.py read K/V straight
through the block tables: the decode kernel for one-row groups, a flash
kernel for the rest. A fresh prompt (nothing cached before it) attends to its
own new rows with SDPA `is_causal`, which lets CUDA pick its flash kernel.
Elsewhere the reference path builds the slot index and dense mask from the
same metadata on the device (vectorized, once per step per group) and runs
one `scaled_dot_product_attention`: the simple, correct path the kernels are
tested against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from lucebox.engine.kernels import kv_quant, triton_attention

MAX_TREE_ROWS = 64  # a draft tree's ancestor sets are int64 bitmasks


@dataclass
class AttnGroup:
    row_start: int  # first flat row of the group
    n_seqs: int
    q_len: int  # rows per sequence
    max_ctx: int  # longest context in the group (host int: the reference path's dense width)
    block_tables: torch.Tensor  # [n_seqs, blocks] int64, padded with scratch block 0
    ctx_lens: torch.Tensor  # [n_seqs] keys per sequence (its cached context + its new rows)
    q_pos: torch.Tensor  # [n_seqs * q_len] position of each row
    tree: torch.Tensor | None = None  # [n_seqs * q_len] int64 ancestor-or-self bits within the block
    fresh: bool = False  # nothing cached before: the rows attend only to each other, causally
    bidirectional: bool = False  # every row sees every key < ctx_lens (a drafter's block; no tree, not fresh)
    q_lens: torch.Tensor | None = None  # ragged group (Triton only): [n_seqs] rows of each sequence
    q_starts: torch.Tensor | None = None  # ragged group: [n_seqs] first row of each sequence, from row_start
    tiles: torch.Tensor | None = None  # ragged group: its query tiles (triton_attention.ragged_tiles)
    n_rows: int = 0  # ragged group: its rows (sum of q_lens); else n_seqs * q_len
    _dense: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot each new row's K/V is written to
    page: int  # KV block size
    groups: list[AttnGroup] = field(default_factory=list)
    window: int | None = None  # sliding-window size of the sliding layers


def tree_bits(parents: list[int]) -> np.ndarray:
    """[n] int64: bit j of row i is set when block row j is row i or one of its ancestors.

    Parents precede children (-1 = the root); a chain is parents [-1, 0, 1, ...]."""
    n = len(parents)
    if n > MAX_TREE_ROWS:
        raise ValueError(f"draft trees are limited to {MAX_TREE_ROWS} rows (got {n}): lower the DDTree budget")
    bits = [0] * n
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(f"tree row {i} has parent {p}: parents must precede children")
        bits[i] = (1 << i) | (bits[p] if p >= 0 else 0)
    return np.array(bits, dtype=np.uint64).view(np.int64)


def pad_tables(tables: Sequence[Sequence[int] | np.ndarray], n_blocks: int, rows: int | None = None) -> np.ndarray:
    """[rows, n_blocks] int64 block tables on the host, cut or padded with scratch block 0."""
    out = np.zeros((len(tables) if rows is None else rows, n_blocks), dtype=np.int64)
    for i, t in enumerate(tables):
        t = t[:n_blocks]
        out[i, : len(t)] = t
    return out


def slot_index(block_tables: torch.Tensor, ctx: int, page: int) -> torch.Tensor:
    """[n, ctx] cache slot of key positions 0..ctx-1 of each table (on the tables' device).

    Positions past a table's end map into block 0 (scratch); callers mask them."""
    kp = torch.arange(ctx, device=block_tables.device)
    return block_tables[:, kp // page] * page + kp % page


def dense_mask(g: AttnGroup, page: int, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's slot index [n, max_ctx] and mask [n, 1, q_len, max_ctx] (True = may attend),
    built on the device from the compact metadata; cached on the group for the step's other layers."""
    hit = g._dense.get(window)
    if hit is not None:
        return hit
    n, ql, c = g.n_seqs, g.q_len, g.max_ctx
    dev = g.block_tables.device
    kp = torch.arange(c, device=dev)
    start = g.ctx_lens - ql  # [n] slot index of each sequence's first new row
    rel = kp[None, :] - start[:, None]  # [n, c] key index relative to the block
    last = g.ctx_lens[:, None].expand(n, ql) - 1 if g.bidirectional else start[:, None] + torch.arange(ql, device=dev)
    allowed = kp[None, None, :] <= last[:, :, None]  # [n, q, c]
    in_block = rel >= 0
    if g.tree is not None:
        bit = (g.tree.view(n, ql)[:, :, None] >> rel.clamp(0, MAX_TREE_ROWS - 1)[:, None, :]) & 1
        allowed &= ~in_block[:, None, :] | (bit != 0)
    if window is not None:
        q_pos = g.q_pos.view(n, ql)
        k_pos = kp[None, :].expand(n, c)
        if g.tree is not None:
            k_pos = torch.where(in_block, q_pos.gather(1, rel.clamp(0, ql - 1)), k_pos)
        allowed &= (q_pos[:, :, None] - k_pos[:, None, :]) < window
    out = g._dense[window] = (slot_index(g.block_tables, c, page), allowed[:, None])
    return out


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding: bool,
    write_kv: bool = True,
    ws: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] for the new rows; caches [slots, Hkv, D].

    Writes the new K/V into the cache (unless a fused kernel already did:
    `write_kv=False`), returns the attention output [T, Hq, D]. `ws` (an int8 workspace of T rows of Hq * D,
    layers.int8_input): also filled with the output's, for an output projection that reads it as int8 (the
    decode kernel writes it as it stores the rows; other paths quantize their output after).
    A q8_0 cache (int8 [slots, Hkv, D + 2], kv_quant) is written quantized and read dequantized: every path,
    a fresh prompt included, attends to the quantized K/V, so cached and uncached prefixes give one result.
    """
    q8 = kv_quant.is_q8(k_cache)
    if q8:
        assert write_kv, "a q8_0 cache is written here (quantized), never by a fused kernel"
        k_cache.index_copy_(0, meta.slot_mapping, kv_quant.quantize(k))
        v_cache.index_copy_(0, meta.slot_mapping, kv_quant.quantize(v))
    elif write_kv:
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
    kernel = triton_attention.available(q.device) and triton_attention.supports(q.shape[2])
    window = meta.window if sliding else None
    if len(meta.groups) == 1:
        return attend_group(q, k, v, k_cache, v_cache, meta.groups[0], meta.page, scale, window, kernel, ws)
    return torch.cat([attend_group(q, k, v, k_cache, v_cache, g, meta.page, scale, window, kernel, ws)
                      for g in meta.groups])


def attend_group(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    g: AttnGroup,
    page: int,
    scale: float,
    window: int | None,
    kernel: bool,
    ws: torch.Tensor | None = None,
) -> torch.Tensor:
    """One group's output [n_seqs * q_len, Hq, D]: the Triton kernels (`kernel`) or the SDPA reference; `ws`
    (the step's rows) gets the group's rows' int8 workspace (paged_attention)."""
    rows = slice(g.row_start, g.row_start + (g.n_rows or g.n_seqs * g.q_len))
    ws = None if ws is None else ws[rows]
    out, wrote_ws = _attend_group(q, k, v, k_cache, v_cache, g, rows, page, scale, window, kernel, ws)
    if ws is not None and not wrote_ws:
        from lucebox.engine.kernels.triton_qmm import quantize_x  # ws exists only where the kernels do

        quantize_x(out.reshape(out.shape[0], -1), out=ws)
    return out


def _attend_group(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    g: AttnGroup,
    rows: slice,
    page: int,
    scale: float,
    window: int | None,
    kernel: bool,
    ws: torch.Tensor | None,
) -> tuple[torch.Tensor, bool]:
    """attend_group's output, and whether its kernel also wrote `ws` (the decode kernel does)."""
    n, ql = g.n_seqs, g.q_len
    q8 = kv_quant.is_q8(k_cache)
    if g.q_lens is not None:
        assert kernel, "ragged groups are laid out only where the Triton kernels run"
        return triton_attention.prefill_attention(
            q[rows], k_cache, v_cache, g.block_tables, g.ctx_lens, g.q_pos, None, q_len=ql, max_ctx=g.max_ctx,
            page=page, scale=scale, window=window, q_lens=g.q_lens, q_starts=g.q_starts, tiles=g.tiles), False
    if g.fresh and not q8 and (window is None or ql <= window):
        # Own rows only, plain causal: SDPA's flash path on CUDA.
        qg = q[rows].view(n, ql, q.shape[1], q.shape[2]).transpose(1, 2)
        kg = k[rows].view(n, ql, k.shape[1], k.shape[2]).transpose(1, 2)
        vg = v[rows].view(n, ql, v.shape[1], v.shape[2]).transpose(1, 2)
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(n * ql, q.shape[1], q.shape[2]), False
    if kernel:
        if ql == 1:
            merged = ws if q.shape[2] % 32 == 0 else None  # the merge kernel writes whole 32-column blocks a head
            return triton_attention.decode_attention(
                q[rows], k_cache, v_cache, g.block_tables, g.q_pos, page=page, scale=scale,
                max_ctx=g.max_ctx, window=window, ws=merged), merged is not None
        return triton_attention.prefill_attention(
            q[rows], k_cache, v_cache, g.block_tables, g.ctx_lens, g.q_pos, g.tree, q_len=ql, max_ctx=g.max_ctx,
            page=page, scale=scale, window=window, bidirectional=g.bidirectional), False
    gather, mask = dense_mask(g, page, window)
    qg = q[rows].view(n, ql, q.shape[1], q.shape[2]).transpose(1, 2)
    kg, vg = k_cache[gather], v_cache[gather]
    if q8:
        kg, vg = kv_quant.dequantize(kg, q.dtype), kv_quant.dequantize(vg, q.dtype)
    out = F.scaled_dot_product_attention(qg, kg.transpose(1, 2), vg.transpose(1, 2),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(n * ql, q.shape[1], q.shape[2]), False
