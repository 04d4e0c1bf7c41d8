"""One step's plan as a compact int64 array: what the other ranks need to build exactly the inputs rank 0's
ModelRunner.prepare builds (ModelRunner.prepare is deterministic in the chunks, so the same chunks give the
same rows, slots, block tables and attention groups on every rank).

Layout: [n_capture, *capture layers, n_chunks] then per chunk (in rank 0's layout order)
[start, n, flags, state_slot, n_blocks, ids (n), parents (n, if a tree), block table (n_blocks)];
flags: 1 verification, 2 samples (wants logits), 4 has a draft tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lucebox.engine.runtime.sequence import Chunk

VERIFY, SAMPLES, TREE = 1, 2, 4


@dataclass
class PlanSeq:
    """The parts of a Sequence that ModelRunner.prepare reads."""

    block_table: list[int]
    state_slot: int = 0


@dataclass
class PlannedChunk(Chunk):
    """A Chunk rebuilt from a plan: its rows' ids and whether it samples come with it (no token history)."""

    ids: list[int] = field(default_factory=list)
    samples: bool = False

    @property
    def wants_logits(self) -> bool:
        return self.verify or self.samples

    def input_ids(self) -> list[int]:
        return self.ids


def encode_plan(chunks: list[Chunk], capture: tuple[int, ...], block_size: int) -> np.ndarray:
    """The plan of a step over `chunks` (rank 0)."""
    words: list[int] = [len(capture), *capture, len(chunks)]
    for c in chunks:
        tree = c.parents is not None
        flags = (VERIFY if c.verify else 0) | (SAMPLES if c.wants_logits else 0) | (TREE if tree else 0)
        blocks = list(c.seq.block_table[: -(-(c.start + c.n) // block_size)])
        words += [c.start, c.n, flags, c.seq.state_slot, len(blocks), *c.input_ids()]
        if tree:
            words += list(c.parents)  # type: ignore[arg-type]
        words += blocks
    return np.asarray(words, dtype=np.int64)


def decode_plan(plan: np.ndarray) -> tuple[list[Chunk], tuple[int, ...]]:
    """The chunks and captured layers of a plan (the other ranks)."""
    w = plan.tolist()
    n_cap = w[0]
    capture = tuple(w[1:1 + n_cap])
    at = 1 + n_cap
    n_chunks = w[at]
    at += 1
    chunks: list[Chunk] = []
    for _ in range(n_chunks):
        start, n, flags, slot, nb = w[at:at + 5]
        at += 5
        ids = w[at:at + n]
        at += n
        parents = None
        if flags & TREE:
            parents = w[at:at + n]
            at += n
        blocks = w[at:at + nb]
        at += nb
        seq = PlanSeq(blocks, slot)
        chunks.append(PlannedChunk(seq, start, n, ids if flags & VERIFY else None, parents,  # type: ignore[arg-type]
                                   ids=ids, samples=bool(flags & SAMPLES)))
    return chunks, capture
