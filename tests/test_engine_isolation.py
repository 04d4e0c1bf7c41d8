"""One bad sequence fails alone: the engine isolates a row whose sampling (or forward) raises.

The engine is driven directly, past the API's validation, with four normal greedy requests and
one poisoned request in the same batch: the four get exactly the tokens they get alone, the
poisoned one ends with finish reason "error", and no KV block leaks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.sampler import (
    REPETITION_PENALTY_RANGE,
    TOP_K_MAX,
    SampleRow,
    SamplingError,
    SamplingParams,
    draw,
    sample,
)
from lucebox.errors import LuceboxError

DRAFTER = Path(__file__).resolve().parents[1] / "model_cards" / "drafters" / "smollm2-135m-instruct-dflash"
PROMPTS = [list(range(100, 130)), list(range(500, 517)), [1, 2, 3, 4, 5, 6, 7, 8, 9], list(range(2000, 2050, 2))]
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
# Plain decode rows; a speculative chain on the dynamic path; a draft tree on the fixed-shape (static) path.
MODES = {"plain": {}, "chain": {"draft": str(DRAFTER)},
         "ddtree-static": {"draft": str(DRAFTER), "ddtree": True, "ddtree_budget": 12, "spec_static": True}}


@pytest.fixture(scope="module", params=list(MODES))
def engine(request, smollm2_path):
    eng = LLMEngine.from_path(smollm2_path, EngineConfig(device="cpu", dtype="float32", kv_tokens=2048,
                                                         **MODES[request.param]), quiet=True)
    eng.alone = [eng.generate([p], GREEDY)[0] for p in PROMPTS]
    yield eng
    del eng


def hot(**bad: object) -> SamplingParams:
    """Sampling parameters with `bad` set after construction, as a caller that skips the clamping would."""
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=6)
    for name, value in bad.items():
        setattr(params, name, value)
    return params


def test_bad_rows_fail_alone_and_the_batch_goes_on(engine):
    """Four normal greedy requests and four bad ones in one batch: the four get their tokens as alone."""
    good = [engine.add(p, GREEDY) for p in PROMPTS[:2]]
    nan_probs = engine.add(list(range(300, 320)), hot(repetition_penalty=1e-300))  # NaN after softmax
    top_k = engine.add(list(range(320, 340)), hot(top_k=2**63))  # "Overflow when unpacking long long"
    good += [engine.add(p, GREEDY) for p in PROMPTS[2:]]
    later_nan = engine.add(list(range(340, 360)), hot())  # poisoned once decoding (or verifying)
    later_forward = engine.add(list(range(360, 380)), SamplingParams(max_tokens=6, ignore_eos=True))
    bad = [nan_probs, top_k, later_nan, later_forward]
    for _ in range(200):
        if later_nan.num_output and later_forward.num_output:
            break
        engine.step()
    later_nan.params.repetition_penalty = 1e-300
    later_forward.forced_tokens = [engine.model_config.vocab_size + 7]  # the model cannot embed it
    for _ in range(200):
        if all(s.is_finished for s in good + bad):
            break
        engine.step()
    assert [s.finish_reason for s in bad] == ["error"] * 4
    assert nan_probs.output_ids == [] and top_k.output_ids == [] and later_nan.num_output == 1
    assert [s.output_ids for s in good] == engine.alone
    assert [s.finish_reason for s in good] == ["length"] * 4
    assert engine.blocks_in_use == 0


def test_prompt_ids_outside_the_vocabulary_are_refused(engine):
    with pytest.raises(LuceboxError, match="outside this model's vocabulary"):
        engine.add([1, 2, engine.model_config.vocab_size], GREEDY)
    with pytest.raises(LuceboxError, match="outside this model's vocabulary"):
        engine.add([-1, 2], GREEDY)


def test_sampling_params_clamp_what_the_sampler_cannot_represent():
    p = SamplingParams(top_k=2**63, repetition_penalty=1e-300, temperature=float("inf"), seed=2**64 + 5,
                       max_tokens=2)
    p.validate()
    assert p.top_k == TOP_K_MAX and p.repetition_penalty == REPETITION_PENALTY_RANGE[0] and p.seed == 5
    assert SamplingParams(repetition_penalty=1e300).repetition_penalty == REPETITION_PENALTY_RANGE[1]
    assert SamplingParams(seed=-1).seed == 2**64 - 1  # a negative seed wraps mod 2**64
    logits = torch.randn(1, 64) * 30
    tokens, _ = sample(logits, [SampleRow(p, list(range(40)), [], p.seed)])
    assert 0 <= tokens[0] < 64
    for bad in (dict(temperature=float("nan")), dict(repetition_penalty=float("nan")), dict(top_k=-5)):
        with pytest.raises(ValueError):
            SamplingParams(**bad).validate()


def test_draw_refuses_a_bad_row_before_moving_the_global_generator():
    """Then the engine drops the bad row and samples the others exactly as it would have (seeded rows
    depend only on their seed and position; unseeded ones on the global generator, which has not moved)."""
    logits = torch.zeros(3, 16)
    logits[2, 4] = float("nan")
    rows = [SampleRow(SamplingParams(temperature=1.0), [], [], seed) for seed in (None, 7, None)]
    torch.manual_seed(0)
    state = torch.get_rng_state()
    with pytest.raises(SamplingError, match=r"rows \[2\]"):
        draw(logits, rows)
    assert torch.equal(torch.get_rng_state(), state)
    alone = draw(logits[:2], rows[:2]).tolist()
    torch.manual_seed(0)
    assert draw(logits[:2], rows[:2]).tolist() == alone
