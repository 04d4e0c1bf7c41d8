"""Adaptive speculation (engine/spec/adaptive.py): a sequence whose drafts do not pay decodes plainly, probes again
later and can return; every mode gives plain decoding's tokens (fp32 greedy, tiny random llama)."""

from __future__ import annotations

import pytest

from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.engine.spec.adaptive import Acceptance, AdaptiveSpec, CostRatio, measure_cost_ratio
from tests.test_spec import random_drafter

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

PROMPTS = [list(range(5, 30)), list(range(100, 140, 3)), [7, 9, 11]]
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def files(tiny_gguf, tmp_path_factory):
    target = tiny_gguf("llama", "F32")
    return target, random_drafter(target, tmp_path_factory.mktemp("adaptive") / "d", layers=1, block=6)


@pytest.fixture(scope="module")
def plain(files):
    eng = LLMEngine.from_path(files[0], EngineConfig(device="cpu", dtype="float32", kv_tokens=2048), quiet=True)
    return [eng.generate([p], GREEDY)[0] for p in PROMPTS]


def engine(files, **kw) -> LLMEngine:
    return LLMEngine.from_path(files[0], EngineConfig(device="cpu", dtype="float32", kv_tokens=2048,
                                                      draft=str(files[1]), **kw), quiet=True)


def drafter_calls(eng: LLMEngine) -> list[int]:
    """Counts drafter forwards (the real one runs; only counted)."""
    calls = [0]
    inner = eng.spec.draft_logprobs

    def counted(chunks):
        calls[0] += 1
        return inner(chunks)

    eng.spec.draft_logprobs = counted
    return calls


def run(eng: LLMEngine, seqs, each_step=None) -> None:
    while any(not s.is_finished for s in seqs):
        eng.step()
        if each_step is not None:
            each_step()


@pytest.mark.parametrize("ahead", [False, True], ids=["in-step", "ahead"])
def test_useless_drafter_stops_after_the_minimum_and_stays_lossless(files, plain, ahead):
    """A random drafter (tau ~ 1 < r = 1.5): min_steps verifications, then plain steps with no drafter forward
    (launched a step ahead where the engine does that: runtime/ahead.py); a probe takes probe_steps
    verifications, and a failed one doubles the wait."""
    eng = engine(files, ahead=ahead)
    eng.adaptive.probe_every = 8
    calls = drafter_calls(eng)
    seq = eng.add(PROMPTS[0], GREEDY)
    run(eng, [seq])
    assert seq.output_ids == plain[0]
    a = eng.adaptive
    assert a.stats.stops >= 2 and a.stats.probes >= 1 and a.stats.resumes == 0
    # The first decision takes min_steps verifications, each failed probe probe_steps (fewer).
    assert seq.spec_steps == calls[0] and seq.spec_steps <= a.min_steps + a.probe_steps * a.stats.probes
    assert a.probe_steps < a.min_steps and seq.spec_steps > a.min_steps
    assert seq.spec_state.interval >= 16  # the failed probe doubled 8
    assert a.stats.plain_tokens > 20 and a.stats.plain_now == 0
    assert eng.kv.pool.num_used == 0
    assert (eng.ahead is not None and eng.ahead.steps > 20) == ahead  # the plain stretches ran ahead


@pytest.mark.parametrize("ahead", [False, True], ids=["in-step", "ahead"])
def test_probe_returns_to_speculation_when_acceptance_pays(files, plain, ahead):
    """Once speculation pays again (here: the cost ratio made low through the tracker's rule), a probe
    re-runs the plain stretch for the drafter context (one longer chunk) and the sequence drafts again."""
    eng = engine(files, ahead=ahead)
    eng.adaptive.probe_every = 8
    seq = eng.add(PROMPTS[1], GREEDY)
    catch_up = []

    def watch():
        if seq.spec_state is not None and not seq.spec_state.speculating:
            eng.adaptive.cost = CostRatio(0.5)  # tau >= 1 > 0.5: the probe passes
        catch_up.extend(n for sid, start, n in eng.last_step if sid == seq.seq_id and n > 1 and start > 0)

    run(eng, [seq], watch)
    assert seq.output_ids == plain[1]
    assert eng.adaptive.stats.resumes == 1 and seq.spec_state.speculating
    assert catch_up == [8 + 1]  # the 8 plain positions' drafter context, and the decode row
    assert seq.spec_steps > eng.adaptive.min_steps


def test_a_new_request_waits_as_long_as_the_last_failed_probe(files, plain):
    """The backoff carries over: after a request whose probes failed, the next one still drafts first (a probe's
    window) but probes again only after the longest wait that failed; the warm-up forgets it, and drafts that pay
    (a low cost ratio) reset it to probe_every."""
    eng = engine(files)
    a = eng.adaptive
    a.probe_every = 4
    eng.warm_up(progress=False)
    assert a.learned_wait == 0 and a.first_wait == 4  # the warm-up's requests are not traffic
    first = eng.add(PROMPTS[0], GREEDY)
    run(eng, [first])
    assert a.stats.probes >= 2 and a.learned_wait == first.spec_state.interval >= 16  # 4 -> 8 -> 16 ...
    assert first.spec_steps >= a.min_steps + 2 * a.probe_steps
    wait = a.learned_wait
    calls = drafter_calls(eng)
    second = eng.add(PROMPTS[1], GREEDY)
    first_stop = []

    def watch():
        if not first_stop and second.spec_state is not None and not second.spec_state.speculating:
            first_stop.append(second.spec_steps)

    run(eng, [second], watch)
    assert second.output_ids == plain[1] and calls[0] == second.spec_steps
    # Its first window was a probe's (probe_steps verifications, not min_steps), then it waited `wait` plain
    # tokens (not 4, 8, ...): one more probe at most in 40 tokens.
    assert first_stop == [a.probe_steps] and second.spec_steps <= 2 * a.probe_steps
    assert a.learned_wait >= wait and a.props()["first_wait"] == a.learned_wait
    a.cost = CostRatio(0.5)  # tau >= 1 > 0.5: a first window that passes resets the wait
    third = eng.add(PROMPTS[2], GREEDY)
    run(eng, [third])
    assert third.output_ids == plain[2] and a.learned_wait == 0 and a.first_wait == 4


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_batch_mixing_speculating_and_plain_sequences(files, plain, static):
    """One sequence drafts throughout, one decodes plainly, a third arrives mid-way (prefill beside both):
    each gets its tokens alone; the plain one never drafts (and never runs ahead beside a drafting one)."""
    eng = engine(files, spec_static=static, ahead=True)
    eng.adaptive.cost = CostRatio(0.5)
    a = eng.add(PROMPTS[0], GREEDY)
    b = eng.new_sequence(PROMPTS[1], GREEDY)
    b.spec_state = Acceptance(interval=1 << 30, speculating=False)
    eng.scheduler.add(b)
    for _ in range(3):
        eng.step()
    c = eng.add(PROMPTS[2], GREEDY)
    run(eng, [a, b, c])
    assert [a.output_ids, b.output_ids, c.output_ids] == plain
    assert b.spec_steps == 0 and a.spec_steps > 0 and c.spec_steps > 0
    assert eng.kv.pool.num_used == 0


def test_the_switch_turns_the_rule_off(files, plain):
    eng = engine(files, spec_adaptive=False)
    assert eng.generate(PROMPTS[:1], GREEDY) == plain[:1]
    assert eng.adaptive.stats.stops == 0 and eng.spec.stats.steps > 10


def test_cost_ratio_lookup_and_measurement(files):
    r = CostRatio({1: 1.2, 4: 1.6, 16: 2.5})
    assert (r.at(1), r.at(2), r.at(4), r.at(9), r.at(64)) == (1.2, 1.6, 1.6, 2.5, 2.5)
    with pytest.raises(ValueError):
        CostRatio(0.0)
    eng = engine(files)
    measured = measure_cost_ratio(eng, batches=(1, 2), steps=2, prompt_len=8)
    assert measured.measured and set(measured.ratios) == {1, 2} and min(measured.ratios.values()) > 0
    assert not eng.has_work() and eng.kv.pool.num_used == 0
    assert eng.spec.stats.steps == 0 and eng.adaptive.stats.plain_now == 0 and eng.adaptive.enabled


def test_serve_and_bench_flag():
    from lucebox.cli import build_parser
    from lucebox.serve import ServerConfig

    parser = build_parser()
    assert ServerConfig.from_args(parser.parse_args(["serve"])).spec_adaptive
    assert not ServerConfig.from_args(parser.parse_args(["serve", "--no-spec-adaptive"])).spec_adaptive
    from lucebox.cli import engine_config  # the engine commands (bench spec) pass it on too

    assert engine_config(parser.parse_args(["bench", "spec"])).spec_adaptive
    assert not engine_config(parser.parse_args(["bench", "spec", "--no-spec-adaptive"])).spec_adaptive


def test_rule_parameters_are_checked():
    assert AdaptiveSpec().probe_steps == 2 < AdaptiveSpec().min_steps == 4
    for bad in (dict(probe_steps=5), dict(probe_steps=0), dict(min_steps=0), dict(alpha=0), dict(probe_every=0),
                dict(probe_every=64, probe_max=32)):
        with pytest.raises(ValueError):
            AdaptiveSpec(**bad)
