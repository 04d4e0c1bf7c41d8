"""Scorer attention over the whole prompt, block-sparse through flex_attention (dense: models/dense_attention.py).

Block-sparse attention only makes the scorer cheaper. Keys and queries are cut
into blocks of `sparse_block` rows; a key block is scored for a query block by
the query block's mean query against the key block's mean key (per head,
softmax over the row's causal blocks), and kept when

- it is one of the first `sink_blocks` blocks (attention sinks),
- it is one of the `window_blocks` blocks ending at the diagonal (local window),
- the query block is one of the last `dense_last_q_blocks` (they see everything),
- or its score is >= alpha * the row's best score,

always within the causal mask. The kept blocks become a flex_attention
`BlockMask` (diagonal blocks carry the causal mask_mod, the rest are full).
Sliding-window layers (Gemma 3) attend to their window only, with no selection.
On CUDA flex_attention runs compiled; elsewhere it runs eagerly (it then
materializes the scores: for tests at small sizes).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from lucebox.engine.pflash.config import PFlashConfig

_compiled_flex: Callable[..., Any] | None = None


def use_flex(cfg: PFlashConfig, device: torch.device) -> bool:
    if cfg.sparse_attention == "auto":
        return device.type == "cuda"
    return cfg.sparse_attention == "flex"


def block_means(x: torch.Tensor, block: int) -> torch.Tensor:
    """Mean row of each block of `block` rows: x [S, H, D] -> [H, n_blocks, D] in fp32."""
    S, H, D = x.shape
    nb = -(-S // block)
    sums = F.pad(x, (0, 0, 0, 0, 0, nb * block - S)).view(nb, block, H, D).sum(1, dtype=torch.float32)
    counts = torch.full((nb,), float(block), device=x.device)
    counts[-1] = S - block * (nb - 1)
    return (sums / counts[:, None, None]).transpose(0, 1)


def select_blocks(q: torch.Tensor, k: torch.Tensor, cfg: PFlashConfig, scale: float) -> torch.Tensor:
    """Kept key blocks per query head and query block: bool [Hq, nb, nb] (see the module docstring).

    q [S, Hq, D], k [S, Hkv, D]: the rotated queries and keys the attention uses.
    """
    Hq, Hkv = q.shape[1], k.shape[1]
    g = Hq // Hkv
    qm, km = block_means(q, cfg.sparse_block), block_means(k, cfg.sparse_block)  # [Hq, nb, D], [Hkv, nb, D]
    nb = qm.shape[1]
    scores = torch.bmm(qm.reshape(Hkv, g * nb, -1), km.transpose(1, 2)).view(Hq, nb, nb) * scale
    i = torch.arange(nb, device=q.device)
    causal = i[None, :] <= i[:, None]  # [q block, k block]
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    keep = probs >= cfg.alpha * probs.amax(-1, keepdim=True)
    structural = (i[None, :] < cfg.sink_blocks) | (i[:, None] - i[None, :] < cfg.window_blocks)
    structural = structural | (i[:, None] >= nb - cfg.dense_last_q_blocks)
    return (keep | structural) & causal


def window_blocks(S: int, block: int, window: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Sliding-window layers: (blocks with any allowed pair, blocks with every pair allowed), [nb, nb] each."""
    nb = -(-S // block)
    i = torch.arange(nb, device=device)
    qi, kj = i[:, None], i[None, :]
    causal = kj <= qi
    anything = causal & (qi * block - (kj * block + block - 1) < window)
    everything = (kj < qi) & ((qi * block + block - 1) - kj * block < window)
    return anything, everything


def block_mask(keep: torch.Tensor, full: torch.Tensor, S: int, block: int, window: int | None) -> Any:
    """A flex_attention BlockMask: `keep` blocks [H, nb, nb] attend; those also in `full` need no mask_mod.

    With `window` set (sliding layers) the mask_mod is the window itself and
    `keep` must be the window's blocks; otherwise it is causal within `keep`.
    """
    from torch.nn.attention.flex_attention import BlockMask

    full = keep & full
    partial = keep & ~full

    def indices(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        count = m.sum(-1, dtype=torch.int32)
        order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # kept blocks first
        return count[None].contiguous(), order[None].contiguous()

    if window is None:
        # The block selection is in the mask_mod too: eager flex_attention (CPU) applies only the mask_mod,
        # the compiled kernel evaluates it only in partial blocks and skips the blocks the BlockMask leaves out.
        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (q_idx >= kv_idx) & keep[h, q_idx // block, kv_idx // block]
    else:
        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    kv_num, kv_idx = indices(partial)
    full_num, full_idx = indices(full)
    padded = keep.shape[-1] * block
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(padded, padded))


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, scale: float,
                   block: int) -> torch.Tensor:
    """flex_attention of q [S, Hq, D] over k/v [S, Hkv, D] under a BlockMask -> [S, Hq, D].

    Rows are zero-padded to a whole number of blocks: the causal mask keeps
    real queries off the padding, and the padded queries' rows are dropped.
    """
    from torch.nn.attention import flex_attention as fa

    S = q.shape[0]
    pad = -S % block
    qh, kh, vh = (F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(0, 1)[None] for t in (q, k, v))
    if q.is_cuda:
        global _compiled_flex
        if _compiled_flex is None:
            _compiled_flex = torch.compile(fa.flex_attention)
        out = _compiled_flex(qh, kh, vh, block_mask=mask, scale=scale, enable_gqa=True)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "called without torch.compile()": eager is the CPU test path
            out = fa.flex_attention(qh, kh, vh, block_mask=mask, scale=scale, enable_gqa=True)
    return out[0, :, :S].transpose(0, 1)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: PFlashConfig, scale: float,
                     window: int | None = None) -> torch.Tensor:
    """Block-sparse causal attention of one layer (sliding-window layers: their window, no selection)."""
    S, block = q.shape[0], cfg.sparse_block
    if window is not None:
        keep, full = window_blocks(S, block, window, q.device)
        keep = keep[None]
    else:
        keep = select_blocks(q, k, cfg, scale)
        i = torch.arange(keep.shape[-1], device=q.device)
        full = i[None, :] < i[:, None]
    return flex_attention(q, k, v, block_mask(keep, full, S, block, window), scale, block)
