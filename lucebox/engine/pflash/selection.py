"""Which chunks of a scored prompt the target gets: pure functions on a score vector and the token ids.

    token scores --smooth--> --chunk means--> chunk scores
    kept = head + tail chunks (scaled to fit n_keep - 1), then anchor chunks,
           then the best-scoring others, n_keep in all, in original order

Anchors catch what attention alone may miss: an n-gram of the prompt's last
tokens (the question) that also occurs, rarely, earlier in the prompt marks
the place the question is about (a needle, a function name), and the chunks
around each such occurrence are kept. They come out of the n_keep budget (in
priority order, see `anchor_chunks`) rather than on top of it: a question
whose words recur across the prompt must not undo the keep ratio, and the
C++ server's published 117,064 -> 5,800 tokens at keep 0.05 is exactly
n_keep chunks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lucebox.engine.pflash.config import PFlashConfig


@dataclass
class Selection:
    """The kept chunks and why each forced one was forced."""

    kept: list[int]  # chunk indices, ascending
    n_chunks: int
    n_keep: int  # the budget: len(kept) == n_keep
    head: int  # first chunks forced
    tail: int  # last chunks forced
    anchors: list[int] = field(default_factory=list)  # chunks kept as anchors (beyond head/tail), ascending
    chunk_scores: torch.Tensor | None = None


def smooth(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """1-D average pool, stride 1, same length; a window cut by an edge averages only what it covers."""
    x = scores.detach().to(torch.float64).flatten().cpu()
    n = x.numel()
    if kernel <= 1 or n == 0:
        return x.float()
    cs = torch.cat([torch.zeros(1, dtype=torch.float64), x.cumsum(0)])
    i = torch.arange(n)
    lo = (i - kernel // 2).clamp(min=0)
    hi = (i + (kernel - 1) // 2).clamp(max=n - 1) + 1
    return ((cs[hi] - cs[lo]) / (hi - lo)).float()


def chunk_means(scores: torch.Tensor, chunk: int) -> torch.Tensor:
    """Mean score of each run of `chunk` tokens (the last run may be shorter)."""
    x = scores.detach().to(torch.float64).flatten().cpu()
    n_chunks = -(-x.numel() // chunk)
    sums = torch.zeros(n_chunks, dtype=torch.float64).index_add_(0, torch.arange(x.numel()) // chunk, x)
    counts = torch.full((n_chunks,), float(chunk), dtype=torch.float64)
    if n_chunks:
        counts[-1] = x.numel() - chunk * (n_chunks - 1)
    return (sums / counts).float()


def n_keep_for(n_chunks: int, keep_ratio: float) -> int:
    return min(n_chunks, max(1, math.floor(n_chunks * keep_ratio)))


def head_tail(n_chunks: int, n_keep: int, cfg: PFlashConfig) -> tuple[int, int]:
    """Head and tail chunk counts: the configured ones, both scaled by the same factor (rounded down) when
    together they would exceed n_keep - 1, so at least one chunk is left to the scores and anchors."""
    head, tail = min(cfg.head_chunks, n_chunks), min(cfg.tail_chunks, n_chunks)
    budget = max(n_keep - 1, 0)
    if head + tail > budget:
        head, tail = head * budget // (head + tail), tail * budget // (head + tail)
    return head, tail


def anchor_chunks(ids: Sequence[int], n_chunks: int, cfg: PFlashConfig) -> list[int]:
    """Chunks near earlier occurrences of the rare n-grams of the prompt's end, most telling first.

    The n-grams are those of the last `anchor_span` tokens; an occurrence
    counts when the whole n-gram lies in [0, S - anchor_exclude]; an n-gram
    found 1..max_hits times marks the chunks within `radius` of each of its
    occurrences. Order, for when the budget cannot take them all: n-gram by
    n-gram, rarer first, then nearer the prompt's end (the question) first;
    within an n-gram ring by ring (its occurrences' own chunks, then those 1,
    2, ... chunks away, the earlier first); each chunk once.
    """
    n, S = cfg.anchor_ngram, len(ids)
    limit = S - cfg.anchor_exclude  # last token index an occurrence may cover
    if not cfg.anchors or limit < n - 1 or S < n:
        return []
    ids = list(ids)
    tail = ids[max(0, S - cfg.anchor_span):]
    grams = {tuple(tail[i:i + n]): i for i in range(len(tail) - n + 1)}  # n-gram -> its last start in the tail
    firsts = {g[0] for g in grams}
    where: dict[tuple[int, ...], list[int]] = {}
    for p in range(limit - n + 2):
        if ids[p] in firsts:
            g = tuple(ids[p:p + n])
            if g in grams:
                where.setdefault(g, []).append(p)
    radius, max_hits = cfg.anchor_params(n_chunks)
    ranked: list[tuple[int, int, int, int]] = []  # (hits, -position in the tail, ring, chunk)
    for g, positions in where.items():
        if len(positions) <= max_hits:
            for p in positions:
                c = p // cfg.chunk
                ranked += [(len(positions), -grams[g], abs(d), c + d) for d in range(-radius, radius + 1)
                           if 0 <= c + d < n_chunks]
    return list(dict.fromkeys(r[-1] for r in sorted(ranked)))


def select_chunks(token_scores: torch.Tensor, ids: Sequence[int], cfg: PFlashConfig,
                  keep_ratio: float | None = None) -> Selection:
    """Smooth, chunk, keep head/tail, then anchors, then the best scores: n_keep chunks in all."""
    S = len(ids)
    if token_scores.numel() != S:
        raise ValueError(f"{token_scores.numel()} scores for {S} tokens")
    chunk_scores = chunk_means(smooth(token_scores, cfg.pool_kernel), cfg.chunk)
    n_chunks = chunk_scores.numel()
    n_keep = n_keep_for(n_chunks, cfg.keep_ratio if keep_ratio is None else keep_ratio)
    head, tail = head_tail(n_chunks, n_keep, cfg)
    kept = set(range(head)) | set(range(n_chunks - tail, n_chunks))
    anchors = []
    for c in anchor_chunks(ids, n_chunks, cfg):
        if len(kept) >= n_keep:
            break
        if c not in kept:
            kept.add(c)
            anchors.append(c)
    if len(kept) < n_keep:
        for c in torch.argsort(chunk_scores, descending=True, stable=True).tolist():
            if c not in kept:
                kept.add(c)
                if len(kept) == n_keep:
                    break
    return Selection(sorted(kept), n_chunks, n_keep, head, tail, sorted(anchors), chunk_scores)
