"""Prefill pacing: a long prompt's chunks are capped while other sequences decode, from measured step times."""

from __future__ import annotations

from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.pacing import PrefillPacer
from lucebox.engine.runtime.sampler import SamplingParams


def run_mixed(pacer: PrefillPacer, t_decode: float, overhead: float, per_token: float, steps: int) -> list[int]:
    """Feed the pacer a decode-only step, then `steps` mixed steps of a linear cost model; returns the chunks."""
    pacer.observe(4, 0, t_decode)
    chunks = []
    for _ in range(steps):
        n = pacer.budget()
        chunks.append(n)
        pacer.observe(4, n, t_decode + overhead + per_token * n)
    return chunks


def test_full_budget_until_a_decode_step_was_timed():
    pacer = PrefillPacer(2048)
    assert pacer.budget() == 2048
    pacer.observe(0, 1024, 0.05)  # prefill alone is never paced
    assert pacer.budget() == 2048


def test_cap_converges_to_a_mixed_step_of_twice_the_decode_step():
    pacer = PrefillPacer(2048)
    chunks = run_mixed(pacer, t_decode=0.006, overhead=0.001, per_token=10e-6, steps=60)
    assert chunks[0] == pacer.min_chunk  # a cautious first mixed step
    # (6 ms - 1 ms) / 10 us = 500 tokens make the mixed step 2 x 6 ms (the overhead's estimate holds 64 tokens)
    assert 420 <= chunks[-1] <= 510, chunks


def test_an_overhead_bound_step_takes_chunks_as_costly_as_its_overhead():
    # An eager step costs 20 ms more than a 1.7 ms graph replay whatever its chunk: small chunks would only
    # multiply those steps, so a chunk may cost as much as the overhead (20 ms / 5 us = 4000 > the budget).
    pacer = PrefillPacer(2048)
    assert run_mixed(pacer, t_decode=0.0017, overhead=0.020, per_token=5e-6, steps=30)[-1] == 2048
    pacer = PrefillPacer(2048)
    chunks = run_mixed(pacer, t_decode=0.006, overhead=0.010, per_token=20e-6, steps=60)
    # 10 ms / 20 us = 500; the overhead's estimate (the first, 64-token step) holds 64 tokens' cost: ~630
    assert 480 <= chunks[-1] <= 680, chunks


def test_free_tokens_get_the_full_budget():
    assert run_mixed(PrefillPacer(2048), t_decode=0.006, overhead=0.0, per_token=1e-9, steps=30)[-1] == 2048


def test_short_tails_do_not_move_the_cap():
    pacer = PrefillPacer(2048)
    run_mixed(pacer, t_decode=0.006, overhead=0.001, per_token=10e-6, steps=40)
    cap = pacer.budget()
    pacer.observe(4, 3, 0.5)  # a 3-token prompt tail in a slow step
    assert pacer.budget() == cap


LONG = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(60))
TEXTS = [f"Story {k}: once upon a time" for k in range(3)] + [LONG]


def _run(smollm2_path, pacing: bool) -> tuple[list[list[int]], list[int]]:
    """Three short prompts decode when a long one arrives; the outputs and the long prompt's chunk sizes."""
    eng = LLMEngine.from_path(smollm2_path, EngineConfig(device="cpu", dtype="float32", kv_tokens=4096,
                                                         max_step_tokens=512, prefill_pacing=pacing), quiet=True)
    prompts = [eng.tokenizer.encode(t) for t in TEXTS]
    assert len(prompts[3]) > 600
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    seqs = [eng.add(p, params) for p in prompts[:3]]
    for _ in range(4):
        eng.step()
    seqs.append(eng.add(prompts[3], params))
    long_chunks = []
    while eng.has_work():
        eng.step()
        long_chunks += [n for sid, _, n in eng.last_step if sid == seqs[3].seq_id and n > 1]
    return [s.output_ids for s in seqs], long_chunks


def test_paced_prefill_is_cut_finer_and_changes_no_token(smollm2_path):
    paced, paced_chunks = _run(smollm2_path, pacing=True)
    free, free_chunks = _run(smollm2_path, pacing=False)
    assert paced == free
    assert free_chunks[0] == 512 - 3  # the step budget less the three decode rows
    assert max(paced_chunks) < free_chunks[0] and len(paced_chunks) > len(free_chunks)
