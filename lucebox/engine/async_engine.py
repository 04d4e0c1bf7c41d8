"""The engine as the asyncio server sees it: submit, stream tokens, cancel.

One engine worker thread owns the LLMEngine (model, KV cache, scheduler);
nothing else touches them. The asyncio side never mutates engine state: it
queues commands (add, abort, force tokens) that the worker applies at the
start of its next step, so every decision about a sequence happens in one
thread and data flows one way:

    submit() ─► pending commands ─► [worker: apply, engine.step()] ─► per-request queue ─► stream()

Between two steps the loop also cancels requests whose client disconnected,
so a disconnect costs at most one step of wasted work.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from lucebox.engine.llm_engine import LLMEngine, StepOutput
from lucebox.engine.sampler import SamplingParams
from lucebox.engine.sequence import Sequence
from lucebox.errors import LuceboxError

log = logging.getLogger(__name__)


class QueueFull(LuceboxError):
    """More requests are waiting than `max_queue` allows (503 / overloaded_error)."""


@dataclass
class Timings:
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None

    def as_dict(self, prompt_tokens: int, output_tokens: int, seq: Sequence | None = None) -> dict[str, float | None]:
        """Milliseconds and rates, as the API layer reports them in `timings`."""
        def ms(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round((b - a) * 1000, 2)

        decode_ms = ms(self.first_token, self.finished)
        prefill_ms = ms(self.first_scheduled, self.first_token)
        spec: dict[str, float | None] = {}
        if seq is not None and seq.spec_steps:
            spec = {"draft_steps": seq.spec_steps, "accepted_draft_tokens": seq.spec_committed - seq.spec_steps,
                    "acceptance_length": round(seq.spec_committed / seq.spec_steps, 3)}
        return {
            **spec,
            "queue_ms": ms(self.arrival, self.first_scheduled),
            "prefill_ms": prefill_ms,
            "ttft_ms": ms(self.arrival, self.first_token),
            "decode_ms": decode_ms,
            "prompt_per_second": round(prompt_tokens / (prefill_ms / 1000), 2) if prefill_ms else None,
            "decode_per_second": (round((output_tokens - 1) / (decode_ms / 1000), 2)
                                  if decode_ms and output_tokens > 1 else None),
        }


@dataclass(eq=False)
class Generation:
    """One submitted request: its sequence and the queue its tokens arrive on."""

    seq: Sequence
    disconnected: asyncio.Event | None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    timings: Timings = field(default_factory=Timings)
    finish_reason: str | None = None

    @property
    def prompt_tokens(self) -> int:
        return self.seq.num_prompt

    @property
    def output_tokens(self) -> int:
        return self.seq.num_output

    @property
    def cached_tokens(self) -> int:
        return self.seq.num_cached


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, max_queue: int = 256) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lucebox-engine")
        self._commands: collections.deque = collections.deque()  # (op, generation, arg)
        self._lock = threading.Lock()
        self._active: dict[int, Generation] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.num_disconnects = 0
        self.steps = 0
        # Recent steps as (monotonic end time, ((seq id, start, rows), ...)): for stats and scheduling tests.
        self.step_log: collections.deque[tuple[float, tuple[tuple[int, int, int], ...]]] = collections.deque(
            maxlen=4096)

    # ----- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="lucebox-engine-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for gen in list(self._active.values()):
            self._deliver_end(gen, "cancelled")
        self._executor.shutdown(wait=True, cancel_futures=True)

    # ----- requests ----------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + sum(1 for op, _, _ in self._commands if op == "add")

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, disconnected: asyncio.Event | None = None,
        cache_hint: object = None,
    ) -> Generation:
        """Queue a request (raises LuceboxError for bad input, QueueFull past --max-queue)."""
        if self.num_waiting >= self.max_queue:
            raise QueueFull(f"the server has {self.num_waiting} requests waiting (limit {self.max_queue}); retry later")
        seq = self.engine.new_sequence(prompt_ids, params)
        seq.cache_hint = cache_hint
        gen = Generation(seq, disconnected)
        self._active[seq.seq_id] = gen
        self._command("add", gen)
        return gen

    def call_in_engine(self, fn: Any) -> concurrent.futures.Future:
        """Run `fn()` on the engine thread between two steps (state only that thread may touch)."""
        return self._executor.submit(fn)

    def cancel(self, gen: Generation, reason: str = "cancelled") -> None:
        if gen.finish_reason is None:
            self._command("abort", gen, reason)

    def force_tokens(self, gen: Generation, token_ids: list[int]) -> None:
        """Replace the next sampled token with these (a forced `</think>`, say)."""
        self._command("force", gen, list(token_ids))

    async def stream(self, gen: Generation) -> AsyncIterator[list[int]]:
        """Yield lists of new token ids until the generation ends (then `gen.finish_reason` is set)."""
        while True:
            item = await gen.queue.get()
            if item is None:
                return
            yield item

    # ----- the loop ----------------------------------------------------------

    def _command(self, op: str, gen: Generation, arg: object = None) -> None:
        with self._lock:
            self._commands.append((op, gen, arg))
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wake is not None
        while True:
            self._cancel_disconnected()
            if not self._commands and not self.engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                outputs, ended = await loop.run_in_executor(self._executor, self._step)
            except Exception:  # a bug in the engine: fail the running requests, keep serving
                log.exception("engine step failed")
                for gen in list(self._active.values()):
                    self._command("abort", gen, "error")
                continue
            now = time.monotonic()
            for out in outputs:
                gen = self._active.get(out.seq.seq_id)
                if gen is None:
                    continue
                if gen.timings.first_token is None:
                    gen.timings.first_token = now
                if out.new_tokens:
                    gen.queue.put_nowait(out.new_tokens)
                if out.finished:
                    self._deliver_end(gen, out.seq.finish_reason or "stop")
            for gen, reason in ended:
                self._deliver_end(gen, reason)

    def _step(self) -> tuple[list[StepOutput], list[tuple[Generation, str]]]:
        """Engine thread: apply queued commands, run one step."""
        ended: list[tuple[Generation, str]] = []
        with self._lock:
            commands = list(self._commands)
            self._commands.clear()
        for op, gen, arg in commands:
            if op == "add":
                if gen.finish_reason is None and not gen.seq.is_finished:
                    self.engine.scheduler.add(gen.seq)
            elif op == "abort":
                if not gen.seq.is_finished:
                    self.engine.abort(gen.seq)
                    gen.seq.finish_reason = arg
                    ended.append((gen, arg))
            elif op == "force" and not gen.seq.is_finished:
                gen.seq.forced_tokens = arg
        now = time.monotonic()
        for seq in self.engine.scheduler.running:
            gen = self._active.get(seq.seq_id)
            if gen is not None and gen.timings.first_scheduled is None:
                gen.timings.first_scheduled = now
        outputs = self.engine.step()
        for seq in self.engine.scheduler.running:  # admitted during this step
            gen = self._active.get(seq.seq_id)
            if gen is not None and gen.timings.first_scheduled is None:
                gen.timings.first_scheduled = now
        self.steps += 1
        if self.engine.last_step:
            self.step_log.append((time.monotonic(), tuple(self.engine.last_step)))
        return outputs, ended

    def _cancel_disconnected(self) -> None:
        for gen in list(self._active.values()):
            if gen.disconnected is not None and gen.disconnected.is_set() and gen.finish_reason is None:
                if not any(op == "abort" and g is gen for op, g, _ in self._commands):
                    self.num_disconnects += 1
                    self._command("abort", gen, "cancelled")

    def _deliver_end(self, gen: Generation, reason: str) -> None:
        if gen.finish_reason is not None:
            return
        gen.finish_reason = reason
        gen.timings.finished = time.monotonic()
        self._active.pop(gen.seq.seq_id, None)
        gen.queue.put_nowait(None)
