"""The scorer's forward: one plain prefill over the whole prompt, scoring every token on the way.

It runs the model's own blocks and weights (any family DecoderModel serves),
through DecoderBlock's own methods (projections, norms, MLP: its hidden
states are the target's, tests/test_block_shared.py), but its own loop: no KV
cache, one attention call per layer over all S rows, dense
(models/dense_attention.py) or block-sparse (sparse.py). In every layer,
before RoPE and after q/k norm, the last `n_lookahead` queries attend to all
S keys:

    p[l, h, i, s] = softmax_s(q[S-n+i, h] . k[s, h] / sqrt(d))    (s <= S-n+i)
    score[s]      = mean_i max_l max_h p[l, h, i, s]

The last layer's attention output and MLP feed nothing and are skipped.
Sliding-window layers (Gemma 3) attend to their window in the forward, as the
model does; their scores, like every layer's, look at all S keys.

Under tensor parallelism (engine/parallel) every rank runs this forward on its
shard and sees only its query heads: `rank_max` takes its max over its heads
and layers to the max over every rank's. A max is exact in any order, so that
one exchange at the end gives the one-rank scores.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from lucebox.engine.models.dense_attention import dense_attention
from lucebox.engine.models.layers import apply_rotary
from lucebox.engine.pflash.config import PFlashConfig
from lucebox.engine.pflash.sparse import sparse_attention, use_flex


def tail_attention(q_tail: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Attention probabilities of the last n queries over all S keys, max over heads: [n, S] fp32.

    q_tail [n, Hq, D] are the queries of positions S-n .. S-1; k [S, Hkv, D].
    Query head h reads key head h // (Hq / Hkv), as in the model.
    """
    n, Hq, D = q_tail.shape
    S, Hkv = k.shape[0], k.shape[1]
    g = Hq // Hkv
    qf = q_tail.float().view(n, Hkv, g, D).permute(1, 2, 0, 3).reshape(Hkv, g * n, D)
    logits = torch.bmm(qf, k.float().permute(1, 2, 0)).view(Hq, n, S) * D**-0.5
    pos = torch.arange(S, device=k.device)
    future = pos[None, :] > (S - n + torch.arange(n, device=k.device))[:, None]
    return logits.masked_fill_(future, float("-inf")).softmax(-1).amax(0)


RankMax = Callable[[torch.Tensor], torch.Tensor]  # a tensor -> its elementwise max over the ranks


@torch.inference_mode()
def token_importance(model: nn.Module, ids: list[int] | torch.Tensor, cfg: PFlashConfig,
                     rank_max: RankMax | None = None) -> torch.Tensor:
    """One importance score per prompt token, [S] fp32 on the model's device (see the module docstring)."""
    return score_prompt(model, ids, cfg, rank_max=rank_max)[0]


@torch.inference_mode()
def score_prompt(model: nn.Module, ids: list[int] | torch.Tensor, cfg: PFlashConfig,
                 capture: Sequence[int] = (), rank_max: RankMax | None = None
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(token_importance's scores, the outputs of the layers in `capture`): the scorer's forward is the
    target's blocks (DecoderBlock's own projections, norms and MLP), only its attention and loop are its own.
    The last layer's output is never computed (nothing reads it), so it cannot be captured. `rank_max`: a
    sharded model's (module docstring)."""
    device = model.output_norm.weight.device  # a norm is always dense (token_embd may be quantized)
    x = torch.as_tensor(ids, device=device, dtype=torch.long).flatten()
    S = x.numel()
    if S == 0:
        return torch.zeros(0, device=device), []
    n = min(cfg.n_lookahead, S)
    flex = use_flex(cfg, device)
    h = model.embed(x)
    positions = torch.arange(S, device=device)
    ropes = model.ropes(positions, h.dtype)
    running: torch.Tensor | None = None
    captured: list[torch.Tensor] = []
    for i, block in enumerate(model.blk):
        q, k, v = block.project_qkv(block.attn_norm(h))
        probs = tail_attention(q[S - n:], k)
        running = probs if running is None else torch.maximum(running, probs)
        if i == len(model.blk) - 1:
            break
        cos, sin = model.rope_for(block, ropes)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if flex:
            a = sparse_attention(q, k, v, cfg, block.scale, block.window)
        else:
            a = dense_attention(q, k, v, block.scale, block.window)
        h = block.after_attention(h, a)
        if i in capture:
            captured.append(h)
    assert running is not None
    if rank_max is not None:
        running = rank_max(running)
    return running.mean(0), captured
