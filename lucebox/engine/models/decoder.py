"""The decoder every supported architecture runs on.

Llama 2/3, SmolLM2 and Mistral are the base; Qwen2 adds QKV bias, Qwen3 adds
q/k norm, Gemma 3 adds scaled embeddings, sandwich norms, GeGLU, a second
RoPE base and sliding-window layers. Each difference is a ModelConfig field,
so one block class serves them all (a family whose block differs in kind
gets its own file here). A mixture-of-experts layer (Qwen3-MoE) is this block
with models/moe.py's MoE in place of the dense MLP. Laguna adds per-layer query
head counts, a softplus output gate and partial rotary on its full-attention
layers (a rotary table narrower than the head rotates only its first dims).

Parameter names are the GGUF tensor names (`blk.0.attn_q.weight` …), so a
GGUF state dict loads as is and HF folders are mapped to them at load.

Two paths compute the same thing. The eager one (`DecoderBlock.forward_with`:
`qkv`, a caller's attention, `after_attention`) is the reference and the CPU
path, and the only copy of the block's math outside the kernels: the PFlash
scorer runs these methods with its own (dense or block-sparse) attention, and
the drafter trainer's target features come from `DecoderModel.forward`. On
CUDA (`triton_ops.use_kernels`) `forward_fused` runs the small ops as fused
Triton kernels, about 10 kernels a layer instead of 22: it carries the
residual stream as (sublayer output, residual) so that each residual add
happens inside the next norm's kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lucebox.engine.kernels import triton_ops as ops
from lucebox.engine.kernels.attention import AttentionMetadata, paged_attention
from lucebox.engine.models.config import ModelConfig
from lucebox.engine.models.layers import (
    Embedding,
    Linear,
    RMSNorm,
    Rotary,
    apply_rotary,
    down_of_gate_up,
    fuse_linears,
    gated_act,
    int8_input,
    rope_inv_freq,
)
from lucebox.engine.models.moe import MoE

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, rotary_dim]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (q, k, v) -> attention output


class DecoderBlock(nn.Module):
    """Pre-norm attention + gated MLP (or mixture of experts); Gemma 3 adds norms after each (sandwich)."""

    moe: MoE | None = None  # set (by MoE.mount) in a mixture-of-experts layer

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.layer_heads(layer), cfg.num_kv_heads, cfg.head_dim
        q_size = self.num_heads * cfg.head_dim
        self.sliding = cfg.layer_types[layer] == "sliding" and cfg.sliding_window is not None
        self.window = cfg.sliding_window if self.sliding else None  # what a sliding layer's queries see
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim**-0.5
        self.act = cfg.hidden_act
        self.attn_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.attn_q = Linear(h, q_size, bias=bias)
        self.attn_k = Linear(h, cfg.kv_size, bias=bias)
        self.attn_v = Linear(h, cfg.kv_size, bias=bias)
        self.attn_output = Linear(q_size, h, bias=False)
        if cfg.softplus_gate:
            self.attn_gate = Linear(h, self.num_heads * cfg.softplus_gate, bias=False)
        if cfg.qk_norm:
            self.attn_q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.attn_k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(h, cfg.rms_norm_eps)
        if cfg.is_moe(layer):
            MoE(cfg, layer).mount(self)
        else:
            self.ffn_gate = Linear(h, cfg.intermediate_size, bias=False)
            self.ffn_up = Linear(h, cfg.intermediate_size, bias=False)
            self.ffn_down = Linear(cfg.intermediate_size, h, bias=False)
        if cfg.sandwich_norm:
            self.post_attention_norm = RMSNorm(h, cfg.rms_norm_eps)
            self.post_ffw_norm = RMSNorm(h, cfg.rms_norm_eps)

    def fuse(self) -> None:
        """Merge q/k/v and gate/up into one matmul each (fewer, larger kernels)."""
        self.attn_qkv = fuse_linears([self.attn_q, self.attn_k, self.attn_v])
        del self.attn_q, self.attn_k, self.attn_v
        if self.moe is None:
            self.ffn_gate_up = fuse_linears([self.ffn_gate, self.ffn_up])
            del self.ffn_gate, self.ffn_up

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (q/k-normed, not yet rotated) and v of the normed input x, each [T, heads, head_dim].

        The PFlash scorer reads q and k here, before RoPE."""
        return self._split_qkv(self.attn_qkv(x))

    def _split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused projection's rows [T, (hq + 2 hkv) head_dim] as q, k (q/k-normed) and v."""
        hq, hkv = self.num_heads, self.num_kv_heads
        qkv = qkv.view(qkv.shape[0], hq + 2 * hkv, self.head_dim)
        q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
        if hasattr(self, "attn_q_norm"):
            q, k = self.attn_q_norm(q), self.attn_k_norm(k)
        return q, k, v

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projected, normed and rotated q/k, and v, each [T, heads, head_dim]."""
        return self._rotate(self.attn_qkv(x), cos, sin)

    def _rotate(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self._split_qkv(qkv)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.moe is not None:
            return self.moe(x)
        return self.ffn_down(gated_act(*self.ffn_gate_up(x).chunk(2, dim=-1), self.act))

    def gated(self, a: torch.Tensor, x: torch.Tensor, ws: torch.Tensor | None = None) -> torch.Tensor:
        """Laguna's output gate: attention output a [T, heads, head_dim] times softplus(attn_gate x) of the
        normed input x, one value per head (or per channel), the softplus in fp32 as transformers does. `ws`:
        x's int8 workspace where its norm wrote one."""
        gate = F.softplus(self.attn_gate(x, ws=ws).float()).to(a.dtype)
        return a * gate.view(a.shape[0], self.num_heads, -1)

    def after_attention(self, h: torch.Tensor, a: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        """The rest of the block once attention gave `a` [T, heads, head_dim] for the stream h [T, hidden]:
        output gate, output projection, (sandwich) norms, both residual adds and the MLP. `x`: attn_norm(h)
        where the caller has it (the gate reads it; recomputed if not given)."""
        if hasattr(self, "attn_gate"):
            a = self.gated(a, self.attn_norm(h) if x is None else x)
        a = self.attn_output(a.reshape(h.shape[0], -1))
        if hasattr(self, "post_attention_norm"):
            a = self.post_attention_norm(a)
        h = h + a
        m = self.mlp(self.ffn_norm(h))
        if hasattr(self, "post_ffw_norm"):
            m = self.post_ffw_norm(m)
        return h + m

    def forward_with(self, h: torch.Tensor, rope: Rope, attend: Attend) -> torch.Tensor:
        """The block (eager reference) with a caller's attention: `attend(q, k, v)` gets the rotated q/k and v
        [T, heads, head_dim] and returns [T, heads, head_dim] (paged over the cache, or dense_attention)."""
        x = self.attn_norm(h)
        q, k, v = self.qkv(x, *rope)
        return self.after_attention(h, attend(q, k, v), x)

    def forward(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if ops.use_kernels(h):
            out, residual = self.forward_fused(h, None, rope, k_cache, v_cache, meta)
            return out + residual

        def paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return paged_attention(q, k, v, k_cache, v_cache, meta, scale=self.scale, sliding=self.sliding)

        return self.forward_with(h, rope, paged)

    def forward_fused(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with fused Triton kernels. The residual stream is h + residual, its add left to the
        next norm (residual None: h is the stream itself); returns the block's output in the same form."""
        # Where the projections read x as int8, the norm's kernel writes that too (one launch, not two).
        ws = int8_input(h, [self.attn_qkv, self.attn_gate] if hasattr(self, "attn_gate") else [self.attn_qkv])
        if residual is None:
            x, residual = ops.rms_norm(h, self.attn_norm.weight, self.attn_norm.eps, ws=ws), h
        else:
            x, residual = ops.add_rms_norm(h, residual, self.attn_norm.weight, self.attn_norm.eps, ws=ws)
        qkv = self.attn_qkv(x, ws=ws)
        if rope[0].shape[-1] == self.head_dim:
            qk_norm = hasattr(self, "attn_q_norm")
            q, k, v = ops.rope_qk_and_cache(
                qkv, *rope, k_cache, v_cache, meta.slot_mapping, self.num_heads, self.num_kv_heads,
                q_norm_w=self.attn_q_norm.weight if qk_norm else None,
                k_norm_w=self.attn_k_norm.weight if qk_norm else None,
                eps=self.attn_q_norm.eps if qk_norm else 0.0,
            )
            # A q8_0 cache (int8) is left unwritten by the fused kernel: paged_attention quantizes the new rows.
            write_kv = k_cache.dtype == torch.int8
        else:
            # Partial rotary (Laguna's full-attention layers): the kernel rotates whole heads, so these layers
            # take the eager q/k/v (a few more small kernels) and paged_attention writes the cache.
            q, k, v = self._rotate(qkv, *rope)
            write_kv = True
        # The output projection's int8 input comes from the attention kernel too (not after Laguna's gate).
        ws_o = None if hasattr(self, "attn_gate") else int8_input(q.reshape(q.shape[0], -1), [self.attn_output])
        a = paged_attention(q, k, v, k_cache, v_cache, meta, scale=self.scale, sliding=self.sliding,
                            write_kv=write_kv, ws=ws_o)
        if hasattr(self, "attn_gate"):
            a = self.gated(a, x, ws)
        a = self.attn_output(a.reshape(h.shape[0], -1), ws=ws_o)
        # Gemma 3's post-attention norm happens in the same kernel, before the add.
        post = self.post_attention_norm.weight if hasattr(self, "post_attention_norm") else None
        ws = self.moe.int8_input(a) if self.moe is not None else int8_input(a, [self.ffn_gate_up])
        x, residual = ops.add_rms_norm(a, residual, self.ffn_norm.weight, self.ffn_norm.eps, x_weight=post, ws=ws)
        # A mixture of experts runs its eager path here (models/moe.py).
        if self.moe is not None:
            m = self.moe(x, ws=ws)
        else:
            gate_up = self.ffn_gate_up(x, ws=ws)
            m = down_of_gate_up(self.ffn_down, gate_up, self.act)  # one launch fewer on the int8 kernels
            if m is None:
                m = self.ffn_down(ops.act_mul(gate_up, self.act))
        if hasattr(self, "post_ffw_norm"):
            m = ops.rms_norm(m, self.post_ffw_norm.weight, self.post_ffw_norm.eps)
        return m, residual


class DecoderModel(nn.Module):
    """Embedding → decoder blocks → final norm → LM head (tied or untied)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.token_embd = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blk = nn.ModuleList(DecoderBlock(cfg, i) for i in range(cfg.num_layers))
        self.output_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.output = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = nn.ModuleDict()

    def finalize(self, device: torch.device | str, freq_factors: torch.Tensor | None = None) -> None:
        """After the weights are assigned: fuse projections, keep norms in fp32, build rotary tables."""
        for block in self.blk:
            block.fuse()
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.weight = nn.Parameter(module.weight.float(), requires_grad=False)
        self.init_rotary(device, freq_factors)

    def init_rotary(self, device: torch.device | str, freq_factors: torch.Tensor | None = None) -> None:
        """(Re)build the rotary tables, each over the dims its layers rotate (Laguna: half the head in full layers)."""
        cfg = self.cfg
        inv, factor = rope_inv_freq(cfg.rotary_dim or cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                    cfg.max_position, freq_factors)
        self.rotary["full"] = Rotary(inv.to(device), factor)
        if cfg.rope_local_theta is not None:
            inv, factor = rope_inv_freq(cfg.rope_local_dim or cfg.head_dim, cfg.rope_local_theta,
                                        cfg.rope_local_scaling, cfg.max_position)
            self.rotary["sliding"] = Rotary(inv.to(device), factor)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.token_embd(input_ids)
        if self.cfg.embed_scale != 1.0:
            # As HF Gemma does: the scale is an fp32 constant, cast to the activation dtype.
            h = h * torch.tensor(self.cfg.embed_scale, dtype=torch.float32).to(h.dtype)
        return h

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: torch.Tensor,
        meta: AttentionMetadata,
        capture: Sequence[int] = (),
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run the blocks over the step's rows.

        kv: [layers, 2, slots, kv_heads, head_dim]. Returns the last hidden
        state (before the final norm) and the outputs of the layers listed in
        `capture` (DFlash conditions its drafter on them).
        """
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        ropes = self.ropes(positions, h.dtype)
        if ops.use_kernels(h):
            return self._forward_fused(h, ropes, kv, meta, capture)
        captured: list[torch.Tensor] = []
        for i, block in enumerate(self.blk):
            h = block(h, self.rope_for(block, ropes), kv[i, 0], kv[i, 1], meta)
            if i in capture:
                captured.append(h)
        return h, captured

    def _forward_fused(
        self,
        h: torch.Tensor,
        ropes: dict[str, Rope],
        kv: torch.Tensor,
        meta: AttentionMetadata,
        capture: Sequence[int],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`forward`'s block loop on the fused kernels: the residual add travels into the next block's norm."""
        residual: torch.Tensor | None = None
        captured: list[torch.Tensor] = []
        for i, block in enumerate(self.blk):
            h, residual = block.forward_fused(h, residual, self.rope_for(block, ropes), kv[i, 0], kv[i, 1], meta)
            if i in capture:
                captured.append(h + residual)
        return (h if residual is None else h + residual), captured

    def ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, Rope]:
        """cos/sin of every rotary table ("full", and "sliding" when sliding layers have their own base)."""
        return {name: rot(positions, dtype) for name, rot in self.rotary.items()}

    @staticmethod
    def rope_for(block: DecoderBlock, ropes: dict[str, Rope]) -> Rope:
        """The table a block rotates with (Gemma 3's sliding layers use the local base)."""
        return ropes["sliding"] if block.sliding and "sliding" in ropes else ropes["full"]

    def lm_head(self, h: torch.Tensor, ws: torch.Tensor | None = None) -> torch.Tensor:
        """h @ head.T: the tied embedding or `output`, dense or quantized (no dense copy of a quantized head).
        `ws`: h's int8 workspace, where the final norm wrote one."""
        return self.token_embd.as_linear(h, ws) if self.cfg.tie_word_embeddings else self.output(h, ws=ws)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head over the rows whose next token is wanted."""
        ws = int8_input(hidden, [self.token_embd if self.cfg.tie_word_embeddings else self.output])
        h = self.output_norm(hidden, ws=ws)
        logits = self.lm_head(h, ws)
        if self.cfg.final_logit_softcap:
            cap = self.cfg.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
