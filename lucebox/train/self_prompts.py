"""Prompts the target writes itself: the chat template up to a user turn's text, continued by the target.

The drafter learns the target's answers, so what it needs is breadth of prompts, and the bundled sources
(lucebox.train.data) are a few thousand of a few kinds. Given only the opening of a user turn, an instruct
model writes a user message from its own training distribution (the Magpie recipe): any number, any topic,
nothing to ship. OPENINGS steer part of them toward the kinds agents and benchmarks ask for (code, word
problems, explanations, writing); none is an evaluation text, and the written prompts go through the same
overlap guard as every source (data.drop_eval_overlap). The messages are sampled (temperature 0.9, seeded
per prompt) and cached in OUT like the responses, so a resumed run trains on the same prompts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lucebox.engine.runtime.llm_engine import LLMEngine
from lucebox.engine.weights.loader import LoadedModel
from lucebox.train.data import Prompt
from lucebox.train.examples import generate_examples

OPENINGS = (
    "", "", "", "",  # free: whatever the target thinks a user asks
    "Write a Python function", "Write a function in", "Fix this code", "Explain what this code does",
    "How do I", "Can you explain", "What is the difference between", "Why does",
    "Solve this problem:", "A store", "Tom has", "Calculate", "If a train",
    "Write a short story", "Write an email", "Give me tips", "Summarize", "Compare",
    "Help me plan", "List", "Describe", "I need help with",
)
SENTINEL = "\x00USER\x00"
TEMPERATURE = 0.9
MIN_WORDS = 4


def user_turn_prefix(builder: Any, opening: str) -> list[int]:
    """Token ids of the chat template up to a user message's text, then `opening`."""
    text = builder.render([{"role": "user", "content": SENTINEL}], add_generation_prompt=False)
    return builder.tokenizer.encode(text[: text.index(SENTINEL)] + opening, add_special=False)


def self_prompts(loaded: LoadedModel, builder: Any, n: int, *, seed: int, max_tokens: int = 128,
                 batch: int = 64, cache: Path | None = None, engine: LLMEngine | None = None,
                 quiet: bool = False) -> list[Prompt]:
    """Up to `n` user prompts written by the target (prompt i from opening i % len(OPENINGS), seed + i).

    Kept: messages the target ended itself (an end-of-turn token before `max_tokens`) with at least
    MIN_WORDS words, each text once."""
    openings = [OPENINGS[i % len(OPENINGS)] for i in range(n)]
    prefixes = {o: user_turn_prefix(builder, o) for o in set(openings)}
    examples = generate_examples(loaded, [prefixes[o] for o in openings], max_new_tokens=max_tokens,
                                 temperature=TEMPERATURE, seed=seed, batch=batch, cache=cache, engine=engine,
                                 quiet=quiet)
    tok = builder.tokenizer
    out: list[Prompt] = []
    seen: set[str] = set()
    for i, (opening, ex) in enumerate(zip(openings, examples)):
        written = ex.tokens[ex.prompt_len:]
        if not written or written[-1] not in tok.eos_ids:
            continue  # cut at max_tokens, or empty
        text = (opening + tok.decode(written[:-1])).strip()
        if len(text.split()) < MIN_WORDS or text in seen:
            continue
        seen.add(text)
        out.append(Prompt("self", f"self-{seed}-{i}", [{"role": "user", "content": text}]))
    return out
