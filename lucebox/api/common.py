"""What the three dialects share: the server's context, and parsing and checking the fields of a JSON body.

A dialect module (anthropic.py, openai_chat.py, openai_responses.py) parses
its JSON body with these helpers into a `ChatRequest` (chat/request.py),
starts a `GenerationRun` (chat/run.py) and renders the run's events and its
`Usage` in its own wire format.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

from lucebox.chat.prompt import PromptBuilder
from lucebox.chat.replay import ToolCallReplay
from lucebox.chat.request import bad_field, json_type, show_value
from lucebox.engine.runtime.async_engine import AsyncEngine
from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.http import HttpError
from lucebox.metrics import Metrics
from lucebox.model_cards import ModelCard


@dataclass
class ServerContext:
    """What handlers need; built once at start-up (engine is None while the model loads)."""

    model_id: str
    n_ctx: int
    prompt: PromptBuilder | None = None
    engine: AsyncEngine | None = None
    card: ModelCard | None = None
    metrics: Metrics = field(default_factory=Metrics)
    props: dict[str, Any] = field(default_factory=dict)  # static /props content (model, settings)
    started_at: float = field(default_factory=time.time)
    raw_system: bool = False  # Anthropic: pass the system prompt through untouched
    raw_user: bool = False  # Anthropic: pass user content through untouched
    pflash: Any = None  # lucebox.engine.pflash.service.PFlashService when --prefill-compression is not off
    replay: ToolCallReplay = field(default_factory=ToolCallReplay)  # tool-call turns rendered as the model wrote them

    def ready(self) -> tuple[AsyncEngine, PromptBuilder]:
        if self.engine is None or self.prompt is None:
            raise HttpError(503, "the model is still loading; retry shortly", "overloaded_error",
                            headers={"Retry-After": "2"})
        return self.engine, self.prompt


# ----- field parsing (400 with the field named, never a 500) -------------------

_MISSING = object()


def field_of(body: dict, name: str, types: type | tuple[type, ...], default: Any = None, *,
             where: str = "") -> Any:
    """`body[name]` checked against `types`; None/absent gives `default`."""
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if isinstance(types, tuple) and float in types and int not in types:
        types = (*types, int)
    elif types is float:
        types = (float, int)
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise bad_field(name, f"must be {_type_names(types)}", where)
    if not isinstance(value, types):
        raise bad_field(name, f"must be {_type_names(types)}, not {json_type(value)}", where)
    return value


def type_field(obj: dict, where: str = "", name: str = "type") -> str | None:
    """The `type` string that says what an item, part or choice is (None when absent); 400 when not a string."""
    value = obj.get(name)
    if value is not None and not isinstance(value, str):
        raise bad_field(name, f"must be a string, not {json_type(value)}", where)
    return value


def _type_names(types: type | tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "an array",
             dict: "an object"}
    ts = types if isinstance(types, tuple) else (types,)
    uniq = [names.get(t, t.__name__) for t in ts if not (t is int and float in ts)]
    return " or ".join(dict.fromkeys(uniq))


def require_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise HttpError(400, "the request body must be a JSON object", "invalid_request_error")
    return body


# The values the sampler computes correctly (float32 logits, int64 tensors, torch seeds); wider ones overflow
# to inf/NaN, or an int that does not fit, inside the engine step, where one row would fail the whole batch.
# (low, high, low is open): temperature above 100 is already uniform; penalties far from 1 or 0 make no sense.
SAMPLING_RANGES: dict[str, tuple[float, float, bool]] = {
    "temperature": (0.0, 100.0, False),
    "top_p": (0.0, 1.0, True),
    "min_p": (0.0, 1.0, False),
    "presence_penalty": (-2.0, 2.0, False),
    "frequency_penalty": (-2.0, 2.0, False),
    "repetition_penalty": (0.01, 100.0, False),
}
MAX_TOP_K = 2**31 - 1
SEED_RANGE = (-(2**63), 2**64 - 1)  # signed or unsigned 64-bit (the sampler takes seeds mod 2**64)
LOGIT_BIAS_LIMIT = 100.0


def _number(value: Any, name: str, lo: float, hi: float, lo_open: bool) -> float:
    """`value` as a finite float within [lo, hi] (or (lo, hi]); a 400 naming the field and the range otherwise."""
    try:
        x = float(value)
    except (OverflowError, ValueError, TypeError):
        x = math.nan
    if not math.isfinite(x) or x > hi or x < lo or (lo_open and x == lo):
        span = f"above {lo:g} and at most {hi:g}" if lo_open else f"from {lo:g} to {hi:g}"
        raise bad_field(name, f"must be a number {span}, not {show_value(value)}")
    return x


def sampling_from_body(body: dict, card: ModelCard | None, *, logprobs: int | None = None) -> SamplingParams:
    """The common sampling fields; missing ones come from the model card, then greedy defaults.

    Every value is checked against what the sampler can compute (`SAMPLING_RANGES`, `MAX_TOP_K`,
    `SEED_RANGE`) here, at the edge: a value that passes never makes the engine step fail.
    """
    defaults = dict(card.sampling) if card else {}
    values: dict[str, float] = {}
    for name, (lo, hi, lo_open) in SAMPLING_RANGES.items():  # absent: the card's value, else SamplingParams'
        value = field_of(body, name, float, defaults.get(name, getattr(SamplingParams, name)))
        values[name] = _number(value, name, lo, hi, lo_open)
    top_k = field_of(body, "top_k", int, defaults.get("top_k", 0))
    if not -1 <= top_k <= MAX_TOP_K:
        raise bad_field("top_k", f"must be an integer from -1 to {MAX_TOP_K} (0 and -1 mean off), "
                                 f"not {show_value(top_k)}")
    seed = field_of(body, "seed", int)
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise bad_field("seed", f"must be an integer from -2^63 to 2^64-1, not {show_value(seed)}")
    return SamplingParams(
        **values,
        top_k=max(top_k, 0),  # -1 means "off" in several clients
        seed=seed,
        logprobs=logprobs,
        ignore_eos=bool(field_of(body, "ignore_eos", bool, False)),  # vLLM's extension, for benchmarks
    )


def check_logit_bias(value: Any) -> None:
    """`logit_bias` is not applied, but a malformed one is a 400 as on OpenAI: {"token id": -100..100}."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise bad_field("logit_bias", f"must be an object mapping token ids to numbers, not {show_value(value)}")
    for key, bias in value.items():
        if not re.fullmatch(r"[0-9]{1,10}", key):
            raise bad_field("logit_bias", f"has the key {show_value(key)}, which is not a token id")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise bad_field(f"logit_bias.{key}", f"must be a number, not {show_value(bias)}")
        _number(bias, f"logit_bias.{key}", -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT, False)


MAX_STOPS = 16
MAX_STOP_CHARS = 256


def stop_list(value: Any, name: str = "stop") -> list[str]:
    """The request's stop strings: at most MAX_STOPS of at most MAX_STOP_CHARS characters each. The matcher
    keeps every proper prefix of every stop (chat/stops.py), so an unbounded stop string cost memory quadratic
    in its length (a 100K-character one: ~5 GB) and per-token work on the shared event loop."""
    if value is None:
        return []
    if isinstance(value, str):
        stops = [value] if value else []
    elif isinstance(value, list) and all(isinstance(s, str) for s in value):
        stops = [s for s in value if s]
    else:
        raise bad_field(name, "must be a string or an array of strings")
    if len(stops) > MAX_STOPS:
        raise bad_field(name, f"holds {len(stops)} stop strings; this server takes at most {MAX_STOPS}")
    longest = max(stops, key=len, default="")
    if len(longest) > MAX_STOP_CHARS:
        raise bad_field(name, f"holds a stop string of {len(longest)} characters; this server takes at most "
                              f"{MAX_STOP_CHARS} a string")
    return stops


def reject_n(body: dict) -> None:
    n = field_of(body, "n", int, 1)
    if n != 1:
        raise bad_field("n", f"= {n} is not supported: this server returns one choice per request")


TEXT_ONLY = "this model takes text only"
