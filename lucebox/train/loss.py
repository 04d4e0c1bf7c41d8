"""The training objective (docs/spec/DFLASH.md, "Training a drafter"): sample_anchors draws the block
starts among the response positions; drafter_hidden runs the drafter's own layers over every anchor's block
[tok[a], MASK x (B-1)] in one attention call, kept apart by block_mask so each block sees the context
features of positions < a only, as SpecDecoder does at inference; block_loss is the cross-entropy of rows
1..B-1 through the target's LM head (head_weight), weighted w_k = exp(-(k-1)/gamma) (position_weights,
loss_gamma), computed chunk by chunk by head_cross_entropy without holding all the logits."""

from __future__ import annotations

from typing import Any

import torch

from lucebox.engine.models import DecoderModel
from lucebox.engine.models.dense_attention import causal_mask, dense_attention
from lucebox.engine.spec.drafter import DFlashDrafter

# gamma of the position weights for the block sizes DFLASH.md names; linear in between and beyond.
GAMMA_POINTS = ((8, 4.0), (10, 5.0), (16, 7.0))


def loss_gamma(block_size: int) -> float:
    """gamma of w_k = exp(-(k-1)/gamma): 4 for B=8, 5 for B=10, 7 for B=16, piecewise linear otherwise."""
    pts = GAMMA_POINTS
    if block_size <= pts[0][0]:
        return pts[0][1] * block_size / pts[0][0]
    for (b0, g0), (b1, g1) in zip(pts, pts[1:]):
        if block_size <= b1:
            return g0 + (g1 - g0) * (block_size - b0) / (b1 - b0)
    (b0, g0), (b1, g1) = pts[-2], pts[-1]
    return g1 + (g1 - g0) / (b1 - b0) * (block_size - b1)


def position_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """[B-1] weights of rows k = 1..B-1."""
    g = gamma or loss_gamma(block_size)
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / g)


def head_weight(target: DecoderModel) -> torch.Tensor:
    """The LM head the drafter shares: the tensor the target's own logits use (tied embedding or `output`)."""
    return target.token_embd.weight if target.cfg.tie_word_embeddings else target.output.weight


def block_mask(anchors: torch.Tensor, ctx_len: int, block: int, window: int | None = None,
               pad_to: int = 1) -> torch.Tensor:
    """[N*B, ctx_len + N*B (padded)] bool: block row of anchor a sees context positions < a (and, with a
    window, >= a - window) and the B rows of its own block; never another block, never padding.

    The context part is the causal rule of a query at position a - 1, the last committed token's (the
    drafter's context ends there), so sliding drafter layers see what SpecDecoder gives them."""
    n = anchors.shape[0]
    dev = anchors.device
    ctx = causal_mask(anchors.repeat_interleave(block) - 1, torch.arange(ctx_len, device=dev), window)
    blk_id = torch.arange(n * block, device=dev) // block
    own = blk_id[:, None] == blk_id[None, :]
    total = ctx_len + n * block
    pad = (-total) % pad_to
    parts = [ctx, own] + ([torch.zeros(n * block, pad, dtype=torch.bool, device=dev)] if pad else [])
    return torch.cat(parts, dim=1)


def drafter_hidden(drafter: DFlashDrafter, target: DecoderModel, features: list[torch.Tensor],
                   tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """drafter.norm(h) of rows 1..B-1 of every anchor's block: [N, B-1, H].

    The same computation as SpecDecoder (extend_context + draft_logprobs) for a
    sequence whose committed tokens are tokens[0..a]: context rows = fused
    features of positions 0..a-1, block = [tokens[a], MASK...] at a..a+B-1.
    It runs the drafter's own layer methods; only the layout differs: every
    anchor's block in one attention call over the shared context, kept apart
    by `block_mask`.
    """
    cfg = drafter.cfg
    b, n = cfg.block_size, anchors.shape[0]
    dev = tokens.device
    ctx_len = int(anchors.max())  # positions >= max anchor are never context
    x = drafter.fuse([f[:ctx_len] for f in features])
    block_ids = torch.full((n, b), cfg.mask_token_id, dtype=torch.long, device=dev)
    block_ids[:, 0] = tokens[anchors]
    with torch.no_grad():
        h = target.embed(block_ids).float().reshape(n * b, -1)  # residual stream kept in fp32
    dtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else h.dtype
    cos_c, sin_c = drafter.rotary(torch.arange(ctx_len, device=dev), dtype)
    cos_b, sin_b = drafter.rotary((anchors[:, None] + torch.arange(b, device=dev)).flatten(), dtype)
    masks = {False: block_mask(anchors, ctx_len, b, pad_to=8)}
    if cfg.sliding_window and any(layer.sliding for layer in drafter.layers):
        masks[True] = block_mask(anchors, ctx_len, b, cfg.sliding_window, pad_to=8)
    pad = masks[False].shape[1] - ctx_len - n * b
    for layer in drafter.layers:
        kc, vc = layer.context_kv(x, cos_c, sin_c)
        q, kb, vb = layer.block_qkv(h, cos_b, sin_b)
        keys, vals = torch.cat([kc, kb.to(kc.dtype)]), torch.cat([vc, vb.to(vc.dtype)])
        if pad:
            keys = torch.cat([keys, keys.new_zeros(pad, *keys.shape[1:])])
            vals = torch.cat([vals, vals.new_zeros(pad, *vals.shape[1:])])
        att = dense_attention(q.to(keys.dtype), keys, vals, mask=masks[layer.sliding])
        h = layer.after_attention(h, att.reshape(n * b, -1))
    return drafter.norm(h).view(n, b, -1)[:, 1:]


class _HeadCrossEntropy(torch.autograd.Function):
    """sum(row_w * CE(h @ W^T, labels)) for a frozen head W, in row chunks, never holding all logits.

    The gradient w.r.t. h is computed in the forward pass (chunk by chunk), so the
    [rows, vocab] logits are neither stored nor recomputed. Also returns the argmax.
    """

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, row_w: torch.Tensor,
                chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = h.shape[0]
        grad = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        preds = torch.empty(rows, dtype=torch.long, device=h.device)
        for s in range(0, rows, chunk):
            e = min(s + chunk, rows)
            logits = (h[s:e].to(weight.dtype) @ weight.t()).float()
            lab = labels[s:e]
            lse = torch.logsumexp(logits, dim=-1)
            loss += ((lse - logits.gather(1, lab[:, None])[:, 0]) * row_w[s:e]).sum()
            preds[s:e] = logits.argmax(-1)
            if grad is not None:
                p = logits.sub_(lse[:, None]).exp_()  # softmax, in place
                p[torch.arange(e - s, device=h.device), lab] -= 1.0
                p.mul_(row_w[s:e, None])
                grad[s:e] = (p.to(weight.dtype) @ weight).to(h.dtype)
        ctx.grad = grad  # an intermediate, not an input or output: kept as an attribute
        ctx.mark_non_differentiable(preds)
        return loss, preds

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, _grad_preds: Any) -> tuple[Any, ...]:
        grad = ctx.grad
        return grad * grad_loss.to(grad.dtype), None, None, None, None


def head_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, row_w: torch.Tensor,
                       chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted CE sum, argmax ids) of rows h [R, H] through the frozen head `weight` [V, H]."""
    chunk = chunk or max(1, (1 << 26) // weight.shape[0])
    return _HeadCrossEntropy.apply(h, weight, labels, row_w, chunk)


def sample_anchors(prompt_len: int, total_len: int, block: int, max_anchors: int,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Sorted anchor positions among the response positions a with a <= T-B (all of them if few enough)."""
    lo, hi = prompt_len, total_len - block  # inclusive
    if hi < lo:
        return torch.empty(0, dtype=torch.long)
    n = hi - lo + 1
    if n <= max_anchors:
        return torch.arange(lo, hi + 1)
    pick = torch.randperm(n, generator=generator)[:max_anchors]
    return (pick + lo).sort().values


def block_loss(drafter: DFlashDrafter, target: DecoderModel, features: list[torch.Tensor], tokens: torch.Tensor,
               anchors: torch.Tensor, pos_w: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale * sum of w_k * CE over the anchors' rows, correct [N, B-1]) for one sequence."""
    b = drafter.cfg.block_size
    h = drafter_hidden(drafter, target, features, tokens, anchors)  # [N, B-1, H]
    labels = tokens[anchors[:, None] + torch.arange(1, b, device=tokens.device)]  # row k predicts tok[a+k]
    row_w = (pos_w.to(tokens.device) * scale).expand(anchors.shape[0], b - 1).reshape(-1)
    loss, preds = head_cross_entropy(h.reshape(-1, h.shape[-1]), head_weight(target), labels.reshape(-1), row_w)
    return loss, preds.view(-1, b - 1) == labels
