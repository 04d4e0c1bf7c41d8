"""Programmatic dependent launch (Hopper and later): a kernel starts while the one before it is finishing.

A batch-1 decode step is a chain of ~10 kernels a layer, most of them a few microseconds long, each
waiting for the one before it to end, so at every boundary the GPU drains and refills and its memory
bandwidth idles. With PDL a kernel is launched with `launch_pdl=True`, its programs become resident as
soon as every program of the kernel before has called `gdc_launch_dependents`, and `gdc_wait` holds them
until that kernel has finished and its writes are visible. The quantized one-row gemvs use the time in
between: before they wait they ask L2 for the first loop step of their weight rows (`prefetch_l2`; the
weights are never written by a step), so the weight stream starts during the norm, RoPE or attention
kernel before them.

The rule that keeps this correct: a kernel launched with `launch_pdl=True` calls `enter` before it loads
anything an earlier kernel wrote and before it stores anything (`launch` sets both the flag and the
kernel's `PDL` constexpr, so one is never without the other). A kernel launched without the flag (torch's,
cuBLAS's, a Triton kernel not converted) starts only after everything before it, as always, and one after
it finds nothing to overlap. `enter` also lets the next kernel launch at once: a kernel is launched ahead
only of one that has itself passed its wait, so at most one kernel's programs wait.

Only one-row launches use it, where it was measured (H100, a Qwen3-8B-shaped Q4_K_M, `bench decode
--batch-sizes 16,1`, 2026-12-07): batch-1 decode 324.0 -> 336.9 tok/s; the waits alone 321 -> 331; each
gemv program prefetching its whole share of the rows instead of one step, 324 -> 314 (L2 flooded). At batch
16 the same kernels (with the int8 tiles prefetching a step) ran 2,492 -> 2,096 tok/s, for a reason not yet
found, so launches of more rows go without. On where it exists (CUDA capability 9+, a Triton with
`tl.extra.cuda.gdc_wait`); env `LUCEBOX_PDL=0` turns it off (read at launch: CUDA graphs keep what they
captured).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` may launch with PDL (env LUCEBOX_PDL=0: never)."""
    return device.type == "cuda" and os.environ.get("LUCEBOX_PDL", "1") != "0" and _capable(device.index)


@functools.cache
def _capable(index: int | None) -> bool:
    extra = getattr(getattr(tl, "extra", None), "cuda", None)
    return (torch.version.hip is None and hasattr(extra, "gdc_wait") and hasattr(extra, "gdc_launch_dependents")
            and torch.cuda.get_device_capability(index)[0] >= 9)  # ROCm reports capabilities of 9 too


def launch(x: torch.Tensor, rows: int) -> dict[str, bool]:
    """Keyword arguments for a converted kernel's launch over `rows` activation rows on x's device: its `PDL`
    constexpr and Triton's `launch_pdl` together (one row only, see above), or nothing (`PDL` defaults to
    False)."""
    return {"PDL": True, "launch_pdl": True} if rows == 1 and enabled(x.device) else {}


@triton.jit
def enter(PDL: tl.constexpr):
    """Wait until the kernel before has finished (its writes visible), then let the next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptr, nbytes, PDL: tl.constexpr):
    """Ask L2 for `nbytes` bytes from each byte pointer of `ptr`: one bulk prefetch each, both ends rounded down
    to 16 bytes as the instruction needs, so never a byte past the range's end and at most 15 before its start
    (for a weight row, the row before's). A hint only: no registers, nothing waits on it."""
    if PDL:
        start = ptr.to(tl.int64)
        first = start & -16
        size = (((start + nbytes) & -16) - first).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [first, size], dtype=tl.int32, is_pure=False, pack=1)
