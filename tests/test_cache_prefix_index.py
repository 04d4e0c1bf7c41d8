"""Tier 0: the prefix index over the engine's real BlockPool (reference counts, free list, block 0)."""

from __future__ import annotations

import random

from lucebox.cache.prefix_index import PrefixIndex
from lucebox.engine.runtime.kv_cache import BlockPool

BS = 4


def run_sequence(pool: BlockPool, index: PrefixIndex, tokens: list[int]) -> list[int]:
    """What the engine does for one sequence: reuse the cached prefix, allocate the rest, index it, finish."""
    shared = index.lookup(tokens[:-1])
    pool.incref(shared)
    table = shared + pool.allocate(-(-len(tokens) // BS) - len(shared))
    index.insert(tokens, table)
    pool.decref(table)
    return table


def test_lookup_returns_longest_chain_of_full_blocks():
    pool = BlockPool(32)
    index = PrefixIndex(pool, BS)
    tokens = list(range(100, 122))  # 5 full blocks + 2 tokens
    table = pool.allocate(6)
    assert index.lookup(tokens) == []
    assert index.insert(tokens, table) == 5, "the partial last block is not indexed"
    assert index.lookup(tokens) == table[:5]
    assert index.lookup(tokens[:15]) == table[:3]
    assert index.lookup(tokens[:3]) == []
    changed = tokens[:9] + [7] + tokens[10:]  # differs inside block 2
    assert index.lookup(changed) == table[:2]
    assert index.lookup([1] + tokens[1:]) == []
    s = index.stats()
    assert (s.lookups, s.hits, s.misses, s.blocks_held) == (6, 3, 3, 5)


def test_index_reference_keeps_blocks_alive_after_their_sequence():
    pool = BlockPool(16)
    index = PrefixIndex(pool, BS)
    tokens = list(range(12))
    table = pool.allocate(3)
    index.insert(tokens, table)
    freed = pool.decref(table)  # the sequence finishes
    assert freed == [] and pool.num_free == 12
    assert index.lookup(tokens) == table
    assert all(pool.ref_counts[b] == 1 for b in table)


def test_shared_prefix_adds_only_new_blocks_and_duplicates_are_not_indexed():
    pool = BlockPool(32)
    index = PrefixIndex(pool, BS)
    a = list(range(16))
    table_a = run_sequence(pool, index, a)
    b = a[:8] + [50, 51, 52, 53, 54, 55, 56, 57]
    table_b = run_sequence(pool, index, b)
    assert table_b[:2] == table_a[:2], "the second sequence reuses the shared blocks"
    assert index.lookup(b) == table_b and index.lookup(a) == table_a
    assert len(index) == 6
    # A sequence that computed the same prefix into blocks of its own: the index keeps its blocks.
    own = pool.allocate(4)
    assert index.insert(a, own) == 0
    assert pool.decref(own) == own, "duplicates are not held by the index"
    assert index.lookup(a) == table_a


def test_block_zero_is_never_indexed():
    pool = BlockPool(8)
    index = PrefixIndex(pool, BS)
    table = pool.allocate(1)
    assert index.insert(list(range(8)), table + [0]) == 1
    assert 0 not in index and pool.ref_counts[0] == 1


def test_evict_is_lru_among_blocks_only_the_index_holds():
    pool = BlockPool(32)
    index = PrefixIndex(pool, BS)
    a, b = list(range(8)), list(range(100, 108))
    table_a = run_sequence(pool, index, a)
    table_b = run_sequence(pool, index, b)
    index.lookup(a)  # a is now the most recently used
    assert index.evict(1) == [table_b[1]], "the least recently used leaf goes first"
    assert index.evict(1) == [table_b[0]]
    assert index.lookup(b) == []
    # A block a running sequence holds is not evictable, and neither is its ancestor.
    pool.incref(table_a)
    assert index.num_evictable() == 0 and index.evict(5) == []
    pool.decref(table_a[:1])
    assert index.num_evictable() == 0, "block 0 of a still has a held child"
    pool.decref(table_a[1:])
    assert index.num_evictable() == 2
    assert sorted(index.evict(5)) == sorted(table_a)
    assert pool.num_free == 31 and len(index) == 0
    assert index.stats().evicted == 4


def test_clear_drops_the_index_references():
    pool = BlockPool(16)
    index = PrefixIndex(pool, BS)
    table = run_sequence(pool, index, list(range(12)))
    running = pool.allocate(1)
    pool.incref(table[:1])  # a running sequence shares the first block
    freed = index.clear()
    assert sorted(freed) == sorted(table[1:])
    assert pool.ref_counts[table[0]] == 1 and len(index) == 0
    pool.decref(table[:1] + running)
    assert pool.num_free == 15


def test_random_workload_keeps_invariants():
    """Random sequences over a small alphabet (many shared prefixes), evictions under pressure.

    Checked after every step: lookups equal a brute-force longest match over what is indexed, every
    indexed block's prefix is indexed too (no holes), and reference counts add up.
    """
    rng = random.Random(7)
    pool = BlockPool(48)
    index = PrefixIndex(pool, BS)
    stems = [[rng.randrange(3) for _ in range(rng.randrange(4, 20))] for _ in range(5)]
    for _ in range(300):
        tokens = rng.choice(stems) + [rng.randrange(3) for _ in range(rng.randrange(1, 16))]
        need = -(-len(tokens) // BS)
        if need > pool.num_free + index.num_evictable():
            continue
        if need > pool.num_free:
            freed = index.evict(need - pool.num_free)
            assert len(freed) >= 1
        run_sequence(pool, index, tokens)
        # Brute force: the indexed prefixes (as token tuples) read back through lookups of themselves.
        nodes = {}
        for block, node in index._by_block.items():
            path, n = [], node
            while n is not index._root:
                path.append(n.tokens)
                n = n.parent
            nodes[tuple(t for run in reversed(path) for t in run)] = block
        for prefix in nodes:
            assert prefix[:-BS] == () or prefix[:-BS] in nodes, "a hole in a cached chain"
        probe = rng.choice(stems) + [rng.randrange(3) for _ in range(12)]
        expect = []
        for k in range(BS, len(probe) + 1, BS):
            if tuple(probe[:k]) not in nodes:
                break
            expect.append(nodes[tuple(probe[:k])])
        assert index.lookup(probe) == expect
        assert all(pool.ref_counts[b] == 1 for b in nodes.values()), "only the index holds blocks between requests"
        assert pool.num_free + len(index) == pool.num_blocks - 1
    assert index.stats().evicted > 0, "the workload must have run the pool dry"
