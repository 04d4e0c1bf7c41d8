"""Prompt text in, shorter target prompt out: tokenize for the scorer, score, select, map back.

The scorer may be any loaded model (by default the target itself). When its
tokenizer is the target's, the kept chunks' token ids go to the target as
they are; otherwise the kept chunks are cut out of the prompt text by the
scorer tokens' character offsets and the text is tokenized again for the
target. Either way `PFlashResult.text` is the compressed prompt as text.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lucebox.engine.pflash.config import PFlashConfig
from lucebox.engine.pflash.scorer import token_importance
from lucebox.engine.pflash.selection import Selection, select_chunks
from lucebox.engine.tokenizer import Tokenizer
from lucebox.engine.weights.loader import LoadedModel
from lucebox.errors import LuceboxError

log = logging.getLogger(__name__)

Range = tuple[int, int]  # [start, end) in scorer tokens
Importance = Callable[[list[int], PFlashConfig], torch.Tensor]  # (scorer ids, config) -> one score per token


@dataclass
class ScoredPrompt:
    """A prompt in scorer tokens with one importance score per token."""

    text: str
    ids: list[int]
    offsets: list[tuple[int, int]]  # character span of each token in `text`
    scores: torch.Tensor  # [len(ids)] fp32, CPU
    seconds: float  # tokenize + scorer forward


@dataclass
class PFlashResult:
    """A compressed prompt and what it cost."""

    ids: list[int]  # the compressed prompt in target token ids
    text: str  # the compressed prompt as text
    kept_chunks: list[int]  # indices of the kept scorer chunks, ascending
    n_chunks: int
    scorer_tokens: int  # the prompt's length in scorer tokens
    original_tokens: int  # the prompt's length in target tokens
    query_appended: bool  # the last user message was appended again (too little of it survived)
    scorer_seconds: float  # tokenize + scorer forward
    total_seconds: float  # everything: tokenize, score, select, map back to target ids
    selection: Selection | None = None

    @property
    def compressed_tokens(self) -> int:
        return len(self.ids)

    @property
    def ratio(self) -> float:
        """original / compressed target tokens (20.0 = twenty times shorter)."""
        return self.original_tokens / max(1, len(self.ids))


def same_tokenizer(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether two tokenizers turn every text into the same ids."""
    return a is b or (a.add_bos == b.add_bos and a.bos_id == b.bos_id and a.hf.to_str() == b.hf.to_str())


class PFlash:
    """Speculative prefill: a small scorer picks the chunks of a long prompt the target gets.

    `compress(text)` takes a rendered prompt (chat template applied; it is
    tokenized without adding BOS, as PromptBuilder.render_ids does).
    """

    def __init__(self, target_tokenizer: Tokenizer, scorer: LoadedModel, config: PFlashConfig | None = None,
                 importance: Importance | None = None) -> None:
        self.config = config or PFlashConfig()
        self.config.validate()
        self.target_tokenizer = target_tokenizer
        self.scorer = scorer
        self.shared_tokenizer = same_tokenizer(target_tokenizer, scorer.tokenizer)
        self.importance = importance or functools.partial(token_importance, scorer.model)

    @classmethod
    def for_model(cls, target: LoadedModel, scorer: LoadedModel | None = None,
                  config: PFlashConfig | None = None, importance: Importance | None = None) -> PFlash:
        """PFlash for `target`, scored by `scorer` (default: the target itself). `importance` runs the
        scorer's forward where it is not `token_importance` on the scorer's model in this process: a target
        split over ranks scores on all of them (LLMEngine.token_importance)."""
        return cls(target.tokenizer, scorer or target, config, importance)

    def compress(self, prompt: str, query: str | None = None, keep_ratio: float | None = None) -> PFlashResult:
        """Score `prompt` and keep its best chunks; `query` is the last user message (survival check)."""
        start = time.perf_counter()
        return self.select(self.score(prompt), query, keep_ratio, started=start)

    def score(self, prompt: str) -> ScoredPrompt:
        """Tokenize for the scorer and run it: one importance score per scorer token."""
        if not prompt:
            raise LuceboxError("PFlash: the prompt is empty")
        start = time.perf_counter()
        enc = self.scorer.tokenizer.hf.encode_batch([prompt], add_special_tokens=False)[0]
        ids, offsets = list(enc.ids), [tuple(o) for o in enc.offsets]
        scores = self.importance(ids, self.config)
        if scores.is_cuda:  # the scorer's own stream (PFlashService), not the device: decode steps run meanwhile
            torch.cuda.current_stream(scores.device).synchronize()
        return ScoredPrompt(prompt, ids, offsets, scores.float().cpu(), time.perf_counter() - start)

    def select(self, scored: ScoredPrompt, query: str | None = None, keep_ratio: float | None = None,
               config: PFlashConfig | None = None, started: float | None = None) -> PFlashResult:
        """Pick chunks of a scored prompt and build the target's ids (`config` overrides this PFlash's)."""
        cfg = config or self.config
        if config is not None:
            config.validate()
        if keep_ratio is not None and not 0.0 < keep_ratio <= 1.0:
            raise LuceboxError(f"PFlash keep ratio must be in (0, 1], got {keep_ratio}")
        t0 = time.perf_counter()
        sel = select_chunks(scored.scores, scored.ids, cfg, keep_ratio)
        S = len(scored.ids)
        ranges = _runs(sel.kept, cfg.chunk, S)
        appended = False
        span = _query_span(scored, query)
        if span is not None:
            qs, qe = span
            kept_tokens = sum(max(0, min(e, qe) - max(s, qs)) for s, e in ranges)
            if kept_tokens < cfg.query_survival * (qe - qs) and qe - qs < cfg.query_max_tokens:
                # Appended right after the message, before what followed it (the assistant header).
                ranges = _clip(ranges, 0, qe) + [(qs, qe)] + _clip(ranges, qe, S)
                appended = True
        text = "".join(scored.text[a:b] for a, b in (_char_span(scored, r) for r in ranges))
        if self.shared_tokenizer:
            ids = [t for s, e in ranges for t in scored.ids[s:e]]
            original = S
        else:
            ids = self.target_tokenizer.encode(text, add_special=False)
            original = len(self.target_tokenizer.encode(scored.text, add_special=False))
        end = time.perf_counter()
        total = scored.seconds + (end - t0) if started is None else end - started
        return PFlashResult(ids, text, sel.kept, sel.n_chunks, S, original, appended, scored.seconds, total, sel)


def _runs(chunks: list[int], chunk: int, S: int) -> list[Range]:
    """Token ranges of sorted chunk indices, neighbours merged."""
    ranges: list[Range] = []
    for c in chunks:
        s, e = c * chunk, min(S, (c + 1) * chunk)
        if ranges and ranges[-1][1] == s:
            ranges[-1] = (ranges[-1][0], e)
        else:
            ranges.append((s, e))
    return ranges


def _clip(ranges: list[Range], lo: int, hi: int) -> list[Range]:
    return [(max(s, lo), min(e, hi)) for s, e in ranges if min(e, hi) > max(s, lo)]


def _char_span(scored: ScoredPrompt, r: Range) -> tuple[int, int]:
    """Characters of tokens [s, e): from the first token's start to the next token's start.

    Tokens that share a character (byte-level pieces of one UTF-8 character)
    give it to the later range, so no range holds half a character.
    """
    s, e = r
    start = 0 if s == 0 else scored.offsets[s][0]
    end = len(scored.text) if e >= len(scored.ids) else scored.offsets[e][0]
    return start, end


def _query_span(scored: ScoredPrompt, query: str | None) -> Range | None:
    """Scorer tokens of the last occurrence of `query` in the prompt, or None."""
    if not query or not query.strip():
        return None
    query = query.strip()
    c0 = scored.text.rfind(query)
    if c0 < 0:
        log.debug("PFlash: the last user message is not in the rendered prompt; no survival check")
        return None
    c1 = c0 + len(query)
    starts = [o[0] for o in scored.offsets]
    qs = next((i for i, o in enumerate(scored.offsets) if o[1] > c0), len(starts))
    qe = next((i for i in range(qs, len(starts)) if starts[i] >= c1), len(starts))
    return (qs, qe) if qe > qs else None
