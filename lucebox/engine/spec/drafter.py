"""The DFlash drafter: a few Qwen3-style layers that draft a block of tokens in one pass.

Layout and math follow docs/spec/DFLASH.md. The drafter has no embedding
and no LM head: its input rows are the target's embeddings of the block
`[last_token, MASK × (B-1)]`, its logits are the target's LM head applied to
its own final norm. It is conditioned on the target through features: the
outputs of chosen target layers, fused (`hidden_norm(fc(concat))`) into one
row per context position, projected to K/V by every drafter layer and kept in
the drafter's own paged KV cache. Block rows attend to all context keys and
to every block key (not causal): the paged attention every target layer
calls, one bidirectional group (`block_metadata`). The block's K/V are written
to the sequence's slots of the block's positions, which the step's
verification reserves (`SpecDecoder.reserve_rows`) and the accepted rows'
context K/V overwrite: they are scratch there, never read as context.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lucebox.engine.kernels import triton_ops as ops
from lucebox.engine.kernels.attention import AttentionMetadata, AttnGroup, paged_attention
from lucebox.engine.models.config import ModelConfig, RopeScaling
from lucebox.engine.models.layers import RMSNorm, Rotary, apply_rotary, gated_act, rope_inv_freq
from lucebox.errors import ModelFileError

WEIGHTS = "model.safetensors"


@dataclass
class DrafterConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = None
    max_position: int = 40960
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_layers

    @classmethod
    def from_json(cls, raw: dict[str, Any], where: str) -> DrafterConfig:
        try:
            n_layers = int(raw["num_hidden_layers"])
            n_target = int(raw.get("num_target_layers") or 0)
            dflash = raw.get("dflash_config") or {}
            ids = dflash.get("target_layer_ids") or raw.get("target_layer_ids")
            if ids is None:
                if not n_target:
                    raise KeyError("dflash_config.target_layer_ids (or num_target_layers for the default)")
                ids = default_target_layers(n_target, n_layers)
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            return cls(
                hidden_size=hidden,
                num_layers=n_layers,
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                intermediate_size=int(raw["intermediate_size"]),
                vocab_size=int(raw["vocab_size"]),
                block_size=int(raw["block_size"]),
                target_layer_ids=[int(i) for i in ids],
                mask_token_id=int(dflash.get("mask_token_id", raw.get("mask_token_id"))),
                num_target_layers=n_target,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta", 1_000_000.0)),
                rope_scaling=raw.get("rope_scaling"),
                max_position=int(raw.get("max_position_embeddings", 40960)),
                layer_types=list(raw.get("layer_types") or []),
                sliding_window=raw.get("sliding_window"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelFileError(f"{where}: missing or bad drafter config field {exc}") from None

    def to_json(self) -> dict[str, Any]:
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position,
            "layer_types": self.layer_types,
            "sliding_window": self.sliding_window,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {"target_layer_ids": self.target_layer_ids, "mask_token_id": self.mask_token_id},
            "tie_word_embeddings": False,
        }


def default_target_layers(n_target: int, n_draft: int) -> list[int]:
    """DFLASH.md fallback: one draft layer → [L//2], else round(1 + k*(L-4)/(n-1))."""
    if n_draft == 1:
        return [n_target // 2]
    ids = [round(1 + k * (n_target - 4) / (n_draft - 1)) for k in range(n_draft)]
    return [min(max(i, 0), n_target - 1) for i in ids]  # tiny targets: keep ids inside the model


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, index: int) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.sliding = cfg.layer_types[index] == "sliding_attention" and cfg.sliding_window is not None
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(h, cfg.num_heads * hd, bias=False)
        self.self_attn.k_proj = nn.Linear(h, cfg.num_kv_heads * hd, bias=False)
        self.self_attn.v_proj = nn.Linear(h, cfg.num_kv_heads * hd, bias=False)
        self.self_attn.o_proj = nn.Linear(cfg.num_heads * hd, h, bias=False)
        self.self_attn.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.self_attn.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def fuse_weights(self) -> None:
        """For inference: q/k/v, and gate/up, as one matrix each (one projection launch instead of three and
        two); the Linear weights become row views of them, so nothing is stored twice."""
        a, m = self.self_attn, self.mlp
        nq, nk = a.q_proj.weight.shape[0], a.k_proj.weight.shape[0]
        qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        gate_up = torch.cat([m.gate_proj.weight, m.up_proj.weight])
        a.q_proj.weight, a.k_proj.weight, a.v_proj.weight = (
            nn.Parameter(w, requires_grad=False) for w in qkv.split([nq, nk, nk]))
        m.gate_proj.weight, m.up_proj.weight = (nn.Parameter(w, requires_grad=False) for w in gate_up.chunk(2))
        self.qkv_weight, self.kv_weight, self.gate_up_weight = qkv, qkv[nq:], gate_up

    def _fused(self, x: torch.Tensor) -> bool:
        """Whether this pass runs on the fused kernels (CUDA, weights fused by `ready` and still their views: a
        later `.to()` would leave the fused copies stale; no gradients: the kernels have no backward) or the
        reference."""
        return (ops.use_kernels(x) and not torch.is_grad_enabled() and hasattr(self, "qkv_weight")
                and self.self_attn.q_proj.weight.data_ptr() == self.qkv_weight.data_ptr()
                and self.mlp.gate_proj.weight.data_ptr() == self.gate_up_weight.data_ptr())

    def write_context(self, x_ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slots: torch.Tensor) -> None:
        """`context_kv` of fused context rows written into the drafter's cache at `slots` [T] (on the fused
        kernels: one projection and one norm-rotate-store launch)."""
        if self._fused(x_ctx) and k_cache.dtype != torch.int8:
            k_norm = self.self_attn.k_norm  # no q heads: the q-norm weight the call takes is never read
            ops.rope_qk_and_cache(F.linear(x_ctx, self.kv_weight), cos, sin, k_cache, v_cache, slots, 0,
                                  self.num_kv_heads, k_norm.weight, k_norm.weight, k_norm.eps)
            return
        k, v = self.context_kv(x_ctx, cos, sin)
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)

    def context_kv(
        self, x_ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed, rotated) and V [T, kv_heads, head_dim] of fused context rows (block rows: the same math)."""
        a = self.self_attn
        t = x_ctx.shape[0]
        k = a.k_norm(a.k_proj(x_ctx).view(t, self.num_kv_heads, self.head_dim))
        v = a.v_proj(x_ctx).view(t, self.num_kv_heads, self.head_dim)
        return apply_rotary(k, cos, sin), v

    def block_qkv(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (normed, rotated) and v of block rows h [T, hidden] (the residual stream, normed here)."""
        a = self.self_attn
        hn = self.input_layernorm(h)
        q = apply_rotary(a.q_norm(a.q_proj(hn).view(h.shape[0], self.num_heads, self.head_dim)), cos, sin)
        k, v = self.context_kv(hn, cos, sin)
        return q, k, v

    def after_attention(self, h: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """Residual stream h [..., hidden] after the attention output att [..., heads * head_dim]: o_proj and
        the SwiGLU MLP, each added to the stream."""
        h = h + self.self_attn.o_proj(att)
        m = self.mlp
        x = self.post_attention_layernorm(h)
        return h + m.down_proj(gated_act(m.gate_proj(x), m.up_proj(x)))

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """h [G, B, H] block rows over the context in this layer's caches [slots, Hkv, D]; `meta`
        (`block_metadata`): where the block's own K/V go and what each row sees."""
        g, b, _ = h.shape
        if self._fused(h):
            return self._forward_fused(h, rope, k_cache, v_cache, meta)
        q, k, v = self.block_qkv(h.view(g * b, -1), *rope)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, scale=self.head_dim**-0.5, sliding=self.sliding)
        return self.after_attention(h, out.reshape(g, b, -1))

    def _forward_fused(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor,
                       v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """`forward` on the target's fused kernels (norms, q/k norm + RoPE + K/V store, the paged attention
        kernel, add + norm, SwiGLU) and fused projections: a graph-replayed draft pays every launch."""
        g, b, _ = h.shape
        a, hq, hkv = self.self_attn, self.num_heads, self.num_kv_heads
        flat = h.view(g * b, -1)
        x = ops.rms_norm(flat, self.input_layernorm.weight, self.input_layernorm.eps)
        q, _, _ = ops.rope_qk_and_cache(F.linear(x, self.qkv_weight), *rope, k_cache, v_cache, meta.slot_mapping,
                                        hq, hkv, a.q_norm.weight, a.k_norm.weight, a.q_norm.eps)
        out = paged_attention(q, None, None, k_cache, v_cache, meta, scale=self.head_dim**-0.5,
                              sliding=self.sliding, write_kv=False)
        x, res = ops.add_rms_norm(F.linear(out.reshape(g * b, -1), a.o_proj.weight), flat,
                                  self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        m = F.linear(ops.act_mul(F.linear(x, self.gate_up_weight), "silu"), self.mlp.down_proj.weight)
        return (res + m).view(g, b, -1)


def block_metadata(tables: torch.Tensor, starts: torch.Tensor, block: int, page: int, max_ctx: int,
                   window: int | None, slots: torch.Tensor | None = None) -> AttentionMetadata:
    """The attention of G draft blocks (on the tables' device, no host sync: a CUDA graph holds it): block rows
    of sequence s at positions starts[s].. write their K/V to those positions' slots and each sees every
    context key (< starts[s]) and every key of its block. tables [G, blocks] int64 cover
    starts[s] + block - 1; max_ctx >= every starts[s] + block. Sliding layers keep the context keys within
    `window` of the last context position (the group's q_pos). `slots` [G, block]: those slots, where the caller
    has them already (a graph's every kernel counts)."""
    g = tables.shape[0]
    if slots is None:
        pos = starts[:, None] + torch.arange(block, device=tables.device)[None, :]
        slots = tables.gather(1, pos // page) * page + pos % page
    slots = slots.flatten()
    last = (starts - 1)[:, None].expand(g, block).flatten()
    group = AttnGroup(0, g, block, max_ctx, tables, starts + block, last, bidirectional=True)
    return AttentionMetadata(slots, page, [group], window)


class DFlashDrafter(nn.Module):
    """Weights named as the public checkpoints name them (`fc`, `hidden_norm`, `layers.N...`, `norm`)."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        n_feat = len(cfg.target_layer_ids)
        self.fc = nn.Linear(n_feat * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary: Rotary | None = None

    def init_rotary(self, device: torch.device | str) -> None:
        raw = self.cfg.rope_scaling or {}
        kind = raw.get("rope_type") or raw.get("type") or "none"
        scaling = RopeScaling() if kind in ("none", "default") else RopeScaling(
            kind=kind, factor=float(raw.get("factor", 1.0)),
            original_max_position=int(raw.get("original_max_position_embeddings") or 0),
            low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(raw.get("high_freq_factor", 4.0)))
        inv, factor = rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta, scaling, self.cfg.max_position)
        self.rotary = Rotary(inv.to(device), factor)

    def fuse(self, features: list[torch.Tensor]) -> torch.Tensor:
        """One context row per position from the target layers' outputs (concat in the listed order; one tensor:
        already concatenated)."""
        return self.hidden_norm(self.fc(features[0] if len(features) == 1 else torch.cat(features, dim=-1)))

    @staticmethod
    def random(cfg: DrafterConfig, seed: int = 0, std: float = 0.02) -> DFlashDrafter:
        """A freshly initialised drafter (the starting point of training, and test fixtures)."""
        g = torch.Generator().manual_seed(seed)
        model = DFlashDrafter(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        return model


def check_compatible(cfg: DrafterConfig, target: ModelConfig, where: str) -> None:
    """Refuse a drafter made for another target, with a message naming the mismatch."""
    if cfg.hidden_size != target.hidden_size:
        raise ModelFileError(f"{where}: drafter hidden size {cfg.hidden_size} does not match the target's "
                             f"{target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        raise ModelFileError(f"{where}: drafter vocabulary {cfg.vocab_size} does not match the target's "
                             f"{target.vocab_size}")
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise ModelFileError(f"{where}: mask_token_id {cfg.mask_token_id} is outside the target's vocabulary")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise ModelFileError(f"{where}: target_layer_ids {bad} do not exist in a {target.num_layers}-layer target")
    if cfg.block_size < 2:
        raise ModelFileError(f"{where}: block_size must be at least 2")


def load_drafter(folder: Path, target: ModelConfig, device: torch.device | str,
                 dtype: torch.dtype) -> DFlashDrafter:
    """Load a drafter folder (config.json + model.safetensors) made for `target`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    where = str(folder)
    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFileError(f"{where}: no config.json (is this a DFlash drafter folder?)") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelFileError(f"{where}/config.json: {exc}") from None
    cfg = DrafterConfig.from_json(raw, where)
    check_compatible(cfg, target, where)
    try:
        state = load_file(str(folder / WEIGHTS))
    except FileNotFoundError:
        raise ModelFileError(f"{where}: no {WEIGHTS}") from None
    except (SafetensorError, OSError) as exc:
        raise ModelFileError(f"{where}/{WEIGHTS}: corrupt or truncated ({exc})") from None
    state = {k.removeprefix("model."): v for k, v in state.items()}
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    expected = model.state_dict()
    missing = sorted(expected.keys() - state.keys())
    if missing:
        raise ModelFileError(f"{where}: drafter weights lack {missing[0]}" +
                             (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
    for name, want in expected.items():
        if tuple(state[name].shape) != tuple(want.shape):
            raise ModelFileError(f"{where}: {name} has shape {tuple(state[name].shape)}, expected {tuple(want.shape)}")
    model.load_state_dict({k: state[k] for k in expected}, assign=True, strict=True)
    return ready(model, device, dtype)


def ready(model: DFlashDrafter, device: torch.device | str, dtype: torch.dtype) -> DFlashDrafter:
    """The drafter for inference on `device`: its norms in fp32 (as the target's), every other weight in
    `dtype`, its projections fused (`DrafterLayer.fuse_weights`), its rotary table built, no gradients."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.data = p.data.to(device=device, dtype=torch.float32 if name.endswith("norm.weight") else dtype)
        for layer in model.layers:
            layer.fuse_weights()
    model.init_rotary(device)
    return model.eval().requires_grad_(False)


def save_drafter(model: DFlashDrafter, folder: Path) -> None:
    """Write the public layout: config.json + model.safetensors (no prefix on the keys)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.cfg.to_json(), indent=2) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(folder / WEIGHTS))


def drafter_config_for(target: ModelConfig, *, layers: int = 1, block_size: int = 16, mask_token_id: int,
                       target_layers: list[int] | None = None, heads: int | None = None,
                       kv_heads: int | None = None, head_dim: int | None = None,
                       intermediate: int | None = None) -> DrafterConfig:
    """A drafter shaped for a target: same hidden size; heads/FFN default to the target's."""
    return DrafterConfig(
        hidden_size=target.hidden_size,
        num_layers=layers,
        num_heads=heads or target.num_heads,
        num_kv_heads=kv_heads or target.num_kv_heads,
        head_dim=head_dim or target.head_dim,
        intermediate_size=intermediate or target.intermediate_size,
        vocab_size=target.vocab_size,
        block_size=block_size,
        target_layer_ids=target_layers or default_target_layers(target.num_layers, layers),
        mask_token_id=mask_token_id,
        num_target_layers=target.num_layers,
        rms_norm_eps=1e-6,
        rope_theta=target.rope_theta,
        max_position=target.max_position,
    )

