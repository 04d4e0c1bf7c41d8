"""The paged KV cache: one tensor of fixed-size blocks and the pool that hands them out.

Every sequence owns a block table (list of block ids); position `p` of a
sequence lives in slot `table[p // block_size] * block_size + p % block_size`.
Blocks are reference-counted so sequences can share a cached prefix; a block
returns to the free list when its last reference is dropped. Block 0 is never
handed out: it is the scratch block that padded rows (CUDA-graph batch
padding) write into.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from lucebox.engine.kernels import kv_quant
from lucebox.engine.models.config import ModelConfig
from lucebox.engine.runtime.recurrent_state import RecurrentStates


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on the CPU from calloc (numpy), whose pages the OS maps as they are first written, so a CPU server
    neither spends start-up time filling a cache it may never use nor holds memory for its empty blocks."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class OutOfBlocks(RuntimeError):
    """Raised when an allocation needs more free blocks than the pool has."""


class BlockPool:
    """Free list and reference counts of the KV blocks (no tensors here)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError("a KV pool needs at least 2 blocks (block 0 is scratch)")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.ref_counts[0] = 1  # scratch, never freed
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            assert self.ref_counts[b] > 0, f"incref of free block {b}"
            self.ref_counts[b] += 1

    def decref(self, blocks: list[int]) -> list[int]:
        """Drop one reference from each block; returns the blocks that became free."""
        freed = []
        for b in blocks:
            assert self.ref_counts[b] > 0, f"decref of free block {b}"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                freed.append(b)
        self._free.extend(freed)
        return freed


def resolve_kv_dtype(kv_dtype: str, model_dtype: torch.dtype) -> str:
    """The KV cache's storage for `--kv-dtype`: "q8_0", or the model's dtype name ("auto"; "bf16" must be it:
    the kernels read K/V in the compute dtype)."""
    if kv_dtype not in kv_quant.KV_DTYPES:
        raise ValueError(f"unknown KV dtype {kv_dtype!r} (choose from {', '.join(kv_quant.KV_DTYPES)})")
    if kv_dtype == "bf16" and model_dtype != torch.bfloat16:
        raise ValueError(f"--kv-dtype bf16 needs a bf16 model (this one computes in "
                         f"{str(model_dtype).removeprefix('torch.')}: add --dtype bf16, or use --kv-dtype q8_0)")
    return "q8_0" if kv_dtype == "q8_0" else str(model_dtype).removeprefix("torch.")


@dataclass
class KVCache:
    """KV tensors `[layers, 2, num_blocks * block_size, kv_heads, head_dim]` and their pool.

    A q8_0 cache (`kv_dtype="q8_0"`) is int8 `[..., head_dim + 2]`: each (slot, head) row's values and its
    fp16 scale (lucebox.engine.kernels.kv_quant); the drafter's context KV stays in the model dtype.
    A hybrid model keeps K/V for its attention layers only (`num_kv_layers`), and its linear layers'
    per-sequence states in `states`, whose slots the scheduler hands out with the blocks."""

    data: torch.Tensor
    block_size: int
    pool: BlockPool
    states: RecurrentStates | None = None

    @classmethod
    def create(
        cls, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str,
        kv_dtype: str = "auto", state_slots: int = 0,
    ) -> KVCache:
        """The cache, and for a hybrid model `state_slots` recurrent state slots (plus the scratch one)."""
        dim = cfg.head_dim
        if kv_dtype == "q8_0":
            dtype, dim = torch.int8, kv_quant.row_bytes(cfg.head_dim)
        shape = (cfg.num_kv_layers, 2, num_blocks * block_size, cfg.num_kv_heads, dim)
        states = RecurrentStates(cfg, state_slots, device) if cfg.is_hybrid else None
        return cls(_zeros(shape, dtype, torch.device(device)), block_size, BlockPool(num_blocks), states)

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, kv_dtype: str = "auto") -> int:
        """Device bytes of one token's K and V over every layer (q8_0: int8 values plus a 2-byte scale per head)."""
        if kv_dtype == "q8_0":
            return cfg.num_kv_layers * 2 * cfg.num_kv_heads * kv_quant.row_bytes(cfg.head_dim)
        return cfg.num_kv_layers * 2 * cfg.num_kv_heads * cfg.head_dim * torch.tensor([], dtype=dtype).element_size()

    @property
    def quantized(self) -> bool:
        return kv_quant.is_q8(self.data)

    @property
    def kv_dtype(self) -> str:
        """"q8_0" or the storage dtype's name (the prefix cache's layout id includes it)."""
        return "q8_0" if self.quantized else str(self.data.dtype).removeprefix("torch.")

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def slot(self, block_table: list[int], pos: int) -> int:
        return block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

