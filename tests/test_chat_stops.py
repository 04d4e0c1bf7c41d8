"""StopMatcher: stop strings split across pieces are caught and never leak."""

from __future__ import annotations

import random

import pytest

from lucebox.chat.stops import StopMatcher


def feed(stops: list[str], pieces: list[str]) -> tuple[str, str | None, int]:
    """Run a matcher over pieces; return (all released text, matched stop, most text ever held)."""
    m = StopMatcher(stops)
    out, matched, most_held = [], None, 0
    for piece in pieces:
        safe, hit = m.push(piece)
        out.append(safe)
        if hit is not None:
            assert matched is None, "a stop matched twice"
            matched = hit
        most_held = max(most_held, len(m._held))
    out.append(m.flush())
    return "".join(out), matched, most_held


def reference(stops: list[str], text: str) -> tuple[str, str | None]:
    """What a reader of the whole text sees: cut at the stop that ends first (longest if tied)."""
    best = None
    for s in {s for s in stops if s}:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < (best[0] + len(best[1]), best[0])):
            best = (i, s)
    return (text, None) if best is None else (text[:best[0]], best[1])


def random_pieces(text: str, rng: random.Random, longest: int = 6) -> list[str]:
    out, i = [], 0
    while i < len(text):
        k = rng.randint(1, longest)
        out.append(text[i:i + k])
        i += k
    return out


def test_stop_in_one_piece_cuts_text_and_discards_the_rest():
    assert feed(["</answer>"], ["Hello</answer>world"]) == ("Hello", "</answer>", 0)


@pytest.mark.parametrize("text", ["Hello</answer>world", "</answer>", "a</answer", "x</a</answer>y"])
def test_stop_split_at_every_position_never_leaks(text):
    want = reference(["</answer>"], text)
    for cut in range(len(text) + 1):
        got, matched, _ = feed(["</answer>"], [text[:cut], text[cut:]])
        assert (got, matched) == want, cut
    got, matched, _ = feed(["</answer>"], list(text))
    assert (got, matched) == want


def test_hold_back_is_released_when_it_is_not_a_stop():
    m = StopMatcher(["STOP"])
    assert m.push("abc ST") == ("abc ", None)
    assert m.push("AR") == ("STAR", None)
    assert m.push("ST") == ("", None)
    assert m.flush() == "ST"


def test_text_held_at_the_end_is_flushed():
    assert feed(["</answer>"], ["abc</an"]) == ("abc</an", None, 4)


def test_after_a_match_nothing_more_comes_out():
    m = StopMatcher(["\n\n"])
    assert m.push("one\n") == ("one", None)
    assert m.push("\ntwo") == ("", "\n\n")
    assert m.done
    assert m.push("three") == ("", None)
    assert m.flush() == ""


def test_the_stop_that_ends_first_wins():
    assert feed(["abcd", "bc"], ["abcd"])[:2] == ("a", "bc")
    assert feed(["xab", "ab"], list("zxab"))[:2] == ("z", "xab")


def test_empty_stop_strings_are_ignored_and_no_stops_pass_through():
    assert feed(["", "END"], ["a", "bEN", "Dc"])[:2] == ("ab", "END")
    m = StopMatcher([])
    assert m.push("anything<") == ("anything<", None)
    assert m.flush() == ""
    assert not m.done


def test_unicode_stops():
    assert feed(["。\n"], ["你好", "。", "\n再见"])[:2] == ("你好", "。\n")


def test_random_texts_against_a_whole_text_reference():
    rng = random.Random(1234)
    for _ in range(400):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(0, 3))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        want = reference(stops, text)
        got, matched, held = feed(stops, random_pieces(text, rng))
        assert (got, matched) == want, (stops, text)
        assert held <= max((len(s) - 1 for s in stops if s), default=0)


def test_long_output_holds_only_a_bounded_window():
    stops = ["<|im_end|>", "</s>", "\nUser:"]
    text = "word " * 40_000 + "</s>tail"
    got, matched, held = feed(stops, random_pieces(text, random.Random(7), 4))
    assert matched == "</s>"
    assert got == "word " * 40_000
    assert held <= max(len(s) for s in stops) - 1
