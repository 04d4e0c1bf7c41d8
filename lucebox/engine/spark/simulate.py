"""`--router-skew zipf:S`: a SIMULATION of expert popularity for models whose routing is not real.

Random weights route uniformly, so no placement can beat another on them. The simulation adds to each MoE
layer's router logits a fixed bias -S * ln(rank + 1), rank a seeded permutation of the layer's experts: a
softmax router's probabilities are then multiplied by (rank + 1)^-S, a Zipf prior of exponent S over the
experts, while the token still moves the choice (the logits' own part). Anything measured under it is
labelled a simulation (`bench spark`, the profile's `router_skew`): it shows what a placement does under that
skew, not what a real model's traffic has.
"""

from __future__ import annotations

import re

import torch

from lucebox.engine.spark.profile import moe_layers
from lucebox.errors import LuceboxError


def parse_skew(text: str | None, tensor_parallel: int | None = 1) -> float | None:
    """`zipf:S` (S > 0) -> S; None or `none` -> None. Refused with `tensor_parallel` > 1: the bias is given to
    rank 0's routers in its process, and the other ranks would route without it."""
    if text is None or text == "none":
        return None
    m = re.fullmatch(r"zipf:([0-9]*\.?[0-9]+)", text.strip())
    if not m or float(m.group(1)) <= 0:
        raise LuceboxError(f"--router-skew must be zipf:S with S > 0 (e.g. zipf:1.2), or none; got {text!r}")
    if (tensor_parallel or 1) > 1:
        raise LuceboxError("--router-skew is a single-process simulation: it cannot run with --tensor-parallel")
    return float(m.group(1))


def popularity_ranks(n_experts: int, layer: int, seed: int = 0) -> torch.Tensor:
    """The simulated popularity rank of each expert of `layer` (0: the most popular), a seeded permutation."""
    g = torch.Generator().manual_seed(seed * 100_003 + layer)
    rank = torch.empty(n_experts, dtype=torch.float32)
    rank[torch.randperm(n_experts, generator=g)] = torch.arange(n_experts, dtype=torch.float32)
    return rank


def apply_router_skew(model: torch.nn.Module, s: float, dtype: torch.dtype, seed: int = 0) -> None:
    """Give every MoE layer's router the Zipf bias (a `bias` buffer of its Linear, read by its forward), and
    mark the model (`router_skew`: the disk KV tier's layout id takes it, so no KV computed under another
    routing is ever restored)."""
    model.router_skew = s
    for layer, moe in moe_layers(model).items():
        lin = moe.ffn_gate_inp
        bias = (-s * torch.log1p(popularity_ranks(moe.n_experts, layer, seed))).to(dtype)
        device = (lin.qdata if lin.qtype is not None else lin.weight).device
        if "bias" in lin._buffers:
            lin.bias.copy_(bias)  # type: ignore[union-attr]
            continue
        del lin.bias
        lin.register_buffer("bias", bias.to(device))
