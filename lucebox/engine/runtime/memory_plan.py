"""How much of the device the KV cache gets: what remains of a budget after weights, activations and graphs.

    KV blocks = (the `--gpu-memory` cap, or what the process could reach: in use + free)
                - weights (what the process holds on the device once the model is loaded)
                - the activation peak, measured: the largest prefill chunk the scheduler can produce
                  (fresh, and over a cached context, extrapolated to the model's context) and the
                  largest decode batch, run once on a small probe KV pool before the real pool exists
                - the CUDA graph pool (one decode graph's workspace, measured, and the static outputs)
                  and allocator slack.

A fixed fraction of free memory either wastes most of a large card or leaves a small one short; measuring
makes the same rule right for both. The cap is enforced too (`apply_cap`: the caching allocator refuses to
grow past it), so a plan that is wrong fails loudly at start-up, not in the middle of a request. The cap
covers PyTorch's allocations; the CUDA context (about 0.5 GB) comes on top of it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from lucebox.errors import LuceboxError

log = logging.getLogger(__name__)

GB = 1 << 30
UNCAPPED_SHARE = 0.92  # without a cap, leave a little of the free memory to the allocator and other libraries
SLACK_MIN = 256 << 20  # allocator fragmentation, cuBLAS workspaces, Triton launch buffers
SLACK_SHARE = 0.02


@dataclass(frozen=True)
class MemoryPlan:
    """The device memory budget, split: every field in bytes except `blocks` (KV blocks, scratch included)."""

    budget: int
    capped: bool
    weights: int
    activations: int
    graphs: int
    block_bytes: int
    block_size: int
    blocks: int

    @property
    def kv_bytes(self) -> int:
        return self.blocks * self.block_bytes

    @property
    def kv_tokens(self) -> int:
        return (self.blocks - 1) * self.block_size  # block 0 is scratch

    def line(self) -> str:
        where = f"cap {self.budget / GB:.1f} GB (--gpu-memory)" if self.capped else \
            f"budget {self.budget / GB:.1f} GB (in use + free)"
        return (f"memory plan: weights {self.weights / GB:.2f} GB, activation peak {self.activations / GB:.2f} GB, "
                f"graphs+slack {self.graphs / GB:.2f} GB, KV {self.kv_bytes / GB:.2f} GB = {self.kv_tokens} tokens; "
                f"{where}")

    def props(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget, "capped": self.capped, "weights_bytes": self.weights,
                "activation_peak_bytes": self.activations, "graph_margin_bytes": self.graphs,
                "kv_bytes": self.kv_bytes, "kv_tokens": self.kv_tokens}


def plan_memory(*, budget: int, capped: bool, weights: int, activations: int, graphs: int, block_bytes: int,
                block_size: int, min_tokens: int, max_tokens: int | None = None) -> MemoryPlan:
    """KV blocks from the budget; raises a one-line LuceboxError when the weights alone exceed it, or when
    what remains cannot hold `min_tokens` of KV. `max_tokens` bounds the KV cache (the uncapped default)."""
    where = f"--gpu-memory {budget / GB:.2f} GB" if capped else f"the {budget / GB:.2f} GB this device has free"
    if weights > budget:
        raise LuceboxError(f"the model's weights take {weights / GB:.2f} GB on the device, more than {where}")
    room = budget - weights - activations - graphs
    blocks = max(room, 0) // block_bytes
    if max_tokens is not None:
        blocks = min(blocks, -(-max_tokens // block_size) + 1)
    need = -(-min_tokens // block_size) + 1
    if blocks < need:
        raise LuceboxError(
            f"weights {weights / GB:.2f} GB + activations {activations / GB:.2f} GB + CUDA graphs and slack "
            f"{graphs / GB:.2f} GB leave {max(room, 0) / GB:.2f} GB of {where}; the KV cache needs at least "
            f"{need * block_bytes / GB:.2f} GB ({min_tokens} tokens): raise --gpu-memory, or lower --ctx-size "
            f"or --max-step-tokens")
    return MemoryPlan(budget, capped, weights, activations, graphs, block_bytes, block_size, blocks)


STATE_SHARE = 0.5  # a hybrid's recurrent states (slots and verification rows) take at most this much of the room


def state_slots(*, room: int, slot_bytes: int, max_seqs: int, verify_rows: int = 0) -> tuple[int, int]:
    """A hybrid model's (state slots, verification rows) from `room`, the bytes weights, activations and
    graphs leave: each running sequence holds one slot and, while it verifies a draft, one slot's bytes per
    verified row (the states every row or tree node keeps until the accepted one is known) and one more (the
    state the rows start from, kept beside them: spec/static.py's buffers). They get at
    most `STATE_SHARE` of the room, the rest staying for KV: as many sequences as fit, up to `max_seqs`,
    with `verify_rows` rows each (0: no speculation); where not even one such sequence fits, one sequence
    verifying fewer rows (at least 2: the last token and one draft; else 0: speculation cannot fit)."""
    share = int(room * STATE_SHARE)
    per_seq = slot_bytes * (2 + verify_rows if verify_rows else 1)
    slots = min(max_seqs, share // per_seq)
    if slots >= 1:
        return slots, verify_rows
    rows = share // slot_bytes - 2
    return 1, rows if verify_rows and rows >= 2 else 0


def extrapolate_peak(samples: list[tuple[int, int]], ctx: int) -> int:
    """The activation peak at context `ctx` from (context, peak bytes) measurements: the largest measured, or
    the straight line through the two longest contexts where that is higher (attention's share grows with
    the context; a paged kernel's does not, and then the line is flat)."""
    best = max(p for _, p in samples)
    pts = sorted(samples)[-2:]
    if len(pts) == 2 and pts[1][0] > pts[0][0] and ctx > pts[1][0]:
        (c1, p1), (c2, p2) = pts
        best = max(best, int(p2 + (p2 - p1) * (ctx - c2) / (c2 - c1)))
    return best


def slack(budget: int) -> int:
    return max(SLACK_MIN, int(budget * SLACK_SHARE))


def apply_cap(device: torch.device, gb: float) -> int:
    """Make the caching allocator refuse to hold more than `gb` GB on `device` (process-wide); returns the cap."""
    index = device.index if device.index is not None else torch.cuda.current_device()  # "cuda" has none
    total = torch.cuda.get_device_properties(index).total_memory
    cap = int(gb * GB)
    if cap > total:
        raise LuceboxError(f"--gpu-memory {gb:g} GB is more than this device has ({total / GB:.1f} GB)")
    torch.cuda.set_per_process_memory_fraction(cap / total, index)
    return cap


@dataclass
class Measured:
    prefill: list[tuple[int, int]]  # (context, peak bytes) of the largest prefill chunk
    decode: int  # eager decode of the largest batch
    graph: int  # one CUDA-graph decode step's workspace (what the shared graph pool keeps), outputs included


def measure_activations(model: Any, dtype: torch.dtype, device: torch.device, *, block_size: int, chunk: int,
                        batch: int, n_ctx: int, probe_tokens: int, graphs: bool, kv_dtype: str = "auto") -> Measured:
    """Run the largest prefill chunk (from position 0, and ending at `probe_tokens`) and the largest decode
    batch on a probe KV pool of `probe_tokens`, reading the allocator's peak above what was held before each.
    The probe pool is freed before returning (the real pool is sized from these numbers)."""
    from lucebox.engine.runtime.kv_cache import KVCache
    from lucebox.engine.runtime.model_runner import ModelRunner

    n_blocks = -(-probe_tokens // block_size)
    runner = ModelRunner(model, KVCache.create(model.cfg, n_blocks + 1, block_size, dtype, device, kv_dtype=kv_dtype),
                         dtype)
    try:
        return _probe(runner, device, chunk=chunk, batch=batch, n_ctx=n_ctx, probe_tokens=probe_tokens,
                      graphs=graphs)
    finally:
        runner.graphs = None
        runner.kv = None  # type: ignore[assignment]
        torch.cuda.empty_cache()


def _probe(runner: Any, device: torch.device, *, chunk: int, batch: int, n_ctx: int, probe_tokens: int,
           graphs: bool) -> Measured:
    from lucebox.engine.runtime.sampler import SamplingParams
    from lucebox.engine.runtime.sequence import Chunk, Sequence

    table = list(range(1, runner.kv.pool.num_blocks))

    def seq() -> Sequence:
        s = Sequence([1] * probe_tokens, SamplingParams())
        s.block_table = table
        return s

    def peak(chunks: list[Chunk] | None = None) -> int:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        if chunks is not None:
            out = runner.forward(runner.prepare(chunks))
        else:
            g = runner.graphs
            out = g._forward(g.bmax, g.max_ctx)
        torch.cuda.synchronize(device)
        del out
        return max(0, torch.cuda.max_memory_allocated(device) - base)

    with torch.inference_mode():
        c = min(chunk, probe_tokens)
        s = seq()
        prefill = [(c, peak([Chunk(s, 0, c)]))]
        if probe_tokens > c:
            prefill.append((probe_tokens, peak([Chunk(s, probe_tokens - c, c)])))
        decode = peak([Chunk(seq(), probe_tokens - 1, 1) for _ in range(batch)])
        graph = 0
        if graphs:
            runner.enable_cuda_graphs(batch, n_ctx)
            graph = peak()
    return Measured(prefill, decode, graph)
