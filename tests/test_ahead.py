"""Greedy decode steps launched one step ahead (engine/runtime/ahead.py) give exactly the plain steps' tokens.

On CUDA the engine runs ahead by default (the decode graph reads each row's input token from the last replay's
argmax); here the same bookkeeping runs on the CPU's eager path (EngineConfig.ahead=True): stops mid-stream
(a row computed for a sequence that had ended), length limits, arrivals while a step is in flight, aborts,
preemption, and rows that cannot run ahead (sampling, penalties, a grammar's forced tokens) in the same batch.
The live-server suite (tests/conftest.py's shared server, test_spec_cache_matrix.py's "ahead" mode) runs it
through the API with tools, streams, disconnects and the prefix cache.
"""

from __future__ import annotations

import pytest
import torch

from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams

TEXTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def add(a, b):\n    return",
    "List three prime numbers greater than one hundred, separated by commas, and explain briefly why each",
    "Hi",
]


def make(path, ahead: bool, **kw) -> LLMEngine:
    kw.setdefault("kv_tokens", 4096)
    return LLMEngine.from_path(path, EngineConfig(device="cpu", dtype="float32", ahead=ahead, **kw), quiet=True)


@pytest.fixture(scope="module")
def engines(smollm2_path) -> tuple[LLMEngine, LLMEngine]:
    return make(smollm2_path, False), make(smollm2_path, True)


@pytest.fixture(scope="module")
def prompts(engines) -> list[list[int]]:
    return [engines[0].tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def plain(engines, prompts) -> list[list[int]]:
    """Each prompt's 24 greedy tokens, plain steps."""
    return engines[0].generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))


def drive(eng: LLMEngine, seqs, until_idle: bool = True) -> None:
    while eng.has_work() if until_idle else any(not s.is_finished for s in seqs):
        eng.step()


def test_off_by_default_on_the_cpu(smollm2_path, monkeypatch):
    monkeypatch.delenv("LUCEBOX_AHEAD", raising=False)
    assert LLMEngine.from_path(smollm2_path, EngineConfig(device="cpu", kv_tokens=256), quiet=True).ahead is None
    monkeypatch.setenv("LUCEBOX_AHEAD", "1")
    assert LLMEngine.from_path(smollm2_path, EngineConfig(device="cpu", kv_tokens=256), quiet=True).ahead is not None


def test_same_tokens_with_stops_and_length_limits(engines, prompts, plain):
    """Stop tokens that end sequences mid-way (their next row was already launched: computed for nothing and
    dropped) and length limits at different steps: every output and finish reason equals the plain steps'."""
    ahead_eng = engines[1]
    params = []
    for i, out in enumerate(plain):
        if i % 2 == 0:  # ends at its (3 + 4i)-th token, a stop token
            params.append(SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=frozenset({out[3 + 4 * i]})))
        else:
            params.append(SamplingParams(max_tokens=5 + 3 * i, ignore_eos=True))
    want = engines[0].generate(prompts, params)
    steps, wasted = ahead_eng.ahead.steps, ahead_eng.ahead.wasted
    seqs = [ahead_eng.add(p, sp) for p, sp in zip(prompts, params)]
    drive(ahead_eng, seqs)
    assert [s.output_ids for s in seqs] == want
    assert [s.finish_reason for s in seqs] == ["stop", "length", "stop", "length", "stop"]
    assert ahead_eng.ahead.steps - steps > 10, "the decode steps did not run ahead"
    assert ahead_eng.ahead.wasted > wasted, "no stopped sequence had a row in flight: the case is not covered"
    assert ahead_eng.kv.pool.num_used == 0 and not ahead_eng.has_work()


def test_arrivals_and_an_abort_while_a_step_is_in_flight(engines, prompts, plain):
    eng = engines[1]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    seqs = [eng.add(prompts[0], params)]
    victim = None
    for i, p in enumerate(prompts[1:], 1):
        for _ in range(3):
            eng.step()
        assert eng.ahead.inflight is not None, "a decode step should be in flight here"
        seqs.append(eng.add(p, params))  # waits: the step in flight is read, then it is admitted
        if i == 2:
            victim = eng.add(prompts[4], params)
    for _ in range(4):
        eng.step()
    eng.abort(victim)  # settles the step in flight first
    assert victim.finish_reason == "cancelled"
    drive(eng, seqs)
    assert [s.output_ids for s in seqs] == plain
    assert eng.kv.pool.num_used == 0


def test_preemption_keeps_outputs_exact(smollm2_path, prompts, plain):
    # 9 usable blocks cannot hold five sequences: a step ahead needing a block falls back to the plain
    # schedule, which preempts; the recomputed sequences still give the plain tokens.
    eng = make(smollm2_path, True, kv_tokens=144, block_size=16)
    assert eng.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True)) == plain
    assert eng.scheduler.num_preemptions > 0 and eng.ahead.steps > 0


def test_rows_that_cannot_run_ahead_share_the_batch(engines, prompts, plain):
    """A seeded sampled row and a penalised row make those steps plain ones; once they end, the greedy rows
    run ahead again. Every sequence gets what it gets with plain steps."""
    mixed = [SamplingParams(max_tokens=24, ignore_eos=True),
             SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.9, seed=7),
             SamplingParams(max_tokens=24, ignore_eos=True),
             SamplingParams(max_tokens=6, ignore_eos=True, repetition_penalty=1.3),
             SamplingParams(max_tokens=24, ignore_eos=True)]
    want = engines[0].generate(prompts, mixed)
    eng = engines[1]
    steps = eng.ahead.steps
    assert eng.generate(prompts, mixed) == want
    assert [want[i] for i in (0, 2, 4)] == [plain[i] for i in (0, 2, 4)]
    assert eng.ahead.steps > steps


def test_forced_tokens_while_a_step_is_in_flight(engines, prompts, plain):
    """A forced token (a thinking budget's `</think>`) set between steps replaces the next committed token,
    as with plain steps, even when that token was already computed ahead."""
    results = []
    for eng in engines:
        seq = eng.add(prompts[0], SamplingParams(max_tokens=16, ignore_eos=True))
        while seq.num_output < 5:
            eng.step()
        assert (eng.ahead is None) or eng.ahead.inflight is not None  # its next token is computed already
        seq.forced_tokens = [plain[1][0]]
        drive(eng, [seq])
        results.append(seq.output_ids)
    assert results[0] == results[1]
    assert results[1][:6] == plain[0][:5] + [plain[1][0]]


def test_a_hold_stops_a_sequence_at_an_exact_length(engines, prompts, plain):
    """A sequence held at N output tokens (Sequence.hold_at: where a thinking budget decides) stops exactly
    there, plain or ahead, while the others go on (running ahead); it keeps its blocks and is no work until
    the hold is lifted. Forced tokens then land at exactly N, a lifted hold goes on as if never held, and
    an abort of a held sequence frees it."""
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    for eng in engines:
        steps = eng.ahead.steps if eng.ahead is not None else 0
        forced = eng.add(prompts[0], params)
        forced.hold_at = 5
        lifted = eng.add(prompts[1], params)
        lifted.hold_at = 3
        dropped = eng.add(prompts[2], params)
        dropped.hold_at = 0  # held before its first token: prefilled up to its last prompt token
        free = eng.add(prompts[3], params)
        drive(eng, [])  # until no work is left: only the held sequences
        assert free.output_ids == plain[3][:16]
        assert [s.num_output for s in (forced, lifted, dropped)] == [5, 3, 0]
        assert not any(s.is_finished for s in (forced, lifted, dropped))
        assert dropped.num_computed == dropped.num_prompt - 1
        assert eng.step() == [] and not eng.has_work() and eng.kv.pool.num_used > 0
        if eng.ahead is not None:
            assert eng.ahead.steps - steps > 5, "the free sequence did not run ahead beside the held ones"
        forced.forced_tokens, forced.hold_at = [plain[1][0]], None
        lifted.hold_at = None
        eng.abort(dropped)
        assert dropped.finish_reason == "cancelled"
        drive(eng, [])
        assert forced.output_ids[:6] == plain[0][:5] + [plain[1][0]]
        assert lifted.output_ids == plain[1][:16]
        assert eng.kv.pool.num_used == 0


def test_a_held_sequence_survives_preemption(smollm2_path, prompts, plain, monkeypatch):
    """A held sequence that is preempted is recomputed up to its last token and held again (no token past
    its hold); lifted, it gives the plain tokens."""
    eng = make(smollm2_path, True, kv_tokens=144, block_size=16)
    victims = []
    preempt = eng.scheduler._preempt
    monkeypatch.setattr(eng.scheduler, "_preempt", lambda seq: (victims.append(seq), preempt(seq)))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    others = [eng.add(p, params) for p in prompts[:4]]
    held = eng.add(prompts[4], params)
    held.hold_at = 2
    drive(eng, [])
    assert held in victims, "the held sequence was not preempted: the case is not covered"
    assert [s.output_ids for s in others] == plain[:4]
    assert held.num_output == 2 and not held.is_finished and not eng.has_work()
    held.hold_at = None
    drive(eng, [])
    assert held.output_ids == plain[4]


def test_graph_carry_equals_host_ids_on_cuda(smollm2_path):
    """On CUDA, the decode graph's carried input (the last replay's argmax) gives the plain steps' tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    outs = []
    for ahead in (False, True):
        eng = LLMEngine.from_path(smollm2_path, EngineConfig(device="cuda", ahead=ahead, kv_tokens=8192,
                                                             max_num_seqs=8), quiet=True)
        eng.warm_up(progress=False)
        prompts = [eng.tokenizer.encode(t) for t in TEXTS]
        outs.append(eng.generate(prompts, SamplingParams(max_tokens=48, ignore_eos=True)))
        if ahead:
            assert eng.ahead.steps > 40
        del eng
        torch.cuda.empty_cache()
    assert outs[0] == outs[1]


def test_generate_returns_with_the_engine_idle(engines, prompts, plain):
    """`generate` resolves the step it launched ahead for sequences that had ended, so the engine is idle
    after it and may switch speculation (bench spec does, between its plain and speculative runs)."""
    stop = frozenset({plain[1][5]})  # ends at a stop token, not at the length limit
    params = SamplingParams(max_tokens=24, stop_token_ids=stop)
    ref = engines[0].generate([prompts[1]], params)[0]
    assert len(ref) <= 6
    eng = engines[1]
    assert eng.generate([prompts[1]], params) == [ref]
    assert not eng.has_work()
    eng.set_speculation(None)
