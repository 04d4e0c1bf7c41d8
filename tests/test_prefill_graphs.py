"""Prefill chunks replayed from CUDA graphs (runtime/prefill_graphs.py) equal the eager forward.

CUDA only (graphs); fp32, so the graph's ragged Triton attention and the eager path's SDPA agree to
rounding and greedy tokens are identical.
"""

from __future__ import annotations

import random

import pytest
import torch

from lucebox.engine.runtime.prefill_graphs import row_buckets, worth_keeping

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")


def test_row_buckets_cover_every_step_size():
    b = row_buckets(2048)
    assert b[:4] == [16, 32, 64, 96] and b[-1] == 2048 and all(x % 16 == 0 for x in b)
    assert all(b2 <= 1.5 * b1 + 16 for b1, b2 in zip(b, b[1:]))  # padding wastes at most about a third
    assert all(b2 - b1 <= 128 for b1, b2 in zip(b, b[1:]) if b1 >= 512)  # and at most 127 rows on big steps
    assert row_buckets(10) == [10]


def test_only_buckets_that_beat_the_eager_step_are_kept():
    """A bucket stays where its replay is faster than the eager forward of the smallest step it serves (a
    small model everywhere; a large model only while the host's launches dominate)."""
    buckets = [16, 32, 512, 640]
    replay = {16: 0.001, 32: 0.001, 512: 0.020, 640: 0.026}
    eager = {16: 0.015, 32: 0.015, 512: 0.025, 640: 0.022}  # 640 rows padded from 513: slower than eager
    assert worth_keeping(buckets, replay, eager) == {16, 32, 512}


@pytest.fixture(scope="module")
def engines(smollm2_path):
    from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine

    def make(graphs: bool) -> LLMEngine:
        e = LLMEngine.from_path(smollm2_path, EngineConfig(dtype="float32", kv_tokens=8192, max_num_seqs=16,
                                                           max_step_tokens=512, cuda_graphs=graphs), quiet=True)
        e.warm_up(progress=False)
        return e

    return make(True), make(False)


@needs_cuda
def test_graph_replay_equals_the_eager_forward(engines):
    """Fresh prompts, chunks after cached prefixes and a chunk from a prompt's middle (no logits), in one
    step: the replayed logits equal the eager forward's for every chunk that samples."""
    from lucebox.engine.runtime.sampler import SamplingParams
    from lucebox.engine.runtime.sequence import Chunk, Sequence

    engine = engines[0]
    runner, kv, rng = engine.runner, engine.kv, random.Random(0)
    assert runner.prefill_graphs is not None and runner.prefill_graphs.ready
    seqs = []
    for n in (70, 33, 120, 9):
        s = Sequence([rng.randrange(1000) for _ in range(n)], SamplingParams())
        s.block_table = kv.pool.allocate(kv.blocks_for(n + 8))
        seqs.append(s)
    a, b, c, d = seqs
    try:
        runner.forward(runner.prepare([Chunk(a, 0, 40), Chunk(c, 0, 50)]))  # cached contexts
        chunks = [Chunk(a, 40, 30), Chunk(b, 0, 20), Chunk(c, 50, 70), Chunk(d, 0, 9)]
        assert not chunks[1].wants_logits  # b's prompt goes on past row 20
        replays = runner.prefill_graphs.replays
        sampled, logits, _, _ = runner.run(chunks)
        assert runner.prefill_graphs.replays == replays + 1
        eager = runner.forward(runner.prepare(chunks))
        want = [ch for ch in eager.inputs.order if ch.wants_logits]
        assert sorted(id(ch) for ch in sampled) == sorted(id(ch) for ch in want)
        for ch, row in zip(sampled, logits):
            torch.testing.assert_close(row, eager.logits[want.index(ch)], atol=2e-4, rtol=1e-4)
    finally:
        for s in seqs:
            kv.pool.decref(s.block_table)


@needs_cuda
def test_staggered_requests_decode_the_same_tokens_with_and_without_graphs(engines):
    """Requests arriving while others decode (mixed steps: a decode graph beside a prefill graph): greedy
    tokens equal the engine without CUDA graphs, and nothing was captured while serving."""
    from lucebox.engine.runtime.sampler import SamplingParams

    rng = random.Random(1)
    prompts = [[rng.randrange(1000) for _ in range(rng.randrange(5, 300))] for _ in range(10)]
    results = []
    for engine in engines:
        seqs, pending = [], list(prompts)
        while pending or engine.has_work():
            for _ in range(min(2, len(pending))):  # two arrivals a step
                seqs.append(engine.add(pending.pop(0), SamplingParams(max_tokens=24, ignore_eos=True,
                                                                      temperature=0)))
            engine.step()
        results.append([s.token_ids for s in seqs])
    assert results[0] == results[1]
    graphs = engines[0].runner.prefill_graphs
    assert graphs.replays > 0 and engines[0].captures_after_ready == 0


@needs_cuda
def test_a_bucket_captured_while_serving_after_a_larger_one_equals_eager(smollm2_path):
    """Without the warm-up a bucket is captured at its first step: after a larger bucket's step (its logit
    rows reach past the smaller bucket's rows) the capture still runs, and its replay equals eager."""
    from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
    from lucebox.engine.runtime.sampler import SamplingParams
    from lucebox.engine.runtime.sequence import Chunk, Sequence

    engine = LLMEngine.from_path(smollm2_path, EngineConfig(dtype="float32", kv_tokens=4096, max_num_seqs=8,
                                                            max_step_tokens=512), quiet=True)
    runner, kv, rng = engine.runner, engine.kv, random.Random(2)
    seqs = []
    for n in (300, 12):
        s = Sequence([rng.randrange(1000) for _ in range(n)], SamplingParams())
        s.block_table = kv.pool.allocate(kv.blocks_for(n + 8))
        seqs.append(s)
    for s in seqs:
        chunks = [Chunk(s, 0, len(s.token_ids))]
        sampled, logits, _, _ = runner.run(chunks)
        assert sampled == chunks
        torch.testing.assert_close(logits, runner.forward(runner.prepare(chunks)).logits, atol=2e-4, rtol=1e-4)
    assert sorted(runner.prefill_graphs.graphs) == [16, 336] and not runner.prefill_graphs.dropped


@needs_cuda
def test_graph_replay_keeps_a_drafters_target_layers(engines):
    """With a drafter's layers set (`set_capture`), a replayed step (`run_step`: a speculative engine's prompt
    and catch-up chunks) gives each chunk the eager forward's logits and captured layer outputs."""
    from lucebox.engine.runtime.sampler import SamplingParams
    from lucebox.engine.runtime.sequence import Chunk, Sequence

    engine = engines[0]
    runner, kv, rng = engine.runner, engine.kv, random.Random(3)
    graphs, layers = runner.prefill_graphs, (2, 15, 27)
    seqs = []
    for n in (90, 40):
        s = Sequence([rng.randrange(1000) for _ in range(n)], SamplingParams())
        s.block_table = kv.pool.allocate(kv.blocks_for(n + 8))
        seqs.append(s)
    a, b = seqs
    try:
        graphs.set_capture(layers)
        assert not graphs.graphs
        graphs.capture_all()
        runner.forward(runner.prepare([Chunk(a, 0, 57)]))  # a cached context, as a catch-up chunk has
        chunks = [Chunk(a, 57, 33), Chunk(b, 0, 40)]
        replayed = graphs.run_step(chunks)
        assert replayed is not None and len(replayed.features) == len(layers)
        eager = runner.forward(runner.prepare(chunks), capture=layers)
        for i, ch in enumerate(replayed.inputs.order):
            j = eager.inputs.order.index(ch)
            torch.testing.assert_close(replayed.chunk_logits(i), eager.chunk_logits(j), atol=2e-4, rtol=1e-4)
            for got, want in zip(replayed.chunk_features(i), eager.chunk_features(j), strict=True):
                assert got.shape == (ch.n, engine.model_config.hidden_size)
                torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    finally:
        graphs.set_capture(())
        graphs.capture_all()  # as the warm-up left them, for the module's other tests
        for s in seqs:
            kv.pool.decref(s.block_table)
