"""The engine as the asyncio server sees it: submit, stream tokens, cancel.

One engine thread owns the LLMEngine (model, KV cache, scheduler) and runs
its own loop: apply queued commands, run a step, hand the new tokens to the
event loop (`call_soon_threadsafe`), repeat — it never waits for the event
loop, so serving many sockets does not slow the model down. The asyncio side
never mutates engine state: it queues commands (add, abort, force tokens,
hold, call) that the engine thread applies at the start of its next step, so every
decision about a sequence happens in one thread and data flows one way:

    submit() ─► commands ─► [engine thread: apply, step] ─► call_soon_threadsafe ─► per-request queue ─► stream()

Before each step the engine thread cancels requests whose client
disconnected, so a disconnect costs at most one step of wasted work (and,
while every running sequence waits at its hold, within the idle wait).

A hold (`Sequence.hold_at`, set at `submit` or by `hold`) stops a sequence at
an exact output length until the event loop lifts it (`hold(gen, None)`, or
`force_tokens`): the chat layer's thinking budget decides there whether to
close the reasoning, so where `</think>` lands does not depend on how far the
engine ran ahead of the loop.

(ARCHITECTURE.md suggests awaiting `run_in_executor` per step; a round trip
through the event loop between steps left the GPU idle while the loop
rendered SSE frames, so the engine thread drives itself.)
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from lucebox.engine.runtime.grammar import Constraint
from lucebox.engine.runtime.llm_engine import LLMEngine, StepOutput
from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.engine.runtime.sequence import Sequence
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
    def __init__(self, engine: LLMEngine, *, max_queue: int = 256, stream_pace: float = 0.0) -> None:
        self.engine = engine
        self.max_queue = max_queue
        # Seconds per active generation that a stream waits after one event before the next (stream()).
        self.pace = stream_pace
        self._commands: collections.deque = collections.deque()  # (op, generation, arg)
        self._lock = threading.Lock()  # commands and the active set
        self._active: dict[int, Generation] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # The last step's tokens, not yet handed to the event loop: the next step hands them over once its
        # forward is launched (engine.on_launched), so the loop's work overlaps the GPU and not the step's host part.
        self._pending: tuple[list[StepOutput], list[tuple[Generation, str]], float] | None = None
        engine.on_launched = self._flush
        self.num_disconnects = 0
        self.steps = 0
        # Recent steps as (monotonic end time, ((seq id, start, rows), ...)): for stats and scheduling tests.
        self.step_log: collections.deque[tuple[float, tuple[tuple[int, int, int], ...]]] = collections.deque(
            maxlen=4096)

    # ----- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._thread_main, name="lucebox-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        for gen in list(self._active.values()):
            self._deliver_end(gen, "cancelled")

    @property
    def thread_ident(self) -> int | None:
        """The engine thread's threading ident while it runs, else None: /metrics reads its CPU clock (a thread
        that has ended has none to read)."""
        return self._thread.ident if self._thread is not None and self._thread.is_alive() else None

    # ----- requests ----------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        with self._lock:
            queued = sum(1 for op, _, _ in self._commands if op == "add")
        return len(self.engine.scheduler.waiting) + queued

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, disconnected: asyncio.Event | None = None,
        cache_hint: object = None, constraint: Constraint | None = None, hold_at: int | None = None,
    ) -> Generation:
        """Queue a request (raises LuceboxError for bad input, QueueFull past --max-queue); `constraint`: the
        grammar its output follows (engine/runtime/grammar.py); `hold_at`: an output length where it waits
        until `hold(gen, None)` or `force_tokens` (Sequence.hold_at)."""
        if self.num_waiting >= self.max_queue:
            raise QueueFull(f"the server has {self.num_waiting} requests waiting (limit {self.max_queue}); retry later")
        seq = self.engine.new_sequence(prompt_ids, params, constraint)
        seq.cache_hint = cache_hint
        seq.hold_at = hold_at  # before the engine thread sees it: no step can pass it
        gen = Generation(seq, disconnected)
        with self._lock:
            self._active[seq.seq_id] = gen
        self._command("add", gen)
        return gen

    def call_in_engine(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn()` on the engine thread between two steps (state only that thread may touch)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._command("call", None, (fn, fut))
        return fut

    def cancel(self, gen: Generation, reason: str = "cancelled") -> None:
        if gen.finish_reason is None:
            self._command("abort", gen, reason)

    def cancel_all(self, reason: str = "cancelled") -> int:
        """End every generation in flight (the server shuts down); each request then renders how it ended."""
        with self._lock:
            gens = list(self._active.values())
        for gen in gens:
            self.cancel(gen, reason)
        return len(gens)

    def force_tokens(self, gen: Generation, token_ids: list[int]) -> None:
        """Replace the next sampled token with these (a forced `</think>`, say); lifts the hold, if any."""
        self._command("force", gen, list(token_ids))

    def hold(self, gen: Generation, at: int | None) -> None:
        """Stop decoding `gen` once it has `at` output tokens (None: lift the hold). If it has more already, it
        stops where it is. It stays admitted, with its KV, until the hold is lifted (or `force_tokens`)."""
        self._command("hold", gen, at)

    async def stream(self, gen: Generation) -> AsyncIterator[list[int]]:
        """Yield lists of new token ids until the generation ends (then `gen.finish_reason` is set).

        Steps that queued up while the consumer was busy (writing the last event to a slow client, or a
        loop serving many streams) come out as one list, so a loop that falls behind writes fewer, larger
        events instead of falling further behind.

        Pacing (`stream_pace`, seconds per active generation): after an event the next one waits until
        `stream_pace x active generations` have passed, gathering the steps in between. The event loop and
        the engine thread share the GIL, and an event costs the loop ~30-50 us whatever it carries, so 64
        streams each writing every step (~1 ms) left the engine waiting for the GIL; at 200 us a stream
        (the default), 64 streams write every 12.8 ms, 8 streams every other step and 1-4 every step as
        before (H100: 64 streams 1.18x the 100 us default's tok/s, 8 streams unchanged; README). The first
        event never waits, nor one whose generation has already ended (an end arriving during a wait goes
        out with that wait's event)."""
        loop = asyncio.get_running_loop()
        last: float | None = None  # when the consumer was done with the last event
        while True:
            item = await gen.queue.get()
            if item is None:
                return
            if last is not None and self.pace > 0 and gen.finish_reason is None:  # an ending goes out at once
                wait = self.pace * len(self._active) - (loop.time() - last)
                if wait > 0:
                    await asyncio.sleep(wait)
            while not gen.queue.empty():
                more = gen.queue.get_nowait()
                if more is None:
                    yield item
                    return
                item = item + more
            yield item
            last = loop.time()

    # ----- the engine thread --------------------------------------------------

    def _command(self, op: str, gen: Generation | None, arg: object = None) -> None:
        with self._lock:
            self._commands.append((op, gen, arg))
        self._wake.set()

    def _thread_main(self) -> None:
        while not self._stopping:
            if not self._commands and not self.engine.has_work() and not self._gone_while_held():
                self._flush()
                cache = self.engine.cache
                copying = cache.poll() if cache is not None else 0  # idle: still publish finished snapshots
                self._wake.wait(0.002 if copying else 0.5)
                self._wake.clear()
                continue
            try:
                outputs, ended = self._step()
            except Exception:  # a bug in the engine: fail the running requests, keep serving
                log.exception("engine step failed")
                outputs, ended = [], self._abort_all("error")
            self._flush()  # a step that launched no forward (or raised) still hands over the step before it
            if outputs or ended:
                self._pending = (outputs, ended, time.monotonic())
                if ended or any(o.finished for o in outputs) or not self.engine.has_work():
                    self._flush()  # an ending is told at once (the client's last event, the next request)
        self._flush()
        if self.engine.cache is not None:
            self.engine.cache.close()  # the snapshots of the last turns reach the disk tier before the process ends

    def _gone_while_held(self) -> bool:
        """A client left while its sequence waits at a hold (no step runs to notice): the next `_step` ends it."""
        with self._lock:
            return any(g.disconnected is not None and g.disconnected.is_set() and not g.seq.is_finished
                       for g in self._active.values())

    def _flush(self) -> None:
        """Hand the held step's tokens to the event loop (engine thread only)."""
        pending, self._pending = self._pending, None
        if pending is not None and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._deliver, *pending)
            except RuntimeError:  # the loop closed meanwhile: nobody is listening
                pass

    def _step(self) -> tuple[list[StepOutput], list[tuple[Generation, str]]]:
        """Apply queued commands (and cancel disconnected clients), then run one step."""
        ended: list[tuple[Generation, str]] = []
        with self._lock:
            commands = list(self._commands)
            self._commands.clear()
            active = list(self._active.values())
        for gen in active:
            if gen.disconnected is not None and gen.disconnected.is_set() and not gen.seq.is_finished:
                self.num_disconnects += 1
                commands.append(("abort", gen, "cancelled"))
        if any(op in ("call", "abort") for op, _, _ in commands):
            self.engine.settle()  # the decode step launched ahead is read first (runtime/ahead.py)
        for op, gen, arg in commands:
            if op == "call":
                fn, fut = arg
                try:
                    fut.set_result(fn())
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(exc)
            elif op == "add":
                if gen.finish_reason is None and not gen.seq.is_finished:
                    self.engine.scheduler.add(gen.seq)
            elif op == "abort":
                if not gen.seq.is_finished:
                    self.engine.abort(gen.seq, arg)  # "stop": the API ended a complete answer, cache it
                    gen.seq.finish_reason = arg
                    ended.append((gen, arg))
            elif op == "force" and not gen.seq.is_finished:
                gen.seq.forced_tokens = arg
                gen.seq.hold_at = None
            elif op == "hold" and not gen.seq.is_finished:
                gen.seq.hold_at = arg
        now = time.monotonic()
        outputs = self.engine.step() if self.engine.has_work() else []
        if self.engine.cache is not None:
            # Publish the snapshots whose copy is done (on the CPU: all of this step's) before the clients hear
            # that their request finished; on CUDA a copy still in flight is published by a later step.
            self.engine.cache.poll()
        for seq in self.engine.scheduler.running:  # admitted now or earlier: when it first got a step
            gen = self._active.get(seq.seq_id)
            if gen is not None and gen.timings.first_scheduled is None:
                gen.timings.first_scheduled = now
        for out in outputs:  # finished in this step (no longer running)
            gen = self._active.get(out.seq.seq_id)
            if gen is not None and gen.timings.first_scheduled is None:
                gen.timings.first_scheduled = now
        self.steps += 1
        if self.engine.last_step:
            self.step_log.append((time.monotonic(), tuple(self.engine.last_step)))
        return outputs, ended

    def _abort_all(self, reason: str) -> list[tuple[Generation, str]]:
        ended = []
        for gen in list(self._active.values()):
            if not gen.seq.is_finished:
                self.engine.abort(gen.seq)
            ended.append((gen, reason))
        return ended

    # ----- the event loop -----------------------------------------------------

    def _deliver(self, outputs: list[StepOutput], ended: list[tuple[Generation, str]], at: float) -> None:
        for out in outputs:
            gen = self._active.get(out.seq.seq_id)
            if gen is None:
                continue
            if gen.timings.first_token is None:
                gen.timings.first_token = at
            if out.new_tokens:
                gen.queue.put_nowait(out.new_tokens)
            if out.finished:
                self._deliver_end(gen, out.seq.finish_reason or "stop")
        for gen, reason in ended:
            self._deliver_end(gen, reason)

    def _deliver_end(self, gen: Generation, reason: str) -> None:
        if gen.finish_reason is not None:
            return
        gen.finish_reason = reason
        gen.timings.finished = time.monotonic()
        with self._lock:
            self._active.pop(gen.seq.seq_id, None)
        gen.queue.put_nowait(None)
