"""The cache tiers on real KV: SmolLM2's own KV cache, snapshotted, restored (via RAM and via disk) and continued.

A restored prefix must give the same logits for a continuation, bit for bit, as the KV it was taken from
(same computation, same KV values, other blocks); and, as a sanity check, the same next token as prefilling
the whole prompt from scratch.
"""

from __future__ import annotations

import pytest
import torch

from lucebox.cache.disk import DiskStore
from lucebox.cache.layout import layout_id
from lucebox.cache.markers import ChatMarkers
from lucebox.cache.prefix_index import PrefixIndex
from lucebox.cache.snapshots import SnapshotPool, gather_kv, prefix_keys, scatter_kv, token_key
from lucebox.chat.template import resolve_chat_template
from lucebox.engine.runtime.kv_cache import KVCache
from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.engine.runtime.sequence import Chunk, Sequence

SYSTEM = ("You are a careful assistant for a small bakery. Answer questions about opening hours, prices and "
          "ingredients in one or two short sentences, and say so when you do not know.")
TURN1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When do you open on Sundays?"}]


@pytest.fixture(scope="module")
def engine(smollm2_path) -> LLMEngine:
    return LLMEngine.from_path(smollm2_path, EngineConfig(device="cpu", kv_tokens=4096, block_size=16), quiet=True)


@pytest.fixture(scope="module")
def chat(engine):
    tok = engine.tokenizer
    template = resolve_chat_template(gguf_template=engine.loaded.chat_template, bos_token=tok.bos_token,
                                     eos_token=tok.eos_token)
    return template, ChatMarkers.from_template(template, tok)


def render(engine, template, messages) -> list[int]:
    return engine.tokenizer.encode(template.render(messages, add_generation_prompt=True), add_special=False)


@torch.inference_mode()
def forward(engine: LLMEngine, token_ids: list[int], table: list[int], start: int) -> torch.Tensor:
    """Run token_ids[start:] on top of the KV already in `table` for [0, start); logits of those rows."""
    seq = Sequence(list(token_ids), SamplingParams())
    seq.block_table = table
    inputs = engine.runner.prepare([Chunk(seq, start, len(token_ids) - start)])
    hidden, _ = engine.loaded.model(inputs.input_ids, inputs.positions, engine.kv.data, inputs.meta)
    return engine.loaded.model.logits(hidden).float()


def fresh_table(kv: KVCache, n_tokens: int) -> list[int]:
    """Blocks for n tokens, filled with NaN so that a missing restore cannot go unnoticed."""
    table = kv.pool.allocate(kv.blocks_for(n_tokens))
    for b in table:
        kv.data[:, :, b * kv.block_size:(b + 1) * kv.block_size] = float("nan")
    return table


@pytest.fixture(scope="module")
def turn(engine, chat):
    """Turn 1 prefilled into blocks; turn 2's prompt (turn 1 + reply + a new question) and its logits
    prefilled from scratch."""
    template, _ = chat
    p1 = render(engine, template, TURN1)
    p2 = render(engine, template, TURN1 + [{"role": "assistant", "content": "We open at 9 am on Sundays."},
                                           {"role": "user", "content": "And is the rye bread vegan?"}])
    assert p2[:len(p1)] == p1
    kv = engine.kv
    scratch = kv.pool.allocate(kv.blocks_for(len(p2)))
    try:
        full = forward(engine, p2, scratch, 0)
    finally:
        kv.pool.decref(scratch)
    table = kv.pool.allocate(kv.blocks_for(len(p2)))
    forward(engine, p1, table, 0)
    yield p1, p2, table, full
    kv.pool.decref(table)


def test_gather_scatter_round_trip_is_bit_exact_and_continues_identically(engine, turn):
    kv = engine.kv
    p1, p2, table, full_p2 = turn
    n = len(p1) - 1
    snap = gather_kv(kv, table, n)
    expect = torch.stack([kv.data[:, :, kv.slot(table, p)] for p in range(n)], dim=2)
    assert torch.equal(snap, expect) and not torch.isnan(snap).any()
    original = forward(engine, p2, table, n)  # the continuation on the KV it was computed into
    other = fresh_table(kv, len(p2))
    try:
        assert not set(other) & set(table)
        scatter_kv(kv, other, snap)
        assert torch.equal(gather_kv(kv, other, n), snap)
        restored = forward(engine, p2, other, n)
    finally:
        kv.pool.decref(other)
    assert torch.equal(restored, original)
    full = full_p2[n:]
    torch.testing.assert_close(restored, full, atol=1e-3, rtol=1e-3)
    assert torch.equal(restored.argmax(-1), full.argmax(-1))


def test_exact_tier_restores_all_but_the_last_token(engine, turn, tmp_path):
    """Tier 2: KV of prompt[:-1] in RAM and on disk; the engine re-prefills the last token for its logits."""
    kv = engine.kv
    p1, _, table, _ = turn
    key = token_key(p1)
    exact = SnapshotPool(4, "exact")
    exact.put(key, p1, gather_kv(kv, table, len(p1) - 1))
    reference = forward(engine, p1, table, len(p1) - 1)
    lid = layout_id(model_path=engine.loaded.path, kv_dtype=kv.data.dtype, block_size=kv.block_size,
                    n_ctx=engine.n_ctx, template_sha1="none", num_layers=kv.data.shape[0],
                    num_kv_heads=kv.data.shape[3], head_dim=kv.data.shape[4])
    DiskStore(tmp_path, lid, 1 << 30).put(2, key, exact.get(key).tokens, exact.get(key).kv)
    from_disk = DiskStore(tmp_path, lid, 1 << 30).get(2, key)  # after a "restart"
    for source in (exact.get(key), from_disk):
        assert source.tokens.tolist() == p1 and source.kv.shape[2] == len(p1) - 1
        other = fresh_table(kv, len(p1))
        try:
            scatter_kv(kv, other, source.kv)
            assert torch.equal(forward(engine, p1, other, len(p1) - 1), reference)
        finally:
            kv.pool.decref(other)


def test_turn_boundary_snapshot_serves_the_next_turn(engine, chat, turn, tmp_path):
    """Tier 1: snapshot turn 1 before its newest user turn; turn 2 finds it by boundary and restores it,
    through RAM and through the disk store after a restart."""
    kv = engine.kv
    _, markers = chat
    p1, p2, table, full_p2 = turn
    bounds = markers.boundaries(p1)
    b = bounds[-2]  # everything before the newest user message's content
    assert engine.tokenizer.decode(p1[:b]).endswith("<|im_start|>user\n")
    prefix = SnapshotPool(8, "prefix")
    prefix.put(token_key(p1[:b]), p1[:b], gather_kv(kv, table, b))
    lid = "kv" + token_key(p1)[:24]
    DiskStore(tmp_path, lid, 1 << 30).put(1, token_key(p1[:b]), p1[:b], prefix.entries()[0].kv)

    ends = [e for e in markers.boundaries(p2) if e < len(p2)]
    keys = prefix_keys(p2, ends)
    end, snap = prefix.longest_prefix(p2, ends, keys)
    assert end == b and snap.tokens.tolist() == p2[:b]
    disk = DiskStore(tmp_path, lid, 1 << 30)
    disk_key = next(k for k in reversed(keys) if disk.contains(1, k))
    assert disk_key == keys[ends.index(b)]
    from_disk = disk.get(1, disk_key)

    full = full_p2[-1]
    results = []
    for source in (snap.kv, from_disk.kv):
        other = fresh_table(kv, len(p2))
        try:
            scatter_kv(kv, other, source)
            results.append(forward(engine, p2, other, b)[-1])
        finally:
            kv.pool.decref(other)
    assert torch.equal(results[0], results[1])
    torch.testing.assert_close(results[0], full, atol=1e-3, rtol=1e-3)
    assert results[0].argmax() == full.argmax()


def test_prefix_index_shares_blocks_across_requests(engine, chat, turn):
    """Tier 0: turn 1's blocks outlive its sequence in the index; turn 2 reuses them without a copy."""
    kv = engine.kv
    p1, p2, table, full_p2 = turn
    free_before = kv.pool.num_free
    index = PrefixIndex(kv.pool, kv.block_size)
    table1 = kv.pool.allocate(kv.blocks_for(len(p1)))  # a request that computed turn 1 (copied, to save time)
    scatter_kv(kv, table1, gather_kv(kv, table, len(p1)))
    assert index.insert(p1, table1) == len(p1) // kv.block_size
    kv.pool.decref(table1)  # turn 1 is done
    junk = fresh_table(kv, 16 * kv.block_size)  # other requests take (and scribble on) the free blocks
    kv.pool.decref(junk)

    shared = index.lookup(p2[:-1])
    common = next((i for i, (a, c) in enumerate(zip(p1, p2)) if a != c), len(p1))
    assert len(shared) == common // kv.block_size > 0 and shared == table1[:len(shared)]
    kv.pool.incref(shared)
    table2 = shared + kv.pool.allocate(kv.blocks_for(len(p2)) - len(shared))
    cached = len(shared) * kv.block_size
    try:
        reused = forward(engine, p2, table2, cached)[-1]
    finally:
        kv.pool.decref(table2)
    full = full_p2[-1]
    torch.testing.assert_close(reused, full, atol=1e-3, rtol=1e-3)
    assert reused.argmax() == full.argmax()
    assert len(index.evict(len(index))) == len(p1) // kv.block_size
    assert kv.pool.num_free == free_before
