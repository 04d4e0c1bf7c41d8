"""The prefix cache's side of a hybrid model's recurrent state (Qwen3.5/3.6: conv + delta-rule states).

A hybrid's KV up to a position is not enough to continue from it: the linear-attention layers need their
state at that exact position, and a state cannot be derived from KV or from a state at another position.
So a cache hit is only ever at a position for which a state was kept, and the states are kept exactly
where the snapshot tiers put their KV: the turn boundary (tier 1) and the end of the prompt less its last
token (tier 2). Per-block states for the GPU index would cost a full state (~150 MB for the 27B, against
~1 MB of KV) per 16 tokens, so the GPU tier contributes the KV blocks below such a position and the
snapshot the rest of the KV and the state.

- At admission (`plan`), once the hit is known, a `StateCapture` is planned on the sequence's state slot
  for each of those positions its prefill will pass, its host tensors taken from the cache's host pool (so
  they count against the RAM budget; none free: no capture, so no snapshot there, never a wrong one).
- The prefill chunk that reaches the position copies that state into the capture (runtime/recurrent_state.py).
- When the request finishes well, the snapshot is taken as for any model and its host buffer holds the
  KV and the captured state; the state goes to disk with the KV (tensors "conv" and "ssm") and comes back
  with it after a restart. A restore writes the KV and the sequence's state slot.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from lucebox.cache.host_pool import HostBuffer, HostBufferPool
from lucebox.cache.snapshots import aligned
from lucebox.engine.runtime.recurrent_state import StateCapture
from lucebox.engine.runtime.sequence import Sequence


class StateSlots(Protocol):
    """The state slots a snapshot is captured from and restored into: RecurrentStates, or under tensor
    parallelism rank 0's view of every rank's (engine/parallel's ShardedStates, the same calls)."""

    def shapes(self) -> tuple[torch.Size, torch.Size]: ...

    def plan(self, slot: int, capture: StateCapture) -> None: ...

    def take_captures(self, slot: int) -> list[StateCapture]: ...

    def write_slot(self, slot: int, conv: torch.Tensor, ssm: torch.Tensor) -> None: ...


class StateSnapshots:
    """Captures and restores of a hybrid model's per-sequence states for the prefix cache."""

    def __init__(self, states: StateSlots, host: HostBufferPool) -> None:
        self.states = states
        self.host = host
        self.shapes = states.shapes()
        self.conv_bytes = 4 * self.shapes[0].numel()
        self.nbytes = aligned(self.conv_bytes) + 4 * self.shapes[1].numel()  # one state, as a buffer holds it

    def views(self, buffer: HostBuffer, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv, ssm) fp32 tensors over `buffer` from `offset` (16-byte aligned): `nbytes` of it."""
        return (buffer.view(tuple(self.shapes[0]), torch.float32, offset),
                buffer.view(tuple(self.shapes[1]), torch.float32, offset + aligned(self.conv_bytes)))

    def fits(self, conv: torch.Tensor | None, ssm: torch.Tensor | None) -> bool:
        """Whether a stored state has this model's shapes (a snapshot without one cannot be restored)."""
        return (conv is not None and ssm is not None and conv.dtype == ssm.dtype == torch.float32
                and conv.shape == self.shapes[0] and ssm.shape == self.shapes[1])

    def plan(self, seq: Sequence, positions: Iterable[int]) -> int:
        """Capture the state of `seq` at each position (its prefill must still pass it); returns how many
        were planned (a position the host pool has no room for is left out)."""
        planned = 0
        for pos in sorted(set(positions)):
            buffer = self.host.acquire(self.nbytes)
            if buffer is None:
                break
            conv, ssm = self.views(buffer, 0)
            self.states.plan(seq.state_slot, StateCapture(pos, conv, ssm, buffer.release))
            planned += 1
        return planned

    def take(self, seq: Sequence) -> dict[int, StateCapture]:
        """The captures of `seq` that hold their state, by position; the rest are released here. The caller
        releases the returned ones once copied (or not needed)."""
        out = {}
        for capture in self.states.take_captures(seq.state_slot):
            if capture.written:
                out[capture.position] = capture
            else:
                capture.release()
        return out

    def restore(self, seq: Sequence, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Set the state slot of `seq` to a snapshot's state (queued before the step that reads it)."""
        self.states.write_slot(seq.state_slot, conv, ssm)
