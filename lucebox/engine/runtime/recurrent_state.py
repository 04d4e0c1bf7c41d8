"""Per-sequence recurrent state of a hybrid model's linear-attention layers, next to the paged KV cache.

A Gated DeltaNet layer (models/qwen35.py) carries two states per sequence from one step to the next: the
last `conv_kernel - 1` inputs of its causal conv, and the [v_heads, k_dim, v_dim] delta-rule matrix. They
live in fixed slots of two fp32 tensors; a running sequence owns one slot (`Sequence.state_slot`), handed
out by the scheduler at admission (before the prefix cache attaches: a hit restores a state into it) and
given back when it is preempted or finishes, so the slot count (the memory plan's, memory_plan.state_slots)
bounds the running set as the block count bounds its tokens. A slot is not cleared when it is
handed out: a chunk that starts at position 0 reads zeros instead of its slot. Slot 0 is never handed
out: like KV block 0 it is scratch, for rows of sequences that own none (the CUDA memory probe's).
Under tensor parallelism each rank's slots hold its share of the channels and heads (engine/parallel/shard.py)
at the slot numbers rank 0 hands out, and rank 0's plans make every change to them on the other ranks too.

A step's new states are kept aside (`StateRows.stage`) and written to the slots only after the whole
forward pass (`StateRows.commit`): a step that raises leaves every state as it was, so the engine can run
its chunks again one by one, as it does for the KV cache (whose writes are idempotent). One exception: in a
CUDA graph replay of a decode step (runtime/cuda_graphs.py), which cannot stop half-way, the decode kernels
write the slots in place (`StateRows.in_place`), saving the staging buffers and a copy of every state.

The prefix cache needs a sequence's state at a few positions its prompt passes through (a turn boundary,
the end of the prompt): it plans a `StateCapture` per position on the sequence's slot (`plan`), the
prefill chunk that reaches the position splits its delta rule there and the commit copies that state into
the capture's host tensors (asynchronously on CUDA, ordered after the forward pass). No device memory is
held for it beyond the step.

A speculative verification (engine/spec) runs the draft's rows from the slot's state, each row (a tree node)
from its parent's state, and keeps every row's state (`verified`: rows x one slot's bytes per verifying
sequence, the verification's state budget) until `accept` writes the state of the last accepted row to the
slot: a rejected suffix leaves no trace. A verification replayed as a CUDA graph (spec/static.py) keeps them
in fixed buffers instead (`StateRows.kept`) and its graph writes the accepted row's state to the slot.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lucebox.engine.models.config import ModelConfig


class OutOfStates(RuntimeError):
    """Raised when a sequence needs a state slot and none is free."""


@dataclass(eq=False)
class StateCapture:
    """The state a sequence has at `position` (after its first `position` tokens), to be copied into `conv`
    [linear layers, conv channels, kernel - 1] and `ssm` [linear layers, v_heads, k_dim, v_dim] (host
    tensors, pinned on CUDA) by the step that reaches it. `release` gives their memory back to the planner."""

    position: int
    conv: torch.Tensor
    ssm: torch.Tensor
    release: Callable[[], None]
    written: bool = False
    event: torch.cuda.Event | None = None  # recorded after the copies (CUDA)

    def wait(self) -> None:
        """Block until the host tensors hold the state (a no-op on the CPU)."""
        if self.event is not None:
            self.event.synchronize()


class RecurrentStates:
    """conv [linear layers, 1 + slots, conv channels, kernel - 1] and ssm [linear layers, 1 + slots, v_heads,
    k_dim, v_dim], fp32, with the free list of slots 1..num_slots (slot 0 is scratch)."""

    def __init__(self, cfg: ModelConfig, num_slots: int, device: torch.device | str) -> None:
        conv, ssm = self.slot_shapes(cfg)
        self.num_slots = num_slots
        self.conv = torch.zeros(conv[0], 1 + num_slots, *conv[1:], dtype=torch.float32, device=device)
        self.ssm = torch.zeros(ssm[0], 1 + num_slots, *ssm[1:], dtype=torch.float32, device=device)
        self._free: deque[int] = deque(range(1, 1 + num_slots))
        self.captures: dict[int, list[StateCapture]] = {}  # slot -> planned captures (the prefix cache's)
        # slot -> per linear layer (conv [rows, C, K-1], ssm [rows, Hv, Dk, Dv]) of its last verification's rows
        self.verified: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    @staticmethod
    def slot_shapes(cfg: ModelConfig) -> tuple[torch.Size, torch.Size]:
        """Shapes of one slot's conv [linear layers, channels, kernel - 1] and ssm [linear layers, v_heads, k_dim,
        v_dim] states of a model of `cfg` (under tensor parallelism: a rank's config gives its share)."""
        n = cfg.layer_types.count("linear")
        conv_dim = 2 * cfg.linear_k_heads * cfg.linear_k_dim + cfg.linear_v_heads * cfg.linear_v_dim
        return (torch.Size((n, conv_dim, cfg.linear_conv_kernel - 1)),
                torch.Size((n, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim)))

    def shapes(self) -> tuple[torch.Size, torch.Size]:
        """Shapes of one slot's conv and ssm states over every linear layer (what a capture or snapshot holds)."""
        return self.conv[:, 0].shape, self.ssm[:, 0].shape

    @staticmethod
    def bytes_per_slot(cfg: ModelConfig) -> int:
        """Device bytes of one sequence's state over every linear layer (fp32)."""
        return 4 * sum(shape.numel() for shape in RecurrentStates.slot_shapes(cfg))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * 4 + self.ssm.numel() * 4

    def allocate(self) -> int:
        if not self._free:
            raise OutOfStates(f"all {self.num_slots} recurrent state slots are in use")
        return self._free.popleft()

    def free(self, slot: int) -> None:
        """Give a slot back; captures still planned on it are dropped (their memory released)."""
        assert 0 < slot <= self.num_slots and slot not in self._free, f"free of unowned state slot {slot}"
        for capture in self.take_captures(slot):
            capture.release()
        self.verified.pop(slot, None)
        self._free.append(slot)

    def accept(self, slot: int, row: int) -> None:
        """After a verification: the slot's state becomes the one after verified row `row` (the last accepted
        one); the other rows' states are dropped."""
        for layer, (conv, ssm) in enumerate(self.verified.pop(slot)):
            self.conv[layer, slot] = conv[row]
            self.ssm[layer, slot] = ssm[row]

    def plan(self, slot: int, capture: StateCapture) -> None:
        """Keep the state of the sequence in `slot` at `capture.position` when a prefill chunk reaches it."""
        self.captures.setdefault(slot, []).append(capture)

    def take_captures(self, slot: int) -> list[StateCapture]:
        """The captures planned on `slot` (written or not), now the caller's to release."""
        return self.captures.pop(slot, [])

    def read_slot(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one slot's conv and ssm states over every linear layer."""
        return self.conv[:, slot], self.ssm[:, slot]

    def snapshot(self, slots: list[int]) -> Callable[[], None]:
        """Copies of `slots`' states as they are now, and the function that writes them back: a step that may be
        run again (Spark's guarded decode, replayed or redone after a miss) must not advance them twice."""
        index = torch.tensor(slots, device=self.conv.device)
        conv, ssm = self.conv[:, index], self.ssm[:, index]  # advanced indexing: copies

        def restore() -> None:
            self.conv[:, index] = conv
            self.ssm[:, index] = ssm
        return restore

    def write_slot(self, slot: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Set one slot's states (a prefix-cache restore; from pinned memory the copy is asynchronous)."""
        self.conv[:, slot].copy_(conv, non_blocking=conv.is_pinned())
        self.ssm[:, slot].copy_(ssm, non_blocking=ssm.is_pinned())


@dataclass
class StateRows:
    """Which state slot each chunk of a step reads and writes: the hybrid model's per-step input.

    The step's flat rows start with `n_decode` one-row decodes (one batched recurrent update, slots
    `slots[:n_decode]`); every other chunk is (first row, rows, start position, slot) and runs alone,
    chunked, with the slot `slots[n_decode + i]`. `captures[i]`: (offset in the chunk, capture) for the
    captures planned on that chunk's slot at a position the chunk reaches (0 <= offset <= rows).
    `trees[i]`: a verification chunk's row parents (-1: the slot's state; a chain is a tree too), None for
    a prefill chunk; its rows' states are kept for `RecurrentStates.accept` instead of written.
    `in_place`: the decode rows' kernels (kernels/triton_deltanet.py) may write the new states into the slots
    as they go, for a forward pass that cannot raise half-way (a CUDA graph replay); otherwise they are
    staged like every other new state.
    `fixed`, `kept` (spec/static.py's verification graphs, every chunk a verification of the same rows): each
    chunk's conv windows [chunks, rows, kernel] and parent states [chunks, rows] (int32, `tree_parents`'
    form) in device buffers filled before the replay, and every row's states kept in conv [linear layers,
    chunks, rows, C, K-1] and ssm [linear layers, chunks, 1 + rows, Hv, Dk, Dv] (index 0: the slot's state)
    instead of `RecurrentStates.verified`.
    """

    states: RecurrentStates
    n_decode: int
    slots: torch.Tensor  # [chunks] int64, on the states' device: each chunk's slot, in layout order
    chunks: list[tuple[int, int, int, int]]
    captures: list[list[tuple[int, StateCapture]]] = field(default_factory=list)
    trees: list[list[int] | None] = field(default_factory=list)
    in_place: bool = False
    fixed: tuple[torch.Tensor, torch.Tensor] | None = None
    kept: tuple[torch.Tensor, torch.Tensor] | None = None
    _staged: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list, repr=False)
    _captured: list[tuple[int, StateCapture, torch.Tensor, torch.Tensor]] = field(default_factory=list, repr=False)
    _verified: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict, repr=False)
    _windows: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _levels: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict, repr=False)
    _parents: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _rows: torch.Tensor | None = field(default=None, repr=False)  # arange(n_decode): the staged buffers' rows

    def __post_init__(self) -> None:
        planned = self.states.captures
        self.captures = [sorted(((c.position - start, c) for c in planned.get(slot, ())
                                 if not c.written and start <= c.position <= start + n), key=lambda x: x[0])
                         for _, n, start, slot in self.chunks]
        self.trees = self.trees or [None] * len(self.chunks)

    def tree_window(self, i: int, kernel: int) -> torch.Tensor:
        """Verification chunk `i`'s conv window of each row [rows, kernel] as the DeltaNet layers read it: columns
        of [slot conv state (kernel - 1) | the chunk's rows], the row's ancestors and then the slot's inputs.
        Built once a step."""
        if self.fixed is not None:
            return self.fixed[0][i]
        if i not in self._windows:
            self._windows[i] = torch.tensor(conv_windows(self._tree(i)[0], kernel), device=self.slots.device)
        return self._windows[i]

    def tree_levels(self, i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Verification chunk `i`'s depths, shallowest first, as (rows, their parents) with states indexed 0 = the
        slot's, 1 + r = after row r: the torch recurrence's batches. Built once a step."""
        if i not in self._levels:
            parents, depth = self._tree(i)
            levels: dict[int, tuple[list[int], list[int]]] = {}
            for r, p in enumerate(parents):
                levels.setdefault(depth[r], ([], []))
                levels[depth[r]][0].append(r)
                levels[depth[r]][1].append(p + 1)
            dev = self.slots.device
            self._levels[i] = [(torch.tensor(rows, device=dev), torch.tensor(ps, device=dev))
                               for _, (rows, ps) in sorted(levels.items())]
        return self._levels[i]

    def tree_parents(self, i: int) -> torch.Tensor:
        """Verification chunk `i`'s parent states, int32 [rows] (0 = the slot's, 1 + p = after row p), for
        kernels/triton_deltanet.py's `tree_step`. Built once a step."""
        if self.fixed is not None:
            return self.fixed[1][i]
        if i not in self._parents:
            parents, _ = self._tree(i)
            self._parents[i] = torch.tensor([p + 1 for p in parents], dtype=torch.int32, device=self.slots.device)
        return self._parents[i]

    def _tree(self, i: int) -> tuple[list[int], list[int]]:
        """Chunk `i`'s row parents (a parent before its child) and the rows' depths."""
        parents = self.trees[i]
        assert parents is not None
        return parents, depths(parents)

    def verify_states(self, layer: int, i: int, rows: int) -> torch.Tensor:
        """Where verification chunk `i` of linear layer `layer` keeps its states [1 + rows, Hv, Dk, Dv]: index 0
        the slot's, 1 + r after row r (a `kept` buffer's, or new)."""
        if self.kept is not None:
            return self.kept[1][layer, i]
        ssm = self.states.ssm
        return torch.empty(rows + 1, *ssm.shape[2:], dtype=torch.float32, device=ssm.device)

    def stage_verified(self, layer: int, i: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Keep the states after every row of verification chunk `i` (conv [rows, C, K-1]; ssm from
        `verify_states`) for the acceptance."""
        if self.kept is not None:
            self.kept[0][layer, i].copy_(conv)
            return
        self._verified.setdefault(self.chunks[i][3], []).append((conv, ssm[1:]))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv, ssm) states of linear layer `layer` for `slots` (copies)."""
        return self.states.conv[layer, slots], self.states.ssm[layer, slots]

    def stage(self, layer: int, slots: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Keep new states of `slots` for `commit` (the forward pass may still raise)."""
        self._staged.append((layer, slots, conv, ssm))

    def decode_targets(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where the decode rows' new states of linear layer `layer` go: (conv, ssm, slots) with row b's states
        at slot slots[b] of conv [.., C, K-1] and ssm [.., Hv, Dk, Dv]: the rows' own slots when `in_place`,
        else buffers staged for `commit`."""
        nd, states = self.n_decode, self.states
        if self.in_place:
            return states.conv[layer], states.ssm[layer], self.slots[:nd]
        conv = torch.empty(nd, *states.conv.shape[2:], dtype=torch.float32, device=states.conv.device)
        ssm = torch.empty(nd, *states.ssm.shape[2:], dtype=torch.float32, device=states.ssm.device)
        self.stage(layer, self.slots[:nd], conv, ssm)
        if self._rows is None:
            self._rows = torch.arange(nd, device=self.slots.device)
        return conv, ssm, self._rows

    def capture(self, layer: int, capture: StateCapture, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Keep one layer's state at `capture.position` ([channels, kernel - 1], [v_heads, k_dim, v_dim])."""
        self._captured.append((layer, capture, conv, ssm))

    def commit(self) -> None:
        """Write every staged state to its slot and every captured one to its host tensors (after the whole
        forward pass succeeded)."""
        for layer, slots, conv, ssm in self._staged:
            self.states.conv[layer].index_copy_(0, slots, conv.to(torch.float32))
            self.states.ssm[layer].index_copy_(0, slots, ssm)
        done: dict[int, StateCapture] = {}
        for layer, capture, conv, ssm in self._captured:
            capture.conv[layer].copy_(conv, non_blocking=True)
            capture.ssm[layer].copy_(ssm, non_blocking=True)
            done[id(capture)] = capture
        for capture in done.values():
            if self.states.conv.device.type == "cuda":
                capture.event = torch.cuda.Event()
                capture.event.record()
            capture.written = True
        self.states.verified.update(self._verified)
        self._staged.clear()
        self._captured.clear()
        self._verified.clear()


def depths(parents: list[int]) -> list[int]:
    """Each row's depth in a verification tree given by its row parents (-1: the root's children)."""
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def conv_windows(parents: list[int], kernel: int) -> list[list[int]]:
    """Each verification row's conv window [rows][kernel] as columns of [slot conv state (kernel - 1) | the
    chunk's rows]: the row's ancestors back from itself, then the slot's last inputs."""
    depth, window = depths(parents), []
    for r in range(len(parents)):
        cols, a = [], r
        for m in range(kernel):  # the input m positions back: an ancestor row, else the slot's conv
            cols.append(kernel - 1 + a if a >= 0 else kernel - 1 + depth[r] - m)
            a = parents[a] if a >= 0 else -1
        window.append(cols[::-1])
    return window
