"""x @ W.T for a quantized W: the Triton kernels on CUDA, an exact dequantize-per-call path elsewhere."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from lucebox.engine.weights.quant.qtensor import QuantWeight

try:
    import triton  # noqa: F401
except ImportError:  # CPU-only installs: no triton, the dequantize-per-call path
    triton_qmm = None
else:  # with triton the kernels must import: a broken import is an error, never a silent slow path
    from lucebox.engine.kernels import triton_qmm

# Tests only: run the kernels on CPU tensors too (requires TRITON_INTERPRET=1, Triton's interpreter).
ON_CPU = False
# LUCEBOX_QUANT_KERNELS=0 makes CUDA dequantize per call too (a debugging switch, like LUCEBOX_FUSED_OPS).
ENABLED = os.environ.get("LUCEBOX_QUANT_KERNELS", "1") != "0"


def use_kernels(x: torch.Tensor) -> bool:
    """Whether `qlinear` runs the Triton kernel for activations like `x`."""
    return ENABLED and triton_qmm is not None and (x.is_cuda or (ON_CPU and x.device.type == "cpu"))


def warm_up(model: torch.nn.Module) -> dict:
    """Tune and check the CUDA kernels for every quantized weight shape of `model` (triton_qmm.warm_up):
    start-up code calls it once, before CUDA graphs are captured. A shape it did not check keeps the older,
    slower kernels (see triton_qmm._word_ok). Returns the configs chosen; {} off CUDA."""
    shapes = [(m.qtype, *m.quant.shape) for m in model.modules() if getattr(m, "qtype", None) is not None]
    if not shapes or not ENABLED or triton_qmm is None:
        return {}
    device = next(m.quant.device for m in model.modules() if getattr(m, "qtype", None) is not None)
    if device.type != "cuda":
        return {}
    return triton_qmm.warm_up(shapes, device=device, dtype=next(
        m.dtype for m in model.modules() if getattr(m, "qtype", None) is not None))


def reads_int8(x: torch.Tensor, weights: list[QuantWeight]) -> bool:
    """Whether one of `weights` runs at x's row count on the int8-activation kernels (the ones the start-up tuner
    chose), which read x as its int8 workspace (triton_qmm.quantize_x)."""
    if not weights or x.dim() != 2 or not use_kernels(x) or x.stride(-1) != 1:
        return False
    return any(triton_qmm.int8_x(x.shape[0], w) for w in weights)


def empty_workspace(x: torch.Tensor) -> torch.Tensor:
    """An unfilled int8 workspace for x's rows (triton_qmm.workspace), for a kernel that writes it."""
    return triton_qmm.workspace(x.shape[0], x.shape[1], x.device)


def int8_workspace(x: torch.Tensor, weights: list[QuantWeight], act: str | None = None) -> torch.Tensor | None:
    """x's int8 workspace (triton_qmm.quantize_x) when one of `weights` reads its rows as one at x's row count
    (reads_int8), else None. Computed once, it serves every weight whose kernel reads it (qlinear): q, k and v of
    different quant types quantize their shared input once, not three times. With `act`, x is gate_up and the
    workspace is that of act(gate) * up (triton_ops.act_mul's rows, bit for bit), so a dense FFN's down projection
    never writes its activated input."""
    if not reads_int8(x, weights):
        return None
    return triton_qmm.quantize_x(x, act)


def summary(tuned: dict) -> str:
    """What `warm_up` chose, in a few words: how many weight shapes and paths, how many on int8 activations."""
    int8 = sum(1 for cfg in tuned.values() if cfg[-1] == "q8x")  # triton_qmm.INT8_VARIANTS (no triton here)
    return f"{len(tuned)} (path, type, shape) cases, {int8} of them on the int8-activation kernels"


def qlinear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
            out: torch.Tensor | None = None, ws: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize(w).T (+ bias) -> [..., N] in x's dtype.

    Off CUDA the weight is dequantized for this call only (exact in fp32, so the CPU result equals a dense
    fp32 weight's) and dropped after it, or its dense copy is read where it keeps one (`--weights both`: the
    same values, without the per-call dequantize). `out` (2-D x only) receives the result, e.g. a column slice. `ws`:
    x's int8 workspace where `int8_workspace` or `layers.int8_input` gave one: used where w's kernel reads x as
    int8 at this row count (then x's values are not read), else x is read (one workspace offered to several
    weights, some of whose kernels the tuner chose to read x).
    """
    if use_kernels(x):
        lead = x.shape[:-1]
        if ws is not None and not triton_qmm.int8_x(x.numel() // x.shape[-1], w):
            ws = None
        y = triton_qmm.qmatmul(x.reshape(-1, x.shape[-1]), w, bias, out, ws)
        return y if out is not None else y.reshape(*lead, y.shape[-1])
    if ws is not None:
        raise ValueError("qlinear: an int8 workspace without the quantized kernels")
    y = F.linear(x, w.dense_as(x.dtype), bias)
    if out is not None:
        out.copy_(y)
        return out
    return y
