"""Model cards: per-model defaults in sidecar JSON (docs/spec/MODEL_CARDS.md).

Lookup: the slug of the model's name (`general.name` of a GGUF, the HF
folder's `_name_or_path` or folder name) in `--model-card PATH`, then the
user's card folder (`$LUCEBOX_HOME/model_cards`), then the repo's
`model_cards/`. A bad card never stops start-up: it is reported and skipped.
Precedence of values: CLI flag > card > built-in default.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from lucebox.errors import LuceboxError

log = logging.getLogger(__name__)

REPO_CARDS = Path(__file__).resolve().parent.parent / "model_cards"
if not REPO_CARDS.is_dir():  # a non-editable install: setup.py put them under <prefix>/share/lucebox
    REPO_CARDS = Path(sys.prefix) / "share" / "lucebox" / "model_cards"
TIERS = ("low", "medium", "high", "x-high", "max")
TIER_ALIASES = {"xhigh": "x-high", "x_high": "x-high"}  # OpenAI's spelling of x-high
_REQUIRED = {"name", "source", "verified_at", "max_tokens"}
_OPTIONAL = {"complex_problem_max_tokens", "hard_limit_reply_budget", "thinking_marker", "thinking_terminator_hint",
             "sampling", "reasoning_effort_tiers", "notes", "drafter", "scorer", "chat_template", "aliases"}
_STRINGS = ("thinking_marker", "thinking_terminator_hint", "drafter", "scorer", "chat_template")
_SAMPLING = {"temperature", "top_p", "top_k", "min_p", "presence_penalty", "repetition_penalty"}


class CardError(LuceboxError):
    pass


def slug(name: str) -> str:
    """File stem for a model name: lower-case, each space/tab/underscore -> '-', other than [a-z0-9.-] dropped.

    Character by character, as the C++ server does, so its card files carry over.
    """
    s = re.sub(r"[ \t_]", "-", name.strip().lower())
    return re.sub(r"[^a-z0-9.-]", "", s)


@dataclass
class ModelCard:
    name: str
    source: str
    verified_at: str
    max_tokens: int
    complex_problem_max_tokens: int | None = None
    hard_limit_reply_budget: int = 4096
    thinking_marker: str | None = None
    thinking_terminator_hint: str | None = None
    sampling: dict[str, float] = field(default_factory=dict)
    reasoning_effort_tiers: dict[str, int] = field(default_factory=dict)
    notes: str | None = None
    drafter: str | None = None
    scorer: str | None = None
    chat_template: str | None = None
    aliases: list[str] = field(default_factory=list)
    path: Path | None = None
    raw: dict[str, Any] = field(default_factory=dict)

    def drafter_path(self) -> str | None:
        """The card's DFlash drafter folder, if it names one that exists."""
        return self.drafter if self.drafter and Path(self.drafter).is_dir() else None

    def effort_budget(self, effort: str, n_ctx: int) -> int:
        """Thinking-token budget for an effort tier (defaults derived as MODEL_CARDS.md says)."""
        tiers = self.tiers(n_ctx)
        tier = TIER_ALIASES.get(effort, effort)
        if tier not in tiers:
            raise CardError(f"unknown reasoning effort {effort!r} (choose from {', '.join(TIERS)})")
        return tiers[tier]

    def tiers(self, n_ctx: int) -> dict[str, int]:
        """Thinking-token budget per effort tier, for a context of `n_ctx` tokens (0: unknown, no cap).

        The thinking budget of a request is what its output budget leaves for the
        answer: think = max_tokens - hard_limit_reply_budget (and likewise from
        complex_problem_max_tokens). Tiers the card leaves out default to low =
        think/8, medium = think/2, high = think, x-high = (think + complex)/2,
        max = complex; then they are made non-decreasing and capped at
        n_ctx - hard_limit_reply_budget. This is the C++ server's rule; it gives
        the Qwen3.6-27B tiers 4032/16128/32256/56832/81408 from max_tokens 32768,
        complex 81920 and a 512-token reply budget.
        """
        budget = self.hard_limit_reply_budget
        think = max(0, self.max_tokens - budget)
        complex_ = max(0, self.complex_problem_max_tokens - budget) if self.complex_problem_max_tokens else think
        defaults = {"low": (think + 4) // 8, "medium": (think + 1) // 2, "high": think,
                    "x-high": (think + complex_) // 2, "max": complex_}
        cap = max(0, n_ctx - budget) if n_ctx > 0 else None
        out: dict[str, int] = {}
        floor = 0
        for tier in TIERS:
            floor = max(floor, int(self.reasoning_effort_tiers.get(tier, defaults[tier])))
            out[tier] = floor if cap is None else min(floor, cap)
        return out


def load_card(path: Path) -> ModelCard:
    """Parse and validate one card file; CardError names what is wrong."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CardError(f"model card {path} does not exist") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CardError(f"model card {path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise CardError(f"model card {path} must be a JSON object")
    missing = sorted(_REQUIRED - raw.keys())
    if missing:
        raise CardError(f"model card {path} lacks required field(s) {', '.join(missing)}")
    unknown = sorted(raw.keys() - _REQUIRED - _OPTIONAL)
    if unknown:
        log.warning("model card %s: ignoring unknown field(s) %s", path, ", ".join(unknown))
    fields = _validated(raw, f"model card {path}")
    here = path.resolve().parent
    if fields.get("chat_template") and not Path(fields["chat_template"]).is_absolute():
        fields["chat_template"] = str(here / fields["chat_template"])  # relative to the card, not the cwd
    for name in ("drafter", "scorer"):  # a folder next to the card, or a name/path taken as given
        if fields.get(name) and not Path(fields[name]).is_absolute() and (here / fields[name]).exists():
            fields[name] = str(here / fields[name])
    return ModelCard(**fields, path=path, raw=raw)


def _validated(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """The card's known fields, type- and range-checked (CardError names the first bad one)."""
    def fail(name: str, problem: str) -> CardError:
        return CardError(f"{where}: {name} {problem}")

    def integer(name: str, minimum: int) -> int:
        value = raw[name]
        if not _is_int(value) or value < minimum:
            raise fail(name, f"must be an integer >= {minimum}, not {value!r}")
        return value

    out: dict[str, Any] = {}
    for name in ("name", "source", "verified_at"):
        if not isinstance(raw[name], str) or not raw[name].strip():
            raise fail(name, "must be a non-empty string")
        out[name] = raw[name]
    if urlparse(raw["source"]).scheme not in ("http", "https"):
        raise fail("source", f"must be the URL of the upstream model card, not {raw['source']!r}")
    try:
        datetime.date.fromisoformat(raw["verified_at"])
    except ValueError:
        raise fail("verified_at", f"must be a date YYYY-MM-DD, not {raw['verified_at']!r}") from None
    out["max_tokens"] = integer("max_tokens", 1)
    if raw.get("complex_problem_max_tokens") is not None:
        out["complex_problem_max_tokens"] = integer("complex_problem_max_tokens", out["max_tokens"])
    if raw.get("hard_limit_reply_budget") is not None:
        out["hard_limit_reply_budget"] = integer("hard_limit_reply_budget", 256)
    for name in _STRINGS:
        if raw.get(name) is not None:
            if not isinstance(raw[name], str):
                raise fail(name, "must be a string")
            out[name] = raw[name]
    notes = raw.get("notes")
    if notes is not None:
        if isinstance(notes, list) and all(isinstance(n, str) for n in notes):
            notes = "\n".join(notes)
        if not isinstance(notes, str):
            raise fail("notes", "must be a string or an array of strings")
        out["notes"] = notes
    aliases = raw.get("aliases") or []
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a.strip() for a in aliases):
        raise fail("aliases", "must be an array of model names")
    out["aliases"] = list(aliases)
    out["sampling"] = _validated_sampling(raw.get("sampling") or {}, where)
    tiers = raw.get("reasoning_effort_tiers") or {}
    if not isinstance(tiers, dict) or not all(k in TIERS and _is_int(v) and v >= 0 for k, v in tiers.items()):
        raise fail("reasoning_effort_tiers", f"must map {'/'.join(TIERS)} to integers >= 0")
    out["reasoning_effort_tiers"] = dict(tiers)
    return out


def _validated_sampling(sampling: Any, where: str) -> dict[str, float]:
    from lucebox.engine.runtime.sampler import SamplingParams

    if not isinstance(sampling, dict) or not all(_is_number(v) for v in sampling.values()):
        raise CardError(f"{where}: sampling must be an object of numbers")
    bad = sorted(sampling.keys() - _SAMPLING)
    if bad:
        log.warning("%s: ignoring unknown sampling field(s) %s", where, ", ".join(bad))
    sampling = {k: v for k, v in sampling.items() if k in _SAMPLING}
    if "top_k" in sampling and not _is_int(sampling["top_k"]):
        raise CardError(f"{where}: sampling.top_k must be an integer")
    try:
        SamplingParams(**sampling).validate()
    except ValueError as exc:
        raise CardError(f"{where}: sampling.{exc}") from None
    return sampling


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def card_dirs(home: Path) -> list[Path]:
    return [home / "model_cards", REPO_CARDS]


def find_card(model_names: list[str], dirs: list[Path]) -> ModelCard | None:
    """The first card whose file name (or alias) is the slug of one of the model's names."""
    slugs = [s for s in (slug(n) for n in model_names if n) if s]
    for d in dirs:
        if not d.is_dir():
            continue
        for s in slugs:
            path = d / f"{s}.json"
            if path.exists():
                try:
                    return load_card(path)
                except CardError as exc:
                    log.warning("%s; continuing without it", exc)
        for path in sorted(d.glob("*.json")):
            try:
                card = load_card(path)
            except CardError:
                continue
            if any(slug(a) in slugs for a in card.aliases):
                return card
    return None
