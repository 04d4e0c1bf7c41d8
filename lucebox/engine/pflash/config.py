"""Every PFlash parameter in one place (defaults: the C++ server's, docs/spec/PFLASH.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lucebox.errors import LuceboxError


@dataclass
class PFlashConfig:
    """How the scorer scores a prompt and which chunks of it the target gets."""

    keep_ratio: float = 0.05  # fraction of chunks kept: n_keep = max(1, floor(n_chunks * keep_ratio))
    chunk: int = 32  # tokens per chunk, the unit of selection
    n_lookahead: int = 8  # last query rows whose attention scores every token
    pool_kernel: int = 13  # 1-D average pool over token scores (edge-truncated)
    head_chunks: int = 8  # always keep the first chunks (system prompt) ...
    tail_chunks: int = 24  # ... and the last (the question), scaled down to fit n_keep - 1
    anchor_ngram: int = 4  # n-grams of the prompt's end that pull in the chunks where they occur earlier
    anchor_span: int = 96  # the n-grams come from the last this many tokens
    anchor_exclude: int = 100  # occurrences count only within tokens [0, S - anchor_exclude]
    # (n_chunks below, radius in chunks, max occurrences): an n-gram occurring 1..max times forces the chunks
    # within radius of each occurrence; the first row whose bound exceeds n_chunks applies.
    anchor_tiers: tuple[tuple[float, int, int], ...] = ((1024, 2, 8), (2048, 4, 16), (math.inf, 8, 32))
    anchors: bool = True
    query_survival: float = 0.8  # if less of the last user message survived ...
    query_max_tokens: int = 1000  # ... and it is shorter than this, it is appended again
    # Block-sparse scorer attention (only makes the scorer cheaper; the scores still use every key).
    sparse_attention: str = "auto"  # auto: flex_attention on CUDA, dense elsewhere | flex | dense
    alpha: float = 0.12  # keep key blocks whose score is >= alpha * the row's best
    sparse_block: int = 128
    sink_blocks: int = 2
    window_blocks: int = 4
    dense_last_q_blocks: int = 2

    def validate(self) -> None:
        """Raise LuceboxError naming the first bad value."""
        if not 0.0 < self.keep_ratio <= 1.0:
            raise LuceboxError(f"PFlash keep ratio must be in (0, 1], got {self.keep_ratio}")
        for name in ("chunk", "n_lookahead", "pool_kernel", "anchor_ngram", "sparse_block"):
            if getattr(self, name) < 1:
                raise LuceboxError(f"PFlash {name} must be at least 1, got {getattr(self, name)}")
        for name in ("head_chunks", "tail_chunks", "anchor_span", "anchor_exclude", "query_max_tokens",
                     "sink_blocks", "window_blocks", "dense_last_q_blocks"):
            if getattr(self, name) < 0:
                raise LuceboxError(f"PFlash {name} must not be negative, got {getattr(self, name)}")
        if not 0.0 <= self.query_survival <= 1.0:
            raise LuceboxError(f"PFlash query survival must be in [0, 1], got {self.query_survival}")
        if not 0.0 <= self.alpha <= 1.0:
            raise LuceboxError(f"PFlash alpha must be in [0, 1], got {self.alpha}")
        if self.sparse_attention not in ("auto", "flex", "dense"):
            raise LuceboxError(f"PFlash sparse attention must be auto, flex or dense, got {self.sparse_attention!r}")
        if not self.anchor_tiers or any(len(t) != 3 or t[1] < 0 or t[2] < 1 for t in self.anchor_tiers):
            raise LuceboxError(f"PFlash anchor tiers must be (n_chunks below, radius >= 0, max_hits >= 1) rows, "
                               f"got {self.anchor_tiers}")

    def anchor_params(self, n_chunks: int) -> tuple[int, int]:
        """(radius, max_hits) for a prompt of n_chunks chunks."""
        for bound, radius, max_hits in self.anchor_tiers:
            if n_chunks < bound:
                return radius, max_hits
        _, radius, max_hits = self.anchor_tiers[-1]
        return radius, max_hits
