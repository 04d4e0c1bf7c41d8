"""Tensor parallelism (engine/parallel) on the CPU: 2 ranks over gloo, fp32, tiny random models.

The test process is rank 0 (one group for the module, a spawned rank 1); each architecture's greedy tokens
and top-3 logprobs at 2 ranks equal one rank's (the logprobs to float rounding: the all-reduce sums the
heads' partial products in another order). The hybrids (qwen35, qwen35moe) too, where rank 1's recurrent
states must follow rank 0's plan: a prefix-cache hit (its state from a RAM or disk snapshot of both ranks'
heads), speculation (each verification's accepted row). PFlash (the target scoring on both ranks) and Spark
offload (each rank placing its own experts) too. A killed rank makes its peer exit non-zero within seconds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from lucebox.cache.manager import CacheConfig
from lucebox.cache.snapshots import token_key
from lucebox.engine.parallel.group import FATAL_EXIT, PLAN_WORDS
from lucebox.engine.parallel.worker import TPGroup
from lucebox.engine.pflash import PFlashConfig
from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.recurrent_state import RecurrentStates
from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.engine.spec.drafter import DFlashDrafter, drafter_config_for, save_drafter
from lucebox.engine.weights.loader import read_model_config
from lucebox.errors import LuceboxError
from tests.fixtures.tiny_models import ARCHS, MOE_ARCHS, write_tiny_laguna_hf, write_tiny_qwen35_gguf

PROMPTS = [[1, 5, 9, 22, 7, 3, 11, 40, 41, 2, 8, 9, 100, 3, 5, 7, 9, 11, 13, 15], [4, 8, 15, 16, 23, 42]]
GREEDY = SamplingParams(max_tokens=6, logprobs=3)
ROOT = Path(__file__).resolve().parents[1]


def engine(path: Path, tp: int = 1, weights: str = "auto") -> LLMEngine:
    return LLMEngine.from_path(path, EngineConfig(device="cpu", kv_tokens=512, tensor_parallel=tp, weights=weights),
                               quiet=True)


def run(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list:
    """Each request's (output ids, per token (id, top-3 ids, logprob), prompt tokens the prefix cache gave);
    the requests run batched, with their cache hints (as the server gives them) when the cache is on."""
    seqs = [eng.new_sequence(p, params) for p in prompts]
    for s in seqs:
        if eng.cache is not None:
            s.cache_hint = eng.cache.prepare(s.prompt_ids)
        eng.scheduler.add(s)
    while any(not s.is_finished for s in seqs):
        eng.step()
    return [(s.output_ids, [(lp.token_id, [t for t, _ in lp.top], lp.logprob) for lp in s.logprobs], s.num_cached)
            for s in seqs]


def assert_same(one: list, two: list) -> None:
    for (ids1, lps1, _), (ids2, lps2, _) in zip(one, two, strict=True):
        assert ids2 == ids1
        assert [lp[:2] for lp in lps2] == [lp[:2] for lp in lps1]
        assert max(abs(a[2] - b[2]) for a, b in zip(lps1, lps2)) < 1e-4


@pytest.fixture(scope="module")
def group():
    """The 2-rank group every test here loads its models into (rank 1 spawned once)."""
    yield TPGroup.get(2, "cpu")
    if TPGroup.current is not None:
        TPGroup.current.close()


@pytest.fixture(scope="module")
def model(tiny_gguf, tmp_path_factory):
    """arch -> its tiny F32 GGUF: tiny_gguf's, or a hybrid's (qwen35, qwen35moe), written once here."""
    root = tmp_path_factory.mktemp("hybrid")
    hybrids = {"qwen35": write_tiny_qwen35_gguf(root / "dense.gguf"),
               "qwen35moe": write_tiny_qwen35_gguf(root / "moe.gguf", moe=True)}
    return lambda arch: hybrids[arch] if arch in hybrids else tiny_gguf(arch)


@pytest.mark.parametrize("arch", ARCHS + MOE_ARCHS + ("qwen35", "qwen35moe"))
def test_two_ranks_give_one_ranks_tokens(group, model, arch):
    path = model(arch)
    one, two = run(engine(path), PROMPTS), run(engine(path, tp=2), PROMPTS)
    assert_same(one, two)
    full, shard = read_model_config(path), group.active
    assert shard.model_config.num_heads * 2 == full.num_heads
    assert shard.kv.data.shape[3] == max(full.num_kv_heads // 2, 1)  # this rank's K/V heads (or the one shared)
    if full.is_hybrid:  # DeltaNet layers by q/k head: this rank's state slots hold half the channels and heads
        conv, ssm = RecurrentStates.slot_shapes(full)
        assert shard.kv.states.shapes() == (conv[:1] + (conv[1] // 2,) + conv[2:], ssm[:1] + (ssm[1] // 2,) + ssm[2:])


def test_laguna_per_layer_heads_and_output_gate(group, tmp_path):
    path = write_tiny_laguna_hf(tmp_path / "laguna")
    assert_same(run(engine(path), PROMPTS), run(engine(path, tp=2), PROMPTS))
    full = read_model_config(path)
    assert [b.num_heads * 2 for b in group.active.loaded.model.blk] == full.heads_per_layer


def test_a_hybrid_whose_key_heads_do_not_split_is_refused(tmp_path):
    path = write_tiny_qwen35_gguf(tmp_path / "one_key.gguf", linear_num_key_heads=1, linear_num_value_heads=2)
    with pytest.raises(LuceboxError, match="1 key heads"):
        engine(path, tp=2)


@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
def test_quantized_weights_shard_in_whole_blocks(group, tiny_gguf, arch):
    path = tiny_gguf(arch, "Q8_0")
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=3, logprobs=3)
    assert_same(run(engine(path, weights="quantized"), PROMPTS, sampled),
                run(engine(path, tp=2, weights="quantized"), PROMPTS, sampled))
    blk = group.active.loaded.model.blk[0]
    assert blk.attn_output.qtype == "Q8_0" and blk.attn_output.cols == blk.num_heads * blk.head_dim


def test_a_split_inside_a_quant_block_is_refused(group, tiny_gguf):
    # K-quant blocks are 256 values; tiny llama at Q4_K has 4 heads of 64: 128 output-projection columns a rank
    with pytest.raises(LuceboxError, match="inside a 256-value block"):
        engine(tiny_gguf("llama", "Q4_K"), tp=2, weights="quantized")
    assert_same(run(engine(tiny_gguf("llama")), PROMPTS[:1]), run(engine(tiny_gguf("llama"), tp=2), PROMPTS[:1]))


def test_unsplittable_shapes_are_refused_before_starting(tiny_gguf):
    with pytest.raises(LuceboxError, match="query heads"):
        engine(tiny_gguf("llama"), tp=3)


def test_a_step_longer_than_the_plan_buffer(group, tiny_gguf):
    """A prompt of more tokens than PLAN_WORDS: its prefill step's plan takes a second broadcast."""
    path = tiny_gguf("llama")
    long = [(7 * i) % 300 + 3 for i in range(PLAN_WORDS + 100)]
    config = {"kv_tokens": 2 * PLAN_WORDS, "max_step_tokens": 2 * PLAN_WORDS}
    one = LLMEngine.from_path(path, EngineConfig(device="cpu", **config), quiet=True)
    two = LLMEngine.from_path(path, EngineConfig(device="cpu", tensor_parallel=2, **config), quiet=True)
    assert_same(run(one, [long, PROMPTS[1]]), run(two, [long, PROMPTS[1]]))


def test_a_prefix_cache_hit_under_two_ranks(group, tiny_gguf):
    path = tiny_gguf("qwen3")
    first = PROMPTS[0] * 2
    second = first + [17, 19, 23]
    cold = run(engine(path), [second])
    eng = engine(path, tp=2)
    eng.enable_prefix_cache(CacheConfig(gpu=True, min_tokens=16))
    run(eng, [first])
    warm = run(eng, [second])
    assert warm[0][2] >= 32, "the second request reused the first one's blocks"
    assert_same(cold, warm)


@pytest.mark.parametrize("arch", ["qwen3", "qwen35"])
def test_dflash_chain_under_two_ranks_equals_plain(group, model, tmp_path, arch):
    """A hybrid's verifications (a random drafter: nearly every draft rejected) keep every row's state on every
    rank, and the next plan tells rank 1 which row rank 0 accepted."""
    target = model(arch)
    cfg = read_model_config(target)
    dcfg = drafter_config_for(cfg, layers=1, block_size=4, mask_token_id=cfg.vocab_size - 1)
    save_drafter(DFlashDrafter.random(dcfg, seed=0, std=0.2), tmp_path / "d")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = engine(target).generate(PROMPTS, params)
    spec = LLMEngine.from_path(target, EngineConfig(device="cpu", kv_tokens=512, tensor_parallel=2,
                                                    draft=str(tmp_path / "d")), quiet=True)
    assert spec.generate(PROMPTS, params) == plain
    assert spec.spec.stats.steps > 0, "decoding went through draft verifications"


SNAPSHOTS = CacheConfig(gpu=False, prefix_slots=0, exact_slots=2, min_tokens=16, disk_min_tokens=16)


@pytest.mark.parametrize("arch", ["qwen2", "qwen35moe"])
def test_a_ram_snapshot_hit_under_two_ranks(group, model, arch):
    """The device tier off: the hit is a RAM snapshot of both ranks' K/V heads (and a hybrid's recurrent
    states, gathered right after the prefill step that captured them), restored into blocks no request used
    before (zeros on rank 1 unless its heads come back) and a state slot another request used last."""
    path = model(arch)  # qwen2: 2 K/V heads, one a rank
    prompt = PROMPTS[0] * 2
    other = [(3 * i) % 300 + 2 for i in range(len(prompt))]
    cold = run(engine(path), [prompt])
    eng = engine(path, tp=2)
    eng.enable_prefix_cache(SNAPSHOTS)
    run(eng, [prompt])
    run(eng, [other])
    warm = run(eng, [prompt])
    assert warm[0][2] == len(prompt) - 1 and eng.cache.counters["exact"].restored_tokens == len(prompt) - 1
    full, snap = read_model_config(path), eng.cache.exact.get(token_key(prompt))
    assert snap.kv.shape[3] == full.num_kv_heads
    if full.is_hybrid:
        assert (snap.conv.shape, snap.ssm.shape) == RecurrentStates.slot_shapes(full)
    assert_same(cold, warm)


@pytest.mark.parametrize(("arch", "order"), [("qwen3", (2, 2, 1)), ("gemma3", (2, 2, 1)), ("qwen35", (2, 1)),
                                             ("qwen35", (1, 2))],
                         ids=["qwen3", "gemma3", "qwen35-tp2-then-tp1", "qwen35-tp1-then-tp2"])
def test_a_disk_snapshot_after_a_restart_and_at_another_rank_count(group, model, tmp_path, arch, order):
    """A disk entry written under -tp 2 holds every K/V head (and a hybrid's every state head) in one rank's
    layout: a restarted -tp 2 engine (fresh KV on both ranks) restores it, and so does a -tp 1 one (the same
    layout id), and the other way round. qwen3: 2 K/V heads (one a rank); gemma3: 1 (replicated on both)."""
    path = model(arch)
    prompt = PROMPTS[0] * 2
    cfg = dataclasses.replace(SNAPSHOTS, disk_dir=tmp_path)
    cold = run(engine(path), [prompt])
    for restart, tp in enumerate(order):
        eng = engine(path, tp=tp)
        eng.enable_prefix_cache(cfg)
        out = run(eng, [prompt])
        eng.cache.poll()  # publishes the finished request's snapshot: its disk write is queued
        eng.cache.disk.flush()
        eng.cache.disk.close()
        disk = eng.cache.stats()["disk"]
        assert (disk["written"], disk["hits"], out[0][2]) == ((1, 0, 0) if not restart else (0, 1, len(prompt) - 1))
        assert_same(cold, out)


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_ddtree_under_two_ranks_moves_every_ranks_kv(group, model, tmp_path, monkeypatch, arch):
    """DDTree with a drafter that ranks the target's next token second at depth 1 and first below: each
    verification accepts a path off the top-1 chain, whose K/V rows rank 0 moves (and rank 1 with the
    next plan), and on a hybrid whose last node's state becomes the slot's on both ranks; the tokens stay
    plain decoding's."""
    target = model(arch)
    cfg = read_model_config(target)
    dcfg = drafter_config_for(cfg, layers=1, block_size=4, mask_token_id=cfg.vocab_size - 1)
    save_drafter(DFlashDrafter.random(dcfg, seed=0, std=0.2), tmp_path / "d")
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[1] * 2]
    plain = engine(target).generate(prompts, params)
    eng = LLMEngine.from_path(target, EngineConfig(device="cpu", kv_tokens=512, tensor_parallel=2, ddtree=True,
                                                   ddtree_budget=6, draft=str(tmp_path / "d")), quiet=True)
    spec = eng.spec
    answers = {tuple(p): p + out + [0] * spec.block for p, out in zip(prompts, plain)}

    def oracle(chunks: list) -> torch.Tensor:
        lp = torch.full((len(chunks), spec.block - 1, cfg.vocab_size), -20.0)
        for g, c in enumerate(chunks):
            want = answers[tuple(c.seq.prompt_ids)][c.start + 1:c.start + spec.block]
            lp[g, 0, (want[0] + 1) % cfg.vocab_size] = -0.1
            lp[g, 0, want[0]] = -0.5
            lp[g, torch.arange(1, spec.block - 1), want[1:]] = -0.1
        return lp

    monkeypatch.setattr(spec, "draft_logprobs", oracle)
    assert eng.generate(prompts, params) == plain
    assert spec.stats.committed > 2 * spec.stats.steps, "the verifications accepted paths off the top-1 chain"


HAYSTACK = " ".join(f"Note {i}: the {('red', 'blue', 'green', 'grey')[i % 4]} box holds {i * 7 % 31} keys."
                    for i in range(40))
SELECT = PFlashConfig(keep_ratio=0.2, chunk=16, head_chunks=1, tail_chunks=2)  # most chunks kept by score


@pytest.mark.parametrize("scorer", [None, "llama"])  # the target itself (sharded), a separate file (rank 0)
def test_pflash_under_two_ranks_keeps_one_ranks_chunks(group, tiny_gguf, scorer):
    """PFlash as `--prefill-compression always` sets it up, on a long prompt: the target as its own scorer
    runs on both ranks' shards (a SCORE plan, each rank's maxima over its heads maxed over the ranks), here in
    a worker thread while the engine thread decodes (as the server runs it); a separate scorer runs whole on
    rank 0. The scores, the kept chunks and the compressed prompt's greedy tokens are one rank's."""
    from lucebox.serve import ServerConfig, enable_pflash

    path = tiny_gguf("qwen3")
    cfg = ServerConfig(model=str(path), device="cpu", prefill_compression="always", prefill_keep_ratio=0.2,
                       prefill_drafter=str(tiny_gguf(scorer)) if scorer else None)
    got = []
    for tp in (1, 2):
        eng = LLMEngine.from_path(path, EngineConfig(device="cpu", kv_tokens=1024, tensor_parallel=tp), quiet=True)
        pf = enable_pflash(eng, dataclasses.replace(cfg, tensor_parallel=tp)).pflash
        with ThreadPoolExecutor(1) as pool:
            scoring = pool.submit(pf.score, HAYSTACK)
            decoded = run(eng, PROMPTS[1:])  # steps meanwhile: they take turns with the scorer pass on the ranks
            res = pf.select(scored := scoring.result(), query=HAYSTACK[-40:], config=SELECT)
        got.append((scored.scores, res.kept_chunks, run(eng, [res.ids]), decoded))
    (scores1, kept1, out1, dec1), (scores2, kept2, out2, dec2) = got
    assert len(scores1) > 1000 and 10 < len(kept1) < len(scores1) // 64  # a fifth of the chunks of 16
    assert kept2 == kept1
    torch.testing.assert_close(scores2, scores1, rtol=1e-5, atol=1e-7)
    assert_same(out1, out2)
    assert_same(dec1, dec2)


def spark_profile(path: Path, out: Path, counts: list[int]) -> Path:
    """A Spark profile of `path` whose every MoE layer was routed `counts` times per expert."""
    from lucebox.engine.spark.profile import layout, layout_id, moe_layers, router_fingerprint, write_profile
    from lucebox.engine.weights.loader import load_model

    loaded = load_model(path, device="cpu", quiet=True)
    lay = layout(loaded.model, loaded.config.arch, loaded.quant)
    write_profile(out, {"layout": lay, "layout_id": layout_id(lay), "router_fingerprint": router_fingerprint(
        loaded.model), "counts": {str(i): counts for i in moe_layers(loaded.model)}, "heldout_counts": {}})
    return out


def test_spark_under_two_ranks_places_each_ranks_experts(group, tiny_gguf, tmp_path):
    """Spark offload on both ranks, each placing its own experts (0-3 on rank 0, 4-7 on rank 1) from one
    profile with its share of the budget: down to every expert cold, the tokens are one rank's with every
    expert on the device."""
    from lucebox.engine.spark.engine import SparkConfig, spark_engine

    path = tiny_gguf("qwen3moe")
    want = run(engine(path), PROMPTS)
    profile = spark_profile(path, tmp_path / "profile.json", [1, 9, 0, 5, 50, 40, 2, 3])
    config = EngineConfig(device="cpu", kv_tokens=512, tensor_parallel=2)
    # (budget of the whole model, ring slots per layer and rank, CPU rows): 50% is 2 experts a layer a rank
    for budget, ring, cpu_rows in (("50%", 0, 0), ("50%", 1, 1), ("0%", 0, 1)):
        eng, spark = spark_engine(path, config, SparkConfig(profile=profile, budget=budget, ring=ring,
                                                            cpu_rows=cpu_rows), quiet=True)
        assert_same(want, run(eng, PROMPTS))
        hot = {i: layer.hot for i, layer in spark.layers.items()}
        s = spark.stats
        assert spark.info["held_experts"] == [0, 4] and s.routed == s.hot + s.ring_hits + s.cold > 0
        if (budget, ring) == ("50%", 0):
            assert all(h == [1, 3] for h in hot.values()), hot  # rank 0's most routed, not rank 1's 4 and 5
        if budget == "0%":
            assert s.hot == 0 and s.cold == s.routed and s.cpu_experts > 0 and s.copies > 0


def test_ranks_started_by_torchrun_env_as_two_nodes(tiny_gguf):
    """What torchrun gives each process (RANK, WORLD_SIZE, MASTER_*, LOCAL_RANK), here for two one-process
    "nodes" on this host: rank 0 generates, rank 1 only runs steps, and the tokens are one rank's."""
    path = tiny_gguf("qwen2")
    port = _free_port()
    cmd = [sys.executable, "-m", "lucebox", "generate", "-m", str(path), "--device", "cpu", "--raw", "-p",
           "hello there", "-n", "6", "--show-ids", "-tp", "2", "--kv-tokens", "512"]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "RANK": str(r), "LOCAL_RANK": "0",
                                   "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    one = engine(path)
    want = one.generate([one.tokenizer.encode("hello there", add_special=True)], SamplingParams(max_tokens=6))[0]
    assert json.loads(outs[0][1].strip().splitlines()[-1]) == want


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


KILL = """
import os, signal, sys, threading, time
from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.engine.spec.drafter import DFlashDrafter, drafter_config_for, save_drafter
if __name__ == "__main__":
    eng = LLMEngine.from_path(sys.argv[1], EngineConfig(device="cpu", kv_tokens=4096, tensor_parallel=2), quiet=True)
    print(eng.tp.pids[0], flush=True)
    if sys.argv[2] == "rank1":
        threading.Timer(0.3, os.kill, (eng.tp.pids[0], signal.SIGKILL)).start()
        while True:
            eng.generate([[1, 2, 3]], SamplingParams(max_tokens=200, ignore_eos=True))
    else:
        os.kill(os.getpid(), signal.SIGKILL)
"""


def _start(path: Path, who: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(KILL), str(path), who], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_killed_rank_ends_rank_0_loudly(tiny_gguf):
    proc = _start(tiny_gguf("llama"), "rank1")
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == FATAL_EXIT, err[-2000:]
    assert "lucebox: tensor parallelism:" in err


def test_rank_1_ends_when_rank_0_is_killed(tiny_gguf):
    proc = _start(tiny_gguf("llama"), "rank0")
    try:
        pid = int(proc.stdout.readline())  # type: ignore[union-attr]
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "rank 1 outlived rank 0"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_projection_of_mixed_types_keeps_each_parts_rows():
    """A fused q|k|v whose parts differ in type is a ConcatLinear of runs (q|k one Q8_0 weight beside a dense v);
    a rank's shard keeps the rows of its heads from each original part, in order: its output is the full
    projection's columns of those rows."""
    from lucebox.engine.models.layers import ConcatLinear, Linear, fuse_linears
    from lucebox.engine.parallel.shard import _take_parts
    from tests.test_quant_formats import random_weight

    k = 64
    parts = []
    for i, (n, qtype) in enumerate([(32, "Q8_0"), (16, "Q8_0"), (16, None)]):
        lin = Linear(k, n)
        if qtype is None:
            lin.weight = torch.nn.Parameter(torch.randn(n, k, generator=torch.Generator().manual_seed(i)),
                                            requires_grad=False)
        else:
            lin.set_quant(random_weight(qtype, n, k, seed=i), torch.float32)
        parts.append(lin)
    fused = fuse_linears(parts)
    assert isinstance(fused, ConcatLinear) and [p.out_features for p in fused.parts] == [48, 16]
    x = torch.randn(3, k)
    full = fused(x)
    rows = [torch.arange(16, 32), torch.arange(8, 16), torch.arange(8, 16)]  # rank 1 of 2: its q and k/v heads
    shard = _take_parts(fused, rows, [32, 16, 16])
    assert torch.equal(shard(x), full[:, torch.cat([rows[0], rows[1] + 32, rows[2] + 48])])
