"""Model cards: per-model defaults in sidecar JSON (shared/spec/MODEL_CARDS.md).

Lookup: the slug of the model's name (`general.name` of a GGUF, the HF
folder's `_name_or_path` or folder name) in `--model-card PATH`, then the
user's card folder (`$LUCEBOX_HOME/model_cards`), then the repo's
`model_cards/`. A bad card never stops start-up: it is reported and skipped.
Precedence of values: CLI flag > card > built-in default.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lucebox.errors import LuceboxError

log = logging.getLogger(__name__)

REPO_CARDS = Path(__file__).resolve().parent.parent / "model_cards"
TIERS = ("low", "medium", "high", "x-high", "max")
_REQUIRED = {"name", "source", "verified_at", "max_tokens"}
_OPTIONAL = {"complex_problem_max_tokens", "hard_limit_reply_budget", "thinking_marker", "thinking_terminator_hint",
             "sampling", "reasoning_effort_tiers", "notes", "drafter", "scorer", "chat_template", "aliases"}
_SAMPLING = {"temperature", "top_p", "top_k", "min_p", "presence_penalty", "repetition_penalty"}


class CardError(LuceboxError):
    pass


def slug(name: str) -> str:
    s = re.sub(r"[\s_]+", "-", name.strip().lower())
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

    def effort_budget(self, effort: str, n_ctx: int) -> int:
        """Thinking-token budget for an effort tier (defaults derived as MODEL_CARDS.md says)."""
        tiers = self.tiers(n_ctx)
        if effort not in tiers:
            raise CardError(f"unknown reasoning effort {effort!r} (choose from {', '.join(TIERS)})")
        return tiers[effort]

    def tiers(self, n_ctx: int) -> dict[str, int]:
        think = self.max_tokens
        complex_ = self.complex_problem_max_tokens or think
        defaults = {"low": think // 8, "medium": think // 2, "high": think, "x-high": (think + complex_) // 2,
                    "max": complex_}
        cap = max(0, n_ctx - self.hard_limit_reply_budget)
        out: dict[str, int] = {}
        floor = 0
        for tier in TIERS:
            value = int(self.reasoning_effort_tiers.get(tier, defaults[tier]))
            floor = max(floor, value)
            out[tier] = min(floor, cap) if cap else floor
        return out


def load_card(path: Path) -> ModelCard:
    """Parse and validate one card file; CardError names what is wrong."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
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
    if not isinstance(raw["max_tokens"], int) or raw["max_tokens"] < 1:
        raise CardError(f"model card {path}: max_tokens must be an integer >= 1")
    budget = raw.get("hard_limit_reply_budget", 4096)
    if not isinstance(budget, int) or budget < 256:
        raise CardError(f"model card {path}: hard_limit_reply_budget must be an integer >= 256")
    sampling = raw.get("sampling") or {}
    if not isinstance(sampling, dict) or not all(isinstance(v, (int, float)) for v in sampling.values()):
        raise CardError(f"model card {path}: sampling must be an object of numbers")
    bad = sorted(sampling.keys() - _SAMPLING)
    if bad:
        log.warning("model card %s: ignoring unknown sampling field(s) %s", path, ", ".join(bad))
        sampling = {k: v for k, v in sampling.items() if k in _SAMPLING}
    tiers = raw.get("reasoning_effort_tiers") or {}
    if not isinstance(tiers, dict) or not all(k in TIERS and isinstance(v, int) for k, v in tiers.items()):
        raise CardError(f"model card {path}: reasoning_effort_tiers must map {'/'.join(TIERS)} to integers")
    known = {k: raw[k] for k in raw.keys() & (_REQUIRED | _OPTIONAL) if k not in ("sampling", "reasoning_effort_tiers")}
    return ModelCard(**known, sampling=dict(sampling), reasoning_effort_tiers=dict(tiers), path=Path(path), raw=raw)


def card_dirs(home: Path) -> list[Path]:
    return [home / "model_cards", REPO_CARDS]


def find_card(model_names: list[str], dirs: list[Path]) -> ModelCard | None:
    """The first card whose file name (or alias) is the slug of one of the model's names."""
    slugs = [slug(n) for n in model_names if n]
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
