"""The mixture-of-experts feed-forward: a router picks `n_experts_used` of `n_experts` SwiGLU experts per
token; an optional shared expert runs on every token (Qwen3-MoE, Qwen3.5-MoE, Laguna).

The experts' weights are one tensor per projection over all experts, as GGUF stores them
(`ffn_gate_exps` [n_experts, ff, hidden] …), held as a 2-D `Linear` of n_experts * ff rows: a GGUF expert
tensor's rows are contiguous per expert, so a quantized file's blocks stay quantized (a `QuantWeight`) and
expert e is the slice of rows [e * ff, (e + 1) * ff), never a dense copy of all experts.

The eager path (the CPU path and the reference) groups the step's (token, expert) pairs by expert: one
matmul per routed expert over its tokens, scaled by the routing weight and added back with index_add, the
order transformers uses. It reads the per-expert counts on the host (one sync per layer), so it cannot be
captured in a CUDA graph. On CUDA a step of few rows (decode, and any step a CUDA graph captures) runs
kernels/triton_moe.py instead: a router kernel, then grouped matmuls over the routed experts, dense or
quantized, the routing read on the device. `experts_every` (every expert over every row, no host sync) is
what a capture gets with that kernel switched off (LUCEBOX_MOE_KERNEL=0). `experts_grouped_mm` is the eager
path as three grouped GEMMs without the host sync (quantized experts dequantized a projection at a time): what
prefill steps take on CUDA (LUCEBOX_MOE_GROUPED_MM=0 turns it off). On the H200, Qwen3-30B-A3B-shaped Q4_K_M, it
prefilled 2048 tokens 12.2x faster than the loop quantized (16.6K vs 1.4K tok/s) and 6.8x dense (21.7K vs 3.2K).

Parameter names are the GGUF tensor names (`ffn_gate_inp`, `ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`,
`exp_probs_b`, `ffn_gate_inp_shexp`, `ffn_gate_shexp`, `ffn_up_shexp`, `ffn_down_shexp`); a block mounts
them on itself (`mount`) so that its parameters keep the file's names (`blk.N.ffn_gate_exps.weight`).

Spark (engine/spark) hooks in at two points, both None by default: `route_counter` counts the routed
(layer, expert) pairs for calibration, and `offload` computes the routed experts from where Spark placed
them (device slots, host memory) instead of the stacked weights.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lucebox.engine.kernels import graph_mode, triton_moe
from lucebox.engine.models.config import ModelConfig
from lucebox.engine.models.layers import Linear, gated_act, int8_input
from lucebox.engine.weights.quant import QuantWeight, qlinear

# torch's grouped GEMM (public as F.grouped_mm in recent releases; torch._grouped_mm since 2.8), for
# `MoE.experts_grouped_mm`, which CUDA prefill steps take (LUCEBOX_MOE_GROUPED_MM=0: the per-expert loop).
_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
GROUPED_MM = os.environ.get("LUCEBOX_MOE_GROUPED_MM", "1") != "0"


class ExpertBias(nn.Module):
    """A per-expert bias added to the sigmoid router's scores for the choice of experts only (GGUF
    `exp_probs_b.bias`, HF `e_score_correction_bias`)."""

    def __init__(self, n_experts: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(n_experts), requires_grad=False)


def expert_rows(lin: Linear, expert: int, rows: int) -> torch.Tensor | QuantWeight:
    """Expert `expert`'s [rows, cols] weight in a stacked expert Linear: a view of its dense rows or of its
    quantized blocks (no copy, nothing dequantized)."""
    lo, hi = expert * rows, (expert + 1) * rows
    if lin.qtype is not None:
        return QuantWeight(lin.qdata[lo:hi], lin.qtype, lin.cols, lin.dtype)
    return lin.weight[lo:hi]


def matmul(x: torch.Tensor, w: torch.Tensor | QuantWeight) -> torch.Tensor:
    """x @ w.T for a dense or quantized weight (the quantized kernels on CUDA)."""
    return qlinear(x, w) if isinstance(w, QuantWeight) else F.linear(x, w)


def expert_ffn(x: torch.Tensor, gate: torch.Tensor | QuantWeight, up: torch.Tensor | QuantWeight,
               down: torch.Tensor | QuantWeight, act: str) -> torch.Tensor:
    """One expert's SwiGLU (GeGLU) on rows x from its three [rows, cols] weights, wherever they are held."""
    return matmul(gated_act(matmul(x, gate), matmul(x, up), act), down)


def _dense(lin: Linear, dtype: torch.dtype) -> torch.Tensor:
    """A stacked expert Linear's whole weight, dense in `dtype`: itself, or its blocks dequantized (on CUDA
    by triton_qmm's dequant kernel)."""
    if lin.qtype is None:
        return lin.weight
    q = lin.quant
    if q.data.is_cuda:
        from lucebox.engine.kernels import triton_qmm

        return triton_qmm.dequantize_rows(q, 0, q.data.shape[0], dtype)
    return q.dequantize(dtype)


class MoE(nn.Module):
    """Router, routed experts and optional shared expert of layer `layer` (its weights' shapes depend only on
    `cfg`; `cfg.is_moe(layer)` tells whether the layer has them): forward(x [T, hidden]) -> [T, hidden]."""

    route_counter: Any = None  # spark.profile.RouteCounter while calibrating: called with (layer, ids)
    offload: Any = None  # spark.offload.LayerOffload when Spark placed this layer's experts
    reduce: Any = None  # tensor parallelism (engine/parallel/shard.py): sums the ranks' partial outputs

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        if cfg.moe_router not in ("softmax", "sigmoid"):
            raise ValueError(f"unknown MoE router {cfg.moe_router!r}")
        h, e, ff = cfg.hidden_size, cfg.n_experts, cfg.expert_ff
        self.layer, self.n_experts, self.top_k, self.ff, self.hidden = layer, e, cfg.n_experts_used, ff, h
        self.router, self.norm_topk, self.scale = cfg.moe_router, cfg.norm_topk_prob, cfg.expert_weights_scale
        self.act = cfg.hidden_act
        self.held = range(e)  # the experts whose weights this module holds (tensor parallelism: a rank's share)
        self.ffn_gate_inp = Linear(h, e)
        if self.router == "sigmoid":
            self.exp_probs_b = ExpertBias(e)
        self.ffn_gate_exps = Linear(h, e * ff)
        self.ffn_up_exps = Linear(h, e * ff)
        self.ffn_down_exps = Linear(ff, e * h)
        if cfg.shared_expert_ff:
            if cfg.shared_expert_gate:
                self.ffn_gate_inp_shexp = Linear(h, 1)
            self.ffn_gate_shexp = Linear(h, cfg.shared_expert_ff)
            self.ffn_up_shexp = Linear(h, cfg.shared_expert_ff)
            self.ffn_down_shexp = Linear(cfg.shared_expert_ff, h)

    def mount(self, host: nn.Module) -> None:
        """Register this module's weights directly on `host` (a decoder block), under their own names, and
        keep `host.moe` as a plain attribute: the block's parameters are then named as the GGUF file names
        them (`blk.N.ffn_up_exps.weight`), so both loaders fill them like any other tensor. The modules are
        shared, so what the loader assigns (dense or quantized) is what `forward` uses."""
        for name, child in self.named_children():
            host.add_module(name, child)
        host.__dict__["moe"] = self

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]) as the model defines them, computed in fp32 (with
        the experts' kernel, by its router kernel)."""
        logits = self.ffn_gate_inp(x)
        if triton_moe.use_kernel(x):
            bias = self.exp_probs_b.bias if self.router == "sigmoid" else None
            return triton_moe.route(logits, self.top_k, self.router, self.norm_topk, self.scale, bias, x.dtype)
        logits = logits.float()
        if self.router == "softmax":
            probs = torch.softmax(logits, dim=-1)
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
        else:
            scores = torch.sigmoid(logits)
            ids = torch.topk(scores + self.exp_probs_b.bias.float(), self.top_k, dim=-1).indices
            weights = scores.gather(-1, ids)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.scale != 1.0:
            weights = weights * self.scale
        return weights.to(x.dtype), ids

    def int8_input(self, x: torch.Tensor) -> torch.Tensor | None:
        """layers.int8_input for this layer's input x (the pre-FFN norm's output): read as int8 by the routed
        experts where they run on the per-pair gemvs, and offered to the shared expert's gate and up."""
        shared = [self.ffn_gate_shexp, self.ffn_up_shexp] if hasattr(self, "ffn_down_shexp") else []
        pairs = self.offload is None and triton_moe.use_kernel(x) and triton_moe.pairs_read_int8(
            x.shape[0], *(p.quant if p.qtype is not None else p.weight for p in (self.ffn_gate_exps, self.ffn_up_exps)))
        return int8_input(x, shared, also=pairs)

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                ws: torch.Tensor | None = None) -> torch.Tensor:
        """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every row t: the rows grouped by expert, one
        matmul per projection per routed expert (or the Triton kernel, see the module's docstring). `ws`: x's
        int8 workspace (int8_input), for the kernel's per-pair gemvs."""
        if triton_moe.use_kernel(x):
            stacked = [p.quant if p.qtype is not None else p.weight
                       for p in (self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps)]
            held = self.held
            if len(held) < self.n_experts:  # a rank's share: others' pairs weigh 0 (no host sync)
                mine = (ids >= held.start) & (ids < held.stop)
                weights, ids = weights * mine.to(weights.dtype), torch.where(mine, ids - held.start, 0)
            return triton_moe.moe_experts(x, weights, ids, len(held), *stacked, self.act, ws=ws)
        if graph_mode.for_graph(x):
            return self.experts_every(x, weights, ids)
        if GROUPED_MM and x.is_cuda and self.grouped_mm_ok(x):
            return self.experts_grouped_mm(x, weights, ids)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = order // self.top_k
        pair_weights = weights.reshape(-1)[order, None]
        counts = torch.bincount(flat, minlength=self.n_experts).tolist()  # the one host sync
        xs = x.index_select(0, rows)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            seg = slice(start, start + n)
            start += n
            if e in self.held:
                out.index_add_(0, rows[seg], self.expert(xs[seg], e - self.held.start) * pair_weights[seg])
        return out

    def grouped_mm_ok(self, x: torch.Tensor) -> bool:
        """Whether `experts_grouped_mm` takes rows `x` of this layer: every expert held here, a torch with a
        grouped GEMM, and bf16 on CUDA (torch's kernels take only that; the CPU takes any float)."""
        return (_grouped_mm is not None and len(self.held) == self.n_experts
                and (not x.is_cuda or x.dtype == torch.bfloat16))

    def experts_grouped_mm(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`experts` as three grouped GEMMs over the pairs sorted by expert (torch's grouped_mm: one launch per
        projection for every expert, the group offsets computed on the device, so no host sync), then each row's k
        weighted outputs summed in a fixed order (deterministic on CUDA too). Quantized experts are
        dequantized a whole projection at a time (one projection's dense copy is the extra memory: 0.4 GB for
        Qwen3-30B-A3B in bf16), against the loop's fused kernel per expert on a few dozen rows each. CUDA prefill steps
        take it (the module docstring has the figures); LUCEBOX_MOE_GROUPED_MM=0 keeps them on the loop."""
        e, ff, h = self.n_experts, self.ff, self.hidden
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = order // self.top_k
        offs = torch.cumsum(torch.bincount(flat, minlength=e), 0).to(torch.int32)
        xs = x.index_select(0, rows)
        gate = _grouped_mm(xs, _dense(self.ffn_gate_exps, x.dtype).view(e, ff, h).transpose(1, 2), offs=offs)
        up = _grouped_mm(xs, _dense(self.ffn_up_exps, x.dtype).view(e, ff, h).transpose(1, 2), offs=offs)
        act = gated_act(gate, up, self.act)
        del gate, up
        y = _grouped_mm(act, _dense(self.ffn_down_exps, x.dtype).view(e, h, ff).transpose(1, 2), offs=offs)
        # Back to (row, k) order, then each row's k outputs weighted and summed by one batched matmul: a fixed order
        # (an index_add of all pairs would add a row's k outputs by atomics, in an order that changes run to run).
        pairs = torch.empty_like(y).index_copy_(0, order, y).view(-1, self.top_k, h)
        return torch.bmm(weights.reshape(-1, 1, self.top_k), pairs).view(-1, h)

    def experts_every(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`experts` without a host sync: every expert over every row, weighted by the routing weights
        scattered into [T, n_experts] (zero where not chosen): what a CUDA graph captures with the kernel off."""
        dense = torch.zeros(x.shape[0], self.n_experts, device=x.device, dtype=x.dtype).scatter_(1, ids, weights)
        out = torch.zeros_like(x)
        for e in self.held:
            out += self.expert(x, e - self.held.start) * dense[:, e, None]
        return out

    def expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """Expert e's SwiGLU (GeGLU) on rows x, from its slice of the stacked weights."""
        return expert_ffn(x, expert_rows(self.ffn_gate_exps, e, self.ff), expert_rows(self.ffn_up_exps, e, self.ff),
                          expert_rows(self.ffn_down_exps, e, self.hidden), self.act)

    def shared(self, x: torch.Tensor, ws: torch.Tensor | None = None) -> torch.Tensor:
        """The shared expert, scaled by its sigmoid gate where the model has one (`ws`: x's int8 workspace)."""
        y = self.ffn_down_shexp(gated_act(self.ffn_gate_shexp(x, ws=ws), self.ffn_up_shexp(x, ws=ws), self.act))
        if hasattr(self, "ffn_gate_inp_shexp"):
            y = torch.sigmoid(self.ffn_gate_inp_shexp(x)) * y
        return y

    def forward(self, x: torch.Tensor, ws: torch.Tensor | None = None) -> torch.Tensor:
        """`ws`: x's int8 workspace where the norm that made x wrote one (int8_input)."""
        weights, ids = self.route(x)
        if self.route_counter is not None:
            self.route_counter(self.layer, ids)
        if self.offload is None:
            out = self.experts(x, weights, ids, ws)
        else:
            out = self.offload.experts(x, weights, ids)
        if hasattr(self, "ffn_down_shexp"):
            out = out + self.shared(x, ws)
        return out if self.reduce is None else self.reduce(out)
