"""Attention without a KV cache: the one mask rule and the one SDPA call for rows that bring their own keys.

The paged path (engine/kernels/attention.py) serves the target over its cache, and the
DFlash drafter's blocks over theirs at inference. Everything else that attends over
keys it holds in hand uses this file: the PFlash scorer's dense prefill and the
drafter trainer (every anchor's block in one call). One rule decides what a query sees:

    query at position q sees the key at position p  iff  p <= q  and (sliding)  q - p < window

(the target's rule too: model_runner builds its paged masks the same way).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Bool [..., Q, K]: True where the query at q_pos [..., Q] may see the key at k_pos [..., K] (see above)."""
    diff = q_pos[..., :, None] - k_pos[..., None, :]
    allowed = diff >= 0
    if window is not None:
        allowed &= diff < window
    return allowed


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                    window: int | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [..., Q, Hq, D] over k/v [..., K, Hkv, D] -> [..., Q, Hq, D]; query head h reads
    key head h // (Hq / Hkv).

    Without `mask`: causal over the rows themselves (Q == K, positions 0..), within `window` if set
    (no window, or one covering every row: `is_causal`, which lets CUDA pick its flash kernel).
    With `mask` (bool [..., Q, K], True = may attend; build it with `causal_mask`): exactly that mask,
    and K/V are repeated per query head, because SDPA's memory-efficient kernel takes a mask but not
    grouped heads (with `enable_gqa` a masked call falls back to the kernel that stores every score).
    """
    batched = q.dim() == 4
    if not batched:
        q, k, v = q[None], k[None], v[None]
    S = q.shape[1]
    if mask is None and window is not None and window < S:
        pos = torch.arange(S, device=q.device)
        mask = causal_mask(pos, pos, window)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
    if mask is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        rep = qh.shape[1] // kh.shape[1]
        if rep > 1:
            kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
        m = mask[None] if mask.dim() == 2 else mask
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=m[:, None], scale=scale)
    out = out.transpose(1, 2)
    return out if batched else out[0]
