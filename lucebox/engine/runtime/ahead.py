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
(no penalties, logprobs, grammar or forced tokens), nothing waiting to be admitted, and a KV block for every
row without preempting anyone. A sequence that reaches its hold (Sequence.hold_at) with the step in flight
gets no row in the next one, so it stops exactly there (a speculating one with a hold never runs ahead).

With a drafter, a step is either every row decoding plainly (the sequences the adaptive rule has decoding
plainly: spec/adaptive.py) or every row speculating, as a greedy one-launch step (spec/static.py `launch`:
draft, verify and accept in one graph). A speculative step commits 1 to n tokens a row, so the host knows only
a bound for the next step's start: that step's graph takes each row's last token and start from the step
before on the device (`StaticSpec.carried`), its tables cover the bound (blocks for reserve_rows past it),
and once the step before is read its chunks get their true starts. A row whose sequence ended wrote K/V only
from its final token's position on (that one's value is the true one). The adaptive rule counts a plain
step's rows once it is launched, so a probe it starts makes the next step speculative, not this one.

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
from typing import TYPE_CHECKING, Any

import torch

from lucebox.engine.runtime.model_runner import ModelRunner, is_decode
from lucebox.engine.runtime.scheduler import Scheduler
from lucebox.engine.runtime.sequence import Chunk, Sequence

if TYPE_CHECKING:
    from lucebox.engine.runtime.llm_engine import StepOutput
    from lucebox.engine.spec.static import StaticSpec


@dataclass
class Launched:
    """A step in flight: its chunks, its argmax (eager steps: the next step's carried inputs), and what reads
    its tokens on the host, waiting for them."""

    chunks: list[Chunk]
    tokens: torch.Tensor | None  # [n] int64, eager plain steps only (a graph's carried rows read it inside it)
    read: Callable[[], list[Any]]  # a plain step's tokens, a speculative one's rows ([tokens..., path length])
    spec: bool = False


def runs_ahead(seq: Sequence) -> bool:
    """A sequence whose next token the device can pick alone: greedy, nothing the host must apply."""
    p = seq.params
    return (p.greedy and not p.has_penalties and p.logprobs is None and seq.constraint is None
            and not seq.forced_tokens)


class Ahead:
    """The engine's step in flight (at most one), launched, continued and resolved."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler,
                 plainly: Callable[[Sequence], bool] | None = None, static: StaticSpec | None = None,
                 commit: Callable[[Chunk, list[int], int], StepOutput] | None = None) -> None:
        self.runner = runner
        self.scheduler = scheduler
        # With a drafter: whether a sequence decodes plainly now; the fixed-shape steps that launch speculating
        # rows, and what commits a verified row's tokens (LLMEngine._commit_ahead: chunk, tokens, batch).
        self.plainly = plainly
        self.static = static
        self.commit = commit
        self.kv = runner.kv
        self.inflight: Launched | None = None
        self.steps = 0  # steps launched ahead
        self.spec_steps = 0  # of them speculative
        self.wasted = 0  # rows computed for a sequence that had ended

    # ----- what may run ahead -------------------------------------------------

    def eligible(self, chunks: list[Chunk]) -> bool:
        """A step the host need not see between: decode rows only, each greedy, a decode graph for it (or every
        row speculating, a one-launch speculative step for it)."""
        if not chunks or not all(is_decode(c) and runs_ahead(c.seq) for c in chunks):
            return False
        if self.plainly is not None and not all(self.plainly(c.seq) for c in chunks):
            return self.speculative(chunks)
        graphs = self.runner.graphs
        if graphs is None:
            return self.runner.device.type != "cuda"
        return graphs.buckets_for(len(chunks), max(c.start + 1 for c in chunks)) is not None

    def speculative(self, chunks: list[Chunk]) -> bool:
        """Every row speculates from its drafter context's end (a row launched ahead: by construction), and
        one launch takes them all."""
        assert self.plainly is not None
        if self.static is None or self.commit is None:
            return False
        if any(self.plainly(c.seq) or c.seq.hold_at is not None for c in chunks):
            return False
        return all(c.carry >= 0 or c.seq.draft_len == c.start for c in chunks) and self.static.launches(chunks)

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
        # The position of the token the step in flight samples (a speculative step's: at most), and the KV
        # slots a row holds past it (SpecDecoder.reserve_rows: the drafter block's, the verification's).
        ahead, past = (self.static.N, sched.decode_rows) if held.spec and self.static is not None else (1, 1)
        for i, c in enumerate(held.chunks):
            seq = c.seq
            if seq.is_finished or not runs_ahead(seq):
                return None
            pos = c.start + ahead
            if seq.num_output + 1 >= seq.params.max_tokens or pos + 1 >= sched.max_model_len:
                continue  # ends there by length
            if seq.hold_at is not None and seq.num_output + 1 >= seq.hold_at:
                continue  # held there: the next token waits for the hold to be lifted
            if held.spec and pos + past > sched.max_model_len:
                return None  # near the end of the context: the plain schedule decides
            need += max(self.kv.blocks_for(pos + past) - len(seq.block_table), 0)
            chunks.append(Chunk(seq, pos, 1, carry=i))
        if not chunks or not self.eligible(chunks) or held.spec != self._speculating(chunks):
            return None
        pool = self.kv.pool
        if need > pool.num_free and sched.cache is not None:
            sched.cache.evict(need - pool.num_free)
        if need > pool.num_free:
            return None  # the plain schedule decides whom to preempt
        for c in chunks:
            grow = self.kv.blocks_for(c.start + past) - len(c.seq.block_table)
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

    def _speculating(self, chunks: list[Chunk]) -> bool:
        return self.plainly is not None and not self.plainly(chunks[0].seq)

    def _launch(self, chunks: list[Chunk], prev: torch.Tensor | None) -> Launched:
        runner = self.runner
        self.steps += 1
        if self._speculating(chunks):
            assert self.static is not None
            self.spec_steps += 1
            return Launched(chunks, None, self.static.launch(chunks), spec=True)
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

        if held.spec:
            return self._resolve_spec(held)
        tokens = held.read()
        live = [(c, t) for c, t in zip(held.chunks, tokens) if not c.seq.is_finished]
        self.wasted += len(held.chunks) - len(live)
        chunks = [c for c, _ in live]
        n_before = [len(c.seq.token_ids) for c in chunks]
        finished = set(self.scheduler.postprocess(chunks, chunks, [t for _, t in live], [None] * len(live)))
        return [StepOutput(c.seq, c.seq.token_ids[n:], c.seq in finished) for c, n in zip(chunks, n_before)]

    def _resolve_spec(self, held: Launched) -> list[StepOutput]:
        """A speculative step's rows: the step launched behind it learns its rows' true starts, then each live
        row's tokens are committed."""
        rows = held.read()
        after = self.inflight
        if after is not None and after.spec:
            for c in after.chunks:
                if c.carry >= 0:
                    c.start = held.chunks[c.carry].start + rows[c.carry][-1]
        live = [(c, row) for c, row in zip(held.chunks, rows) if not c.seq.is_finished]
        self.wasted += len(held.chunks) - len(live)
        chunks = [c for c, _ in live]
        assert self.static is not None and self.commit is not None
        committed = self.static.finish(chunks, [row for _, row in live])
        return [self.commit(c, tokens, len(held.chunks)) for c, tokens in zip(chunks, committed)]

    def settle(self) -> list[StepOutput]:
        """Resolve the step in flight, if any (before anything else reads or changes the sequences)."""
        held, self.inflight = self.inflight, None
        return self.resolve(held) if held is not None else []
