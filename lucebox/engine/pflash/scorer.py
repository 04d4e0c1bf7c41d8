"""The scorer's forward: one plain prefill over the whole prompt, scoring every token on the way.

It runs the model's own blocks and weights (any family DecoderModel serves)
but its own loop: no KV cache, one attention call per layer over all S rows,
optionally block-sparse (sparse.py). In every layer, before RoPE and after
q/k norm, the last `n_lookahead` queries attend to all S keys:

    p[l, h, i, s] = softmax_s(q[S-n+i, h] . k[s, h] / sqrt(d))    (s <= S-n+i)
    score[s]      = mean_i max_l max_h p[l, h, i, s]

The last layer's attention output and MLP feed nothing and are skipped.
Sliding-window layers (Gemma 3) attend to their window in the forward, as the
model does; their scores, like every layer's, look at all S keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lucebox.engine.models.layers import apply_rotary
from lucebox.engine.pflash.config import PFlashConfig
from lucebox.engine.pflash.sparse import dense_attention, sparse_attention, use_flex


def project_qkv(block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k (q/k-normed, not rotated) and v of a block's attention, [S, heads, head_dim] each."""
    hq, hkv, d = block.num_heads, block.num_kv_heads, block.head_dim
    S = x.shape[0]
    if hasattr(block, "attn_qkv"):
        qkv = block.attn_qkv(x).view(S, hq + 2 * hkv, d)
        q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    else:  # an unfused block
        q, k, v = (m(x).view(S, -1, d) for m in (block.attn_q, block.attn_k, block.attn_v))
    if hasattr(block, "attn_q_norm"):
        q, k = block.attn_q_norm(q), block.attn_k_norm(k)
    return q, k, v


def mlp(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if hasattr(block, "ffn_gate_up"):
        gate, up = block.ffn_gate_up(x).chunk(2, dim=-1)
    else:
        gate, up = block.ffn_gate(x), block.ffn_up(x)
    gate = F.silu(gate) if block.act == "silu" else F.gelu(gate, approximate="tanh")
    return block.ffn_down(gate * up)


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


@torch.inference_mode()
def token_importance(model: nn.Module, ids: list[int] | torch.Tensor, cfg: PFlashConfig) -> torch.Tensor:
    """One importance score per prompt token, [S] fp32 on the model's device (see the module docstring)."""
    device = model.output_norm.weight.device  # a norm is always dense (token_embd may be quantized)
    x = torch.as_tensor(ids, device=device, dtype=torch.long).flatten()
    S = x.numel()
    if S == 0:
        return torch.zeros(0, device=device)
    n = min(cfg.n_lookahead, S)
    flex = use_flex(cfg, device)
    window = model.cfg.sliding_window
    h = model.embed(x)
    positions = torch.arange(S, device=device)
    ropes = {name: rot(positions, h.dtype) for name, rot in model.rotary.items()}
    running: torch.Tensor | None = None
    for i, block in enumerate(model.blk):
        q, k, v = project_qkv(block, block.attn_norm(h))
        probs = tail_attention(q[S - n:], k)
        running = probs if running is None else torch.maximum(running, probs)
        if i == len(model.blk) - 1:
            break
        cos, sin = ropes["sliding"] if block.sliding and "sliding" in ropes else ropes["full"]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        layer_window = window if block.sliding else None
        if flex:
            a = sparse_attention(q, k, v, cfg, block.scale, layer_window)
        else:
            a = dense_attention(q, k, v, block.scale, layer_window)
        a = block.attn_output(a.reshape(S, -1))
        if hasattr(block, "post_attention_norm"):
            a = block.post_attention_norm(a)
        h = h + a
        m = mlp(block, block.ffn_norm(h))
        if hasattr(block, "post_ffw_norm"):
            m = block.post_ffw_norm(m)
        h = h + m
    assert running is not None
    return running.mean(0)
