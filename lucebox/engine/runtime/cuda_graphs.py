"""Decode steps replayed as CUDA graphs.

A small model's decode step is hundreds of tiny kernels; launched one by one
from Python they cost ~7 µs each, replayed from a graph ~1 µs. A graph fixes
every shape and address, so a decode-only step is padded to a captured batch
size and context bucket:
- batch buckets 1, 2, 4, 8, then multiples of 8 up to `max_batch`;
- context buckets: powers of two from 256 tokens up to the model's context.
Every bucket is captured at start-up (`capture_all`, from `LLMEngine.warm_up`),
largest first, into one shared memory pool: the intermediates of one graph are
free for the next capture, so the pool holds about one graph's workspace, and
every graph writes its outputs into one static buffer. After warm-up a capture
while serving is a bug (a request waits for it): it is counted in
`captures_after_ready` and logged as a warning.

Per step the host packs token ids, positions, cache slots and block tables
into one pinned buffer and copies it to the device in one transfer; the graph
does the rest: the model, the LM head, and the greedy argmax (so a greedy step
reads back one int per sequence). A row may instead take its token from the
last replay's argmax, still on the device (`Chunk.carry`: the step launched one
step ahead, runtime/ahead.py). Attention uses the Triton paged decode kernel
where available, else keys are gathered inside the graph.
Padding rows write their K/V into scratch block 0 and are dropped.

A hybrid model's decode step (models/qwen35.py) is captured the same way: the rows' recurrent state slots are
one more part of the packed inputs (padding rows: scratch slot 0), and its Triton decode kernels
(kernels/triton_deltanet.py) update the slots in place, which is safe since a replay cannot stop half-way.
With speculation on, a hybrid's plain rows extend the drafter context as they go (it cannot re-run positions
later), so its decode graphs keep the drafter's layers' outputs too (`capture`, set before the warm-up).
The eager warm-up runs before a capture point the rows at the scratch slots (KV and state), so a capture while
serving leaves the sequences' states as they were. They run under `graph_mode.rehearsal()`, so every layer takes
the path the capture will take (the sync-free MoE and Spark paths) and its Triton kernels compile then, never
inside the capture (which breaks it: "operation failed due to a previous error during capture").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lucebox.engine.kernels import graph_mode, triton_attention
from lucebox.engine.kernels.attention import AttentionMetadata, AttnGroup
from lucebox.engine.runtime.recurrent_state import StateRows
from lucebox.engine.runtime.sequence import Chunk

log = logging.getLogger(__name__)

MIN_CTX = 256
# A hybrid model's decode graphs (its state slots among the packed inputs): on since
# tests/test_triton_deltanet.py::test_graph_decode_equals_eager passed on the H200 (2026-12-02);
# LUCEBOX_HYBRID_GRAPHS=0 turns them off (eager hybrid decode, for a check).
HYBRID = os.environ.get("LUCEBOX_HYBRID_GRAPHS", "1") == "1"


def pick_buckets(batches: list[int], max_ctx: int, n: int, ctx: int) -> tuple[int, int] | None:
    """The smallest (batch, context) bucket holding `n` sequences of up to `ctx` positions."""
    batch = next((b for b in batches if b >= n), None)
    if batch is None or ctx > max_ctx:
        return None
    c = MIN_CTX
    while c < ctx:
        c *= 2
    return batch, min(c, max_ctx)


def batch_buckets(max_batch: int) -> list[int]:
    small = [b for b in (1, 2, 4) if b <= max_batch]
    return small + list(range(8, max_batch + 8, 8)) if max_batch > 4 else small


def ctx_buckets(max_ctx: int) -> list[int]:
    """Every context bucket `pick_buckets` can return for contexts up to `max_ctx` (ascending)."""
    out, c = [], MIN_CTX
    while c < max_ctx:
        out.append(c)
        c *= 2
    return out + [max(max_ctx, MIN_CTX)]


def all_buckets(batches: list[int], max_ctx: int) -> list[tuple[int, int]]:
    """Every (batch, context) bucket a configuration can reach, largest first (the capture order: later,
    smaller graphs reuse the shared pool memory the first ones freed)."""
    return [(b, c) for b in sorted(batches, reverse=True) for c in reversed(ctx_buckets(max_ctx))]


class HostTables:
    """The graph rows' block tables in the pinned host buffer, kept across steps. A decode step's tables
    barely change (a row's sequence is usually the same, its table one block longer now and then), so a
    row is rewritten only from the first entry not yet written for the same table; a different table (a
    new list: tables only grow in place) rewrites the row and clears what is left of the old one."""

    def __init__(self, tables: np.ndarray) -> None:
        self.t = tables  # [rows, blocks] view of the host buffer
        self.rows: list[tuple[list[int], int] | None] = [None] * tables.shape[0]  # (table, entries written)

    def fill(self, i: int, table: list[int]) -> None:
        n = min(len(table), self.t.shape[1])
        held = self.rows[i]
        start = 0
        if held is not None and held[0] is table and held[1] <= n:
            start = held[1]
        elif held is not None and held[1] > n:
            self.t[i, n: held[1]] = 0
        if n > start:
            self.t[i, start:n] = table[start:n]
        self.rows[i] = (table, n)

    def clear_from(self, first: int) -> None:
        """Rows `first`.. are padding: scratch block 0."""
        for i in range(first, len(self.rows)):
            held = self.rows[i]
            if held is not None:
                self.t[i, : held[1]] = 0
                self.rows[i] = None


class _HostBuffer:
    """One pinned staging buffer: the packed decode inputs with their block-table rows, the argmax that a step
    launched ahead reads back, each batch bucket's views of both (made once: a slice is a call into torch,
    runtime/ahead.py says why those count), and one event recorded behind the buffer's last copy."""

    def __init__(self, size: int, head: int, rows: int, blocks: int, batches: list[int]) -> None:
        self.pinned = torch.zeros(size, dtype=torch.long, pin_memory=True)
        self.np = self.pinned.numpy()
        self.tables = HostTables(self.np[head:].reshape(rows, blocks))
        self.tokens = torch.zeros(rows, dtype=torch.long, pin_memory=True)
        self.tokens_np = self.tokens.numpy()
        self.inputs = {b: self.pinned[: head + b * blocks] for b in batches}
        self.outputs = {b: self.tokens[:b] for b in batches}
        self.event = torch.cuda.Event()
        self.pending = False  # a copy is queued behind `event` and nobody has waited for it yet

    def wait(self) -> None:
        """Wait for this buffer's last copies (at most once per copy)."""
        if self.pending:
            self.event.synchronize()
            self.pending = False


class _Graph:
    def __init__(self, graph: torch.cuda.CUDAGraph, logits: torch.Tensor, tokens: torch.Tensor) -> None:
        self.graph = graph
        self.logits = logits  # views of the decoder's static output buffers, one row per batch bucket row
        self.tokens = tokens
        self.batch = tokens.shape[0]


class CudaGraphDecoder:
    """Captures and replays decode steps for one ModelRunner."""

    def __init__(self, runner: Any, max_batch: int, max_ctx: int) -> None:
        self.runner = runner
        self.model = runner.model
        self.cfg = runner.model.cfg
        self.kv = runner.kv
        self.device = runner.device
        self.page = self.kv.block_size
        self.batches = batch_buckets(max_batch)
        self.max_ctx = max(MIN_CTX, -(-max_ctx // self.page) * self.page)
        self.use_kernel = triton_attention.available(self.device)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        b, nb = self.batches[-1], self.max_ctx // self.page
        self.bmax, self.nbmax = b, nb
        self.states = self.kv.states  # a hybrid's recurrent state slots, else None
        # One packed int64 buffer: ids[b] | positions[b] | slots[b] | (hybrids) state slots[b] | carry[b] |
        # block tables[b, nb]. carry: the row of the last replay's tokens that is this row's input (-1: ids).
        self.head = (4 if self.states is None else 5) * b
        self.carry_at = self.head - b
        size = self.head + b * nb
        # Two pinned staging buffers, used in turn: a step launched ahead (runtime/ahead.py) is packed while the
        # copy of the step before may still be queued; a buffer is rewritten only once its last copy is done.
        self._staging = [_HostBuffer(size, self.head, b, nb, self.batches) for _ in range(2)]
        self._turn = 0
        self.dev = torch.zeros(size, dtype=torch.long, device=self.device)
        self._dev_inputs = {x: self.dev[: self.head + x * nb] for x in self.batches}
        self.out_logits: torch.Tensor | None = None  # [bmax, vocab], made at the first capture
        self.out_tokens = torch.zeros(b, dtype=torch.long, device=self.device)
        self.capture: tuple[int, ...] = ()  # layers whose outputs every replay keeps (`features`)
        self.out_features: list[torch.Tensor] = []  # [bmax, hidden] each, made at the first capture
        self.ready = False  # set by the engine's warm-up; a capture after it is counted
        self.captures_after_ready = 0

    def _views(self, t: torch.Tensor, batch: int, c: int) -> tuple[torch.Tensor, ...]:
        b, nb = self.bmax, self.nbmax
        tables = t[self.head:].view(b, nb)[:batch, : c // self.page]
        return t[:batch], t[b: b + batch], t[2 * b: 2 * b + batch], tables

    def buckets_for(self, n: int, ctx: int) -> tuple[int, int] | None:
        return pick_buckets(self.batches, self.max_ctx, n, ctx)

    def buckets(self) -> list[tuple[int, int]]:
        """Every bucket a decode step can reach, in capture order."""
        return all_buckets(self.batches, self.max_ctx)

    def capture_all(self, advance: Callable[[int], None] | None = None) -> int:
        """Capture every bucket not captured yet (start-up); returns how many were captured. A second warm-up
        (after `keep_layers`, or `bench spec`'s next configuration) rehearses on neutral inputs: the last real
        step's slots may be cached blocks (the GPU prefix tier) that its stale tokens would overwrite."""
        if any(key not in self.graphs for key in self.buckets()):
            self._neutral_inputs()
        n = 0
        for key in self.buckets():
            if key not in self.graphs:
                self.graphs[key] = self._capture(*key)
                n += 1
            if advance is not None:
                advance(1)
        return n

    def _neutral_inputs(self) -> None:
        """Inputs that touch nothing: token 0 at position 0 into scratch slot 0 (and state slot 0), no carry,
        scratch block 0 tables. The staging buffers keep their rows: a step's copy rewrites its bucket's."""
        self.dev.zero_()
        self.dev[self.carry_at: self.head].fill_(-1)

    def run(self, chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(logits [n, vocab], argmax tokens [n]) for a decode-only step, or None if no bucket fits.
        A chunk with `carry` >= 0 takes its input token from that row of the last replay's argmax (on the
        device: runtime/ahead.py launches the step before the host has read those tokens)."""
        replayed = self._replay(chunks)
        if replayed is None:
            return None
        g, buf = replayed
        buf.event.record()
        buf.pending = True
        n = len(chunks)
        return g.logits[:n], g.tokens[:n]

    def launch(self, chunks: list[Chunk]) -> Callable[[], list[int]]:
        """Replay a decode step launched ahead (runtime/ahead.py) and copy its argmax to pinned memory behind
        it; returns what reads the tokens (it waits for that copy). Nothing else is called into torch: per
        step this thread calls it five times (inputs copy, replay, tokens copy, record, wait), each a point
        where it lets go of the GIL. The caller checked the bucket (`buckets_for`)."""
        replayed = self._replay(chunks)
        assert replayed is not None, "the caller checked the bucket"
        g, buf = replayed
        buf.outputs[g.batch].copy_(g.tokens, non_blocking=True)
        buf.event.record()
        buf.pending = True
        n = len(chunks)

        def read() -> list[int]:  # before this buffer's next fill: two launches later
            buf.wait()
            return buf.tokens_np[:n].tolist()
        return read

    def _replay(self, chunks: list[Chunk]) -> tuple[_Graph, _HostBuffer] | None:
        """Pack the chunks, copy them to the device and replay their bucket's graph (None: no bucket fits)."""
        buckets = self.buckets_for(len(chunks), max(c.start + 1 for c in chunks))
        if buckets is None:
            return None
        buf = self._fill(chunks)
        g = self.graphs.get(buckets)
        if g is None:
            if self.ready:
                self.captures_after_ready += 1
                log.warning("decode graph batch=%d ctx=%d captured while serving (the warm-up missed it)", *buckets)
            g = self._capture(*buckets)
            self.graphs[buckets] = g
        g.graph.replay()
        return g, buf

    def keep_layers(self, capture: tuple[int, ...]) -> None:
        """Keep these layers' outputs in every replay from now on (graphs captured before are dropped)."""
        if capture != self.capture:
            self.capture, self.out_features = capture, []
            self.graphs.clear()
            self.pool = torch.cuda.graph_pool_handle()  # a fresh pool: recapturing into the freed graphs' one
            # trips the caching allocator (`use_count > 0` INTERNAL ASSERT, torch 2.11)

    def features(self, n: int) -> list[torch.Tensor]:
        """The last replay's `capture` layer outputs of its first `n` rows ([n, hidden] each)."""
        return [f[:n] for f in self.out_features]

    def _fill(self, chunks: list[Chunk]) -> _HostBuffer:
        """Pack the chunks into the next staging buffer and queue its copy to the device."""
        self._turn ^= 1
        buf = self._staging[self._turn]
        buf.wait()  # its copies of two steps ago (a step launched ahead was read since: no wait then)
        h, b, tables = buf.np, self.bmax, buf.tables
        n = len(chunks)
        h[: self.head] = 0  # padding rows: token 0 at position 0, written to scratch slot 0 (and state slot 0)
        h[self.carry_at: self.head] = -1
        for i, ch in enumerate(chunks):
            table = ch.seq.block_table
            if ch.carry >= 0:
                h[self.carry_at + i] = ch.carry
            else:
                h[i] = ch.seq.token_ids[ch.start]
            h[b + i] = ch.start
            h[2 * b + i] = table[ch.start // self.page] * self.page + ch.start % self.page
            if self.states is not None:
                h[3 * b + i] = ch.seq.state_slot
            tables.fill(i, table)
        tables.clear_from(n)
        batch = next(x for x in self.batches if x >= n)  # the bucket's rows are all the graph reads
        self._dev_inputs[batch].copy_(buf.inputs[batch], non_blocking=True)
        return buf

    def _meta(self, batch: int, c: int) -> AttentionMetadata:
        ids, pos, slots, tables = self._views(self.dev, batch, c)
        window = self.cfg.sliding_window if self.cfg.has_sliding_layers else None
        return AttentionMetadata(slots, self.page, [AttnGroup(0, batch, 1, c, tables, pos + 1, pos)], window)

    @torch.inference_mode()
    def _forward(self, batch: int, c: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        ids, pos, _, _ = self._views(self.dev, batch, c)
        carry = self.dev[self.carry_at: self.carry_at + batch]
        # (read before this replay overwrites out_tokens; rows that carry nothing keep their host ids)
        ids = torch.where(carry >= 0, self.out_tokens[carry.clamp(min=0)], ids)
        extra: dict[str, StateRows] = {}
        if self.states is not None:  # every row a decode; the kernels update the slots in place
            slots = self.dev[3 * self.bmax: 3 * self.bmax + batch]
            extra["state"] = StateRows(self.states, batch, slots, [], in_place=True)
        hidden, features = self.model(ids, pos, self.kv.data, self._meta(batch, c), capture=self.capture, **extra)
        logits = self.model.logits(hidden)
        return logits, logits.argmax(-1), features

    @torch.inference_mode()
    def _capture(self, batch: int, c: int) -> _Graph:
        held = None
        if self.states is not None:  # the eager runs below write the scratch slots (K/V, state), not the rows':
            part = self.dev[2 * self.bmax: 4 * self.bmax]  # their states would advance (their K/V be wrong)
            held = part.clone()
            part.zero_()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), graph_mode.rehearsal():
            for _ in range(2):  # warm-up outside the graph (kernel compilation, cuBLAS handles) on its path
                logits, _, features = self._forward(batch, c)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if held is not None:
            part.copy_(held)
        if self.out_logits is None:
            self.out_logits = torch.zeros(self.bmax, logits.shape[-1], dtype=logits.dtype, device=self.device)
        if len(self.out_features) != len(features):
            self.out_features = [torch.zeros(self.bmax, f.shape[-1], dtype=f.dtype, device=self.device)
                                 for f in features]
        del logits, features
        out_logits, out_tokens = self.out_logits[:batch], self.out_tokens[:batch]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits, tokens, features = self._forward(batch, c)
            out_logits.copy_(logits)
            out_tokens.copy_(tokens)
            for out, f in zip(self.out_features, features):
                out[:batch].copy_(f)
        log.debug("captured decode graph batch=%d ctx=%d (triton kernel: %s)", batch, c, self.use_kernel)
        return _Graph(graph, out_logits, out_tokens)
