"""Attention over the paged KV cache: the one function every model layer calls.

A step's tokens are laid out flat ([T, heads, head_dim]) and split into
groups. A group is `n_seqs` sequences that each bring `q_len` new rows:
- the batched group: every decoding sequence (q_len 1), or every sequence
  verifying a draft block / tree (q_len = block or tree size);
- one group per prefill chunk (n_seqs 1, q_len = chunk length).
Per group the keys are gathered from the cache by a precomputed slot index,
the mask (causal, sliding window, tree) is precomputed once per step, and one
`scaled_dot_product_attention` call does the work. A fresh prefill (nothing
cached before it) attends to its own new rows with `is_causal`, which lets
CUDA pick the flash kernel.

This is the simple, correct path on every device; fast paths must match it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttnGroup:
    row_start: int
    n_seqs: int
    q_len: int
    # [n_seqs, ctx] cache slots to attend to; None = only this group's own new rows.
    gather: torch.Tensor | None = None
    # [n_seqs, 1, q_len, ctx] True = may attend; None = plain causal over own rows.
    mask: torch.Tensor | None = None
    mask_sliding: torch.Tensor | None = None


@dataclass
class DecodeBatch:
    """Every row is one sequence's newest token: the paged decode kernel's inputs."""

    block_tables: torch.Tensor  # [B, blocks] int64
    positions: torch.Tensor  # [B] position of each row
    max_ctx: int  # context bucket (static shapes for CUDA graphs)
    page: int  # KV block size


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot each new row's K/V is written to
    groups: list[AttnGroup] = field(default_factory=list)
    decode: DecodeBatch | None = None  # set: use the Triton decode kernel instead of `groups`
    window: int | None = None  # sliding-window size, for the decode kernel


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
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] for the new rows; caches [slots, Hkv, D].

    Writes the new K/V into the cache (unless a fused kernel already did:
    `write_kv=False`), returns the attention output [T, Hq, D].
    """
    if write_kv:
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
    if meta.decode is not None:
        from lucebox.engine.triton_attention import decode_attention

        d = meta.decode
        return decode_attention(q, k_cache, v_cache, d.block_tables, d.positions, page=d.page, scale=scale,
                                max_ctx=d.max_ctx, window=meta.window if sliding else None)
    if len(meta.groups) == 1:
        return _attend_group(q, k, v, k_cache, v_cache, meta.groups[0], scale, sliding)
    return torch.cat([_attend_group(q, k, v, k_cache, v_cache, g, scale, sliding) for g in meta.groups])


def _attend_group(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    g: AttnGroup,
    scale: float,
    sliding: bool,
) -> torch.Tensor:
    rows = slice(g.row_start, g.row_start + g.n_seqs * g.q_len)
    n, ql = g.n_seqs, g.q_len
    qg = q[rows].view(n, ql, q.shape[1], q.shape[2]).transpose(1, 2)
    if g.gather is None:
        kg = k[rows].view(n, ql, k.shape[1], k.shape[2]).transpose(1, 2)
        vg = v[rows].view(n, ql, v.shape[1], v.shape[2]).transpose(1, 2)
    else:
        kg = k_cache[g.gather].transpose(1, 2)
        vg = v_cache[g.gather].transpose(1, 2)
    mask = g.mask_sliding if sliding and g.mask_sliding is not None else g.mask
    out = F.scaled_dot_product_attention(
        qg, kg, vg, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2).reshape(n * ql, q.shape[1], q.shape[2])
