"""Tiers 1 and 2 in RAM: keys, gather/scatter between paged blocks and snapshots, and each pool's eviction."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from lucebox.cache.snapshots import SnapshotPool, gather_kv, prefix_keys, scatter_kv, token_key
from lucebox.engine.runtime.kv_cache import BlockPool, KVCache

LAYERS, HEADS, DIM, BS = 3, 2, 8, 4


def make_cache(num_blocks: int = 16, dtype: torch.dtype = torch.float32, seed: int = 0) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    data = torch.randn(LAYERS, 2, num_blocks * BS, HEADS, DIM, generator=g).to(dtype)
    return KVCache(data, BS, BlockPool(num_blocks))


def by_position(kv: KVCache, table: list[int], n: int) -> torch.Tensor:
    """The reference: one slot at a time, through KVCache.slot."""
    return torch.stack([kv.data[:, :, kv.slot(table, p)] for p in range(n)], dim=2)


def snap(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(LAYERS, 2, n, HEADS, DIM, generator=torch.Generator().manual_seed(seed))


# ----- keys -------------------------------------------------------------------


def test_keys_are_sha1_of_little_endian_int32_ids():
    ids = [5, 70000, 0, 262143, 1]
    assert token_key(ids) == hashlib.sha1(b"".join(i.to_bytes(4, "little") for i in ids)).hexdigest()
    assert token_key(np.array(ids, dtype=np.int64)) == token_key(ids)
    ends = [0, 2, 2, 5]
    assert prefix_keys(ids, ends) == [token_key(ids[:e]) for e in ends]
    with pytest.raises(ValueError):
        prefix_keys(ids, [3, 1])


# ----- gather / scatter ----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 4, 13])
def test_gather_copies_positions_out_of_scattered_blocks(dtype, n):
    kv = make_cache(dtype=dtype)
    table = [9, 2, 14, 5]  # not in order, not contiguous
    out = gather_kv(kv, table, n)
    assert out.shape == (LAYERS, 2, n, HEADS, DIM) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, by_position(kv, table, n))
    before = out.clone()
    kv.data.zero_()
    assert torch.equal(out, before), "a snapshot is a copy, not a view of the cache"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_writes_exactly_the_asked_positions(dtype):
    kv = make_cache(dtype=dtype)
    n = 11
    src = snap(n, seed=1).to(dtype)
    table = [3, 12, 7]
    untouched = kv.data.clone()
    scatter_kv(kv, table, src)
    assert torch.equal(by_position(kv, table, n), src)
    written = set(kv.slots(table, 0, n))
    others = [s for s in range(kv.data.shape[2]) if s not in written]
    assert torch.equal(kv.data[:, :, others], untouched[:, :, others])


def test_scatter_from_start_leaves_shared_blocks_alone():
    kv = make_cache()
    shared_block, table = 6, [6, 10, 11]
    shared = kv.data[:, :, 6 * BS:7 * BS].clone()
    src = snap(10, seed=2)
    scatter_kv(kv, table, src, start=BS)
    assert torch.equal(kv.data[:, :, shared_block * BS:(shared_block + 1) * BS], shared)
    assert torch.equal(by_position(kv, table, 10)[:, :, BS:], src[:, :, BS:])
    scatter_kv(kv, table, src, start=5, end=7)  # a sub-range is fine too
    scatter_kv(kv, table, src, start=10)  # and an empty one


def test_scatter_refuses_what_does_not_fit():
    kv = make_cache()
    with pytest.raises(ValueError, match="does not fit"):
        scatter_kv(kv, [1, 2], torch.zeros(LAYERS, 2, 5, HEADS + 1, DIM))
    with pytest.raises(ValueError, match="does not fit"):
        scatter_kv(kv, [1, 2], torch.zeros(LAYERS, 2, 5, HEADS, DIM, dtype=torch.float16))
    with pytest.raises(ValueError, match="does not hold"):
        scatter_kv(kv, [1], snap(5))
    with pytest.raises(ValueError, match="outside"):
        scatter_kv(kv, [1, 2], snap(5), start=6)
    with pytest.raises(ValueError, match="does not hold"):
        gather_kv(kv, [1, 2], 9)


# ----- the pools ----------------------------------------------------------------


def put(pool: SnapshotPool, tokens: list[int], seed: int = 0):
    return pool.put(token_key(tokens), tokens, snap(len(tokens), seed))


def test_pool_keeps_a_contiguous_cpu_tensor_without_copying():
    pool = SnapshotPool(4, "prefix", pin=False)
    kv = snap(6)
    entry = pool.put(token_key(range(6)), range(6), kv)
    assert entry.kv.data_ptr() == kv.data_ptr() and entry.tokens.dtype == np.int32
    strided = snap(6)[:, :, ::2]
    entry = pool.put(token_key(range(3)), range(3), strided)
    assert entry.kv.is_contiguous() and torch.equal(entry.kv, strided)
    with pytest.raises(ValueError):
        pool.put("k", [1], torch.zeros(2, 2, 2))


def test_prefix_pool_evicts_the_oldest_entry_that_is_not_a_prefix_of_another():
    system = list(range(20))
    conv_a = system + [100, 101, 102]
    conv_b = system + [200, 201]
    pool = SnapshotPool(3, "prefix", pin=False)
    for t in (system, conv_a, conv_b):
        put(pool, t)
    put(pool, [7, 7, 7])  # full: system is the oldest, but a prefix of both conversations
    assert token_key(system) in pool and token_key(conv_a) not in pool
    assert pool.get(token_key(conv_b)) is not None  # conv_b used again: now [7,7,7] is the oldest leaf
    put(pool, [8, 8])
    assert token_key([7, 7, 7]) not in pool and token_key(conv_b) in pool
    put(pool, [9])  # conv_b is the oldest leaf now
    assert token_key(conv_b) not in pool
    put(pool, [10])  # system prefixes nothing any more: it goes as the oldest
    assert token_key(system) not in pool
    assert len(pool) == 3 and pool.stats().evicted == 4


def test_exact_pool_is_lru():
    pool = SnapshotPool(2, "exact", pin=False)
    a, b, c = [1, 2, 3], [1, 2, 3, 4], [5]
    put(pool, a)
    put(pool, b)
    assert pool.get(token_key(a)) is not None
    put(pool, c)
    assert token_key(b) not in pool and token_key(a) in pool and token_key(c) in pool
    assert pool.get(token_key(b)) is None
    s = pool.stats()
    assert (s.hits, s.misses, s.evicted, s.entries) == (1, 1, 1, 2)


def test_pool_byte_budget():
    one = snap(10).numel() * 4 + 10 * 4
    pool = SnapshotPool(10, "exact", max_bytes=2 * one + 1, pin=False)
    for i in range(4):
        put(pool, [i] * 10)
    assert len(pool) == 2 and pool.nbytes <= 2 * one + 1
    assert [e.tokens[0] for e in pool.entries()] == [2, 3]
    assert put(pool, list(range(40))) is None, "larger than the whole budget: not stored"


def test_longest_prefix_picks_the_longest_boundary_and_checks_tokens():
    pool = SnapshotPool(8, "prefix", pin=False)
    prompt = list(range(50))
    ends = [5, 20, 35, 49]
    put(pool, prompt[:5])
    put(pool, prompt[:20])
    # An entry filed under the key of prompt[:35] but holding other tokens (a forged or colliding key).
    pool.put(token_key(prompt[:35]), [0] * 35, snap(35))
    end, entry = pool.longest_prefix(prompt, ends)
    assert end == 20 and list(entry.tokens) == prompt[:20] and entry.hits == 1
    assert pool.longest_prefix(list(range(1, 50)), ends) is None
    s = pool.stats()
    assert (s.hits, s.misses) == (1, 1)
    keys = prefix_keys(prompt, ends)
    assert pool.longest_prefix(prompt, ends, keys)[0] == 20


def test_pool_kind_and_slots_are_checked():
    with pytest.raises(ValueError):
        SnapshotPool(4, "tier3")
    with pytest.raises(ValueError):
        SnapshotPool(0, "exact")
