"""Building blocks shared by every model family: linear layers and embeddings
whose weight is dense or GGUF-quantized, RMSNorm and rotary embedding.

Their math is the pure-torch reference in triton_ops.py; on CUDA, RMSNorm runs
the fused Triton kernel instead (`triton_ops.use_kernels`), and quantized
weights run the kernels of engine/weights/quant.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lucebox.engine.kernels import triton_ops
from lucebox.engine.models.config import RopeScaling
from lucebox.engine.weights.quant import QuantWeight, qlinear
from lucebox.engine.weights.quant.linear import empty_workspace, int8_workspace, reads_int8, use_kernels

# LUCEBOX_INT8_INPUT=0: no int8 rows written by the kernel that makes an input (int8_input), read at forward time.
INT8_INPUT = os.environ.get("LUCEBOX_INT8_INPUT", "1") != "0"


class _MaybeQuant(nn.Module):
    """A module whose [rows, cols] `weight` is a dense Parameter or, once a `QuantWeight` is loaded into it
    (`load_state_dict`), that weight's raw blocks (buffer `qdata`) and type.

    Loading a QuantWeight under `<prefix>weight` replaces the dense Parameter, so a GGUF file's blocks go
    to the device as they are. `weight` stays readable for callers that need a dense tensor: for a
    quantized module it is dequantized on each access (full size; the model's own paths never do this).
    """

    qtype: str | None = None
    dtype: torch.dtype = torch.float32  # what `weight` dequantizes to: the model's compute dtype

    @property
    def quant(self) -> QuantWeight:
        return QuantWeight(self.qdata, self.qtype, self.cols, self.dtype,  # type: ignore[arg-type]
                           self._buffers.get("qdense"))

    def set_quant(self, w: QuantWeight, dtype: torch.dtype) -> None:
        self._parameters.pop("weight", None)
        self.register_buffer("qdata", w.data)
        self._buffers.pop("qdense", None)
        if w.dense is not None:  # `--weights both`: the dense copy the blocks keep beside them
            self.register_buffer("qdense", w.dense)
        self.qtype, self.cols, self.dtype = w.qtype, w.cols, dtype

    def __getattr__(self, name: str) -> Any:
        if name == "weight" and self.__dict__.get("qtype") is not None:
            dense = self._buffers.get("qdense")
            return dense if dense is not None else self.quant.dequantize(self.dtype)
        return super().__getattr__(name)

    def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        w = state_dict.get(prefix + "weight")
        if isinstance(w, QuantWeight):
            self._parameters.pop("weight", None)
            state_dict = {k: v for k, v in state_dict.items() if k != prefix + "weight"}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if isinstance(w, QuantWeight):
            self.set_quant(w, w.dtype)


class Linear(_MaybeQuant):
    """y = x W^T (+ b), W dense [out, in] or GGUF-quantized (the same math, from the blocks)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.cols = in_features, out_features, in_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, ws: torch.Tensor | None = None) -> torch.Tensor:
        """`ws`: x's int8 workspace (int8_workspace, int8_input), for a quantized weight whose kernel reads x as
        int8; a dense weight reads x and ignores it."""
        if self.qtype is not None:
            return qlinear(x, self.quant, self.bias, ws=ws)
        if self.bias is None and triton_ops.small_linear_ok(x, self.weight):
            return triton_ops.small_linear(x, self.weight)
        return F.linear(x, self.weight, self.bias)


class Embedding(_MaybeQuant):
    """Token embedding, dense or quantized (then only the looked-up rows are dequantized). Also the tied
    LM head: `as_linear`."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.cols = num_embeddings, embedding_dim, embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qtype is not None:
            return self.quant.rows(ids, self.dtype)
        return F.embedding(ids, self.weight)

    def as_linear(self, x: torch.Tensor, ws: torch.Tensor | None = None) -> torch.Tensor:
        """x @ E^T: logits through the tied embedding (`ws`: x's int8 workspace, as Linear takes it)."""
        if self.qtype is not None:
            return qlinear(x, self.quant, ws=ws)
        return F.linear(x, self.weight)


class ConcatLinear(nn.Module):
    """Several linears over the same input, outputs side by side: a fused q|k|v or gate|up whose parts
    hold weights of different quant types (a Q4_K_M file stores attn_v as Q6_K, attn_q as Q4_K).

    On CPU the parts are dequantized and concatenated into one weight for one matmul, exactly what a
    dense fused weight computes; on CUDA each part's kernel writes its columns of one output, the input
    quantized to int8 once for all of them where their kernels read it so (int8_workspace).
    """

    def __init__(self, parts: list[Linear]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor, ws: torch.Tensor | None = None) -> torch.Tensor:
        """`ws`: x's int8 workspace, where the norm that made x wrote it (int8_input)."""
        parts: list[Linear] = list(self.parts)  # type: ignore[arg-type]
        if not use_kernels(x) or x.dim() != 2:
            if ws is not None:
                raise ValueError("ConcatLinear: an int8 workspace without the quantized kernels")
            weight = torch.cat([p.quant.dense_as(x.dtype) if p.qtype else p.weight.to(x.dtype) for p in parts])
            bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])  # type: ignore[misc]
            return F.linear(x, weight, bias)
        out = torch.empty(x.shape[0], self.out_features, device=x.device, dtype=x.dtype)
        if ws is None:  # x quantized once for all parts
            ws = int8_workspace(x, [p.quant for p in parts if p.qtype is not None])
        col = 0
        for p in parts:
            cols = out[:, col:col + p.out_features]
            if p.qtype is not None:
                qlinear(x, p.quant, p.bias, out=cols, ws=ws)
            else:
                cols.copy_(F.linear(x, p.weight, p.bias))
            col += p.out_features
        return out


def fuse_linears(parts: list[Linear]) -> nn.Module:
    """One module computing the parts side by side: a single Linear when the weights concatenate (all dense,
    or all one quant type), else a ConcatLinear of the runs of neighbouring parts that do (a Q4_K_M layer's
    q|k as one Q4_K weight beside a Q6_K v: two kernels, not three)."""
    runs: list[list[Linear]] = []
    for p in parts:
        if runs and runs[-1][0].qtype == p.qtype:
            runs[-1].append(p)
        else:
            runs.append([p])
    if len(runs) > 1:
        return ConcatLinear([_concat(run) for run in runs])
    return _concat(parts)


def _concat(parts: list[Linear]) -> Linear:
    """The parts (one quant type, or all dense) as one Linear of their rows stacked."""
    first = parts[0]
    if len(parts) == 1:
        return first
    has_bias = first.bias is not None
    with torch.device("meta"):  # no dense placeholder of the fused size
        fused = Linear(first.in_features, sum(p.out_features for p in parts), bias=has_bias)
    if first.qtype is None:
        fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
    else:
        fused.set_quant(QuantWeight.cat([p.quant for p in parts]), first.dtype)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)  # type: ignore[misc]
    return fused


def int8_input(x: torch.Tensor, readers: list[nn.Module], also: bool = False) -> torch.Tensor | None:
    """An unfilled int8 workspace for x's rows when a reader of x (a Linear, ConcatLinear or tied head's Embedding)
    holds a quantized weight whose kernel reads x as int8 at this row count (the kernels the tuner chose), else
    None. The kernel that makes x fills it (triton_ops.rms_norm / add_rms_norm `ws`, paged_attention's) and every
    reader is offered it as `ws`: those whose kernels read int8 take it, the rest (dense, or the tuner chose a
    kernel that reads x) read x. x is quantized once, in the launch that makes it, instead of once per reader in
    launches of their own. None off the fused-ops path, where x wants a gradient (the kernels have no backward),
    and with LUCEBOX_INT8_INPUT=0 (each reader then quantizes x itself: the same bytes, for a same-run
    comparison). `also`: another reader reads x as int8 (a mixture of experts' routed experts: MoE.int8_input)."""
    if not INT8_INPUT or not triton_ops.use_kernels(x) or (torch.is_grad_enabled() and x.requires_grad):
        return None
    weights: list[QuantWeight] = []
    for m in readers:
        parts = list(m.parts) if isinstance(m, ConcatLinear) else [m]
        if not all(isinstance(p, (Linear, Embedding)) for p in parts):  # a module that does not take `ws`
            return None
        weights += [p.quant for p in parts if p.qtype is not None]  # type: ignore[union-attr]
    if also and x.dim() == 2 and x.stride(-1) == 1:
        return empty_workspace(x)
    if not reads_int8(x, weights):
        return None
    return empty_workspace(x)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, multiplied by the stored weight.

    The weight is the full multiplier (Gemma's `1 + w` is folded in at load)
    and is kept in fp32 whatever the model dtype (`DecoderModel.finalize`).
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, ws: torch.Tensor | None = None) -> torch.Tensor:
        """`ws` (int8_input): also fill x's normed rows' int8 workspace, in the kernel's launch."""
        if ws is not None:
            return triton_ops.rms_norm(x, self.weight, self.eps, ws=ws)
        # The kernel (one launch instead of cast, norm, cast) has no backward: the drafter trainer's norms,
        # which need gradients, take the reference.
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        if triton_ops.use_kernels(x) and not needs_grad:
            return triton_ops.rms_norm(x, self.weight, self.eps)
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
    """cos/sin for given positions, computed on the fly (CUDA-graph friendly) in three launches: the angles, then
    cos and sin each cast to `dtype` as they are stored (with an attention factor, two more). A step pays this once
    per table and a speculative one three times, so every launch shows."""

    def __init__(self, inv_freq: torch.Tensor, attn_factor: float = 1.0) -> None:
        super().__init__()
        # The frequencies twice over (rotate-half pairs dim i with i + d/2): no concatenation per call.
        self.register_buffer("freq", torch.cat((inv_freq, inv_freq)).float(), persistent=False)
        self.attn_factor = attn_factor

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions[:, None] * self.freq.float()[None, :]  # fp32 (the float() is free; a cast module's isn't)
        if self.attn_factor != 1.0:
            return (angles.cos() * self.attn_factor).to(dtype), (angles.sin() * self.attn_factor).to(dtype)
        out = torch.empty(2, *angles.shape, dtype=dtype, device=angles.device)
        torch.cos(angles, out=out[0])  # computed in fp32, rounded once on the store
        torch.sin(angles, out=out[1])
        return out[0], out[1]


def down_of_gate_up(down: Linear, gate_up: torch.Tensor, act: str) -> torch.Tensor | None:
    """down(act(gate) * up) where the quantized kernels read down's input as int8: the activation, its rounding
    and the int8 quantization in one launch (int8_workspace with `act`), the activated rows never written.
    None where they do not (the caller runs act_mul and down)."""
    if getattr(down, "qtype", None) is None:
        return None
    ws = int8_workspace(gate_up, [down.quant], act)
    if ws is None:
        return None
    return down(gate_up[:, :down.in_features], ws=ws)  # through the module: a tensor-parallel shard sums its part


def gated_act(gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """The gated MLP's middle, act(gate) * up: SwiGLU for "silu", GeGLU (tanh GELU, Gemma) otherwise."""
    return (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on x [T, heads, head_dim] with cos/sin [T, rotary_dim]: a table narrower than the head
    (partial rotary) rotates the first rotary_dim dims and passes the rest, as transformers does."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return triton_ops.apply_rotary_ref(x, cos, sin)
    return torch.cat((triton_ops.apply_rotary_ref(x[..., :r], cos, sin), x[..., r:]), dim=-1)
