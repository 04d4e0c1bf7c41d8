"""The packed training forward: many sequences and all their anchor blocks in one drafter pass.

loss.block_loss runs one sequence at a time; a training step here runs every sequence of a step (or of a
`max_rows` slice of it) at once, with the same math (tests/test_train_packed.py: loss and gradients equal).
Layout of one forward, built on the host by `pack` (no device sync):

    queries: the B rows of every block of every sequence, sequence after sequence      [Q = sum N_s * B]
    keys:    the fused context rows of every sequence (positions 0..max anchor-1), then
             the block rows again (a block's own keys)                                 [C + Q]

One mask rule, `mask_mod`, says what a query row sees: the context rows of its own sequence at positions
< its anchor (and >= anchor - window on sliding layers), and the B rows of its own block. On CUDA it is a
flex_attention BlockMask (tiles computed here from the row ranges, `tile_block_mask`, so nothing of size
Q x (C + Q) is ever built); on the CPU, where flex_attention has no backward, the same mask_mod evaluated
densely for scaled_dot_product_attention. Both read grouped K/V heads (`enable_gqa`), without copies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from lucebox.engine.models import DecoderModel
from lucebox.engine.spec.drafter import DFlashDrafter
from lucebox.train.loss import head_cross_entropy, head_weight

TILE = 128  # flex_attention's block size (the BlockMask's tiles)

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Packed:
    """Index tensors of one packed forward (host-built; `to` moves them to the device in one copy)."""

    block: int
    ctx_lens: list[int]  # context rows of each sequence (its largest anchor)
    n_blocks: list[int]  # anchors of each sequence
    q_len: int  # query rows: NB * B
    kv_len: int  # keys: context rows + block rows
    ctx_pos: torch.Tensor  # [C] position of each context row
    q_pos: torch.Tensor  # [Q] position of each block row (anchor + j)
    block_ids: torch.Tensor  # [NB, B] block tokens: tok[a], MASK...
    labels: torch.Tensor  # [NB, B-1] row k's label tok[a+k]
    q_seq: torch.Tensor  # [q_len] sequence of each query row
    q_anchor: torch.Tensor  # [q_len] its anchor
    q_blk: torch.Tensor  # [q_len] its block
    kv_seq: torch.Tensor  # [kv_len] sequence of a context key (-1 for block keys)
    kv_pos: torch.Tensor  # [kv_len] position of a context key
    kv_blk: torch.Tensor  # [kv_len] block of a block key (-1 for context keys)

    _TENSORS = ("ctx_pos", "q_pos", "block_ids", "labels", "q_seq", "q_anchor", "q_blk", "kv_seq", "kv_pos",
                "kv_blk")

    @property
    def n_ctx(self) -> int:
        return int(self.ctx_pos.shape[0])

    def to(self, device: torch.device) -> Packed:
        """The same batch with its tensors on `device`: one host-to-device copy of all of them."""
        if device.type == "cpu":
            return self
        parts = [getattr(self, n) for n in self._TENSORS]
        flat = to_device(torch.from_numpy(np.concatenate([p.numpy().reshape(-1) for p in parts])), device)
        out = dict(self.__dict__)
        off = 0
        for name, p in zip(self._TENSORS, parts):
            out[name] = flat[off: off + p.numel()].view(p.shape)
            off += p.numel()
        return Packed(**out)


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """x (a host tensor) on `device`, through pinned memory and without waiting: a copy from pageable memory
    would first wait for the GPU to finish its queued work."""
    if device.type == "cpu":
        return x
    return x.pin_memory().to(device, non_blocking=True)


def pack(tokens: list[list[int]], anchors: list[torch.Tensor], block: int, mask_token: int) -> Packed:
    """The packed layout of sequences `tokens` with their (sorted, CPU) anchors; every sequence has one.
    Built with numpy: host work only, and cheap next to the step."""
    anchor_np = [a.numpy() for a in anchors]
    ctx_lens = [int(a[-1]) for a in anchor_np]  # sorted anchors: the last is the largest
    n_blocks = [len(a) for a in anchor_np]
    seq_ids = np.arange(len(tokens))
    ctx_pos = np.concatenate([np.arange(c) for c in ctx_lens])
    ctx_seq = np.repeat(seq_ids, ctx_lens)
    anc = np.concatenate(anchor_np).astype(np.int64)
    nb = anc.shape[0]
    offs = np.arange(block)
    tok = np.concatenate([np.asarray(t, dtype=np.int64) for t in tokens])
    starts = np.cumsum([0] + [len(t) for t in tokens[:-1]])
    base = np.repeat(starts, n_blocks) + anc  # index of tok[a] in `tok`
    block_ids = np.full((nb, block), mask_token, dtype=np.int64)
    block_ids[:, 0] = tok[base]
    labels = tok[base[:, None] + offs[1:]]
    q, c = nb * block, ctx_pos.shape[0]
    blk = np.repeat(np.arange(nb), block)
    arrays = dict(
        ctx_pos=ctx_pos, q_pos=(anc[:, None] + offs).reshape(-1), block_ids=block_ids, labels=labels,
        q_seq=np.repeat(seq_ids, np.asarray(n_blocks) * block), q_anchor=np.repeat(anc, block), q_blk=blk,
        kv_seq=np.concatenate([ctx_seq, np.full(q, -1)]), kv_pos=np.concatenate([ctx_pos, np.zeros(q, np.int64)]),
        kv_blk=np.concatenate([np.full(c, -1), blk]))
    return Packed(block=block, ctx_lens=ctx_lens, n_blocks=n_blocks, q_len=q, kv_len=c + q,
                  **{k: torch.from_numpy(v.astype(np.int64, copy=False)) for k, v in arrays.items()})


def mask_mod(px: Packed, window: int | None = None) -> MaskMod:
    """The one mask rule (flex_attention's mask_mod signature; also evaluated densely on the CPU)."""
    q_seq, q_anchor, q_blk, kv_seq, kv_pos, kv_blk = px.q_seq, px.q_anchor, px.q_blk, px.kv_seq, px.kv_pos, px.kv_blk

    def allowed(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        a = q_anchor[q]
        ctx = (kv_seq[kv] == q_seq[q]) & (kv_pos[kv] < a)
        if window is not None:
            ctx = ctx & (kv_pos[kv] >= a - window)
        return ctx | (kv_blk[kv] == q_blk[q])

    return allowed


def dense_mask(px: Packed, window: int | None = None) -> torch.Tensor:
    """Bool [q_len, kv_len]: mask_mod at every (query, key)."""
    dev = px.q_seq.device
    q = torch.arange(px.q_len, device=dev)[:, None]
    kv = torch.arange(px.kv_len, device=dev)[None, :]
    return mask_mod(px, window)(None, None, q, kv)  # type: ignore[arg-type]


def _tile_sums(starts: np.ndarray, ends: np.ndarray, q_tile: np.ndarray, rows: np.ndarray, n_q: int,
               n_kv: int) -> tuple[np.ndarray, np.ndarray]:
    """Per (query tile, key tile): how many rows have a key range [start, end) touching it, and how many
    cover it whole; one entry per group of `rows` rows in query tile `q_tile` sharing the range."""

    def spread(lo: np.ndarray, hi: np.ndarray, ok: np.ndarray) -> np.ndarray:
        """sum over the entries of rows at key tiles lo..hi-1 (a difference array, then a prefix sum)."""
        width = n_kv + 1
        w = rows[ok].astype(np.float64)
        d = np.bincount(q_tile[ok] * width + lo[ok], w, n_q * width) - \
            np.bincount(q_tile[ok] * width + hi[ok], w, n_q * width)
        return d.reshape(n_q, width).cumsum(1)[:, :n_kv].round().astype(np.int64)

    touch = spread(starts // TILE, (ends - 1) // TILE + 1, ends > starts)
    first, last = -(-starts // TILE), ends // TILE  # key tiles [first, last) lie inside the range
    return touch, spread(first, last, last > first)


def tile_block_mask(px: Packed, dev_px: Packed, window: int | None) -> BlockMask:
    """The BlockMask of mask_mod, from the row ranges of the host batch `px` (its mask_mod reads `dev_px`, the
    same batch on the device).

    The rows of a block see the same two key ranges: their sequence's context [off + lo, off + a) and their
    block's rows [C + blk*B, C + (blk+1)*B). A tile pair is partial where some range touches it and full
    where all TILE rows of the query tile cover all TILE keys of the key tile (so a last, shorter tile is
    never full). A block's rows fall in one query tile or straddle a few: one entry per (block, tile)."""
    n_q, n_kv = -(-px.q_len // TILE), -(-px.kv_len // TILE)
    b, c = px.block, px.n_ctx
    ctx_off = np.concatenate([[0], np.cumsum(px.ctx_lens)[:-1]]).astype(np.int64)
    nb = sum(px.n_blocks)
    seq = np.repeat(np.arange(len(px.ctx_lens)), px.n_blocks)
    anchor = px.q_anchor.numpy()[::b]  # [NB]
    lo = np.zeros_like(anchor) if window is None else np.maximum(anchor - window, 0)
    first_row = np.arange(nb) * b
    pieces = []  # (block, query tile, rows of the block in it)
    for k in range(-(-b // TILE) + 1):
        qt = first_row // TILE + k
        n = np.minimum(first_row + b, (qt + 1) * TILE) - np.maximum(first_row, qt * TILE)
        ok = n > 0
        pieces.append((np.nonzero(ok)[0], qt[ok], n[ok]))
    blk, q_tile, rows = (np.concatenate(x) for x in zip(*pieces))
    ctx_lo, ctx_hi = ctx_off[seq[blk]] + lo[blk], ctx_off[seq[blk]] + anchor[blk]
    t1, w1 = _tile_sums(ctx_lo, ctx_hi, q_tile, rows, n_q, n_kv)
    t2, w2 = _tile_sums(c + blk * b, c + (blk + 1) * b, q_tile, rows, n_q, n_kv)
    full = (w1 + w2) == TILE
    partial = ((t1 + t2) > 0) & ~full

    def blocks(m: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        num = torch.from_numpy(m.sum(1).astype(np.int32))
        idx = torch.from_numpy(np.argsort(~m, axis=1, kind="stable").astype(np.int32))
        return to_device(num[None, None], device), to_device(idx[None, None], device)

    device = dev_px.q_seq.device
    (kv_num, kv_idx), (full_num, full_idx) = blocks(partial), blocks(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=TILE,
                                    mask_mod=mask_mod(dev_px, window), seq_lengths=(px.q_len, px.kv_len))


Masks = dict[bool, "torch.Tensor | BlockMask"]  # by `layer.sliding`


def attention_masks(drafter: DFlashDrafter, px: Packed, dev_px: Packed, flex: bool) -> Masks:
    """The masks of the drafter's full (False) and sliding (True) layers: BlockMasks for flex_attention, else
    dense ones; built from the host batch px, read on the device."""
    cfg = drafter.cfg
    windows: dict[bool, int | None] = {False: None}
    if cfg.sliding_window and any(layer.sliding for layer in drafter.layers):
        windows[True] = cfg.sliding_window
    if flex:
        return {k: tile_block_mask(px, dev_px, w) for k, w in windows.items()}
    return {k: dense_mask(dev_px, w) for k, w in windows.items()}


_compiled_flex: Callable[..., torch.Tensor] | None = None


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    """flex_attention compiled on CUDA (its fused kernels). The lengths change step to step: dynamo compiles
    the first two shapes as they come, then dynamic ones (checked with the aot_eager backend on the CPU: no
    recompilation after that, a new mask_mod closure each step included); eager elsewhere (the CPU's
    forward-only reference, for tests)."""
    global _compiled_flex
    if q.device.type != "cuda":
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=True)


def packed_hidden(drafter: DFlashDrafter, target: DecoderModel, ctx_features: torch.Tensor, px: Packed,
                  masks: Masks) -> torch.Tensor:
    """drafter.norm(h) of rows 1..B-1 of every block: [NB, B-1, H] (loss.drafter_hidden, packed).

    ctx_features [C, n_feat * H]: each sequence's target features at positions 0..ctx_len-1, concatenated
    in layer order (what DFlashDrafter.fuse concatenates); px on the device; masks from attention_masks."""
    cfg = drafter.cfg
    b, nb = cfg.block_size, px.block_ids.shape[0]
    dev = ctx_features.device
    x = drafter.fuse([ctx_features])
    with torch.no_grad():
        h = target.embed(px.block_ids).float().reshape(nb * b, -1)  # residual stream kept in fp32
    dtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else h.dtype
    cos_c, sin_c = drafter.rotary(px.ctx_pos, dtype)
    cos_b, sin_b = drafter.rotary(px.q_pos, dtype)
    for layer in drafter.layers:
        kc, vc = layer.context_kv(x, cos_c, sin_c)
        q, kb, vb = layer.block_qkv(h, cos_b, sin_b)
        keys, vals = torch.cat([kc.to(dtype), kb.to(dtype)]), torch.cat([vc.to(dtype), vb.to(dtype)])
        qh, kh, vh = (t.to(dtype).transpose(0, 1).unsqueeze(0) for t in (q, keys, vals))  # [1, heads, rows, D]
        m = masks[layer.sliding]
        if isinstance(m, BlockMask):
            att = _flex(qh.contiguous(), kh.contiguous(), vh.contiguous(), m)
        else:
            att = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=m, enable_gqa=True)
        att = att[0].transpose(0, 1).reshape(nb * b, -1)
        h = layer.after_attention(h, att)
    return drafter.norm(h).view(nb, b, -1)[:, 1:]


def packed_loss(drafter: DFlashDrafter, target: DecoderModel, ctx_features: torch.Tensor, px: Packed,
                masks: Masks, pos_w: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale * sum over every block's rows of w_k * CE, correct [NB, B-1]): block_loss of all sequences."""
    b = drafter.cfg.block_size
    h = packed_hidden(drafter, target, ctx_features, px, masks)
    nb = h.shape[0]
    row_w = (pos_w * scale).expand(nb, b - 1).reshape(-1)
    loss, preds = head_cross_entropy(h.reshape(-1, h.shape[-1]), head_weight(target), px.labels.reshape(-1), row_w)
    return loss, preds.view(nb, b - 1) == px.labels
