"""Speculate only where it pays: a per-sequence acceptance tracker and the rule that switches a sequence
between speculative and plain decoding.

A speculative step costs r plain steps (r: the measured cost ratio, spec step time / plain step time, at the
step's decode batch) and commits τ tokens per sequence, so speculation pays for a sequence while τ > r. Each
sequence keeps τ as a moving average of the tokens its verifications committed (a plain mean over the first
1/alpha, so the first decision after `min_steps` verifications is not one step's luck). When τ falls to r or
below, the sequence decodes plainly: its row is an ordinary one-token decode row (and a step where no sequence
drafts or prefills is a plain step, no drafter at all). After `probe_every` plain tokens it drafts again (a
probe: a fresh window of `probe_steps` verifications, fewer than the first decision's: on a drafter that never
pays the probes were most of what the rule cost); a probe that fails doubles the wait, up to `probe_max`, and
one that passes resets it. The first wait of a new sequence is learned across sequences: the longest wait whose
probe failed lately (`first_wait`), back to `probe_every` as soon as any sequence's drafts pay (a first decision
or a probe that passes). While that wait is learned, a new request's first window is a probe's (`probe_steps`
verifications, not `min_steps`). With a drafter that does not pay on the traffic, a request then spends one
probe's verifications and few or no more, instead of re-learning the backoff from `probe_every` each time (a
short agent turn paid most of that); every request still drafts at its start. Output is unaffected either way:
both modes give plain decoding's tokens.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.engine.runtime.sequence import Sequence

if TYPE_CHECKING:
    from lucebox.engine.runtime.llm_engine import LLMEngine

log = logging.getLogger(__name__)

DEFAULT_COST_RATIO = 1.5  # spec step / plain step where nothing was measured (the CPU; issue 15: 1.5-2.2x on CUDA)


@dataclass
class Acceptance:
    """One sequence's tracker (Sequence.spec_state)."""

    interval: int  # plain tokens before the next probe
    speculating: bool = True
    tau: float = 0.0  # moving average of tokens committed per verification (this window)
    steps: int = 0  # verifications in this window (since speculation started or was probed again)
    probing: bool = False  # this window is a probe that has not passed yet
    plain_tokens: int = 0  # tokens decoded plainly since it stopped speculating


@dataclass
class AdaptiveStats:
    stops: int = 0  # times a sequence switched to plain decoding
    resumes: int = 0  # probes that passed (the sequence speculates again)
    probes: int = 0  # probes started
    plain_tokens: int = 0  # tokens decoded plainly by sequences that had stopped speculating
    plain_now: int = 0  # running sequences decoding plainly now


class CostRatio:
    """Spec step time / plain step time by decode batch size: the value measured at the smallest measured
    batch at or above it (the largest measured one beyond them), or one constant."""

    def __init__(self, ratios: Mapping[int, float] | float = DEFAULT_COST_RATIO) -> None:
        self.measured = isinstance(ratios, Mapping)
        self.ratios = dict(ratios) if isinstance(ratios, Mapping) else {1: float(ratios)}
        if not self.ratios or min(self.ratios.values()) <= 0:
            raise ValueError(f"cost ratios must be positive: {self.ratios}")

    def at(self, batch: int) -> float:
        sizes = sorted(self.ratios)
        return self.ratios[next((b for b in sizes if b >= batch), sizes[-1])]

    def props(self) -> dict[str, float]:
        return {str(b): round(r, 3) for b, r in sorted(self.ratios.items())}


class AdaptiveSpec:
    def __init__(self, enabled: bool = True, cost: CostRatio | None = None, *, min_steps: int = 4,
                 probe_steps: int = 2, alpha: float = 0.25, probe_every: int = 32, probe_max: int = 512) -> None:
        if not 1 <= probe_steps <= min_steps or not 0 < alpha <= 1 or not 1 <= probe_every <= probe_max:
            raise ValueError("adaptive speculation: 1 <= probe_steps <= min_steps, 0 < alpha <= 1, "
                             "1 <= probe_every <= probe_max")
        self.enabled = enabled
        self.cost = cost or CostRatio()
        self.min_steps, self.probe_steps, self.alpha = min_steps, probe_steps, alpha
        self.probe_every, self.probe_max = probe_every, probe_max
        self.learned_wait = 0  # the longest wait whose probe failed lately (0: none, or drafts paid since)
        self.stats = AdaptiveStats()

    def state(self, seq: Sequence) -> Acceptance:
        if seq.spec_state is None:
            # Drafts have not paid lately (a learned wait): the first window is a probe's.
            seq.spec_state = Acceptance(interval=self.first_wait, probing=self.learned_wait > 0)
            self.stats.probes += self.learned_wait > 0
        return seq.spec_state

    @property
    def first_wait(self) -> int:
        """Plain tokens before a new sequence's first probe, learned from the sequences before it."""
        return max(self.probe_every, self.learned_wait)

    def forget(self) -> None:
        """Start the learned first wait over (after a warm-up, whose requests are not traffic)."""
        self.learned_wait = 0

    def speculates(self, seq: Sequence) -> bool:
        """Whether this sequence's next decode row drafts (always, with the rule off)."""
        return not self.enabled or self.state(seq).speculating

    def observe(self, seq: Sequence, committed: int, batch: int) -> None:
        """After a verification that committed `committed` tokens in a step of `batch` decoding sequences
        (before the tokens are committed: a sequence that finishes then is released once, in its final mode)."""
        if not self.enabled:
            return
        st = self.state(seq)
        st.steps += 1
        st.tau += max(self.alpha, 1.0 / st.steps) * (committed - st.tau)
        if st.steps < (self.probe_steps if st.probing else self.min_steps):
            return
        r = self.cost.at(batch)
        if st.tau > r:
            self.learned_wait = 0  # drafts pay on this traffic: new sequences probe early again
            if st.probing:
                st.probing, st.interval = False, self.probe_every
                self.stats.resumes += 1
                log.info("request %d: tau %.2f > cost ratio %.2f on a probe: speculating again", seq.seq_id,
                         st.tau, r)
            return
        if st.probing:
            st.interval = min(2 * st.interval, self.probe_max)
            self.learned_wait = max(self.learned_wait, st.interval)
        st.speculating, st.probing, st.plain_tokens = False, False, 0
        self.stats.stops += 1
        self.stats.plain_now += 1
        log.info("request %d: tau %.2f <= cost ratio %.2f after %d verifications: decoding plainly, drafting "
                 "again after %d tokens", seq.seq_id, st.tau, r, st.steps, st.interval)

    def plain_token(self, seq: Sequence) -> None:
        """A plain decode row of a sequence that stopped speculating (counted as the step starts); starts a
        probe when one is due."""
        st = self.state(seq)
        st.plain_tokens += 1
        self.stats.plain_tokens += 1
        if st.plain_tokens >= st.interval:
            self._probe(st)
            log.debug("request %d: probing speculation after %d plain tokens", seq.seq_id, st.plain_tokens)

    def release(self, seq: Sequence) -> None:
        """The sequence left the running set. A preempted one rebuilds its drafter context in its recompute,
        so it probes as soon as it decodes again."""
        st = seq.spec_state
        if st is not None and not st.speculating:
            self._probe(st)

    def _probe(self, st: Acceptance) -> None:
        st.speculating, st.probing, st.steps, st.tau = True, True, 0, 0.0
        self.stats.probes += 1
        self.stats.plain_now -= 1

    def props(self) -> dict[str, object]:
        s = self.stats
        return {"adaptive": self.enabled, "cost_ratio": self.cost.props(), "cost_ratio_measured": self.cost.measured,
                "stops": s.stops, "resumes": s.resumes, "probes": s.probes, "plain_tokens": s.plain_tokens,
                "plain_sequences": s.plain_now, "first_wait": self.first_wait}


def time_steps(engine: LLMEngine, batches: tuple[int, ...] = (1, 4, 16, 64), steps: int = 8,
               prompt_len: int = 32, around: Callable[[str, int], AbstractContextManager[Any]] | None = None
               ) -> dict[int, tuple[float, float]]:
    """{batch: (plain step seconds, speculative step seconds)}, timed through the engine's own steps (its CUDA
    graphs captured already, or captured in an untimed step): `steps` decode steps of `batch` short requests
    decoding plainly, then the same speculating. The engine must be idle; the prefix cache is detached meanwhile
    and the counters the requests moved are put back. Batches beyond --max-num-seqs or the KV pool are left out.
    `around(mode, batch)`: a context entered around each timed run of steps (`bench spec-cost --profile`)."""
    assert engine.spec is not None and engine.adaptive is not None and not engine.has_work()
    adaptive, spec, sched = engine.adaptive, engine.spec, engine.scheduler
    vocab, rows = engine.model_config.vocab_size, spec.rows_per_step
    per_seq = prompt_len + (steps + 3) * rows
    room = (engine.kv.pool.num_free - 1) * engine.kv.block_size
    sizes = [b for b in batches if b <= engine.config.max_num_seqs and b * (per_seq + engine.kv.block_size) <= room]
    cache, sched.cache, engine.cache = sched.cache, None, None
    stats = spec.stats
    saved = (sched.num_preemptions, stats.steps, stats.committed, stats.drafted, adaptive.enabled,
             replace(adaptive.stats))
    times: dict[int, tuple[float, float]] = {}
    try:
        for b in sizes:
            seconds = {}
            for mode in ("plain", "spec"):
                adaptive.enabled = mode == "plain"  # off: every row drafts; on: the plain state below holds
                seqs = []
                for i in range(b):
                    ids = [(7 * j + 13 * i + 11) % vocab for j in range(prompt_len)]
                    seq = engine.new_sequence(ids, SamplingParams(max_tokens=(steps + 2) * rows, ignore_eos=True))
                    if mode == "plain":
                        seq.spec_state = Acceptance(interval=1 << 30, speculating=False)
                    sched.add(seq)
                    seqs.append(seq)
                try:
                    while any(s.num_pending != 1 for s in seqs):  # the prefill, up to the first decode
                        engine.step()
                    engine.step()  # one decode step untimed
                    _sync(engine)
                    with around(mode, b) if around is not None else contextlib.nullcontext():
                        t = time.perf_counter()
                        for _ in range(steps):
                            engine.step()
                        _sync(engine)
                        seconds[mode] = (time.perf_counter() - t) / steps
                finally:
                    for s in seqs:
                        engine.abort(s)
                    while engine.has_work():  # the aborted rows of a step that was in flight (runtime/ahead.py)
                        engine.step()
            times[b] = (seconds["plain"], seconds["spec"])
    finally:
        sched.cache = engine.cache = cache
        sched.num_preemptions, stats.steps, stats.committed, stats.drafted = saved[:4]
        adaptive.enabled, adaptive.stats = saved[4], saved[5]
    return times


def measure_cost_ratio(engine: LLMEngine, batches: tuple[int, ...] = (1, 4, 16, 64), steps: int = 8,
                       prompt_len: int = 32) -> CostRatio:
    """r by decode batch from `time_steps` (the nearest measured batch stands in for those left out)."""
    ratios = {b: spec / plain for b, (plain, spec) in time_steps(engine, batches, steps, prompt_len).items()}
    if not ratios:
        log.warning("speculation cost ratio: no batch fits the KV pool to measure it; %.2f", DEFAULT_COST_RATIO)
        return CostRatio()
    log.info("speculation cost ratio (spec step / plain step, measured): %s; a sequence drafts while its tau "
             "is above it", ", ".join(f"batch {b}: {r:.2f}" for b, r in sorted(ratios.items())))
    return CostRatio(ratios)


def _sync(engine: LLMEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
