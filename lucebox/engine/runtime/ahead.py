"""Decode one step ahead: launch step N+1 before the host has read step N's tokens.

A plain decode step ends with the host waiting for its tokens; it then appends them, checks the stop
rules, schedules the next step and packs its inputs while the GPU waits. With CUDA graphs a small model's
step is about a millisecond of GPU time, and that host part is a tenth to a third of it (more with many
streams), so the GPU idles that long every step.

Here the host launches step N+1 while step N runs: each of its rows takes its input token on the device
from step N's argmax (`Chunk.carry`; the decode graph reads it from the last replay's output). Step N's
tokens are copied to pinned memory behind step N, and only then does the host wait for them, while the
GPU already has step N+1 queued. A row whose sequence ended at step N (an EOS, a stop token) was computed
for nothing and is dropped: its K/V write lands at the position after the sequence's final token, in a
block the engine frees and hands out again only to steps queued later on the same stream.

Only steps where nothing needs the host between two steps run ahead: decode-only batches of greedy rows
(no penalties, logprobs, grammar or forced tokens), none of them speculating (with a drafter loaded, the
sequences the adaptive rule has decoding plainly: spec/adaptive.py), nothing waiting to be admitted,
and a KV block for every row without preempting anyone. A sequence that reaches its hold
(Sequence.hold_at) with the step in flight gets no row in the next one, so it stops exactly there.
Before anything else touches the sequences (an abort, a command on the engine thread) the engine settles
the step in flight.
The greedy tokens are the same as a plain step's: the rows, their inputs and their kernels are.

Such a step calls into torch five times on this thread (CudaGraphDecoder.launch), no more: every call lets go
of the GIL, and with the event loop busy writing many streams' events the thread waits up to the switch
interval to get it back, at each call (the slices, events and second pinned buffer of the first version made
it about a dozen).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lucebox.engine.runtime.model_runner import ModelRunner, is_decode
from lucebox.engine.runtime.scheduler import Scheduler
from lucebox.engine.runtime.sequence import Chunk, Sequence

if TYPE_CHECKING:
    from lucebox.engine.runtime.llm_engine import StepOutput


@dataclass
class Launched:
    """A step in flight: its chunks, its argmax (eager steps: the next step's carried inputs), and what reads
    its tokens on the host, waiting for them."""

    chunks: list[Chunk]
    tokens: torch.Tensor | None  # [n] int64, eager steps only (a graph's carried rows read it inside the graph)
    read: Callable[[], list[int]]


def runs_ahead(seq: Sequence) -> bool:
    """A sequence whose next token the device can pick alone: greedy, nothing the host must apply."""
    p = seq.params
    return (p.greedy and not p.has_penalties and p.logprobs is None and seq.constraint is None
            and not seq.forced_tokens)


class Ahead:
    """The engine's step in flight (at most one), launched, continued and resolved."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler,
                 plainly: Callable[[Sequence], bool] | None = None) -> None:
        self.runner = runner
        self.scheduler = scheduler
        # With a drafter: whether a sequence decodes plainly now (a speculating row needs the host each step).
        self.plainly = plainly
        self.kv = runner.kv
        self.inflight: Launched | None = None
        self.steps = 0  # steps launched ahead
        self.wasted = 0  # rows computed for a sequence that had ended

    # ----- what may run ahead -------------------------------------------------

    def eligible(self, chunks: list[Chunk]) -> bool:
        """A step the host need not see between: decode rows only, each greedy, a decode graph for it."""
        if not chunks or not all(is_decode(c) and runs_ahead(c.seq) for c in chunks):
            return False
        if self.plainly is not None and not all(self.plainly(c.seq) for c in chunks):
            return False
        graphs = self.runner.graphs
        if graphs is None:
            return self.runner.device.type != "cuda"
        return graphs.buckets_for(len(chunks), max(c.start + 1 for c in chunks)) is not None

    def next_chunks(self) -> list[Chunk] | None:
        """The step after the one in flight, if it can launch before that one's tokens are read: every
        running sequence was in it (or is held: Sequence.held) and none waits, each one still runs ahead, and
        its KV blocks are free. A sequence that reaches its length limit or its hold with the step in flight
        has no row in it."""
        held = self.inflight
        sched = self.scheduler
        if held is None or sched.waiting:
            return None
        n = len(sched.running)
        if n != len(held.chunks) and n - sum(1 for s in sched.running if s.held) != len(held.chunks):
            return None
        chunks: list[Chunk] = []
        need = 0
        for i, c in enumerate(held.chunks):
            seq = c.seq
            if seq.is_finished or not runs_ahead(seq):
                return None
            pos = c.start + 1  # the position of the token the step in flight samples
            if seq.num_output + 1 >= seq.params.max_tokens or pos + 1 >= sched.max_model_len:
                continue  # ends there by length
            if seq.hold_at is not None and seq.num_output + 1 >= seq.hold_at:
                continue  # held there: the next token waits for the hold to be lifted
            need += max(self.kv.blocks_for(pos + 1) - len(seq.block_table), 0)
            chunks.append(Chunk(seq, pos, 1, carry=i))
        if not chunks or not self.eligible(chunks):
            return None
        pool = self.kv.pool
        if need > pool.num_free and sched.cache is not None:
            sched.cache.evict(need - pool.num_free)
        if need > pool.num_free:
            return None  # the plain schedule decides whom to preempt
        for c in chunks:
            grow = self.kv.blocks_for(c.start + 1) - len(c.seq.block_table)
            if grow > 0:
                c.seq.block_table.extend(pool.allocate(grow))
        return chunks

    # ----- launch and resolve ---------------------------------------------------

    def launch(self, chunks: list[Chunk]) -> None:
        """Queue the step on the device (nothing waits for it); it becomes the step in flight."""
        assert self.inflight is None and all(c.carry < 0 for c in chunks)
        self.inflight = self._launch(chunks, None)

    def advance(self, chunks: list[Chunk]) -> Launched:
        """Launch `next_chunks()` behind the step in flight; returns that step (now to be resolved)."""
        held = self.inflight
        assert held is not None
        self.inflight = self._launch(chunks, held.tokens)
        return held

    def _launch(self, chunks: list[Chunk], prev: torch.Tensor | None) -> Launched:
        runner = self.runner
        self.steps += 1
        if runner.graphs is not None:  # carried rows read the last replay's argmax, inside the graph
            return Launched(chunks, None, runner.graphs.launch(chunks))
        # eager (the CPU): the carried rows' ids are patched in on the device
        inputs = runner.prepare(chunks)
        src = torch.tensor([c.carry for c in chunks], device=runner.device)
        if prev is not None:
            n = len(chunks)
            inputs.input_ids[:n] = torch.where(src >= 0, prev[src.clamp(min=0)], inputs.input_ids[:n])
        tokens = runner.forward(inputs).logits.argmax(-1)
        return Launched(chunks, tokens, tokens.tolist)

    def resolve(self, held: Launched) -> list[StepOutput]:
        """Wait for a launched step's tokens and commit them, as a plain step's postprocess does."""
        from lucebox.engine.runtime.llm_engine import StepOutput

        tokens = held.read()
        live = [(c, t) for c, t in zip(held.chunks, tokens) if not c.seq.is_finished]
        self.wasted += len(held.chunks) - len(live)
        chunks = [c for c, _ in live]
        n_before = [len(c.seq.token_ids) for c in chunks]
        finished = set(self.scheduler.postprocess(chunks, chunks, [t for _, t in live], [None] * len(live)))
        return [StepOutput(c.seq, c.seq.token_ids[n:], c.seq in finished) for c, n in zip(chunks, n_before)]

    def settle(self) -> list[StepOutput]:
        """Resolve the step in flight, if any (before anything else reads or changes the sequences)."""
        held, self.inflight = self.inflight, None
        return self.resolve(held) if held is not None else []
