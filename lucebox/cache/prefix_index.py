"""Tier 0: full KV blocks on the device, indexed by the tokens that precede and fill them.

A block's KV depends on its own tokens and on every token before it, so the
index is a tree: the node of block i hangs under the node of block i-1 and is
found by the tuple of block i's tokens (the hash chain "key_i = hash(key_i-1,
tokens_i)", with exact tuple keys, so no hash collision can ever return the
wrong KV). A path from the root is a cached prefix in whole blocks.

The index holds one reference (`BlockPool.incref`) on every block in it, so a
block outlives the sequence that computed it. A new request walks the tree
(`lookup`) and shares the blocks it finds without copying. When the pool runs
short, `evict` frees least-recently-used blocks that nothing but the index
holds, leaves first: a parent is never evicted before its children, so every
cached chain stays a prefix with no holes.

Only blocks whose KV is final go in: full blocks of committed tokens (not
draft tokens a verify step may still reject), and block 0 (the scratch block)
never.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from lucebox.engine.runtime.kv_cache import BlockPool


@dataclass(eq=False)
class _Node:
    block: int  # -1 for the root
    tokens: tuple[int, ...]
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    last_used: int = 0


@dataclass
class PrefixIndexStats:
    lookups: int = 0
    hits: int = 0  # lookups that found at least one block
    misses: int = 0
    hit_blocks: int = 0  # blocks handed out by lookups, in total
    inserted: int = 0
    evicted: int = 0
    blocks_held: int = 0


class PrefixIndex:
    """Radix tree of full KV blocks keyed by block-aligned token runs (tier 0)."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._root = _Node(-1, (), None)
        self._by_block: dict[int, _Node] = {}
        self._tick = 0
        self._stats = PrefixIndexStats()

    def __len__(self) -> int:
        return len(self._by_block)

    def __contains__(self, block: int) -> bool:
        return block in self._by_block

    def _runs(self, token_ids: Sequence[int]) -> list[tuple[int, ...]]:
        bs = self.block_size
        return [tuple(token_ids[i:i + bs]) for i in range(0, len(token_ids) - bs + 1, bs)]

    def lookup(self, token_ids: Sequence[int]) -> list[int]:
        """Blocks of the longest cached chain that is a prefix of `token_ids`, in order.

        The caller increfs the blocks it keeps. To leave the last prompt token to be
        computed (its logits are needed, and a shared block must never be written),
        pass `prompt_ids[:-1]`.
        """
        self._tick += 1
        node, blocks = self._root, []
        for run in self._runs(token_ids):
            child = node.children.get(run)
            if child is None:
                break
            child.last_used = self._tick
            blocks.append(child.block)
            node = child
        s = self._stats
        s.lookups += 1
        s.hits += bool(blocks)
        s.misses += not blocks
        s.hit_blocks += len(blocks)
        return blocks

    def insert(self, token_ids: Sequence[int], block_table: Sequence[int]) -> int:
        """Index the full blocks of a sequence; returns how many blocks were new to the index.

        `token_ids` are the tokens whose KV is computed and final, `block_table` the
        sequence's blocks. Where the index already has a block for the same prefix, it
        keeps its own and walks on (the sequence's duplicate is not indexed).
        """
        self._tick += 1
        node, added = self._root, 0
        for i, run in enumerate(self._runs(token_ids)):
            if i >= len(block_table):
                break
            child = node.children.get(run)
            if child is None:
                block = block_table[i]
                if block == 0 or block in self._by_block:
                    break  # scratch, or already indexed under another prefix: nothing safe to add below
                self.pool.incref([block])
                child = _Node(block, run, node)
                node.children[run] = child
                self._by_block[block] = child
                added += 1
            child.last_used = self._tick
            node = child
        self._stats.inserted += added
        return added

    def _evictable(self, node: _Node) -> bool:
        return not node.children and self.pool.ref_counts[node.block] == 1

    def blocks(self) -> set[int]:
        """The indexed blocks."""
        return set(self._by_block)

    def num_evictable(self) -> int:
        """Blocks repeated `evict` calls could free now: held by the index alone, and so are all their descendants."""
        free: dict[int, bool] = {}
        for node in self._post_order():
            free[node.block] = (self.pool.ref_counts[node.block] == 1
                                and all(free[c.block] for c in node.children.values()))
        return sum(free.values())

    def _post_order(self) -> list[_Node]:
        """Every node, children before their parent."""
        out, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        out.reverse()  # reversed pre-order puts every child before its parent
        return out

    def evict(self, n_blocks: int) -> list[int]:
        """Free up to `n_blocks` blocks, least recently used leaves first; returns the freed ids."""
        heap = [(n.last_used, n.block) for n in self._by_block.values() if self._evictable(n)]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < n_blocks:
            _, block = heapq.heappop(heap)
            node = self._by_block[block]
            self._remove(node)
            freed.extend(self.pool.decref([block]))
            parent = node.parent
            if parent is not self._root and self._evictable(parent):
                heapq.heappush(heap, (parent.last_used, parent.block))
        self._stats.evicted += len(freed)
        return freed

    def _remove(self, node: _Node) -> None:
        assert node.parent is not None
        del node.parent.children[node.tokens]
        del self._by_block[node.block]

    def clear(self) -> list[int]:
        """Drop every block from the index; returns the blocks that became free."""
        blocks = list(self._by_block)
        self._root.children.clear()
        self._by_block.clear()
        return self.pool.decref(blocks)

    def stats(self) -> PrefixIndexStats:
        s = self._stats
        return PrefixIndexStats(s.lookups, s.hits, s.misses, s.hit_blocks, s.inserted, s.evicted, len(self))
