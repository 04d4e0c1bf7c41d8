"""Model cards: the repo's cards, lookup for the real GGUFs, precedence, bad cards, effort tiers.

The tier numbers are the Qwen3.6-27B example of docs/spec/MODEL_CARDS.md
(tiers low 4032, medium 16128, high 32256, x-high 56832, max 81408 for
max_tokens 32768 and complex_problem_max_tokens 81920). Those tiers come from
think = max_tokens - reply budget with the C++ server's 512-token reply budget
(32768 - 512 = 32256 = high, 32256 / 8 = 4032 = low); no context cap can
produce them (a cap bounds every tier at one value, and low would still be
4096). The C++ card, which now says hard_limit_reply_budget 4096, writes them
out explicitly; both forms are tested, with and without the context cap.
"""

from __future__ import annotations

import datetime
import json
import logging
from pathlib import Path

import pytest

from lucebox.engine.weights.loader import read_model_config
from lucebox.model_cards import REPO_CARDS, TIERS, CardError, ModelCard, card_dirs, find_card, load_card, slug
from lucebox.serve import ServerConfig, resolve_card

QWEN_TIERS = {"low": 4032, "medium": 16128, "high": 32256, "x-high": 56832, "max": 81408}


def server_names(path: Path) -> list[str]:
    """The names `serve.load_into` passes to the card lookup for a model file."""
    return [read_model_config(path).name, path.stem, path.stem.split(".")[0], path.name]


def write_card(folder: Path, file_name: str, **fields) -> Path:
    card = {"name": "Test card", "source": "https://huggingface.co/test/model", "verified_at": "2026-01-02",
            "max_tokens": 1234, **fields}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / file_name
    path.write_text(json.dumps(card), encoding="utf-8")
    return path


# ----- naming ----------------------------------------------------------------------


def test_slug_is_the_cpp_file_stem():
    assert slug("Gemma 3 270m") == "gemma-3-270m"
    assert slug("Qwen3.6 27B") == "qwen3.6-27b"
    assert slug("Smollm2 135M 8k Lc100K Mix1 Ep2") == "smollm2-135m-8k-lc100k-mix1-ep2"
    assert slug("a__b  c\tD") == "a--b--c-d"  # one '-' per character, as the C++ server names files
    assert slug("Llama-3.1 (8B)!") == "llama-3.1-8b"
    assert slug("SmolLM2-135M-Instruct.Q4_1") == "smollm2-135m-instruct.q4-1"


# ----- the repo's cards ------------------------------------------------------------


def repo_cards() -> list[Path]:
    return sorted(REPO_CARDS.glob("*.json"))


def test_repo_has_a_card_for_each_fetchable_model():
    assert {p.stem for p in repo_cards()} >= {"smollm2-135m-instruct", "gemma-3-270m"}


@pytest.mark.parametrize("path", repo_cards(), ids=lambda p: p.name)
def test_repo_card_is_valid_and_traceable(path, caplog):
    with caplog.at_level(logging.WARNING, logger="lucebox.model_cards"):
        card = load_card(path)
    assert not caplog.records, "a shipped card must not have unknown fields"
    assert card.source.startswith("https://huggingface.co/")
    assert datetime.date.fromisoformat(card.verified_at) <= datetime.date.today()
    assert card.max_tokens >= 1 and card.sampling, "transcribe the upstream sampling"
    assert card.notes, "say where each value came from"
    assert card.raw == json.loads(path.read_text(encoding="utf-8"))


def test_real_ggufs_find_their_cards(smollm2_path, gemma3_path, tmp_path):
    dirs = card_dirs(tmp_path)  # an empty user folder, then the repo's cards
    smol = find_card(server_names(smollm2_path), dirs)
    gemma = find_card(server_names(gemma3_path), dirs)
    assert smol is not None and smol.path == REPO_CARDS / "smollm2-135m-instruct.json"
    assert gemma is not None and gemma.path == REPO_CARDS / "gemma-3-270m.json"
    # Each name the server passes finds it on its own, so no single source of names is load-bearing.
    assert find_card([read_model_config(smollm2_path).name], dirs).path == smol.path  # via aliases
    assert find_card([smollm2_path.stem.split(".")[0]], dirs).path == smol.path  # file name
    assert find_card([read_model_config(gemma3_path).name], dirs).path == gemma.path  # general.name
    assert find_card([gemma3_path.stem], dirs).path == gemma.path  # via aliases
    # Sampling transcribed from the upstream cards (see each card's notes).
    assert smol.sampling == {"temperature": 0.2, "top_p": 0.9}
    assert gemma.sampling == {"temperature": 1.0, "top_k": 64, "top_p": 0.95}


def test_unknown_model_has_no_card(tmp_path):
    assert find_card(["Some Other Model 7B", "other-7b.Q4_K_M"], card_dirs(tmp_path)) is None


# ----- precedence --------------------------------------------------------------------


def test_model_card_flag_wins_over_lookup(smollm2_path, tmp_path):
    flag = write_card(tmp_path / "elsewhere", "mine.json", name="From the flag", max_tokens=77)
    card = resolve_card(ServerConfig(model_card=flag), server_names(smollm2_path))
    assert card is not None and card.name == "From the flag" and card.max_tokens == 77
    assert resolve_card(ServerConfig(), server_names(smollm2_path)).path == REPO_CARDS / "smollm2-135m-instruct.json"


def test_user_folder_wins_over_repo(smollm2_path, tmp_path):
    write_card(tmp_path / "model_cards", "smollm2-135m-instruct.json", name="User's own")
    card = find_card(server_names(smollm2_path), card_dirs(tmp_path))
    assert card is not None and card.name == "User's own" and card.path.parent == tmp_path / "model_cards"


def test_user_card_found_by_alias(smollm2_path, tmp_path):
    write_card(tmp_path / "model_cards", "anything.json", name="Aliased", aliases=["SmolLM2-135M-Instruct.Q4_1"])
    assert find_card(server_names(smollm2_path), card_dirs(tmp_path)).name == "Aliased"


# ----- bad cards ---------------------------------------------------------------------

BAD_CARDS = {  # case -> (file content: text as is, or fields over a valid card; what the error names)
    "invalid JSON": ("{not json", "not valid JSON"),
    "not an object": ("[1, 2]", "must be a JSON object"),
    "missing field": ('{"name": "x", "source": "https://h.co/x", "max_tokens": 5}', "verified_at"),
    "max_tokens 0": ({"max_tokens": 0}, "max_tokens"),
    "max_tokens bool": ({"max_tokens": True}, "max_tokens"),
    "max_tokens text": ({"max_tokens": "4096"}, "max_tokens"),
    "reply budget < 256": ({"hard_limit_reply_budget": 100}, "hard_limit_reply_budget"),
    "complex < max": ({"complex_problem_max_tokens": 10}, "complex_problem_max_tokens"),
    "temperature < 0": ({"sampling": {"temperature": -1}}, "temperature"),
    "top_p > 1": ({"sampling": {"top_p": 1.5}}, "top_p"),
    "top_k fraction": ({"sampling": {"top_k": 2.5}}, "top_k"),
    "sampling text": ({"sampling": {"temperature": "hot"}}, "sampling"),
    "tier negative": ({"reasoning_effort_tiers": {"low": -1}}, "reasoning_effort_tiers"),
    "tier unknown": ({"reasoning_effort_tiers": {"huge": 5}}, "reasoning_effort_tiers"),
    "bad date": ({"verified_at": "last week"}, "verified_at"),
    "source not a URL": ({"source": "the model card"}, "source"),
    "aliases string": ({"aliases": "smollm2"}, "aliases"),
    "name empty": ({"name": " "}, "name"),
}


def bad_card_file(folder: Path, file_name: str, case: str) -> tuple[Path, str]:
    content, problem = BAD_CARDS[case]
    if isinstance(content, dict):
        return write_card(folder, file_name, **content), problem
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / file_name
    path.write_text(content, encoding="utf-8")
    return path, problem


@pytest.mark.parametrize("case", sorted(BAD_CARDS))
def test_bad_card_is_rejected_naming_the_problem(case, tmp_path):
    path, problem = bad_card_file(tmp_path, "card.json", case)
    with pytest.raises(CardError, match=problem) as err:
        load_card(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("case", ["invalid JSON", "missing field", "top_p > 1", "max_tokens 0"])
def test_bad_card_never_stops_start_up(case, smollm2_path, tmp_path, caplog):
    names = server_names(smollm2_path)
    # --model-card PATH that is bad: a warning, and no card (not a crash, not a silent lookup).
    flag, problem = bad_card_file(tmp_path / "flag", "bad.json", case)
    with caplog.at_level(logging.WARNING):
        assert resolve_card(ServerConfig(model_card=flag), names) is None
    assert any(problem in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    caplog.clear()
    # A bad card where the lookup finds it first: a warning, then the next match (the repo's card).
    bad_card_file(tmp_path / "home" / "model_cards", "smollm2-135m-instruct.json", case)
    with caplog.at_level(logging.WARNING):
        card = find_card(names, card_dirs(tmp_path / "home"))
    assert card is not None and card.path == REPO_CARDS / "smollm2-135m-instruct.json"
    assert any("continuing without it" in r.getMessage() for r in caplog.records)


def test_missing_model_card_flag_is_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        assert resolve_card(ServerConfig(model_card=tmp_path / "nope.json"), ["x"]) is None
    assert any("does not exist" in r.getMessage() for r in caplog.records)


def test_unknown_key_is_reported_and_ignored(tmp_path, caplog):
    path = write_card(tmp_path, "card.json", max_tokn=5, sampling={"temperature": 0.7, "typical_p": 0.9})
    with caplog.at_level(logging.WARNING, logger="lucebox.model_cards"):
        card = load_card(path)
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "max_tokn" in messages and "typical_p" in messages
    assert card.max_tokens == 1234 and card.sampling == {"temperature": 0.7}
    assert card.raw["max_tokn"] == 5  # /props shows the file verbatim


def test_optional_fields_load(tmp_path):
    (tmp_path / "tpl.jinja").write_text("{{ messages }}", encoding="utf-8")
    path = write_card(tmp_path, "card.json", complex_problem_max_tokens=5000, hard_limit_reply_budget=512,
                      thinking_terminator_hint="\n</think>\n\n", notes=["one", "two"], chat_template="tpl.jinja",
                      drafter="z-lab/drafter", scorer="qwen3-0.6b")
    card = load_card(path)
    assert card.complex_problem_max_tokens == 5000 and card.hard_limit_reply_budget == 512
    assert card.notes == "one\ntwo" and card.thinking_terminator_hint == "\n</think>\n\n"
    assert Path(card.chat_template) == (tmp_path / "tpl.jinja").resolve()  # relative to the card, not the cwd
    assert (card.drafter, card.scorer) == ("z-lab/drafter", "qwen3-0.6b")


# ----- effort tiers ------------------------------------------------------------------


def qwen_card(**fields) -> ModelCard:
    base = {"name": "Qwen3.6 27B", "source": "https://huggingface.co/Qwen/Qwen3.6-27B", "verified_at": "2026-05-23",
            "max_tokens": 32768, "complex_problem_max_tokens": 81920}
    return ModelCard(**{**base, **fields})


def test_tier_defaults_reproduce_the_qwen_example():
    card = qwen_card(hard_limit_reply_budget=512)  # the C++ default budget when these numbers were derived
    assert card.tiers(262144) == QWEN_TIERS  # Qwen3.6-27B's native context: no cap applies
    # n_ctx - 512 >= 81408 for every n_ctx >= 81920: the smallest context that keeps every tier whole.
    assert card.tiers(81920) == QWEN_TIERS
    assert card.tiers(81919) == {**QWEN_TIERS, "max": 81407}
    assert card.tiers(65536) == {**QWEN_TIERS, "max": 65024}  # cap = 65536 - 512
    assert card.tiers(32768) == {"low": 4032, "medium": 16128, "high": 32256, "x-high": 32256, "max": 32256}
    assert card.tiers(0) == QWEN_TIERS  # context unknown: no cap


def test_explicit_tiers_of_the_spec_example_are_capped_by_the_context():
    card = qwen_card(hard_limit_reply_budget=4096, reasoning_effort_tiers=dict(QWEN_TIERS))  # MODEL_CARDS.md's card
    assert card.tiers(262144) == QWEN_TIERS
    assert card.tiers(81408 + 4096) == QWEN_TIERS  # n_ctx = 85504: max sits exactly on the cap
    assert card.tiers(85503) == {**QWEN_TIERS, "max": 81407}
    assert card.tiers(65536) == {**QWEN_TIERS, "max": 61440}  # cap = 65536 - 4096
    assert card.effort_budget("max", 65536) == 61440


def test_tier_defaults_with_the_4096_reply_budget():
    # Without explicit tiers a 4096-token reply budget leaves think = 28672 and complex = 77824.
    tiers = qwen_card(hard_limit_reply_budget=4096).tiers(262144)
    assert tiers == {"low": 3584, "medium": 14336, "high": 28672, "x-high": 53248, "max": 77824}


def test_tiers_clamped_non_decreasing_and_without_complex():
    card = qwen_card(complex_problem_max_tokens=None, hard_limit_reply_budget=512,
                     reasoning_effort_tiers={"low": 20000, "medium": 100})
    tiers = card.tiers(262144)
    assert tiers == {"low": 20000, "medium": 20000, "high": 32256, "x-high": 32256, "max": 32256}
    assert list(tiers) == list(TIERS)


def test_effort_names():
    card = qwen_card(hard_limit_reply_budget=512)
    assert card.effort_budget("xhigh", 262144) == card.effort_budget("x-high", 262144) == 56832  # OpenAI's spelling
    with pytest.raises(CardError, match="unknown reasoning effort 'extreme'"):
        card.effort_budget("extreme", 262144)
