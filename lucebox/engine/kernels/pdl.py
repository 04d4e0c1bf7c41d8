"""Programmatic dependent launch (Hopper and later): a decode step's kernels start while the one before ends.

At batch 1 a decode step is a chain of ~460 kernels, most a few microseconds long, and each one's start (its
programs scheduled, their first loads in flight) waits for the previous kernel to drain. A kernel launched with
PDL (`launch_pdl`) may be scheduled as soon as every program of the kernel before it has started
(`gdc_launch_dependents`); it must then wait (`gdc_wait`: the previous kernel finished and its writes visible)
before it reads what that kernel wrote, or writes anything an earlier kernel may still read. `begin` does both,
first thing, in every kernel that takes the flag. What a kernel does before `begin` may only touch memory no
kernel of the step writes: the quantized gemvs prefetch their first weight blocks into L2 there.

The rule that keeps this safe across many kernels: each PDL kernel passes `begin` before it ends, so its end
implies its predecessor's, and so on back; a kernel launched without the flag (torch's, Triton's others) waits
for the whole stream as usual, so the two kinds mix freely. The interpreter and GPUs before sm_90 never use it.

Opt-in (`LUCEBOX_PDL=1`), because as written it loses: timed on the H200 (2026-12-05, one lease, a
Qwen3-8B-shaped Q4_K_M held quantized, `bench decode --weights quantized --prompt-lens 512 --batch-sizes 1,16`
run with =1, =0, =1, =0) batch 1 decodes 258.9 / 258.9 tok/s with PDL against 310.1 / 310.6 without (0.83x),
batch 16 2,500 / 2,484 against 2,475 / 2,496 (even). The same file held dense, where only the norms, RoPE,
quantize and decode attention take PDL (cuBLAS does the matmuls), gained: batch 1 216.9 / 216.9 against
211.5 / 211.6 (1.025x). So what loses is in the quantized gemvs' use of it (their early trigger or their L2
prefetch before the wait); it stays opt-in until a variant of those beats plain launches at batch 1. Its
correctness test passes on the GPU.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("LUCEBOX_PDL", "0") == "1"


@functools.cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9 and os.environ.get("TRITON_INTERPRET", "0") != "1"


def launch(x: torch.Tensor) -> dict[str, bool]:
    """The launch arguments for a kernel that takes `PDL` on x's device: both on, or none (the kernel's
    default, PDL False: a plain launch)."""
    if ENABLED and x.is_cuda and _supported(x.device.index if x.device.index is not None else 0):
        return {"PDL": True, "launch_pdl": True}
    return {}


@triton.jit
def begin(PDL: tl.constexpr):
    """Let the next kernel be scheduled, then wait for the previous one (a no-op without PDL)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch(ptrs, PDL: tl.constexpr):
    """Ask L2 for the lines at pointers `ptrs` (any shape; weights only: before `begin` nothing else is
    safe to read). Only with PDL, where the loads then overlap the previous kernel."""
    if PDL:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs.to(tl.int64)],
                                  dtype=tl.int32, is_pure=False, pack=1)
