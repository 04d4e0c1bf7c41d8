"""What rank 0 tells the other ranks to do, as one compact int64 array per message: a step's forward, a
prefix-cache snapshot's copy out of or into the KV blocks, or a PFlash scorer pass, each after the K/V moves
DDTree made since the previous message.

A step carries what the other ranks need to build exactly the inputs rank 0's ModelRunner.prepare builds
(prepare is deterministic in the chunks, so the same chunks give the same rows, slots, block tables and
attention groups, a draft tree's mask included, on every rank). A snapshot op names the blocks: rank 0's
cache index decides, and every rank copies its own K/V heads at the same slots.

Layout: [n_moves, src slots (n_moves), dst slots (n_moves), op, ...], then by op:
- STEP: [n_capture, *capture layers, n_chunks] then per chunk (in rank 0's layout order)
  [start, n, flags, state_slot, n_blocks, ids (n), parents (n, if a tree), block table (n_blocks)];
  flags: 1 verification, 2 samples (wants logits), 4 has a draft tree.
- SAVE: [n_tokens, n_blocks, *blocks]: send rank 0 the KV of positions [0, n_tokens) of these blocks.
- LOAD: [start, end, n_blocks, *blocks]: take positions [start, end) from rank 0 into these blocks.
- SCORE: [n, *ids]: PFlash's scorer forward over these n token ids (the target as its own scorer); the
  PFlashConfig follows as one object on the plan group, and the ranks' tail-attention maxima meet in one
  all-gather at its end (worker.sharded_importance). It reads and writes no KV, and carries no moves: it is
  sent from the scorer's thread, and the moves wait for the engine thread's next message.

Rank 0 sends a message and runs the collectives it starts under one lock (`PlanSender.turn`): the engine
thread's steps and snapshot copies and a PFlash worker thread's scorer passes take turns, so every rank meets
them in the order it received them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from lucebox.engine.parallel.group import Comm
from lucebox.engine.runtime.sequence import Chunk
from lucebox.errors import LuceboxError

VERIFY, SAMPLES, TREE = 1, 2, 4
STEP, SAVE, LOAD, SCORE = 0, 1, 2, 3


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


@dataclass
class Plan:
    """One decoded message: the K/V moves to make first, then the op and its arguments."""

    op: int
    moves: tuple[list[int], list[int]] = ([], [])  # (source slots, destination slots)
    chunks: list[Chunk] = field(default_factory=list)  # STEP
    capture: tuple[int, ...] = ()  # STEP
    start: int = 0  # SAVE (always 0) and LOAD: positions [start, end) of `blocks`
    end: int = 0
    blocks: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # SCORE


def encode_step(chunks: list[Chunk], capture: tuple[int, ...], block_size: int) -> list[int]:
    """The op of a step over `chunks` (rank 0)."""
    words: list[int] = [STEP, len(capture), *capture, len(chunks)]
    for c in chunks:
        tree = c.parents is not None
        flags = (VERIFY if c.verify else 0) | (SAMPLES if c.wants_logits else 0) | (TREE if tree else 0)
        blocks = list(c.seq.block_table[: -(-(c.start + c.n) // block_size)])
        words += [c.start, c.n, flags, c.seq.state_slot, len(blocks), *c.input_ids()]
        if tree:
            words += list(c.parents)  # type: ignore[arg-type]
        words += blocks
    return words


def encode_save(n_tokens: int, blocks: list[int]) -> list[int]:
    return [SAVE, n_tokens, len(blocks), *blocks]


def encode_load(start: int, end: int, blocks: list[int]) -> list[int]:
    return [LOAD, start, end, len(blocks), *blocks]


def encode_score(ids: list[int]) -> list[int]:
    return [SCORE, len(ids), *ids]


def with_moves(moves: list[tuple[int, int]], op: list[int]) -> np.ndarray:
    """The message of `op`, after the K/V moves (source slot, destination slot) the other ranks must make."""
    return np.asarray([len(moves), *(a for a, _ in moves), *(b for _, b in moves), *op], dtype=np.int64)


def decode_plan(plan: np.ndarray) -> Plan:
    """A message of rank 0's (the other ranks)."""
    w = plan.tolist()
    n_moves = w[0]
    moves = (w[1:1 + n_moves], w[1 + n_moves:1 + 2 * n_moves])
    at = 1 + 2 * n_moves
    op = w[at]
    at += 1
    if op == SAVE:
        n, nb = w[at:at + 2]
        return Plan(op, moves, end=n, blocks=w[at + 2:at + 2 + nb])
    if op == LOAD:
        start, end, nb = w[at:at + 3]
        return Plan(op, moves, start=start, end=end, blocks=w[at + 3:at + 3 + nb])
    if op == SCORE:
        return Plan(op, moves, ids=w[at + 1:at + 1 + w[at]])
    n_cap = w[at]
    capture = tuple(w[at + 1:at + 1 + n_cap])
    at += 1 + n_cap
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
    return Plan(op, moves, chunks=chunks, capture=capture)


class PlanSender:
    """Rank 0's end of the plans: each message first carries the K/V moves made on rank 0 since the last one
    (`moves()`: DDTree's accepted paths), so every rank's KV is the same before the next op reads it."""

    def __init__(self, comm: Comm, moves: Callable[[], list[tuple[int, int]]]) -> None:
        self.comm = comm
        self.moves = moves
        self.closed = False
        self.lock = threading.Lock()

    @contextmanager
    def turn(self, op: list[int], moves: bool = True) -> Iterator[None]:
        """Send `op`, then hold the group while the caller runs the collectives it starts (module docstring);
        `moves=False`: leave DDTree's moves to the engine thread's next message."""
        with self.lock:
            if self.closed:
                raise LuceboxError("this tensor-parallel engine was closed (another one was loaded)")
            self.comm.send_plan(with_moves(self.moves() if moves else [], op))
            yield
