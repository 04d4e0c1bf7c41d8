"""Per-sequence recurrent state of a hybrid model's linear-attention layers, next to the paged KV cache.

A Gated DeltaNet layer (models/qwen35.py) carries two states per sequence from one step to the next: the
last `conv_kernel - 1` inputs of its causal conv, and the [v_heads, k_dim, v_dim] delta-rule matrix. They
live in fixed slots of two fp32 tensors; a running sequence owns one slot (`Sequence.state_slot`), handed
out by the scheduler with its first KV blocks and given back when it is preempted or finishes, so the
slot count bounds the running set as the block count bounds its tokens. A slot is not cleared when it is
handed out: a chunk that starts at position 0 reads zeros instead of its slot. Slot 0 is never handed
out: like KV block 0 it is scratch, for rows of sequences that own none (the CUDA memory probe's).

A step's new states are kept aside (`StateRows.stage`) and written to the slots only after the whole
forward pass (`StateRows.commit`): a step that raises leaves every state as it was, so the engine can run
its chunks again one by one, as it does for the KV cache (whose writes are idempotent).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from lucebox.engine.models.config import ModelConfig


class OutOfStates(RuntimeError):
    """Raised when a sequence needs a state slot and none is free."""


class RecurrentStates:
    """conv [linear layers, 1 + slots, conv channels, kernel - 1] and ssm [linear layers, 1 + slots, v_heads,
    k_dim, v_dim], fp32, with the free list of slots 1..num_slots (slot 0 is scratch)."""

    def __init__(self, cfg: ModelConfig, num_slots: int, device: torch.device | str) -> None:
        n = cfg.layer_types.count("linear")
        conv_dim = 2 * cfg.linear_k_heads * cfg.linear_k_dim + cfg.linear_v_heads * cfg.linear_v_dim
        self.num_slots = num_slots
        self.conv = torch.zeros(n, 1 + num_slots, conv_dim, cfg.linear_conv_kernel - 1, dtype=torch.float32,
                                device=device)
        self.ssm = torch.zeros(n, 1 + num_slots, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim,
                               dtype=torch.float32, device=device)
        self._free: deque[int] = deque(range(1, 1 + num_slots))

    @staticmethod
    def bytes_per_slot(cfg: ModelConfig) -> int:
        """Device bytes of one sequence's state over every linear layer (fp32)."""
        conv_dim = 2 * cfg.linear_k_heads * cfg.linear_k_dim + cfg.linear_v_heads * cfg.linear_v_dim
        per_layer = conv_dim * (cfg.linear_conv_kernel - 1) + cfg.linear_v_heads * cfg.linear_k_dim * cfg.linear_v_dim
        return 4 * per_layer * cfg.layer_types.count("linear")

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
        assert 0 < slot <= self.num_slots and slot not in self._free, f"free of unowned state slot {slot}"
        self._free.append(slot)


@dataclass
class StateRows:
    """Which state slot each chunk of a step reads and writes: the hybrid model's per-step input.

    The step's flat rows start with `n_decode` one-row decodes (one batched recurrent update, slots
    `slots[:n_decode]`); every other chunk is (first row, rows, fresh) and runs alone, chunked, with the
    slot `slots[n_decode + i]`.
    """

    states: RecurrentStates
    n_decode: int
    slots: torch.Tensor  # [chunks] int64, on the states' device: each chunk's slot, in layout order
    chunks: list[tuple[int, int, bool]]
    _staged: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list, repr=False)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv, ssm) states of linear layer `layer` for `slots` (copies)."""
        return self.states.conv[layer, slots], self.states.ssm[layer, slots]

    def stage(self, layer: int, slots: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Keep new states of `slots` for `commit` (the forward pass may still raise)."""
        self._staged.append((layer, slots, conv, ssm))

    def commit(self) -> None:
        """Write every staged state to its slot (after the whole forward pass succeeded)."""
        for layer, slots, conv, ssm in self._staged:
            self.states.conv[layer].index_copy_(0, slots, conv.to(torch.float32))
            self.states.ssm[layer].index_copy_(0, slots, ssm)
        self._staged.clear()
