"""Qwen3.5 / Qwen3.6 dense hybrid (`qwen35`): Gated DeltaNet layers with a few gated full-attention layers.

Layer i is a linear-attention (Gated DeltaNet) layer or a full-attention layer as `cfg.layer_types` says
(transformers' `layer_types`, or llama.cpp's `full_attention_interval`: every 4th layer attends). Both are
pre-norm with a dense SwiGLU FFN after `post_attention_norm`, or in `qwen35moe` (Qwen3.5/3.6-35B-A3B) the
mixture of experts of models/moe.py (softmax router, renormalised top-k, a shared expert behind a sigmoid
gate).

- Full attention: `attn_q` yields per head [query | output gate]; q/k RMSNorm per head; RoPE on the first
  `rotary_dim` dims of each head (rotate-half over those dims, the rest passes: transformers' text model,
  whose three M-RoPE sections see one position for text, and llama.cpp's IMROPE agree on this); paged
  attention over the KV cache; the output times sigmoid(gate) before `attn_output`.
- Gated DeltaNet: `attn_qkv` -> causal depthwise conv (`ssm_conv1d`, its last kernel-1 inputs kept per
  sequence) -> SiLU -> q, k, v; q and k L2-normed, q scaled by k_dim^-1/2; per token and value head,
  decay exp(g) with g = ssm_a * softplus(ssm_alpha x + ssm_dt.bias) (ssm_a = -exp(A_log)) and
  beta = sigmoid(ssm_beta x); the state S [k_dim, v_dim] follows the gated delta rule
  S <- exp(g) S;  S <- S + k (beta (v - k^T S))^T;  o = q^T S.
  The output is RMSNorm(o) * silu(`attn_gate` x), then `ssm_out`.

Conventions are llama.cpp's (the GGUF needs no conversion; the HF loader converts): tensor names, norms
holding `1 + w` (all but `ssm_norm`), ssm_a = -exp(A_log), and value heads in tiled order (value head h
reads q/k head h % k_heads; HF groups them, h // (v_heads / k_heads)).

The recurrent states live in runtime/recurrent_state.py; each step's `StateRows` says which slot each
chunk reads and writes. A prefill chunk runs the chunked (WY) form of the delta rule from its slot's state
(zeros at position 0), in pieces cut where the prefix cache keeps a state (`StateRows.captures`); the step's
one-row decodes run one batched recurrent update; a speculative verification (a chain or a DDTree) runs
its rows one depth at a time, each from its parent row's state (conv windows along the row's ancestors),
and keeps every row's state for the acceptance. fp32 states. The step's decoding rows take two fused Triton
kernels on CUDA (kernels/triton_deltanet.py: conv, norms, gate and delta rule on the slots themselves, so a
decode step is capturable in a CUDA graph, runtime/cuda_graphs.py); the chunked form's pass over its
blocks is one kernel too, and so is a verification's delta rule over all its rows (one launch a layer, not
one step a depth, and capturable: spec/static.py replays whole speculative steps as CUDA graphs); the rest of
prefill and verification stay torch, and plain torch everywhere is the CPU path and the reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lucebox.engine.kernels import triton_deltanet, triton_ops
from lucebox.engine.kernels.attention import AttentionMetadata, paged_attention
from lucebox.engine.models.config import ModelConfig
from lucebox.engine.models.decoder import DecoderModel, Rope
from lucebox.engine.models.layers import (
    Embedding,
    Linear,
    RMSNorm,
    apply_rotary,
    down_of_gate_up,
    fuse_linears,
    gated_act,
    int8_input,
)
from lucebox.engine.models.moe import MoE
from lucebox.engine.runtime.recurrent_state import StateRows

DELTA_CHUNK = 64  # rows per block of the chunked delta rule (transformers' and fla's default)


class _Tensors(nn.Module):
    """A module holding bare parameters, so GGUF names such as `ssm_dt.bias` resolve."""

    def __init__(self, **shapes: tuple[int, ...]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape), requires_grad=False))


class _Block(nn.Module):
    """What both layer kinds share: the two pre-norms and the FFN (dense SwiGLU, or the mixture of experts)."""

    moe: MoE | None = None  # set (by MoE.mount) in a mixture-of-experts layer

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.intermediate_size
        self.attn_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_norm = RMSNorm(h, cfg.rms_norm_eps)  # the pre-FFN norm (llama.cpp's name)
        if cfg.is_moe(layer):
            MoE(cfg, layer).mount(self)
        else:
            self.ffn_gate = Linear(h, f)
            self.ffn_up = Linear(h, f)
            self.ffn_down = Linear(f, h)

    def fuse(self) -> None:
        """Merge the dense FFN's gate and up into one matmul (`fuse_linears`: one gemv launch and one int8
        quantization of x a block, not two; parallel/shard.py splits the fused rows as a dense decoder's)."""
        if self.moe is None:
            self.ffn_gate_up = fuse_linears([self.ffn_gate, self.ffn_up])
            del self.ffn_gate, self.ffn_up

    def ffn(self, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """h' + FFN(post_attention_norm(h')) with h' = h + out, the mixer's output `out` added to the residual
        stream `h` (on the fused-ops device in the norm's kernel, and act(gate) * up in one kernel there)."""
        norm = self.post_attention_norm
        fused = triton_ops.use_kernels(out) and not torch.is_grad_enabled()
        ws = None  # x's int8 rows, filled by the norm kernel
        if fused:
            ws = self.moe.int8_input(out) if self.moe is not None else int8_input(out, [self.ffn_gate_up])
            x, h = triton_ops.add_rms_norm(out, h, norm.weight, norm.eps, ws=ws)
        else:
            h = h + out
            x = norm(h)
        if self.moe is not None:
            return h + self.moe(x, ws=ws)
        gate_up = self.ffn_gate_up(x, ws=ws)
        down = down_of_gate_up(self.ffn_down, gate_up, "silu") if fused else None
        if down is not None:
            return h + down
        return h + self.ffn_down(triton_ops.act_mul(gate_up, "silu") if fused else gated_act(*gate_up.chunk(2, -1)))


class GatedAttentionBlock(_Block):
    """Full attention with q/k norm, partial RoPE and a sigmoid output gate."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        h, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.scale = hd**-0.5
        self.attn_q = Linear(h, 2 * cfg.q_size)  # per head: [query | gate]
        self.attn_k = Linear(h, cfg.kv_size)
        self.attn_v = Linear(h, cfg.kv_size)
        self.attn_output = Linear(cfg.q_size, h)
        self.attn_q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.attn_k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, rope: Rope, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        T, hd = h.shape[0], self.head_dim
        ws = int8_input(h, [self.attn_q, self.attn_k, self.attn_v])
        x = self.attn_norm(h, ws=ws)
        qg = self.attn_q(x, ws=ws).view(T, self.num_heads, 2 * hd)
        q, gate = self.attn_q_norm(qg[..., :hd]), qg[..., hd:]
        k = self.attn_k_norm(self.attn_k(x, ws=ws).view(T, self.num_kv_heads, hd))
        v = self.attn_v(x, ws=ws).view(T, self.num_kv_heads, hd)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)  # the table is rotary_dim wide: partial rotary
        a = paged_attention(q, k, v, k_cache, v_cache, meta, scale=self.scale, sliding=False)
        a = a.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))
        return self.ffn(h, self.attn_output(a))


class DeltaNetBlock(_Block):
    """Gated DeltaNet linear attention (see the module docstring for the math)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        h = cfg.hidden_size
        self.k_heads, self.v_heads = cfg.linear_k_heads, cfg.linear_v_heads
        self.k_dim, self.v_dim = cfg.linear_k_dim, cfg.linear_v_dim
        key_size, value_size = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        self.conv_dim = 2 * key_size + value_size
        self.attn_qkv = Linear(h, self.conv_dim)
        self.attn_gate = Linear(h, value_size)  # z
        self.ssm_beta = Linear(h, self.v_heads)
        self.ssm_alpha = Linear(h, self.v_heads)
        self.ssm_a = nn.Parameter(torch.empty(self.v_heads), requires_grad=False)  # -exp(A_log)
        self.ssm_dt = _Tensors(bias=(self.v_heads,))
        self.ssm_conv1d = _Tensors(weight=(self.conv_dim, cfg.linear_conv_kernel))
        self.ssm_norm = RMSNorm(self.v_dim, cfg.rms_norm_eps)
        self.ssm_out = Linear(value_size, h)

    def fuse(self) -> None:
        """The FFN's gate|up (_Block.fuse), and beta|alpha as one matmul (two small gemvs a layer, one launch)."""
        super().fuse()
        self.ssm_beta_alpha = fuse_linears([self.ssm_beta, self.ssm_alpha])
        del self.ssm_beta, self.ssm_alpha

    def forward(self, h: torch.Tensor, rows: StateRows, layer: int) -> torch.Tensor:
        """The block over the step's rows; `layer` is this block's index among the linear layers."""
        ws = int8_input(h, [self.attn_qkv, self.attn_gate, self.ssm_beta_alpha])
        x = self.attn_norm(h, ws=ws)
        mixed = self.attn_qkv(x, ws=ws)  # [T, conv_dim]
        ba = self.ssm_beta_alpha(x, ws=ws)
        b, a = ba[:, :self.v_heads], ba[:, self.v_heads:]  # [T, v_heads] each, before sigmoid / softplus
        out = torch.empty(h.shape[0], self.v_heads, self.v_dim, dtype=torch.float32, device=h.device)
        nd = rows.n_decode
        if nd:
            self.decode(mixed[:nd], a[:nd], b[:nd], rows, layer, out[:nd])
        if not rows.chunks:
            return self._finish(h, x, out, ws)
        mixed, a, b = mixed.float(), a.float(), b.float()
        beta, g = torch.sigmoid(b), self._decay(a)
        weight = self.ssm_conv1d.weight  # [conv_dim, kernel], fp32
        for i, (start, n, position, _slot) in enumerate(rows.chunks):
            slots = rows.slots[nd + i: nd + i + 1]
            conv, ssm = rows.read(layer, slots)
            if rows.trees[i] is not None:  # a verification: every row from its parent's state, all kept
                window = rows.tree_window(i, weight.shape[-1])
                ext = torch.cat((conv[0], mixed[start:start + n].T), dim=-1)[:, window]  # [C, n, K]
                q, k, v = self._qkv(F.silu((ext * weight[:, None, :]).sum(-1)).T)
                states = rows.verify_states(layer, i, n)
                states[0] = ssm[0]
                if triton_deltanet.use_tree_kernel(q):  # every row in one launch
                    triton_deltanet.tree_step(q, k, v, a[start:start + n], b[start:start + n], self.ssm_a,
                                              self.ssm_dt.bias, rows.tree_parents(i), states, out[start:start + n])
                else:
                    for r, parents in rows.tree_levels(i):  # one batched recurrent step per depth
                        at = start + r
                        out[at], states[r + 1] = recurrent_gated_delta_step(q[r], k[r], v[r], g[at], beta[at],
                                                                            states[parents])
                rows.stage_verified(layer, i, ext[..., 1:].transpose(0, 1), states)
                continue
            if position == 0:  # transformers' zero left padding, and an empty state
                conv, ssm = torch.zeros_like(conv), torch.zeros_like(ssm)
            ext = torch.cat((conv[0], mixed[start:start + n].T), dim=-1)  # [C, K-1+n]
            q, k, v = self._qkv(F.silu(F.conv1d(ext[None], weight[:, None, :], groups=self.conv_dim)[0].T))
            # The delta rule runs in pieces that end where the prefix cache keeps a state (then at the end).
            s, done, kept = ssm[0], 0, conv.shape[-1]
            for cut, capture in [*rows.captures[i], (n, None)]:
                if cut > done:
                    part = slice(start + done, start + cut)
                    out[part], s = chunk_gated_delta(q[done:cut], k[done:cut], v[done:cut], g[part], beta[part], s)
                    done = cut
                if capture is not None:  # after `cut` rows the conv keeps the inputs ext[cut: cut + K-1]
                    rows.capture(layer, capture, ext[:, cut:cut + kept], s)
            rows.stage(layer, slots, ext[None, :, ext.shape[1] - kept:], s[None])
        return self._finish(h, x, out, ws)

    def _finish(self, h: torch.Tensor, x: torch.Tensor, out: torch.Tensor, ws: torch.Tensor | None) -> torch.Tensor:
        """The gated output norm, `ssm_out`, the residual and the FFN, from the delta rule's outputs `out`
        (`ws`: x's int8 workspace, or None)."""
        z = self.attn_gate(x, ws=ws)
        if triton_ops.use_kernels(h) and not torch.is_grad_enabled():  # one launch, and ssm_out's int8 rows
            ws_out = int8_input(z, [self.ssm_out]) if self.v_dim % 32 == 0 else None  # whole blocks a head
            y = triton_ops.gated_rms_norm(out, z, self.ssm_norm.weight, self.ssm_norm.eps, h.dtype, ws=ws_out)
            return self.ffn(h, self.ssm_out(y, ws=ws_out))
        y = triton_ops.gated_rms_norm_ref(out, z, self.ssm_norm.weight, self.ssm_norm.eps, h.dtype)
        return self.ffn(h, self.ssm_out(y))

    def decode(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: StateRows, layer: int,
               out: torch.Tensor) -> None:
        """One recurrent step of the step's B decoding rows (slots `rows.slots[:B]`) into `out` [B, v_heads,
        v_dim] from their projections (activation dtype; the math is fp32): the fused kernels where they run (new
        states written where `rows.decode_targets` says), else plain torch (new states staged)."""
        slots = rows.slots[:mixed.shape[0]]
        weight = self.ssm_conv1d.weight  # [conv_dim, kernel], fp32
        if triton_deltanet.use_kernel(mixed):
            conv, ssm, dst = rows.decode_targets(layer)
            triton_deltanet.decode_step(mixed, a, b, weight, self.ssm_a, self.ssm_dt.bias, rows.states.conv[layer],
                                        rows.states.ssm[layer], slots, conv, ssm, dst, out, self.k_heads)
            return
        conv, ssm = rows.read(layer, slots)  # [B, C, K-1], [B, Hv, Dk, Dv]
        window = torch.cat((conv, mixed.float()[:, :, None]), dim=-1)  # [B, C, K]
        q, k, v = self._qkv(F.silu((window * weight).sum(-1)))
        o, ssm = recurrent_gated_delta_step(q, k, v, self._decay(a.float()), torch.sigmoid(b.float()), ssm)
        out.copy_(o)
        rows.stage(layer, slots, window[..., 1:], ssm)

    def _decay(self, a: torch.Tensor) -> torch.Tensor:
        """The per-token log decay g = ssm_a * softplus(alpha x + dt_bias) from the `ssm_alpha` outputs."""
        return self.ssm_a * F.softplus(a + self.ssm_dt.bias)

    def _qkv(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split conv outputs [T, conv_dim] into q, k [T, v_heads, k_dim] (L2-normed, q scaled, each q/k head
        tiled over the value heads) and v [T, v_heads, v_dim]."""
        ks = self.k_heads * self.k_dim
        q = l2norm(c[:, :ks].view(-1, self.k_heads, self.k_dim)) * self.k_dim**-0.5
        k = l2norm(c[:, ks:2 * ks].view(-1, self.k_heads, self.k_dim))
        rep = self.v_heads // self.k_heads
        return q.repeat(1, rep, 1), k.repeat(1, rep, 1), c[:, 2 * ks:].view(-1, self.v_heads, self.v_dim)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (fla's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for a batch: q/k [B, H, Dk], v [B, H, Dv], g/beta [B, H],
    state [B, H, Dk, Dv] -> (output [B, H, Dv], new state). fp32."""
    state = state * g.exp()[..., None, None]
    predicted = torch.einsum("bhk,bhkv->bhv", k, state)
    delta = (v - predicted) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q, state), state


def chunk_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, chunk: int = DELTA_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence's rows, `chunk` rows at a time (the WY / UT-transform form):
    q/k [T, H, Dk], v [T, H, Dv], g/beta [T, H], state [H, Dk, Dv] -> (output [T, H, Dv], final state).

    Within a block, with G the cumulative log decay, the T rows' delta updates fold into one triangular
    solve: (I + strict_lower(beta_i k_i.k_j e^{G_i-G_j})) [U | W] = [beta v | beta k e^G]; then, from the
    state S at the block's start, v' = U - W S, o = (q e^G) S + (q k^T e^{G_i-G_j}, j <= i) v' and
    S <- e^{G_last} S + (k e^{G_last - G})^T v'. Padding rows (g = 0, k = 0) change nothing. fp32."""
    T, H, _ = q.shape
    pad = -T % chunk
    q, k, v = (F.pad(t.transpose(0, 1), (0, 0, 0, pad)) for t in (q, k, v))  # [H, T', D]
    g, beta = (F.pad(t.T, (0, pad)) for t in (g, beta))  # [H, T']
    n = (T + pad) // chunk
    q, k, v = (t.reshape(H, n, chunk, -1) for t in (q, k, v))
    g, beta = g.reshape(H, n, chunk).cumsum(-1), beta.reshape(H, n, chunk)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, n, C, C]
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * g.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * g.exp()[..., None]
    k_decayed = k * (g[..., -1:] - g).exp()[..., None]
    block_decay = g[..., -1].exp()[..., None, None]  # [H, n, 1, 1]
    if triton_deltanet.use_kernel(q) and chunk >= 16 and chunk & (chunk - 1) == 0:  # the loop below, one launch
        out, state = triton_deltanet.chunk_scan(u, w, q_decayed, attn, k_decayed, block_decay[..., 0, 0], state)
        return out.reshape(H, n * chunk, -1)[:, :T].transpose(0, 1), state
    out = torch.empty_like(v)
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ state
        out[:, i] = q_decayed[:, i] @ state + attn[:, i] @ v_new
        state = state * block_decay[:, i] + k_decayed[:, i].transpose(-1, -2) @ v_new
    return out.reshape(H, n * chunk, -1)[:, :T].transpose(0, 1), state


class Qwen35Model(DecoderModel):
    """Embedding -> hybrid blocks -> final norm -> LM head: DecoderModel's interface (embed, logits, lm_head,
    finalize, init_rotary, forward) with the step's `StateRows` as one more forward input.

    It shares DecoderModel's embedding, head and rotary code; its blocks are its own."""

    def __init__(self, cfg: ModelConfig) -> None:
        nn.Module.__init__(self)  # DecoderModel's __init__ would build dense blocks
        self.cfg = cfg
        self.token_embd = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blk = nn.ModuleList(DeltaNetBlock(cfg, i) if t == "linear" else GatedAttentionBlock(cfg, i)
                                 for i, t in enumerate(cfg.layer_types))
        self.output_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.output = Linear(cfg.hidden_size, cfg.vocab_size)
        self.rotary = nn.ModuleDict()

    def finalize(self, device: torch.device | str, freq_factors: torch.Tensor | None = None) -> None:
        """After the weights are assigned: norms and the small DeltaNet tensors (decay rates, dt bias, conv
        taps: what the fp32 state update reads) in fp32, the dense FFNs' gate|up fused, rotary tables."""
        for block in self.blk:
            block.fuse()
        for module in self.modules():
            if isinstance(module, RMSNorm | _Tensors):
                for name, p in module.named_parameters(recurse=False):
                    setattr(module, name, nn.Parameter(p.float(), requires_grad=False))
            elif isinstance(module, DeltaNetBlock):
                module.ssm_a = nn.Parameter(module.ssm_a.float(), requires_grad=False)
        self.init_rotary(device, freq_factors)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: torch.Tensor,
        meta: AttentionMetadata,
        capture: Sequence[int] = (),
        inputs_embeds: torch.Tensor | None = None,
        state: StateRows | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run the blocks over the step's rows. kv: [full-attention layers, 2, slots, kv_heads, head_dim];
        `state`: the linear layers' slots for these rows (required). The step's new states are written
        once every block has run."""
        if state is None:
            raise ValueError("a hybrid model's forward needs the step's recurrent state rows")
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary["full"](positions, h.dtype)
        captured: list[torch.Tensor] = []
        n_kv = n_linear = 0
        for i, block in enumerate(self.blk):
            if isinstance(block, DeltaNetBlock):
                h = block(h, state, n_linear)
                n_linear += 1
            else:
                h = block(h, rope, kv[n_kv, 0], kv[n_kv, 1], meta)
                n_kv += 1
            if i in capture:
                captured.append(h)
        state.commit()
        return h, captured
