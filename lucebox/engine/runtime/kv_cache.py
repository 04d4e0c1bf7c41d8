"""The paged KV cache: one tensor of fixed-size blocks and the pool that hands them out.

Every sequence owns a block table (list of block ids); position `p` of a
sequence lives in slot `table[p // block_size] * block_size + p % block_size`.
Blocks are reference-counted so sequences can share a cached prefix; a block
returns to the free list when its last reference is dropped. Block 0 is never
handed out: it is the scratch block that padded rows (CUDA-graph batch
padding) write into.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from lucebox.engine.models.config import ModelConfig


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


@dataclass
class KVCache:
    """KV tensors `[layers, 2, num_blocks * block_size, kv_heads, head_dim]` and their pool."""

    data: torch.Tensor
    block_size: int
    pool: BlockPool

    @classmethod
    def create(
        cls, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> KVCache:
        shape = (cfg.num_layers, 2, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), block_size, BlockPool(num_blocks))

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
        return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * torch.tensor([], dtype=dtype).element_size()

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def slot(self, block_table: list[int], pos: int) -> int:
        return block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

