"""Building blocks shared by every model family: RMSNorm and rotary embedding.

Their math is the pure-torch reference in triton_ops.py; on CUDA, RMSNorm runs
the fused Triton kernel instead (`triton_ops.use_kernels`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lucebox.engine import triton_ops
from lucebox.engine.config import RopeScaling


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, multiplied by the stored weight.

    The weight is the full multiplier (Gemma's `1 + w` is folded in at load)
    and is kept in fp32 whatever the model dtype (`DecoderModel.finalize`).
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton_ops.use_kernels(x):
            return triton_ops.rms_norm(x, self.weight, self.eps)  # one kernel instead of cast, norm, cast
        return triton_ops.rms_norm_ref(x, self.weight, self.eps)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling, max_position: int, freq_factors: torch.Tensor | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention factor, following the formulas of
    each scaling type as Hugging Face transformers defines them.

    Computed in fp32 exactly as transformers does: Gemma 3's activations reach
    1e5, and a one-ulp difference in a frequency shows up in its logits.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    attn_factor = 1.0
    if freq_factors is not None:  # GGUF llama3: precomputed per-dimension divisors
        inv = inv / freq_factors.float()
    elif scaling.kind == "linear":
        inv = inv / scaling.factor
    elif scaling.kind == "llama3":
        old = scaling.original_max_position or max_position
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
        smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    elif scaling.kind == "yarn":
        old = scaling.original_max_position or max_position

        def corr_dim(rot: float) -> float:
            return (head_dim * math.log(old / (rot * 2 * math.pi))) / (2 * math.log(theta))

        low = max(math.floor(corr_dim(scaling.beta_fast)), 0)
        high = min(math.ceil(corr_dim(scaling.beta_slow)), head_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv = (inv / scaling.factor) * (1 - extrapolation) + inv * extrapolation
        attn_factor = scaling.attention_factor or (
            0.1 * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0
        )
    return inv.to(torch.float32), float(attn_factor)


class Rotary(nn.Module):
    """cos/sin for given positions, computed on the fly (CUDA-graph friendly)."""

    def __init__(self, inv_freq: torch.Tensor, attn_factor: float = 1.0) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attn_factor = attn_factor

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attn_factor).to(dtype), (emb.sin() * self.attn_factor).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on x [T, heads, head_dim] with cos/sin [T, head_dim]."""
    return triton_ops.apply_rotary_ref(x, cos, sin)
