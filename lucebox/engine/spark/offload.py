"""Routed experts computed from where Spark put them: device slots (hot experts and a per-layer LRU ring) and
host memory (the cold experts, pinned on CUDA), one `LayerOffload` per MoE layer (set as its `moe.offload`).

Each projection's slots are one device tensor of `slots * rows` rows in the layer's storage (quantized blocks
stay blocks: an expert is its rows, as in models/moe.py's `expert_rows`), so a slot is the same kind of view
of rows as an expert of the stacked weights. A step:

1. route as the model does; the routed experts, by expert, with the rows each got (one host sync, as the
   eager grouped path has);
2. each routed expert is hot, in the ring (an LRU hit), or cold (a cold hit). A cold expert is computed on
   the CPU when the rule says so (`OffloadRule`), else copied: into a free ring slot, or over the least
   recently used ring expert this step does not use, or, with no ring slot to take, into a buffer for this
   step only. On CUDA the copies run on a copy stream, from pinned memory, issued before any expert's
   matmuls so they overlap the hot experts' compute; the compute stream waits on the copies' event before
   using them, and the copy stream waits on the compute stream before overwriting a ring slot;
3. every expert's output is computed (hot and ring first, then the copied ones, the CPU ones last, while the
   device works), then added into the step's output in ascending expert order, weighted by the routing,
   exactly as the grouped path does: in fp32 on the CPU offloaded tokens equal all-on-device ones bit for bit.
   A step of few rows (decode) that needed no one-step buffer runs kernels/triton_moe.py instead, once, with
   the slots as its stacked experts and the routing mapped to slot ids (the CPU's pairs weighted 0 there and
   added after), as the all-device model runs it.

The graph-resident decode (on CUDA by default, spark/engine.py): each layer keeps `slot_table`, a device
tensor [n_experts] of every expert's slot (-1: not resident), updated in place whenever the ring changes, so
a decode step can run over the resident experts with no host sync (`_resident`: what a CUDA graph captures,
and what runs eagerly while `optimistic` is set): a routed pair whose expert is not resident is weighted 0
and its expert is marked in the layer's row of `missed` (a device [n_experts] bool). The engine reads the
model's `missed` after the step and, when any is set, copies the marked experts into the ring (`fetch`) and
replays the step, or runs it again eagerly (the path above) when the ring cannot take them. Such steps do
not count routed, hot, ring or cold pairs (the host never sees their routing), nor move ring experts to the
back of the LRU.

A Q4_K expert of Qwen3-30B-A3B's shape measured on this project's 2-core CPU box: copy 0.1 ms (a memcpy),
CPU matmuls on one row 52 ms, so the rule gives 0 there.

The CPU rule: a cold expert routed to at most `cpu_rows` rows in a step is computed on the CPU, until it has
been computed there `promote_after` times since it was last copied (a recurring expert is then copied into
the ring, where later steps hit it). `cpu_rows` defaults to what a measurement at load says pays:
floor(t_copy / t_cpu_row), one expert's host-to-device copy time over its CPU time per row (both timed on
this machine at load), which is 0 when the CPU is slower per row than the copy (the usual case for
quantized experts, which the CPU dequantizes first).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from lucebox.engine.kernels import graph_mode, triton_moe
from lucebox.engine.models.moe import MoE, expert_ffn
from lucebox.engine.weights.quant import QuantWeight


@dataclass
class OffloadRule:
    """When a cold expert is computed on the CPU instead of copied (see the module docstring)."""

    cpu_rows: int = 0
    promote_after: int = 2
    measured: dict[str, float] = field(default_factory=dict)  # t_copy_s, t_cpu_row_s when measured


@dataclass
class SparkStats:
    """Counters over every offloaded layer since start (what /metrics and /props show)."""

    routed: int = 0  # (token, expert) pairs routed
    hot: int = 0  # pairs whose expert is hot
    ring_hits: int = 0  # pairs whose expert was in the ring
    cold: int = 0  # pairs whose expert was in host memory when routed: the cold hits
    copies: int = 0  # experts copied host -> device (ring fills and one-step buffers)
    copy_bytes: int = 0
    cpu_experts: int = 0  # cold experts computed on the CPU
    cpu_seconds: float = 0.0
    graph_steps: int = 0  # decode steps run over the resident experts and kept (the graph-resident decode)
    refetches: int = 0  # such steps replayed after copying in the experts they missed (fetch)
    redos: int = 0  # such steps run again eagerly (the ring could not take what they missed)
    started: float = field(default_factory=time.monotonic)

    @property
    def cold_hit_rate(self) -> float:
        return self.cold / self.routed if self.routed else 0.0

    def copies_per_second(self) -> float:
        return self.copies / max(time.monotonic() - self.started, 1e-9)

    def props(self) -> dict[str, Any]:
        return {"routed_pairs": self.routed, "hot_pairs": self.hot, "ring_hits": self.ring_hits,
                "cold_hits": self.cold, "cold_hit_rate": round(self.cold_hit_rate, 4), "copies": self.copies,
                "copy_bytes": self.copy_bytes, "copies_per_s": round(self.copies_per_second(), 2),
                "cpu_experts": self.cpu_experts, "cpu_expert_seconds": round(self.cpu_seconds, 4),
                "graph_steps": self.graph_steps, "refetches": self.refetches, "redos": self.redos}

    def reset(self) -> None:
        self.routed = self.hot = self.ring_hits = self.cold = self.copies = self.copy_bytes = 0
        self.cpu_experts, self.cpu_seconds, self.started = 0, 0.0, time.monotonic()
        self.graph_steps = self.refetches = self.redos = 0


class _Projection:
    """One stacked expert projection (gate, up or down): its storage and the rows of one expert."""

    def __init__(self, lin: Any, rows: int) -> None:
        self.rows, self.qtype, self.cols, self.dtype = rows, lin.qtype, lin.cols, lin.dtype
        self.src: torch.Tensor = lin.qdata if lin.qtype is not None else lin.weight.data

    def view(self, store: torch.Tensor, index: int) -> torch.Tensor | QuantWeight:
        rows = store[index * self.rows:(index + 1) * self.rows]
        return QuantWeight(rows, self.qtype, self.cols, self.dtype) if self.qtype is not None else rows


class LayerOffload:
    """One MoE layer's experts: `hot` resident in device slots, `ring_slots` spare device slots (LRU), the
    rest in host memory. Takes the experts out of the layer's stacked Linears (left with 0 rows).

    Under tensor parallelism the layer holds only its rank's experts (`moe.held`, engine/parallel/shard.py):
    those are the ones placed, and another rank's routed pairs are left out here (that rank adds them in the
    MoE's all-reduce), so the counters are this rank's."""

    optimistic = False  # eagerly, the decode step a CUDA graph captures (`_resident`); set by Spark.guarded

    def __init__(self, moe: MoE, hot: list[int], ring_slots: int, device: torch.device, rule: OffloadRule,
                 stats: SparkStats, copy_stream: Any = None, missed: torch.Tensor | None = None) -> None:
        self.moe, self.device, self.rule, self.stats, self.copy_stream = moe, device, rule, stats, copy_stream
        # the experts a step over the resident ones routed to while not resident (a row of the model's; the
        # host reads and clears it)
        self.missed = missed if missed is not None else torch.zeros(moe.n_experts, dtype=torch.bool, device=device)
        self.hot = sorted(set(hot))
        if not set(self.hot) <= set(moe.held):
            raise ValueError(f"hot experts {self.hot} are not all among the layer's experts {moe.held}")
        self.cold = [e for e in moe.held if e not in set(self.hot)]
        lins = (moe.ffn_gate_exps, moe.ffn_up_exps, moe.ffn_down_exps)
        self.proj = [_Projection(lin, rows) for lin, rows in zip(lins, (moe.ff, moe.ff, moe.hidden))]
        n_slots = len(self.hot) + ring_slots
        pin = device.type == "cuda"
        # zeros, not garbage: a sync-free step computes a ring slot not filled yet with its pairs weighted 0
        self.slots = [torch.zeros(n_slots * p.rows, p.src.shape[1], dtype=p.src.dtype, device=device)
                      for p in self.proj]
        self.host = [torch.empty(len(self.cold) * p.rows, p.src.shape[1], dtype=p.src.dtype, pin_memory=pin)
                     for p in self.proj]
        lo = moe.held.start  # the stacked weights' first expert
        for p, slots, host in zip(self.proj, self.slots, self.host):
            src = p.src.cpu()
            for store, experts in ((slots, self.hot), (host, self.cold)):
                for i, e in enumerate(experts):
                    store[i * p.rows:(i + 1) * p.rows].copy_(src[(e - lo) * p.rows:(e - lo + 1) * p.rows])
        self.hot_slot = {e: i for i, e in enumerate(self.hot)}
        self.host_index = {e: i for i, e in enumerate(self.cold)}
        self.ring: OrderedDict[int, int] = OrderedDict()  # expert -> slot, least recently used first
        # every expert's slot on the device (-1: not resident): the hot ones' now, the ring's as it changes
        table = torch.full((moe.n_experts,), -1, dtype=torch.int64)
        table[self.hot] = torch.arange(len(self.hot))
        self.slot_table = table.to(device)  # never reassigned: a captured graph reads this tensor
        self.free = list(range(len(self.hot), n_slots))
        self.cpu_runs: dict[int, int] = {}  # cold expert -> CPU computations since its last copy
        for lin, p in zip(lins, self.proj):  # the stacked tensors now live in the slots and the host store
            empty = torch.empty(0, p.src.shape[1], dtype=p.src.dtype, device=device)
            if lin.qtype is not None:
                lin.qdata = empty
            else:
                lin.weight = torch.nn.Parameter(empty, requires_grad=False)
        for p in self.proj:
            del p.src
        moe.offload = self

    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.slots)

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host)

    def expert_bytes(self) -> int:
        return sum(p.rows * t.shape[1] * t.element_size() for p, t in zip(self.proj, self.host))

    def weights_at(self, stores: list[torch.Tensor], index: int) -> list[Any]:
        """Gate, up and down of the expert at row block `index` of `stores` (the slots, the host store, or
        one-step buffers at 0)."""
        return [p.view(t, index) for p, t in zip(self.proj, stores)]

    def _take_slot(self, busy: set[int]) -> int | None:
        """A ring slot for a copy: a free one, else the least recently used expert's that this step does not
        use (evicted); None when the ring has none."""
        if self.free:
            return self.free.pop()
        for victim in self.ring:
            if victim not in busy:
                self.slot_table[victim] = -1
                return self.ring.pop(victim)
        return None

    def _wants_cpu(self, e: int, n: int) -> bool:
        rule = self.rule
        if n > rule.cpu_rows or self.cpu_runs.get(e, 0) >= rule.promote_after:
            return False
        self.cpu_runs[e] = self.cpu_runs.get(e, 0) + 1
        return True

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """MoE.experts' result, computed from the slots, the ring, copies and the CPU (module docstring)."""
        if self.optimistic or graph_mode.for_graph(x):
            return self._resident(x, weights, ids)
        moe = self.moe
        flat = ids.reshape(-1)
        counts = torch.bincount(flat, minlength=moe.n_experts).tolist()  # the one host sync
        segs, start = {}, 0
        for e, n in enumerate(counts):
            if n and e in moe.held:  # another rank's expert: that rank adds its rows
                segs[e] = slice(start, start + n)
            start += n
        resident, copied, on_cpu = [], [], []
        stats = self.stats  # written by the engine thread only; /metrics reads plain ints
        for e, seg in segs.items():
            n = seg.stop - seg.start
            stats.routed += n
            if e in self.hot_slot:
                stats.hot += n
                resident.append((e, self.hot_slot[e]))
            elif e in self.ring:
                self.ring.move_to_end(e)
                stats.ring_hits += n
                resident.append((e, self.ring[e]))
            else:
                stats.cold += n
                (on_cpu if self._wants_cpu(e, n) else copied).append(e)
        ys: dict[int, torch.Tensor] = {}
        copies = self._issue_copies(copied, set(segs))
        kernel = triton_moe.use_kernel(x) and len(self.slots[0]) > 0 and all(b is None for _, b in copies.values())
        if not kernel or on_cpu:  # the grouped path's rows by expert (the kernel groups on the device)
            order = torch.argsort(flat, stable=True)
            rows = order // moe.top_k
            pair_weights = weights.reshape(-1)[order, None]
            xs = x.index_select(0, rows)
        cpu_in = {e: xs[segs[e]].to("cpu") for e in on_cpu}  # before the device queues the matmuls
        if self.copy_stream is not None and copies and kernel:
            torch.cuda.current_stream(self.device).wait_event(self.copy_event)
        if kernel:  # one launch over the slots: the routing remapped to slot ids, the CPU's pairs weighted 0
            out = self._kernel(x, weights, self.slot_table[ids])  # the ring's copies are in the table now
        else:
            out = torch.zeros_like(x)
            for e, slot in resident:
                ys[e] = expert_ffn(xs[segs[e]], *self.weights_at(self.slots, slot), moe.act)
            if self.copy_stream is not None and copies:
                torch.cuda.current_stream(self.device).wait_event(self.copy_event)
            for e, (slot, stage) in copies.items():
                w = self.weights_at(stage, 0) if stage is not None else self.weights_at(self.slots, slot)
                ys[e] = expert_ffn(xs[segs[e]], *w, moe.act)
        if on_cpu:
            t = time.perf_counter()
            for e in on_cpu:
                y = expert_ffn(cpu_in[e], *self.weights_at(self.host, self.host_index[e]), moe.act)
                ys[e] = y.to(self.device, non_blocking=True)
            stats.cpu_experts += len(on_cpu)
            stats.cpu_seconds += time.perf_counter() - t
        for e, seg in segs.items():
            if e in ys:
                out.index_add_(0, rows[seg], ys[e] * pair_weights[seg])
        return out

    def _resident(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts that are resident, from `slot_table`, with no host sync (module docstring): a
        pair whose expert is not resident weighs 0 and marks it in `missed`. Another rank's pair weighs 0 (not
        a miss)."""
        moe, held = self.moe, self.moe.held
        slot_ids = self.slot_table[ids]
        cold = slot_ids < 0
        if len(held) < moe.n_experts:
            cold = cold & (ids >= held.start) & (ids < held.stop)
        # every pair of an expert has the same `cold`, so the duplicate writes agree; a resident one writes False
        if not graph_mode.rehearsing():  # a capture's rehearsal would leave marks no step made
            self.missed.index_put_((ids.reshape(-1),), cold.reshape(-1))
        n_slots = len(self.slots[0]) // self.proj[0].rows
        if n_slots == 0:
            return torch.zeros_like(x)
        if triton_moe.use_kernel(x):
            return self._kernel(x, weights, slot_ids)
        # every slot over every row (as MoE.experts_every); scatter_add: the pairs weighted 0 share slot 0
        w = weights.masked_fill(slot_ids < 0, 0)
        dense = torch.zeros(x.shape[0], n_slots, device=x.device, dtype=x.dtype)
        dense.scatter_add_(1, slot_ids.clamp(min=0), w)
        out = torch.zeros_like(x)
        for s in range(n_slots):
            out += expert_ffn(x, *self.weights_at(self.slots, s), moe.act) * dense[:, s, None]
        return out

    def _kernel(self, x: torch.Tensor, weights: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
        """The routed pairs through kernels/triton_moe.py with the slots as its stacked weights, the routing
        mapped to slots (`slot_table[ids]`); a pair whose expert has no slot (-1: cold, on the CPU) weighs 0."""
        stacked = [QuantWeight(t, p.qtype, p.cols, p.dtype) if p.qtype is not None else t
                   for p, t in zip(self.proj, self.slots)]
        return triton_moe.moe_experts(x, weights.masked_fill(slot_ids < 0, 0), slot_ids.clamp(min=0),
                                      len(self.slots[0]) // self.proj[0].rows, *stacked, self.moe.act)

    def fetch(self, experts: list[int]) -> bool:
        """Copy cold `experts` (a step over the resident experts missed them) into ring slots, evicting the
        least recently used; the device's later work waits for the copies. False, copying nothing, when the
        ring has too few slots for them."""
        if len(experts) > len(self.free) + len(self.ring):
            return False
        self._issue_copies(experts, set(experts))
        if self.copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self.copy_event)
        return True

    def _issue_copies(self, copied: list[int], busy: set[int]) -> dict[int, tuple[int | None, Any]]:
        """Start the copies of `copied` (on the copy stream on CUDA); {expert: (ring slot, one-step buffers)}."""
        out: dict[int, tuple[int | None, Any]] = {}
        if not copied:
            return out
        cs = self.copy_stream
        if cs is not None:
            cs.wait_stream(torch.cuda.current_stream(self.device))  # ring slots are read by earlier steps
        for e in copied:  # buffers are allocated on the compute stream, which uses (and frees) them
            slot = self._take_slot(busy)
            stage = None
            if slot is None:
                stage = [torch.empty(p.rows, t.shape[1], dtype=t.dtype, device=self.device)
                         for p, t in zip(self.proj, self.host)]
            out[e] = (slot, stage)
        with torch.cuda.stream(cs) if cs is not None else contextlib.nullcontext():
            for e, (slot, stage) in out.items():
                self._copy_into(e, slot, stage)
            if cs is not None:
                self.copy_event = torch.cuda.Event()
                self.copy_event.record(cs)
        for e, (slot, _) in out.items():
            self.cpu_runs.pop(e, None)
            if slot is not None:
                self.ring[e] = slot
                self.slot_table[e] = slot
        return out

    def _copy_into(self, e: int, slot: int | None, stage: list[torch.Tensor] | None) -> None:
        i = self.host_index[e]
        for k, (p, host) in enumerate(zip(self.proj, self.host)):
            dst = stage[k] if stage is not None else self.slots[k][slot * p.rows:(slot + 1) * p.rows]  # type: ignore[operator]
            dst.copy_(host[i * p.rows:(i + 1) * p.rows], non_blocking=True)
        self.stats.copies += 1
        self.stats.copy_bytes += self.expert_bytes()


def measure_rule(layer: LayerOffload, promote_after: int = 2) -> OffloadRule:
    """The CPU rule from timings on this machine: one cold expert's copy to the device against its CPU
    matmuls on one row (each the best of three, after a first run that warms the kernels)."""
    if not layer.cold:
        return OffloadRule(0, promote_after)
    e = layer.cold[0]
    i = layer.host_index[e]
    x = torch.randn(1, layer.moe.hidden, dtype=layer.proj[0].dtype)

    def timed(fn: Any) -> float:
        best = math.inf
        for _ in range(4):
            t = time.perf_counter()
            fn()
            if layer.device.type == "cuda":
                torch.cuda.synchronize(layer.device)
            best = min(best, time.perf_counter() - t)
        return best

    stage = [torch.empty(p.rows, t.shape[1], dtype=t.dtype, device=layer.device)
             for p, t in zip(layer.proj, layer.host)]
    t_copy = timed(lambda: [s.copy_(h[i * p.rows:(i + 1) * p.rows], non_blocking=True)
                            for s, h, p in zip(stage, layer.host, layer.proj)])
    t_cpu = timed(lambda: expert_ffn(x, *layer.weights_at(layer.host, i), layer.moe.act))
    cpu_rows = int(t_copy // t_cpu) if layer.device.type == "cuda" else 0
    return OffloadRule(cpu_rows, promote_after, {"t_copy_s": t_copy, "t_cpu_row_s": t_cpu})
