"""Constrained decoding in the engine (engine/runtime/grammar.py): the output follows the grammar, batching and
speculative decoding change nothing, and a grammar that cannot compile is refused."""

from __future__ import annotations

import json

import jsonschema
import pytest

from lucebox.chat.constrain import BOUNDED
from lucebox.engine.runtime.grammar import GrammarError, compiler_for, grammar_from_lark
from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams
from tests.test_spec import SHIPPED, chat_prompt

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                           "units": {"enum": ["metric", "imperial"]}},
          "required": ["city", "days", "units"], "additionalProperties": False}
QUESTIONS = ["What's the weather in Paris for the next three days?", "Tell me a joke.", "Count to five."]


def engine(path, **kw) -> LLMEngine:
    return LLMEngine.from_path(path, EngineConfig(device="cpu", dtype="float32", kv_tokens=4096, **kw), quiet=True)


def schema_grammar(schema: dict) -> str:
    return grammar_from_lark("start: %json " + json.dumps(schema))


def run(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams, constrained: set[int],
        complete: bool = True, schema: dict = SCHEMA) -> list[list[int]]:
    """Generate all prompts together; those whose index is in `constrained` follow `schema` (and, with `complete`,
    end because their JSON is complete)."""
    tg = compiler_for(eng.tokenizer, eng.model_config.vocab_size)
    seqs = [eng.add(p, params, tg.constraint(schema_grammar(schema), "test") if i in constrained else None)
            for i, p in enumerate(prompts)]
    while any(not s.is_finished for s in seqs):
        eng.step()
    assert all(s.finish_reason == "stop" for i, s in enumerate(seqs) if i in constrained and complete)
    return [s.output_ids for s in seqs]


@pytest.fixture(scope="module")
def plain(smollm2_path) -> LLMEngine:
    return engine(smollm2_path)


def test_constrained_output_follows_the_schema_and_leaves_the_batch_alone(plain):
    prompts = [chat_prompt(plain.tokenizer, q) for q in QUESTIONS]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    free = plain.generate(prompts, params)
    alone = run(plain, prompts[:1], params, {0})[0]
    together = run(plain, prompts, params, {0})
    assert together[0] == alone
    assert together[1:] == free[1:]  # the unconstrained rows get exactly what they get without it
    jsonschema.validate(json.loads(plain.tokenizer.decode(alone)), SCHEMA)
    assert plain.tokenizer.eos_ids.isdisjoint(alone)  # the grammar's end ended it, even with ignore_eos


def test_constrained_sampling_draws_only_what_the_grammar_allows(plain):
    """Sampled at T=1, every constrained answer is complete, valid JSON, in the whitespace the server allows JSON
    answers (`BOUNDED`). With llguidance's free whitespace, seed 7's answer to an off-topic question (a joke as
    weather JSON) filled its 64 tokens with newlines between tokens, which that grammar allows."""
    prompts = [chat_prompt(plain.tokenizer, q) for q in QUESTIONS]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_tokens=64, logprobs=2)
    for out in run(plain, prompts, params, {0, 1, 2}, schema={**SCHEMA, "x-guidance": BOUNDED}):
        jsonschema.validate(json.loads(plain.tokenizer.decode(out)), SCHEMA)


@pytest.mark.parametrize("ddtree", [False, True])
def test_speculative_constrained_equals_plain_constrained(plain, smollm2_path, ddtree):
    """fp32 greedy: the verify walks the grammar row by row, so speculation changes no token."""
    prompts = [chat_prompt(plain.tokenizer, q) for q in QUESTIONS[:2]]
    params = SamplingParams(max_tokens=24)
    ref = run(plain, prompts, params, {0}, complete=False)
    spec = engine(smollm2_path, draft=str(SHIPPED), ddtree=ddtree, ddtree_budget=8)
    assert run(spec, prompts, params, {0}, complete=False) == ref
    assert spec.spec.stats.steps > 0


def test_a_grammar_that_cannot_compile_is_refused(plain):
    tg = compiler_for(plain.tokenizer, plain.model_config.vocab_size)
    with pytest.raises(GrammarError, match="nope"):
        tg.constraint(schema_grammar({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "test")
    with pytest.raises(GrammarError):
        tg.constraint(grammar_from_lark("start: undefined_rule"), "test")


def test_a_repeated_grammar_reuses_its_compiled_matcher_and_starts_fresh(plain):
    """The second constraint of a grammar is a copy of the compiled one, in its initial state."""
    tg = compiler_for(plain.tokenizer, plain.model_config.vocab_size)
    grammar = schema_grammar({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    first = tg.constraint(grammar, "test")
    for t in plain.tokenizer.encode('{"n": 4', add_special=False):
        assert not first.advance(t)
    assert grammar in tg._compiled
    second = tg.constraint(grammar, "test")
    ids = plain.tokenizer.encode('{"n": 12}', add_special=False)
    assert second.matcher.try_consume_tokens(ids) == len(ids) and second.done
    assert not first.done  # the first one kept its own state


def test_a_finished_sequence_hands_its_matcher_back_reset(plain):
    """A finished (or aborted) sequence's matcher becomes the copy source of its grammar, back at the start: the
    next sequence copies its built lexer states and gets the same tokens as from a fresh compile."""
    tg = compiler_for(plain.tokenizer, plain.model_config.vocab_size)
    grammar = schema_grammar(SCHEMA)
    prompt = chat_prompt(plain.tokenizer, QUESTIONS[0])
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    tg._compiled.pop(grammar, None)
    first = plain.add(prompt, params, tg.constraint(grammar, "test"))
    used = first.constraint.matcher
    while not first.is_finished:
        plain.step()
    assert first.finish_reason == "stop" and tg._compiled[grammar] is used and first.constraint.matcher is None
    second = plain.add(prompt, params, tg.constraint(grammar, "test"))
    assert second.constraint.matcher is not used and second.constraint.consumed == 0
    while not second.is_finished:
        plain.step()
    assert second.output_ids == first.output_ids
    third = plain.add(prompt, params, tg.constraint(grammar, "test"))
    kept = third.constraint.matcher
    plain.step()
    plain.abort(third)  # a client that left: its matcher, part-way through, comes back reset as well
    assert tg._compiled[grammar] is kept and kept.validate_tokens(second.output_ids) == len(second.output_ids)


def test_a_draft_is_fitted_to_the_grammar_and_the_state_is_left_alone(plain):
    """fit_draft keeps the valid prefix, puts the forced tokens after it, and consumes nothing."""
    tok = plain.tokenizer
    tg = compiler_for(tok, plain.model_config.vocab_size)
    c = tg.constraint(schema_grammar({"type": "object", "properties": {"name": {"type": "string"}},
                                      "required": ["name"], "additionalProperties": False}), "test")
    good = tok.encode('{"name": "Bo"}', add_special=False)
    assert c.fit_draft(good) == good
    bad = tok.encode('{"nope nope nope nope', add_special=False)
    fitted = c.fit_draft(bad)
    assert len(fitted) == len(bad) and fitted != bad
    assert tok.decode(fitted).startswith('{"name')  # the grammar forces the only key there is
    assert c.consumed == 0 and c.matcher.validate_tokens(good) == len(good)  # nothing was consumed
