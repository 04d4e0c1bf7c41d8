"""The prefix cache on the Qwen3.5 hybrid (`qwen35`, `qwen35moe`): a hit restores KV and the recurrent state.

A hit is only ever at a position a state was captured at (cache/state_snapshots.py): the turn boundary of
tier 1, the end of the prompt less its last token of tier 2. Each hit is checked against an engine without
the cache, fp32 on the CPU: the same greedy tokens, and the same top-5 logprobs at every step (within
1e-4), over two and three turns, with the GPU tier on (its blocks shared below the restored position) and
off (everything from the RAM snapshot), after a restart from the disk tier, and through the live server.
Prefills run in 16-token chunks, so the captured positions fall inside chunks and the delta rule splits there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lucebox.cache.manager import CacheConfig
from lucebox.chat.template import resolve_chat_template
from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.engine.runtime.sequence import Chunk, Sequence
from tests.fixtures.tiny_models import write_tiny_qwen35_gguf

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SYSTEM = ("You are a careful assistant for a small bakery. Answer questions about opening hours, prices and "
          "ingredients in one or two short sentences, and say so when you do not know.")
TURN1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When do you open on Sundays?"}]
TURN2 = TURN1 + [{"role": "assistant", "content": "We open at 9 am on Sundays."},
                 {"role": "user", "content": "And is the rye bread vegan?"}]
TURN3 = TURN2 + [{"role": "assistant", "content": "Yes, it is."}, {"role": "user", "content": "Thanks!"}]
OTHER = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Do you bake gluten-free cakes?"}]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen35_cache")
    return {"qwen35": write_tiny_qwen35_gguf(root / "dense.gguf"),
            "qwen35moe": write_tiny_qwen35_gguf(root / "moe.gguf", moe=True)}


def engine(path: Path, cache: CacheConfig | None = None) -> LLMEngine:
    e = LLMEngine.from_path(path, EngineConfig(device="cpu", dtype="float32", max_step_tokens=16, kv_tokens=2048),
                            quiet=True)
    if cache is not None:
        tok = e.tokenizer
        e.enable_prefix_cache(cache, resolve_chat_template(gguf_template=e.loaded.chat_template,
                                                           bos_token=tok.bos_token, eos_token=tok.eos_token))
    return e


def render(e: LLMEngine, messages: list[dict]) -> list[int]:
    tok = e.tokenizer
    template = resolve_chat_template(gguf_template=e.loaded.chat_template, bos_token=tok.bos_token,
                                     eos_token=tok.eos_token)
    return tok.encode(template.render(messages, add_generation_prompt=True), add_special=False)


def run(e: LLMEngine, ids: list[int], n: int = 6) -> Sequence:
    """One greedy request (top-5 logprobs at each token) to completion; the cache's snapshots published."""
    seq = e.new_sequence(ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=5))
    if e.cache is not None:
        seq.cache_hint = e.cache.prepare(ids)
    e.scheduler.add(seq)
    while not seq.is_finished:
        e.step()
    if e.cache is not None:
        e.cache.poll()
    return seq


def assert_same(got: Sequence, want: Sequence) -> None:
    """Greedy tokens equal, and the top-5 logprobs of every step within 1e-4."""
    assert got.output_ids == want.output_ids
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        torch.testing.assert_close(torch.tensor([lp for _, lp in a.top]), torch.tensor([lp for _, lp in b.top]),
                                   rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def plain(files) -> dict[str, LLMEngine]:
    return {arch: engine(path) for arch, path in files.items()}


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu+ram", "ram"])
@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_hits_equal_no_cache(files, plain, arch: str, gpu: bool) -> None:
    """The same prompt again hits tier 2 at its last token; the next turns hit tier 1 at the previous prompt's
    last turn boundary; a prompt with another last turn hits the shared system prefix. Each continues as the
    engine without a cache does, and no state slot or block is left behind."""
    e, ref = engine(files[arch], CacheConfig(gpu=gpu, min_tokens=16)), plain[arch]
    t1, t2, t3, other = (render(e, m) for m in (TURN1, TURN2, TURN3, OTHER))
    b1, b2 = (e.cache.markers.boundaries(t)[-2] for t in (t1, t2))  # the turn-1 and turn-2 snapshots' ends
    cold = run(e, t1)
    assert cold.num_cached == 0
    assert_same(cold, run(ref, t1))
    for ids, cached in ((t1, len(t1) - 1), (t2, b1), (t3, b2), (other, b1)):
        seq = run(e, ids)
        assert seq.num_cached == cached
        assert_same(seq, run(ref, ids))
    stats = e.cache.stats()
    assert stats["exact"]["hits"] == 1 and stats["prefix"]["hits"] == 3
    assert (stats["gpu"]["restored_tokens"] > 0) == gpu  # tier 0 shared its blocks below the restored position
    assert e.kv.states.num_free == e.kv.states.num_slots and not e.kv.states.captures
    e.cache.clear()
    assert e.kv.pool.num_used == 0


def test_no_state_no_hit(files, plain) -> None:
    """GPU blocks alone hold no recurrent state: a prompt that shares blocks with a finished one but no
    snapshot position (tiers 1 and 2 off) is computed from position 0. A snapshot evicted from RAM falls back
    to the shorter one that is still there."""
    e, ref = engine(files["qwen35"], CacheConfig(gpu=True, prefix_slots=0, exact_slots=0)), plain["qwen35"]
    t1 = render(e, TURN1)
    run(e, t1)
    assert len(e.cache.index) > 0
    seq = run(e, t1[:-3] + [5, 6, 7])
    assert seq.num_cached == 0
    assert_same(seq, run(ref, t1[:-3] + [5, 6, 7]))

    one = engine(files["qwen35"], CacheConfig(gpu=True, min_tokens=16, prefix_slots=2, exact_slots=1))
    t1, t2, t3 = (render(one, m) for m in (TURN1, TURN2, TURN3))
    for ids in (t1, t2):
        run(one, ids)
    with one.cache._lock:  # the turn-2 snapshot goes; the turn-1 one (the system prefix) stays
        one.cache.prefix.remove(one.cache.prepare(t3).keys[one.cache.markers.boundaries(t2)[-2]])
    seq = run(one, t3)
    assert seq.num_cached == one.cache.markers.boundaries(t1)[-2]
    assert_same(seq, run(ref, t3))


def test_restart_from_disk(files, plain, tmp_path) -> None:
    """Snapshots written to the disk tier carry the state ("conv", "ssm" in the file); a new engine on the same
    folder hits them at the same positions and continues as the engine without a cache does."""
    from lucebox.cache.disk import DiskStore

    cfg = CacheConfig(gpu=True, min_tokens=16, disk_dir=tmp_path, disk_min_tokens=16)
    first = engine(files["qwen35"], cfg)
    t1, t2 = render(first, TURN1), render(first, TURN2)
    run(first, t1)
    first.cache.disk.flush()
    store = first.cache.disk
    assert len(store.entries()) == 2
    for entry in store.entries():
        snap = store.get(entry.tier, entry.key)
        assert snap is not None and snap.state is not None
        assert snap.conv.shape == first.kv.states.shapes()[0] and snap.ssm.shape == first.kv.states.shapes()[1]
    store.close()
    del first
    second = engine(files["qwen35"], cfg)
    assert isinstance(second.cache.disk, DiskStore) and len(second.cache.disk.entries()) == 2
    ref = plain["qwen35"]
    for ids, cached in ((t1, len(t1) - 1), (t2, second.cache.markers.boundaries(t1)[-2])):
        seq = run(second, ids)
        assert seq.num_cached == cached
        assert_same(seq, run(ref, ids))
    second.cache.disk.close()


def test_captured_state_is_the_prefill_state(files) -> None:
    """The state kept at a position inside a prefill chunk is the state a prefill that ends there leaves in
    its slot (up to the rounding of other chunk shapes: the later layers' inputs differ by it)."""
    e = engine(files["qwen35"], CacheConfig(gpu=False, min_tokens=16))
    t1 = render(e, TURN1)
    seq = e.new_sequence(t1, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    seq.cache_hint = e.cache.prepare(t1)
    e.scheduler.add(seq)
    e.step()  # admitted: the captures are planned on its slot
    captures = {c.position: c for c in e.kv.states.captures[seq.state_slot]}
    assert sorted(captures) == [e.cache.markers.boundaries(t1)[-2], len(t1) - 1]
    while not seq.is_finished:
        e.step()
    def prefill_state(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        alone = e.new_sequence(t1[:n], SamplingParams(temperature=0.0, max_tokens=1))
        alone.block_table = e.kv.pool.allocate(e.kv.blocks_for(n))
        alone.state_slot = e.kv.states.allocate()
        e.runner.forward(e.runner.prepare([Chunk(alone, 0, n)]))
        conv, ssm = (t.clone() for t in e.kv.states.read_slot(alone.state_slot))
        e.kv.pool.decref(alone.block_table)
        e.kv.states.free(alone.state_slot)
        return conv, ssm

    for pos, capture in captures.items():
        assert capture.written
        for got, want in zip((capture.conv, capture.ssm), prefill_state(pos)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-4)
        for got, one_more in zip((capture.conv, capture.ssm), prefill_state(pos + 1)):  # the check can fail
            assert (got - one_more).abs().max() > 1e-2
    e.cache.clear()


def test_live_server_hits(files) -> None:
    """`lucebox serve` of the tiny qwen35 GGUF with its default prefix cache: the same chat request again and
    the next turn hit the cache (tiers 2 and 1) and answer what the first request (a miss) and a cold server
    answer."""
    import httpx

    from tests.live_server import start_server

    def ask(server, messages: list[dict]) -> list[int]:
        r = httpx.post(server.base_url + "/chat/completions", timeout=60,
                       json={"messages": messages, "max_tokens": 6, "temperature": 0, "logprobs": True,
                             "top_logprobs": 3})
        assert r.status_code == 200, r.text
        return [(t["token"], round(t["logprob"], 3)) for t in r.json()["choices"][0]["logprobs"]["content"]]

    server = start_server(files["qwen35"], kv_tokens=1024, max_step_tokens=16)
    try:
        first, again, turn2 = ask(server, TURN1), ask(server, TURN1), ask(server, TURN2)
        tiers = httpx.get(server.url + "/props", timeout=10).json()["prefix_cache"]["tiers"]
        assert tiers["exact"]["hits"] == 1 and tiers["prefix"]["hits"] == 1, tiers
    finally:
        server.stop()
    assert first == again
    cold = start_server(files["qwen35"], kv_tokens=1024, max_step_tokens=16, prefix_cache=False)
    try:
        assert ask(cold, TURN2) == turn2
    finally:
        cold.stop()


def test_preemption_releases_captures(files, plain) -> None:
    """A KV pool too small for three prompts at once: sequences are preempted with captures planned (some
    written, some not), recomputed from 0 and captured again. Same tokens as without the cache; once the
    cache is cleared no host buffer is held (every capture was released or went into a snapshot)."""
    e = LLMEngine.from_path(files["qwen35"], EngineConfig(device="cpu", dtype="float32", max_step_tokens=16,
                                                          kv_tokens=192), quiet=True)
    tok = e.tokenizer
    e.enable_prefix_cache(CacheConfig(gpu=True, min_tokens=16), resolve_chat_template(
        gguf_template=e.loaded.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token))
    prompts = [render(e, m) for m in (TURN1, OTHER, TURN1[:1] + [{"role": "user", "content": "Is it open?"}])]
    seqs = [e.new_sequence(p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)) for p in prompts]
    for s in seqs:
        s.cache_hint = e.cache.prepare(s.prompt_ids)
        e.scheduler.add(s)
    while e.has_work():
        e.step()
    e.cache.poll()
    assert e.scheduler.num_preemptions > 0
    assert [s.output_ids for s in seqs] == [run(plain["qwen35"], p).output_ids for p in prompts]
    assert e.kv.states.num_free == e.kv.states.num_slots and not e.kv.states.captures
    assert e.cache.stats()["exact"]["entries"] == 3 and e.cache.host.stats().in_use > 0
    e.cache.clear()
    assert e.cache.host.stats().in_use == 0
