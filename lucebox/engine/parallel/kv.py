"""Rank 0 changes to the KV cache outside a forward that every rank must make too, on its own K/V heads.

- Prefix-cache snapshots (RAM and disk tiers): rank 0's cache decides what is saved and restored (it owns the
  scheduler and the index); `ShardedKV` sends the op in a plan (which blocks, which positions), then gathers
  every rank's K/V heads into one snapshot of all the model's heads (a save) or hands each rank its heads of
  one (a restore). A snapshot therefore has the layout one rank's would, and its disk layout id is the
  same at any --tensor-parallel: a disk entry written under -tp 2 restores under -tp 1 or 4 and back.
- DDTree: accepting a tree path moves the accepted rows' K/V to consecutive slots (SpecDecoder.accept).
  `LeaderSpec` keeps rank 0's moves, and the next plan carries them: the other ranks make them before
  that plan's op, which is the first thing to read those rows again.

Everything goes through the plan group in rank 0's engine-thread order, so the ops are synchronous under
tensor parallelism (no copier thread): a snapshot's copy is done when the commit that started it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lucebox.cache.snapshots import KVCopy, LocalKV, gather_kv, snapshot_shape
from lucebox.engine.parallel.group import fatal
from lucebox.engine.parallel.plan import PlanSender, encode_load, encode_save
from lucebox.engine.parallel.shard import kv_heads_of
from lucebox.engine.runtime.kv_cache import KVCache
from lucebox.engine.runtime.sequence import Chunk
from lucebox.engine.spec.dflash import SpecDecoder


class ShardedKV(LocalKV):
    """The prefix cache's snapshots on rank 0 of a group: every rank's K/V heads, in the model's head order."""

    def __init__(self, kv: KVCache, sender: PlanSender, kv_heads: int) -> None:
        super().__init__(kv)
        self.asynchronous = False  # ordered with the plans, on the engine thread
        self.sender = sender
        self.comm = sender.comm
        self.heads = kv_heads
        self.ranges = [kv_heads_of(r, self.comm.world, kv_heads) for r in range(self.comm.world)]

    @property
    def kv_heads(self) -> int:
        return self.heads

    def shape(self, n_tokens: int) -> tuple[int, ...]:
        d = self.kv.data
        return (d.shape[0], d.shape[1], n_tokens, self.heads, d.shape[4])

    def nbytes(self, n_tokens: int) -> int:
        n = 1
        for s in self.shape(n_tokens):
            n *= s
        return n * self.kv.data.element_size()

    def gather_into(self, block_table: Sequence[int], n_tokens: int, out: torch.Tensor,
                    after: torch.cuda.Event | None = None) -> KVCopy:
        """Positions [0, n_tokens) of every rank's heads into `out` (a host tensor of `shape(n_tokens)`)."""
        if tuple(out.shape) != self.shape(n_tokens) or out.dtype != self.dtype:
            raise ValueError(f"a host tensor {tuple(out.shape)} {out.dtype} cannot take the KV of {n_tokens} "
                             f"positions {self.shape(n_tokens)} {self.dtype}")
        blocks = list(block_table[:self.kv.blocks_for(n_tokens)])
        with self.sender.turn(encode_save(n_tokens, blocks)):
            try:
                parts = self.comm.gather_to_root(save_rows(self.kv, blocks, n_tokens))
                assert parts is not None
                for heads, part in zip(self.ranges, parts):
                    out[:, :, :, heads.start:heads.stop].copy_(part)
            except Exception as exc:  # noqa: BLE001 - the other ranks took part: a retry would be out of step
                fatal(f"rank 0: a snapshot's save failed after its plan was sent ({type(exc).__name__}: {exc})")
        return KVCopy(None)

    def scatter(self, block_table: Sequence[int], snapshot_kv: torch.Tensor, start: int, end: int) -> None:
        """Positions [start, end) of a snapshot of every head into the blocks, each rank its own heads."""
        n = snapshot_kv.shape[2]
        if tuple(snapshot_kv.shape) != self.shape(n) or snapshot_kv.dtype != self.dtype:
            raise ValueError(f"snapshot KV {tuple(snapshot_kv.shape)} {snapshot_kv.dtype} does not fit "
                             f"{self.shape(n)} {self.dtype}")
        if not 0 <= start <= end <= n:
            raise ValueError(f"positions [{start}, {end}) are outside a snapshot of {n} tokens")
        if start == end:
            return
        blocks = list(block_table[:self.kv.blocks_for(end)])
        with self.sender.turn(encode_load(start, end, blocks)):
            try:
                parts = [snapshot_kv[:, :, start:end, h.start:h.stop] for h in self.ranges]
                mine = self.comm.scatter_from_root(load_rows(self.kv, start, end), parts)
                write_rows(self.kv, blocks, start, end, mine)
            except Exception as exc:  # noqa: BLE001 - as in gather_into
                fatal(f"rank 0: a snapshot's restore failed after its plan was sent ({type(exc).__name__}: {exc})")


def write_rows(kv: KVCache, blocks: Sequence[int], start: int, end: int, rows: torch.Tensor) -> None:
    """Write `rows` ([layers, 2, end - start, heads, dim], host) at positions [start, end) of `blocks`."""
    slots = torch.tensor(kv.slots(list(blocks), start, end), device=kv.data.device)
    kv.data.index_copy_(2, slots, rows.to(kv.data.device))


def save_rows(kv: KVCache, blocks: Sequence[int], n_tokens: int) -> torch.Tensor:
    """This rank's heads at positions [0, n_tokens) of `blocks`, on the host (a SAVE op's part)."""
    return gather_kv(kv, blocks, n_tokens, pin=False)


def load_rows(kv: KVCache, start: int, end: int) -> torch.Tensor:
    """An empty host tensor for this rank's heads at `end - start` positions (a LOAD op's part)."""
    return torch.empty(snapshot_shape(kv, end - start), dtype=kv.data.dtype)


def move_rows(kv: KVCache, src: list[int], dst: list[int]) -> None:
    """Rank 0's DDTree moves on this rank: the K/V at slots `src` to slots `dst` (all read, then written)."""
    if src:
        dev = kv.data.device
        kv.data[:, :, torch.tensor(dst, device=dev)] = kv.data[:, :, torch.tensor(src, device=dev)]


class LeaderSpec(SpecDecoder):
    """Speculation on rank 0 of a group: as SpecDecoder, keeping the slot moves each accepted DDTree path made
    on rank 0's KV (a chain's path is in place: none) until the next plan carries them (`take_moves`).
    The sequences' verification rows lie in their own blocks, so the moves of several are disjoint."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.moves: list[tuple[int, int]] = []

    def accept(self, chunk: Chunk, logits: torch.Tensor, features: list[torch.Tensor],
               choose: Callable[[int, list[int]], int]) -> list[int]:
        path: list[int] = []

        def walked(row: int, accepted: list[int]) -> int:  # the walk asks at each row of its path, in order
            path.append(row)
            return choose(row, accepted)

        tokens = super().accept(chunk, logits, features, walked)
        table, p0 = chunk.seq.block_table, chunk.start
        moves = [(self.target_kv.slot(table, p0 + i), self.target_kv.slot(table, p0 + d))
                 for d, i in enumerate(path) if i != d]
        self.moves += moves
        return tokens

    def take_moves(self) -> list[tuple[int, int]]:
        moves, self.moves = self.moves, []
        return moves
