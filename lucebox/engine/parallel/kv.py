"""Rank 0 changes to the KV cache and to a hybrid's recurrent states outside a forward (or, for the prefix
cache's state captures, inside one) that every rank must make too, on its own K/V heads and state heads.

- Prefix-cache snapshots (RAM and disk tiers): rank 0's cache decides what is saved and restored (it owns the
  scheduler and the index); `ShardedKV` sends the op in a plan (which blocks, which positions), then gathers
  every rank's K/V heads into one snapshot of all the model's heads (a save) or hands each rank its heads of
  one (a restore). A snapshot therefore has the layout one rank's would, and its disk layout id is the
  same at any --tensor-parallel: a disk entry written under -tp 2 restores under -tp 1 or 4 and back.
- A hybrid's states in those snapshots (`ShardedStates`, the same way): the cache plans a capture of the state
  at a position; the step that reaches it names it in its plan, every rank's forward captures its own
  channels and heads there, and right after the step rank 0 gathers them into the one capture in the whole
  model's layout. A restore hands each rank its channels and heads of it (a LOAD_STATE plan).
- Speculation: accepting a DDTree path moves the accepted rows' K/V to consecutive slots, and on a hybrid the
  accepted row's state becomes the slot's (SpecDecoder.accept). `LeaderSpec` keeps rank 0's moves and
  accepts, and the next plan carries them: the other ranks make them before that plan's op, which is the
  first thing to read those rows or states again.

Everything goes through the plan group in rank 0's engine-thread order, so the ops are synchronous under
tensor parallelism (no copier thread): a snapshot's copy is done when the commit that started it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lucebox.cache.snapshots import KVCopy, LocalKV, gather_kv, snapshot_shape
from lucebox.engine.models.config import ModelConfig
from lucebox.engine.parallel.group import Comm, fatal
from lucebox.engine.parallel.plan import PlanSender, SpecChanges, encode_load, encode_load_state, encode_save
from lucebox.engine.parallel.shard import kv_heads_of, linear_heads_of
from lucebox.engine.runtime.kv_cache import KVCache
from lucebox.engine.runtime.recurrent_state import RecurrentStates, StateCapture, StateRows
from lucebox.engine.runtime.sequence import Chunk
from lucebox.engine.runtime.sequence import Sequence as Seq
from lucebox.engine.spec.dflash import SpecDecoder


class ShardedKV(LocalKV):
    """The prefix cache's snapshots on rank 0 of a group: every rank's K/V heads, in the model's head order."""

    def __init__(self, kv: KVCache, sender: PlanSender, kv_heads: int, states: ShardedStates | None) -> None:
        super().__init__(kv)
        self.asynchronous = False  # ordered with the plans, on the engine thread
        self.states = states
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


@dataclass(eq=False)
class PartCapture(StateCapture):
    """Rank 0's part of a capture of every rank's state (`whole`, the prefix cache's): rank 0's forward fills
    this one like any capture, and `ShardedStates.gather` then fills `whole` from every rank's part."""

    whole: StateCapture | None = None


class ShardedStates:
    """A hybrid's recurrent states as the prefix cache sees them on rank 0 (StateSnapshots' calls): every rank's
    channels and heads in the whole model's layout (`RecurrentStates.slot_shapes` of the unsharded config), so
    a snapshot's state is the same at any --tensor-parallel, as its K/V is."""

    def __init__(self, states: RecurrentStates, sender: PlanSender, full: ModelConfig) -> None:
        self.states = states
        self.sender = sender
        self.comm = sender.comm
        self.whole = RecurrentStates.slot_shapes(full)
        self.parts = [linear_heads_of(r, self.comm.world, full) for r in range(self.comm.world)]

    def shapes(self) -> tuple[torch.Size, torch.Size]:
        return self.whole

    def plan(self, slot: int, capture: StateCapture) -> None:
        """Keep every rank's state at `capture.position` in `capture` (whole shapes) when a step reaches it."""
        self.states.plan(slot, PartCapture(capture.position, *host_states(self.states), capture.release,
                                           whole=capture))

    def take_captures(self, slot: int) -> list[StateCapture]:
        return [_whole(c) for c in self.states.take_captures(slot)]

    def gather(self, captures: list[StateCapture]) -> None:
        """After a step that captured `captures` (rank 0's parts, in the order its plan named them): every
        rank's part of each into its whole capture."""
        convs, ssms = gather_captures(self.comm, captures)
        assert convs is not None and ssms is not None
        for k, c in enumerate(map(_whole, captures)):
            for (channels, heads), conv, ssm in zip(self.parts, convs, ssms):
                c.conv.index_copy_(1, channels, conv[k])
                c.ssm.index_copy_(1, heads, ssm[k])
            c.written = True

    def write_slot(self, slot: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Set a state slot on every rank to its channels and heads of a snapshot's state (whole shapes)."""
        with self.sender.turn(encode_load_state(slot)):
            try:
                parts = [(conv.index_select(1, channels), ssm.index_select(1, heads))
                         for channels, heads in self.parts]
                self.states.write_slot(slot, *scatter_state(self.comm, self.states, parts))
            except Exception as exc:  # noqa: BLE001 - as in ShardedKV.gather_into
                fatal(f"rank 0: a state's restore failed after its plan was sent ({type(exc).__name__}: {exc})")


def _whole(capture: StateCapture) -> StateCapture:
    assert isinstance(capture, PartCapture) and capture.whole is not None, "rank 0 plans captures by ShardedStates"
    return capture.whole


def step_captures(rows: StateRows | None) -> list[tuple[int, StateCapture]]:
    """The state captures a step makes (slot, capture), in the order every rank sends them: its prefill
    chunks' (a verification chunk captures nothing)."""
    if rows is None:
        return []
    return [(slot, c) for (_, _, _, slot), caps, tree in zip(rows.chunks, rows.captures, rows.trees)
            if tree is None for _, c in caps]


def host_states(states: RecurrentStates) -> tuple[torch.Tensor, torch.Tensor]:
    """Host tensors for one slot's conv and ssm states of `states` (pinned on CUDA, for the capture's copy)."""
    pin = states.conv.device.type == "cuda"
    conv, ssm = states.shapes()
    return torch.empty(conv, pin_memory=pin), torch.empty(ssm, pin_memory=pin)


def capture_states(states: RecurrentStates, wanted: list[tuple[int, int]]) -> list[tuple[int, StateCapture]]:
    """A follower's captures of a step's plan ((slot, position) pairs, rank 0's order), planned on its slots."""
    out = [(slot, StateCapture(position, *host_states(states), lambda: None)) for slot, position in wanted]
    for slot, capture in out:
        states.plan(slot, capture)
    return out


def send_captures(comm: Comm, states: RecurrentStates, captures: list[tuple[int, StateCapture]]) -> None:
    """A follower, after the step that filled `captures`: its parts to rank 0, then the captures off its slots."""
    gather_captures(comm, [c for _, c in captures])
    for slot, _ in captures:
        states.take_captures(slot)


def gather_captures(comm: Comm, captures: list[StateCapture]) -> tuple[list[torch.Tensor] | None,
                                                                       list[torch.Tensor] | None]:
    """Every rank's captured states of a step ([captures, ...] conv and ssm parts, in rank order) on rank 0
    (None on the others)."""
    for c in captures:
        c.wait()
    return (comm.gather_to_root(torch.stack([c.conv for c in captures])),
            comm.gather_to_root(torch.stack([c.ssm for c in captures])))


def scatter_state(comm: Comm, states: RecurrentStates,
                  parts: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (conv, ssm) of a state rank 0 restores (`parts`: every rank's, in rank order, on rank 0)."""
    conv, ssm = states.shapes()
    return (comm.scatter_from_root(torch.empty(conv), None if parts is None else [p[0] for p in parts]),
            comm.scatter_from_root(torch.empty(ssm), None if parts is None else [p[1] for p in parts]))


class LeaderSpec(SpecDecoder):
    """Speculation on rank 0 of a group: as SpecDecoder, keeping what each acceptance changed on rank 0 (the
    slot moves of an accepted DDTree path, a chain's being in place; a hybrid's accepted row) until the next
    plan carries them (`take_changes`). The sequences' verification rows lie in their own blocks and
    states, so the changes of several are disjoint."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.changes = SpecChanges()

    def accept(self, chunk: Chunk, logits: torch.Tensor, features: list[torch.Tensor],
               choose: Callable[[int, list[int]], int]) -> list[int]:
        path: list[int] = []

        def walked(row: int, accepted: list[int]) -> int:  # the walk asks at each row of its path, in order
            path.append(row)
            return choose(row, accepted)

        tokens = super().accept(chunk, logits, features, walked)
        table, p0 = chunk.seq.block_table, chunk.start
        self.changes.moves += [(self.target_kv.slot(table, p0 + i), self.target_kv.slot(table, p0 + d))
                               for d, i in enumerate(path) if i != d]
        return tokens

    def accept_state(self, seq: Seq, row: int) -> None:
        super().accept_state(seq, row)
        self.changes.accepts.append((seq.state_slot, row))

    def take_changes(self) -> SpecChanges:
        changes, self.changes = self.changes, SpecChanges()
        return changes
