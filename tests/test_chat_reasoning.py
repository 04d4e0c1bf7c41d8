"""ReasoningSplitter: reasoning vs answer, tags split at every position."""

from __future__ import annotations

import random

import pytest

from lucebox.chat.events import ReasoningDelta, TextDelta, merge_events
from lucebox.chat.reasoning import ReasoningConfig, ReasoningSplitter


def split(pieces: list[str], **kw) -> list:
    s = ReasoningSplitter(**kw)
    events = []
    for p in pieces:
        events += s.push(p)
    events += s.flush()
    assert all(ev.text for ev in events), "empty delta"
    return merge_events(events)


def all_splits(text: str, seed: int = 0) -> list[list[str]]:
    """Whole, char by char, every single cut point, and random splits."""
    rng = random.Random(seed)
    out = [[text], list(text)]
    out += [[text[:k], text[k:]] for k in range(1, len(text))]
    for _ in range(30):
        pieces, i = [], 0
        while i < len(text):
            k = rng.randint(1, 5)
            pieces.append(text[i:i + k])
            i += k
        out.append(pieces)
    return out


CASES = [
    # (output, kwargs, expected merged events)
    ("<think>\nLet me see.\n</think>\n\nParis.", {},
     [ReasoningDelta("Let me see."), TextDelta("Paris.")]),
    ("\n<think>a < b </thin> c</think>x", {},
     [ReasoningDelta("a < b </thin> c"), TextDelta("x")]),
    ("Just an answer with <think> in it.", {},
     [TextDelta("Just an answer with <think> in it.")]),
    ("<b>bold</b>", {}, [TextDelta("<b>bold</b>")]),
    ("I reason first.\n</think>\n\nAnswer", {"start_in_reasoning": True},
     [ReasoningDelta("I reason first."), TextDelta("Answer")]),
    ("<think>\nrepeated tag\n</think>A", {"start_in_reasoning": True},
     [ReasoningDelta("repeated tag"), TextDelta("A")]),
    ("<think>\nstill thinking when the length limit hit  \n", {},
     [ReasoningDelta("still thinking when the length limit hit")]),
    ("<think>cut inside the tag </thi", {}, [ReasoningDelta("cut inside the tag </thi")]),
    ("<think>\n\n</think>\n\nNo thoughts.", {}, [TextDelta("No thoughts.")]),
    ("<think></think>", {}, []),
    ("  \n  ", {}, [TextDelta("  \n  ")]),
    ("<think>\n\n</think>\n\nHi", {"enabled": False}, [TextDelta("Hi")]),
    ("<think>I think anyway</think>Hi", {"enabled": False}, [TextDelta("<think>I think anyway</think>Hi")]),
    ("Plain <think></think>", {"enabled": False}, [TextDelta("Plain <think></think>")]),
    ("[THINK]step[/THINK]done", {"open_tag": "[THINK]", "close_tag": "[/THINK]"},
     [ReasoningDelta("step"), TextDelta("done")]),
    ("中文推理</think>答案", {"start_in_reasoning": True}, [ReasoningDelta("中文推理"), TextDelta("答案")]),
]


@pytest.mark.parametrize(("text", "kw", "want"), CASES)
def test_every_split_gives_the_same_events(text, kw, want):
    for pieces in all_splits(text):
        assert split(pieces, **kw) == want, pieces


def test_tags_are_never_emitted_even_split_char_by_char():
    text = "<think>" + "x" * 50 + "</think>" + "y" * 50
    s = ReasoningSplitter()
    for ch in text:
        for ev in s.push(ch):
            assert "<" not in ev.text and ">" not in ev.text


def test_partial_close_tag_is_held_then_released_as_reasoning():
    s = ReasoningSplitter(start_in_reasoning=True)
    assert s.push("a </thi") == [ReasoningDelta("a")]
    assert s.push("s is not it") == [ReasoningDelta(" </this is not it")]


def test_in_reasoning_and_saw_reasoning_follow_the_stream():
    s = ReasoningSplitter()
    assert not s.in_reasoning
    s.push("<think>")
    assert s.in_reasoning and not s.saw_reasoning
    s.push("hmm")
    assert s.saw_reasoning
    s.push("</think>ok")
    assert not s.in_reasoning
    assert ReasoningSplitter(start_in_reasoning=True).in_reasoning
    assert not ReasoningSplitter(start_in_reasoning=True, enabled=False).in_reasoning


def test_from_config_and_bad_tags():
    s = ReasoningSplitter.from_config(ReasoningConfig(start_in_reasoning=True))
    assert s.push("r</think>t") == [ReasoningDelta("r"), TextDelta("t")]
    with pytest.raises(ValueError):
        ReasoningSplitter("", "</think>")


def test_random_texts_split_invariant():
    rng = random.Random(99)
    alphabet = ["<think>", "</think>", "<", "/", "t", "\n", " ", "a", "think>"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        kw = rng.choice([{}, {"start_in_reasoning": True}, {"enabled": False}])
        want = split([text], **kw)
        for pieces in all_splits(text, seed=rng.randint(0, 1 << 30))[:8]:
            assert split(pieces, **kw) == want, (text, kw, pieces)
