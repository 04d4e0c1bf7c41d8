"""Drafter training data (issue 15, item 2): the evaluation split's overlap check catches quoted benchmark text,
prompts at scale stay distinct and clean, and `--responses N` adds the target's sampled responses beside its
greedy ones."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from lucebox.cli import build_parser
from lucebox.data import DATA_DIR
from lucebox.errors import LuceboxError
from lucebox.train import data
from lucebox.train.command import EXAMPLES, SUMMARY, main
from lucebox.train.examples import load_examples_file


def test_a_prompt_quoting_an_eval_question_is_dropped_even_when_not_equal(tmp_path):
    mt = next(p for p in data.eval_prompts(DATA_DIR) if p.source == "mtbench" and len(p.user_text().split()) > 20)
    words = re.findall(r"\w+", mt.user_text())  # the overlap test's words
    quoted = "My teacher gave us this, can you help? " + " ".join(words[:data.OVERLAP_WORDS + 2]) + " (and so on)"
    near = " ".join(words[:data.OVERLAP_WORDS - 1]) + " ... but about something else entirely."
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in (quoted, near, "Write a haiku about rain.")))
    train, counts = data.training_prompts(DATA_DIR, sources=["file"], files=[f])
    assert counts == {"file": 2, "dropped_eval_overlap": 1}
    assert [p.user_text() for p in train] == [near, "Write a haiku about rain."]  # 12 shared words: kept
    assert data.word_runs("A b, c!", 2) == {"a b", "b c"}


def test_command_adds_sampled_responses(tiny_gguf, tmp_path):
    rng = random.Random(0)
    words = "the cat sat on a mat while two dogs ran far away from home".split()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(rng.choices(words, k=6))}) + "\n" for _ in range(6)))
    out = tmp_path / "run"
    args = build_parser().parse_args([
        "train-drafter", "--target", str(tiny_gguf("llama", "F32")), "--out", str(out), "--device", "cpu",
        "--prompts", str(prompts), "--sources", "file", "--max-new-tokens", "16", "--layers", "1",
        "--block-size", "4", "--target-layers", "0,1", "--batch", "2", "--anchors", "8", "--steps", "2",
        "--eval-prompts", "0", "--save-dtype", "float32", "--responses", "3", "--quiet"])
    torch.manual_seed(0)
    assert main(args) == 0
    greedy, s1, s2 = (load_examples_file(out / n) for n in (EXAMPLES, "examples-1.npz", "examples-2.npz"))
    assert len(greedy) == len(s1) == len(s2) == 6
    assert [e.tokens[: e.prompt_len] for e in s1] == [e.tokens[: e.prompt_len] for e in greedy]  # the same prompts
    assert sum(a.tokens != b.tokens for a, b in zip(greedy, s1)) >= 3  # sampled: other responses
    assert sum(a.tokens != b.tokens for a, b in zip(s1, s2)) >= 3  # and other seeds per extra response
    assert json.loads((out / SUMMARY).read_text())["n_examples"] == 18


def test_prompts_at_scale_are_distinct_and_never_overlap_the_evaluation_suites():
    train, counts = data.training_prompts(DATA_DIR, swe_per_issue=8, math_count=12000)
    assert counts["swe_bench"] == 4000 and counts["math"] == 12000 and counts["dropped_eval_overlap"] == 0
    assert len(train) > 16000 and len({p.id for p in train}) == len(train)
    assert len({json.dumps(p.messages) for p in train}) == len(train)  # no conversation twice
    held = set().union(*(data.word_runs(t) for p in data.eval_prompts(DATA_DIR) for t in [p.user_text(), *p.followups]))
    assert not any(data.word_runs(p.user_text()) & held for p in train)
    assert [p.messages for p in data.math_prompts(600)] == [p.messages for p in train if p.source == "math"][:600]
    with pytest.raises(LuceboxError, match="--swe-per-issue 9"):
        data.training_prompts(DATA_DIR, sources=["swe_bench"], swe_per_issue=9)


def test_the_target_writes_user_prompts_of_its_own(smollm2_path, tmp_path):
    """--self-prompts (the Magpie recipe): the default model continues the chat template's opening of a user turn;
    what it ends itself becomes a training prompt (the steered openings kept), each text once, cached."""
    from lucebox.chat.prompt import PromptBuilder
    from lucebox.engine.weights.loader import load_model
    from lucebox.train.self_prompts import OPENINGS, self_prompts, user_turn_prefix

    loaded = load_model(smollm2_path, device=torch.device("cpu"), dtype=torch.float32, quiet=True)
    builder = PromptBuilder.for_model(loaded)
    prefix = builder.tokenizer.decode(user_turn_prefix(builder, "Write a Python function"))
    assert prefix.endswith("<|im_start|>user\nWrite a Python function") and "<|im_start|>system" in prefix
    n, cache = 12, tmp_path / "self-prompts.npz"
    written = self_prompts(loaded, builder, n, seed=3, max_tokens=64, batch=12, cache=cache, quiet=True)
    assert len(written) >= n // 2, [p.user_text() for p in written]  # most messages end before 64 tokens
    texts = [p.user_text() for p in written]
    assert len(set(texts)) == len(texts) and all(len(t.split()) >= 4 for t in texts)
    assert all(p.source == "self" and [m["role"] for m in p.messages] == ["user"] for p in written)
    for p in written:  # a steered prompt keeps its opening
        i = int(p.id.rsplit("-", 1)[1])
        assert p.user_text().startswith(OPENINGS[i % len(OPENINGS)])
    stamp = cache.stat().st_mtime_ns
    again = self_prompts(loaded, builder, n, seed=3, max_tokens=64, batch=12, cache=cache, quiet=True)
    assert [p.messages for p in again] == [p.messages for p in written] and cache.stat().st_mtime_ns == stamp
    other = self_prompts(loaded, builder, n, seed=4, max_tokens=64, batch=12, quiet=True)
    assert [p.messages for p in other] != [p.messages for p in written]  # another seed, other prompts
    assert data.drop_eval_overlap(written + [data.eval_prompts(DATA_DIR)[0]], DATA_DIR) == written


def test_command_trains_on_self_written_prompts(tiny_gguf, tmp_path):
    out = tmp_path / "run"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "the cat sat on a mat"}) + "\n")
    args = build_parser().parse_args([
        "train-drafter", "--target", str(tiny_gguf("llama", "F32")), "--out", str(out), "--device", "cpu",
        "--prompts", str(prompts), "--sources", "file", "--self-prompts", "6", "--max-new-tokens", "8",
        "--layers", "1", "--block-size", "4", "--target-layers", "0,1", "--batch", "2", "--anchors", "8",
        "--steps", "1", "--eval-prompts", "0", "--save-dtype", "float32", "--quiet"])
    assert main(args) == 0
    summary = json.loads((out / SUMMARY).read_text())
    assert (out / "self-prompts.npz").exists() and "self" in summary["train_prompts"]
    assert summary["n_examples"] == 1 + summary["train_prompts"]["self"]
