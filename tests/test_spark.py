"""Spark MoE expert offload (lucebox/engine/spark): calibration, placement, the offloaded experts, the bench.

The reference is the same model with every expert on the device (the eager grouped path of models/moe.py,
itself checked against transformers in tests/test_moe.py). On the CPU, "device" slots and "host" memory are
both CPU tensors, but placement, the ring, its LRU, the copies and the CPU rule run the code CUDA runs, so
offloaded logits must equal the reference bit for bit in fp32, at every budget down to every expert cold.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from lucebox.cli import main as cli_main
from lucebox.engine.kernels import triton_moe
from lucebox.engine.models.config import ModelConfig
from lucebox.engine.models.moe import MoE
from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.engine.spark import placement
from lucebox.engine.spark.engine import SparkConfig, place_experts
from lucebox.engine.spark.offload import LayerOffload, OffloadRule, SparkStats
from lucebox.engine.spark.placement import Budget
from lucebox.engine.weights.loader import load_model
from lucebox.errors import LuceboxError
from tests.fixtures.tiny_models import write_tiny_qwen35_gguf

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

DATA = Path(__file__).resolve().parents[1] / "lucebox" / "data"
IDS = list(range(3, 40)) + list(range(100, 160))
PROMPTS = [IDS, list(range(200, 260)), list(range(7, 19))]


def engine(path: Path, spark: SparkConfig | None = None, quantized: bool | None = None, guarded: bool = False,
           **config):
    """(engine, Spark) on the CPU; `guarded`: decode steps over the resident experts first (Spark.guarded, what
    a CUDA graph replays under LUCEBOX_SPARK_GRAPHS=1), run again eagerly on a miss."""
    loaded = load_model(path, device="cpu", dtype=torch.float32, quiet=True,
                        weights={None: "auto", True: "quantized", False: "dense"}[quantized])
    sp = place_experts(loaded, torch.device("cpu"), spark, quiet=True) if spark is not None else None
    guard = sp.guarded if guarded and sp is not None else None
    return LLMEngine(loaded, EngineConfig(device="cpu", dtype="float32", kv_tokens=2048, **config),
                     decode_guard=guard), sp


@pytest.fixture(scope="module")
def qwen35moe_gguf(tmp_path_factory) -> Path:
    return write_tiny_qwen35_gguf(tmp_path_factory.mktemp("spark-q35") / "tiny.gguf", moe=True)


@pytest.mark.parametrize("model,quantized", [("qwen3moe-Q8_0", True), ("qwen3moe-F32", None), ("qwen35moe", None)])
def test_offloaded_equals_all_on_device_at_every_budget(tiny_gguf, qwen35moe_gguf, model, quantized) -> None:
    """Logits bit for bit and greedy tokens (batched), from every expert hot down to every expert cold: cold
    experts copied into a ring, through one-step buffers (no ring), computed on the CPU, and mixes of them.
    Q8_0 experts stay blocks in the slots and the host store; qwen35moe adds the gated shared expert."""
    path = qwen35moe_gguf if model == "qwen35moe" else tiny_gguf("qwen3moe", model.split("-")[1])
    ref_engine, _ = engine(path, quantized=quantized)
    ref_logits = ref_engine.score(IDS)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ref_tokens = ref_engine.generate(PROMPTS, params)
    # (budget, ring, cpu_rows, promote_after): the last case computes every cold expert on the CPU
    cases = [("50%", 2, 1, 2), ("0%", 0, 0, 2)]
    if quantized:
        cases += [("100%", 0, 0, 2), ("25%", 1, 0, 2), ("0%", 0, 10**6, 10**9)]
    for budget, ring, cpu_rows, promote in cases:
        ours, spark = engine(path, SparkConfig(budget=budget, ring=ring, cpu_rows=cpu_rows, promote_after=promote),
                             quantized=quantized)
        what = f"{model} budget {budget} ring {ring} cpu_rows {cpu_rows}"
        assert torch.equal(ours.score(IDS), ref_logits), what
        assert ours.generate(PROMPTS, params) == ref_tokens, what
        s = spark.stats
        assert s.routed == s.hot + s.ring_hits + s.cold > 0, what
        layer = next(iter(spark.layers.values()))
        stacked = layer.moe.ffn_gate_exps
        assert (stacked.quant.shape[0] if quantized else stacked.weight.numel()) == 0, "the experts moved out"
        if quantized:
            assert all(t.dtype == torch.uint8 for t in layer.slots + layer.host), "blocks must stay blocks"
        if budget == "100%":
            assert s.cold == 0 and s.copies == 0
        if budget == "0%":
            assert s.hot == 0 and s.cold == s.routed, "every expert cold"
            assert (s.cpu_experts > 0) == (cpu_rows > 0) and (s.copies > 0) == (cpu_rows < 10**6), what
        if ring:
            assert s.ring_hits > 0 and s.copies > 0, what


def moe_layer(n_experts: int = 8, top_k: int = 2) -> MoE:
    cfg = ModelConfig(arch="test", name="moe", vocab_size=8, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6, max_position=64, rope_theta=1e4,
                      n_experts=n_experts, n_experts_used=top_k, expert_ff=16)
    moe = MoE(cfg, 0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return moe


def step(off: LayerOffload, ref: MoE, experts: list[list[int]]) -> None:
    """One step routing row t to experts[t] (equal weights): offloaded equals the stacked weights' result."""
    x = torch.randn(len(experts), 32, generator=torch.Generator().manual_seed(len(experts)))
    ids = torch.tensor(experts)
    weights = torch.full(ids.shape, 0.5)
    with torch.no_grad():
        assert torch.equal(off.experts(x, weights, ids), ref.experts(x, weights, ids))


def test_ring_is_lru_and_never_evicts_an_expert_the_step_uses() -> None:
    ref, moe = moe_layer(), moe_layer()
    stats = SparkStats()
    off = LayerOffload(moe, hot=[0], ring_slots=2, device=torch.device("cpu"), rule=OffloadRule(0), stats=stats)
    step(off, ref, [[0, 3]])
    step(off, ref, [[0, 4]])
    assert list(off.ring) == [3, 4] and stats.copies == 2
    step(off, ref, [[3, 0]])  # a hit moves 3 to the back
    assert list(off.ring) == [4, 3] and stats.ring_hits == 1
    step(off, ref, [[5, 0]])  # evicts 4, the least recently used
    assert list(off.ring) == [3, 5]
    step(off, ref, [[3, 5], [6, 7]])  # 3 and 5 are used by this step: 6 and 7 go through one-step buffers
    assert list(off.ring) == [3, 5] and stats.copies == 5
    assert stats.routed == 12 and stats.hot == 4 and stats.ring_hits == 3 and stats.cold == 5


def test_slot_table_follows_the_ring_and_the_sync_free_step_flags_misses() -> None:
    """`slot_table` (one tensor, updated in place) says every expert's slot as the hot set and the ring do,
    through fills and evictions; the sync-free step equals the exact one when every routed expert is resident,
    and otherwise weighs the missing pairs 0 and marks their experts in `missed` (never clearing it); `fetch`
    copies missed experts into the ring, or nothing when the ring is too small for them."""
    ref, moe = moe_layer(), moe_layer()
    off = LayerOffload(moe, hot=[0], ring_slots=2, device=torch.device("cpu"), rule=OffloadRule(0),
                       stats=SparkStats())
    table = off.slot_table

    def expected() -> list[int]:
        want = [-1] * 8
        for e, slot in {**off.hot_slot, **off.ring}.items():
            want[e] = slot
        return want

    assert table.tolist() == expected() == [0] + [-1] * 7
    for experts in ([[0, 3]], [[0, 4]], [[5, 0]], [[3, 5], [6, 7]]):  # 3 evicted by 5, then back; 6, 7 one-step
        step(off, ref, experts)
        assert off.slot_table is table and table.tolist() == expected(), experts
    assert list(off.ring) == [5, 3]
    before = (dict(off.stats.__dict__), list(off.ring), table.tolist())
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(3))
    weights = torch.full((2, 2), 0.5)
    off.optimistic = True
    with torch.no_grad():
        ids = torch.tensor([[0, 3], [5, 0]])
        torch.testing.assert_close(off.experts(x, weights, ids), ref.experts(x, weights, ids))
        assert not off.missed.any()
        ids = torch.tensor([[0, 6], [5, 0]])  # 6 is in host memory: weighed 0, a miss
        torch.testing.assert_close(off.experts(x, weights, ids),
                                   ref.experts(x, torch.tensor([[0.5, 0.0], [0.5, 0.5]]), ids))
        assert off.missed.nonzero().flatten().tolist() == [6]
        ids = torch.tensor([[0, 3], [5, 0]])
        off.experts(x, weights, ids)
        assert off.missed.nonzero().flatten().tolist() == [6], "only the host clears it"
    assert (off.stats.__dict__, list(off.ring), table.tolist()) == before, "no host decision, nothing counted"
    off.optimistic = False
    assert not off.fetch([1, 2, 6]), "three experts, a ring of two"
    assert (list(off.ring), table.tolist()) == before[1:]
    assert off.fetch([6]) and list(off.ring) == [3, 6] and table.tolist() == expected(), "5 was least recent"
    off.optimistic = True
    with torch.no_grad():
        ids = torch.tensor([[0, 6], [3, 0]])
        torch.testing.assert_close(off.experts(x, weights, ids), ref.experts(x, weights, ids))


@pytest.mark.parametrize("model,quantized", [("qwen3moe-F32", None), ("qwen3moe-Q8_0", True), ("qwen35moe", None)])
def test_guarded_decode_equals_the_exact_path_and_redoes_misses(tiny_gguf, qwen35moe_gguf, monkeypatch, model,
                                                                quantized) -> None:
    """Decode steps over the resident experts (the sync-free step a CUDA graph captures, run eagerly here),
    replayed after copying in what they missed or run again eagerly, give the exact path's greedy tokens in
    fp32, from every expert hot (no redo) down to every expert cold without a ring (every step redone). The
    hybrid's recurrent states are put back before each rerun: advanced twice, its tokens would differ."""
    path = qwen35moe_gguf if model == "qwen35moe" else tiny_gguf("qwen3moe", model.split("-")[1])
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = engine(path, quantized=quantized)[0].generate(PROMPTS, params)
    decode_steps = params.max_tokens - 1  # the prompts prefill in one step, which samples the first tokens
    for budget, ring in (("100%", 0), ("50%", 2), ("25%", 2), ("0%", 0)):  # 25%: the ring alone
        what = f"{model} budget {budget} ring {ring}"
        ours, spark = engine(path, SparkConfig(budget=budget, ring=ring, cpu_rows=0), quantized=quantized,
                             guarded=True, ahead=True)
        assert ours.ahead is None, "a guarded step is read before it is kept: nothing runs ahead"
        assert ours.generate(PROMPTS, params) == want, what
        s = spark.stats
        assert s.graph_steps + s.redos == decode_steps, what
        if budget == "100%":
            assert s.redos == 0 and s.cold == 0, what
        elif ring == 0:
            assert s.graph_steps == 0, "every expert cold and no ring: every decode step is run again"
        else:
            assert s.refetches + s.redos > 0 and s.copies > 0, what
        assert spark.props()["redos"] == s.redos and spark.props()["refetches"] == s.refetches
        assert not spark.missed.any(), "read and cleared after every step"
    # kept steps and redone ones in one stream: a skewed router (simulate.py) keeps returning to the experts
    # the redone steps copied into the ring, so later steps find them resident
    from lucebox.engine.spark.simulate import apply_router_skew

    long = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = engine(path, quantized=quantized)[0]
    apply_router_skew(ref.loaded.model, 2.0, torch.float32)
    ours, spark = engine(path, SparkConfig(budget="50%", ring=2, cpu_rows=0), quantized=quantized, guarded=True)
    apply_router_skew(ours.loaded.model, 2.0, torch.float32)
    assert ours.generate([IDS], long) == ref.generate([IDS], long)
    s = spark.stats
    assert s.graph_steps > 0 and s.refetches > 0 and s.graph_steps + s.redos == long.max_tokens - 1, s
    # spark_engine: LUCEBOX_SPARK_GRAPHS=1 guards the decode steps (graphs on CUDA), a hybrid's too
    from lucebox.engine.spark.engine import spark_engine

    econf = EngineConfig(device="cpu", dtype="float32", kv_tokens=2048)
    scfg = SparkConfig(budget="50%", ring=1, cpu_rows=0)
    monkeypatch.delenv("LUCEBOX_SPARK_GRAPHS", raising=False)
    assert spark_engine(path, econf, scfg, quiet=True)[0].runner.guard is None, "off by default on the CPU"
    monkeypatch.setenv("LUCEBOX_SPARK_GRAPHS", "1")
    ours, spark = spark_engine(path, econf, scfg, quiet=True)
    assert ours.runner.guard is not None and ours.generate(PROMPTS, params) == want
    assert spark.stats.graph_steps + spark.stats.redos == decode_steps
    hybrid, _ = spark_engine(qwen35moe_gguf, econf, scfg, quiet=True)
    assert hybrid.runner.guard is not None, "a hybrid's states are put back before a step runs again"


def test_cpu_rule_computes_small_cold_experts_on_the_cpu_until_they_recur() -> None:
    """cpu_rows 1, promote_after 2: an expert routed to one row is computed on the CPU twice, then copied into
    the ring; one routed to two rows is copied at once."""
    ref, moe = moe_layer(), moe_layer()
    stats = SparkStats()
    off = LayerOffload(moe, hot=[0], ring_slots=2, device=torch.device("cpu"), rule=OffloadRule(1, 2), stats=stats)
    step(off, ref, [[0, 3]])
    step(off, ref, [[0, 3]])
    assert stats.cpu_experts == 2 and stats.copies == 0 and not off.ring
    step(off, ref, [[0, 3]])
    assert stats.copies == 1 and list(off.ring) == [3]
    step(off, ref, [[0, 5], [5, 0]])
    assert stats.copies == 2 and list(off.ring) == [3, 5] and stats.cpu_experts == 2


def test_placements_for_a_budget() -> None:
    counts = {0: [5, 0, 9, 1], 2: [0, 7, 0, 8]}
    sizes = {0: 10, 2: 10}
    assert placement.calibrated(counts, sizes, 30) == {0: [2], 2: [1, 3]}
    assert placement.uniform(4, sizes, 30) == {0: [0, 1], 2: [0]}
    assert placement.cold_hit_rate(counts, {0: [2], 2: [1, 3]}) == pytest.approx(1 - 24 / 30)
    assert Budget.parse("60%").bytes(1000) == 600 and Budget.parse("1.5GB").bytes(0) == 3 << 29
    with pytest.raises(LuceboxError, match="ring"):
        placement.hot_budget(30, sizes, 2)


def write_traffic(tmp: Path) -> list[Path]:
    """Logged requests in the formats calibration reads (OpenAI and Anthropic bodies, content blocks, bare
    message lists, prompt, turns), and an agent system prompt."""
    rows = [{"messages": [{"role": "system", "content": "You are a coding agent."},
                          {"role": "user", "content": f"Fix the bug number {i} in parser.py"}]} for i in range(6)]
    rows.append({"system": "Be brief.", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Summarise this file."}, {"type": "tool_result", "content": "x = 1"}]}]})
    rows.append([{"role": "user", "content": "What is a monad?"}])
    rows.append({"prompt": "Write a haiku about caches."})
    rows.append({"turns": ["Plan a trip to Rome.", "Now make it cheaper."]})
    log = tmp / "requests.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return [log, DATA / "agent_prompts" / "codex_gpt5_codex.md"]


def calibrate(path: Path, out: Path, traffic: list[Path], *extra: str) -> int:
    return cli_main(["spark", "calibrate", "--model", str(path), "--device", "cpu", "--traffic",
                     *map(str, traffic), "--out", str(out), "--max-prompt-tokens", "96", *extra])


def test_calibrate_counts_every_routed_pair_and_serving_reads_the_profile(tiny_gguf, tmp_path, capsys) -> None:
    """Per layer the counts add up to tokens x top_k (prefill, plus the decoded tokens); the hot set is the
    most routed experts; the held-out split's rate is the profile's; `generate --spark` serves it."""
    path = tiny_gguf("qwen3moe", "Q8_0")
    traffic = write_traffic(tmp_path)
    out = tmp_path / "profile.json"
    assert calibrate(path, out, traffic, "--decode-tokens", "2", "--heldout-every", "4",
                     "--expert-gpu-budget", "50%") == 0
    assert "predicted cold-hit rate" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["format"] == "lucebox.spark.profile" and doc["layout"]["n_experts"] == 8
    files = {t["file"]: t for t in doc["traffic"]}
    assert set(files) == {"requests.jsonl", "codex_gpt5_codex.md"} and len(files["requests.jsonl"]["sha256"]) == 64
    assert files["requests.jsonl"]["conversations"] + files["requests.jsonl"]["heldout_conversations"] == 10
    n_conv = {"train": sum(t["conversations"] for t in files.values()),
              "heldout": sum(t["heldout_conversations"] for t in files.values())}
    tokens = {"train": sum(t["tokens"] for t in files.values()), "heldout": sum(t["heldout_tokens"] for t in
                                                                                files.values())}
    for split, key in (("train", "counts"), ("heldout", "heldout_counts")):
        for layer, row in doc[key].items():
            assert sum(row) == 2 * (tokens[split] + 2 * n_conv[split]), (split, layer)
    counts = {int(k): v for k, v in doc["counts"].items()}
    hot = {int(k): v for k, v in doc["placement"]["hot"].items()}
    assert doc["placement"]["hot_experts"] == 12  # 50% of 24 experts of equal size
    assert min(counts[0][e] for e in hot[0]) >= max(counts[0][e] for e in range(8) if e not in hot[0])
    heldout = {int(k): v for k, v in doc["heldout_counts"].items()}
    assert doc["predicted_cold_hit_rate"] == pytest.approx(placement.cold_hit_rate(heldout, hot))
    offloaded = tmp_path / "offloaded.json"  # a model too big for the device calibrates offloaded: same counts
    assert calibrate(path, offloaded, traffic, "--decode-tokens", "2", "--heldout-every", "4",
                     "--expert-gpu-budget", "50%", "--offload-budget", "10%") == 0
    again = json.loads(offloaded.read_text())
    assert (again["counts"], again["heldout_counts"]) == (doc["counts"], doc["heldout_counts"])
    ids = []
    for spark in ([], ["--spark", str(out), "--expert-gpu-budget", "20%", "--spark-ring", "1"]):
        assert cli_main(["generate", "--model", str(path), "--device", "cpu", "-p", "hello", "-n", "6",
                         "--show-ids", *spark]) == 0
        ids.append(capsys.readouterr().err.strip().splitlines()[-1])
    assert ids[0] == ids[1], "generate --spark gives the all-on-device tokens"


def test_router_skew_simulation_concentrates_the_routing(tiny_gguf, tmp_path) -> None:
    """Under a strong zipf:S the most routed experts of every layer are the simulation's most popular ones."""
    from lucebox.engine.spark.simulate import popularity_ranks

    path = tiny_gguf("qwen3moe", "F32")
    traffic = write_traffic(tmp_path)
    shares = []
    for skew in ([], ["--router-skew", "zipf:8"]):
        out = tmp_path / f"p{len(skew)}.json"
        assert calibrate(path, out, traffic, *skew) == 0
        doc = json.loads(out.read_text())
        row = sorted(doc["counts"]["0"], reverse=True)
        shares.append(sum(row[:2]) / sum(row))
    assert doc["router_skew"] == "zipf:8 (simulation)"
    for layer, row in doc["counts"].items():
        top = sorted(range(8), key=lambda e: -row[e])[:2]
        assert sorted(popularity_ranks(8, int(layer))[top].tolist()) == [0.0, 1.0], (layer, row)
    assert shares[1] > shares[0], shares


def test_hostile_inputs_are_one_line_and_exit_2(tiny_gguf, qwen35moe_gguf, tmp_path, capsys, caplog) -> None:
    path = tiny_gguf("qwen3moe", "F32")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{not json\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    binary = tmp_path / "x.bin"
    binary.write_bytes(b"\xff\xfe\x00")
    cases = [([bad], "bad.jsonl:2: not a JSON line"), ([empty], "holds no prompts"),
             ([tmp_path / "missing.jsonl"], "missing.jsonl"), ([binary], "not UTF-8")]
    for traffic, message in cases:
        assert calibrate(path, tmp_path / "p.json", traffic) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("lucebox: error:") and message in err[-1], err
    profile = tmp_path / "p.json"
    assert calibrate(path, profile, write_traffic(tmp_path)) == 0
    capsys.readouterr()
    damaged = tmp_path / "damaged.json"
    doc = json.loads(profile.read_text())
    doc["counts"]["0"] = doc["counts"]["0"][:3]
    damaged.write_text(json.dumps(doc))
    for model, prof, message in ((qwen35moe_gguf, profile, "calibrated on another model"),
                                 (path, damaged, "damaged profile"), (path, tmp_path / "nope.json", "no such")):
        assert cli_main(["generate", "--model", str(model), "--device", "cpu", "-p", "hi", "-n", "1",
                         "--spark", str(prof)]) == 2
        assert message in capsys.readouterr().err.strip().splitlines()[-1]
    loaded = load_model(tiny_gguf("qwen3moe", "Q8_0"), device="cpu", quiet=True, weights="quantized")
    with caplog.at_level("WARNING", logger="lucebox.spark"):  # the same model in another quant: served, warned
        place_experts(loaded, torch.device("cpu"), SparkConfig(profile=profile, cpu_rows=0), quiet=True)
    assert "calibrated on a F32 file, this one is Q8_0" in caplog.text
    assert calibrate(DATA.parent / "missing-model.gguf", tmp_path / "q.json", write_traffic(tmp_path)) == 2
    assert calibrate(tiny_gguf("llama"), tmp_path / "q.json", write_traffic(tmp_path)) == 2
    assert "no MoE layers" in capsys.readouterr().err.strip().splitlines()[-1]
    assert calibrate(path, tmp_path / "no" / "q.json", write_traffic(tmp_path)) == 2
    assert "no folder" in capsys.readouterr().err.strip().splitlines()[-1]
    # the simulated skew biases the routers of one process: refused before any rank starts
    assert calibrate(path, tmp_path / "q.json", write_traffic(tmp_path), "--router-skew", "zipf:1", "-tp", "2") == 2
    assert "cannot run with --tensor-parallel" in capsys.readouterr().err.strip().splitlines()[-1]


def test_serving_under_the_router_skew_routes_as_its_calibration(tiny_gguf, tmp_path, capsys, caplog) -> None:
    """`serve`/`generate --router-skew zipf:S` give the served model the routers' simulated bias that `spark calibrate
    --router-skew` measured the profile under (so a random-weight model served with a profile sees the traffic it
    was placed for): each layer's most routed experts are the simulation's most popular, /props labels the
    simulation, the disk KV tier keys on it (no KV of another routing restored), and a profile calibrated under
    another skew is warned about; a bad value, -tp and a dense model are one line and exit 2."""
    from lucebox.api.common import ServerContext
    from lucebox.engine.spark.profile import RouteCounter, moe_layers
    from lucebox.serve import ServerConfig, load_into

    path = tiny_gguf("qwen3moe", "F32")
    profile = tmp_path / "unskewed.json"
    assert calibrate(path, profile, write_traffic(tmp_path)) == 0
    counts, layouts = [], []
    for skew in (None, "zipf:8"):
        cfg = ServerConfig(model=str(path), device="cpu", router_skew=skew, warm_up=False,
                           kv_cache_dir=tmp_path / "kv", prefill_compression="off", spark=profile,
                           spark_cpu_rows=0).validate()
        ctx = ServerContext(model_id="tiny", n_ctx=0)
        caplog.clear()
        with caplog.at_level("WARNING", logger="lucebox.serve"):
            eng = load_into(ctx, cfg)
        assert ctx.props.get("router_skew") == (skew and "zipf:8 (simulation)")
        assert ("calibrated under router skew none, served under zipf:8" in caplog.text) == (skew is not None)
        layouts.append(eng.cache.disk.layout_id)
        counter = RouteCounter(moe_layers(eng.loaded.model), torch.device("cpu"))
        counter.attach()
        eng.generate(PROMPTS[:2], SamplingParams(max_tokens=4, ignore_eos=True))
        counts.append(counter.counts.clone())
    # the biased routers send most pairs to each layer's two top-ranked experts
    from lucebox.engine.spark.simulate import popularity_ranks

    for layer in range(counts[1].shape[0]):
        top = counts[1][layer].argsort(descending=True)[:2]
        assert sorted(popularity_ranks(8, layer)[top].tolist()) == [0.0, 1.0], counts[1][layer]
    assert counts[1].max(dim=1).values.sum() > counts[0].max(dim=1).values.sum()
    assert layouts[0] != layouts[1]
    for args, message in ((["--router-skew", "zipf:0"], "must be zipf:S"),
                          (["--router-skew", "zipf:1", "-tp", "2"], "cannot run with --tensor-parallel")):
        assert cli_main(["generate", "--model", str(path), "--device", "cpu", "-p", "hi", "-n", "1", *args]) == 2
        assert message in capsys.readouterr().err.strip().splitlines()[-1]
    assert cli_main(["generate", "--model", str(tiny_gguf("llama")), "--device", "cpu", "-p", "hi", "-n", "1",
                     "--router-skew", "zipf:1"]) == 2
    assert "no MoE layers" in capsys.readouterr().err.strip().splitlines()[-1]


def test_props_and_metrics_show_the_offload(tiny_gguf, monkeypatch) -> None:
    from lucebox.api.common import ServerContext
    from lucebox.serve import ServerConfig, load_into

    monkeypatch.delenv("LUCEBOX_SPARK_GRAPHS", raising=False)
    cfg = ServerConfig(model=str(tiny_gguf("qwen3moe", "F32")), device="cpu", expert_gpu_budget="25%", spark_ring=1,
                       spark_cpu_rows=1, warm_up=False, prefix_cache=False, prefill_compression="off").validate()
    ctx = ServerContext(model_id="tiny", n_ctx=0)
    eng = load_into(ctx, cfg)
    eng.generate(PROMPTS[:2], SamplingParams(max_tokens=6, ignore_eos=True))
    props = ctx.props["spark"]()
    assert props["enabled"] and props["placement"] == "uniform" and props["ring_slots_per_layer"] == 1
    assert props["routed_pairs"] > 0 and 0 < props["cold_hit_rate"] < 1 and props["copies"] > 0
    assert props["redos"] == props["graph_steps"] == 0, "the graph-resident decode is off by default on the CPU"
    text = ctx.metrics.render()
    for name in ("lucebox_spark_cold_hits_total", "lucebox_spark_expert_copies_total",
                 "lucebox_spark_cpu_expert_seconds_total", "lucebox_spark_cold_hit_rate",
                 "lucebox_spark_copies_per_second", "lucebox_spark_redos_total", "lucebox_spark_refetches_total"):
        assert f"\n{name} " in text, name


def test_bench_spark_on_a_random_hybrid_shape(tiny_gguf, tmp_path) -> None:
    """--shape tiny-qwen3.5-moe: a random qwen35moe hybrid written with --model's tokenizer, its graph-resident
    rows (the recurrent states put back before a rerun) agreeing with all-device."""
    out = tmp_path / "bench.json"
    conv = tmp_path / "conv.jsonl"
    conv.write_text("\n".join(json.dumps({"prompt": f"Tell me about topic {i}."}) for i in range(4)) + "\n")
    assert cli_main(["bench", "spark", "--model", str(tiny_gguf("qwen3moe", "F32")), "--shape", "tiny-qwen3.5-moe",
                     "--mix", "F16", "--device", "cpu", "--dtype", "float32", "--budgets", "50%", "--ring", "1",
                     "--prompts", "2", "--gen-len", "6", "--prompt-len", "40", "--router-skew", "zipf:1.5",
                     "--conversation", str(conv), "--code", str(conv), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert "qwen35moe" in doc["model"]
    graphs = [r for r in doc["rows"] if r["config"] == "calibrated+ring+graphs"]
    assert graphs and all(r["graph_steps"] + r["redos"] > 0 for r in graphs), graphs
    assert all(r["token_agreement"] == 1.0 for r in doc["rows"][1:] if r.get("token_agreement") is not None)


def test_bench_spark_runs_every_configuration(tiny_gguf, tmp_path, capsys) -> None:
    """Small but whole: every row is there, labelled a simulation, offloaded tokens equal all-device ones."""
    from lucebox.bench.spark import agreement

    assert agreement([[1, 2, 3], [4, 5]], [[1, 2, 9], [4, 5]]) == 4 / 5
    out = tmp_path / "bench.json"
    conv = tmp_path / "conv.jsonl"
    conv.write_text("\n".join(json.dumps({"prompt": f"Tell me about topic {i}."}) for i in range(4)) + "\n")
    code = tmp_path / "code.jsonl"
    code.write_text("\n".join(json.dumps({"prompt": f"def f{i}(x):\n    return x * {i}"}) for i in range(4)) + "\n")
    assert cli_main(["bench", "spark", "--model", str(tiny_gguf("qwen3moe", "F32")), "--device", "cpu",
                     "--budgets", "0%,50%", "--ring", "1", "--prompts", "2", "--gen-len", "4", "--prompt-len", "48",
                     "--router-skew", "zipf:1.5", "--conversation", str(conv), "--code", str(code),
                     "--json", str(out)]) == 0
    assert "SIMULATION" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["simulation"].startswith("SIMULATION")
    configs = [(r["config"], r["budget"], r["profile"], r["eval"]) for r in doc["rows"]]
    assert configs[0] == ("all-device", "100%", None, "conversation") and len(configs) == 1 + 2 * 4 + 3
    assert ("calibrated+ring", "50%", "code", "conversation") in configs
    graphs = [r for r in doc["rows"] if r["config"] == "calibrated+ring+graphs"]
    assert len(graphs) == 2 and all(r["graph_steps"] + r["redos"] > 0 for r in graphs), graphs
    assert all(r["peak_gib"] is None and r["kv_tokens_fit"] is None for r in doc["rows"]), "CUDA only"
    for r in doc["rows"][1:]:
        assert 0 <= r["cold_hit_rate"] <= 1 and r["decode_tok_s"] > 0
        if r["eval"] == "conversation":
            assert r["token_agreement"] == 1.0, r
    assert all(r["cold_hit_rate"] == 1.0 for r in doc["rows"] if r["budget"] == "0%" and not r["ring"])


KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(
    triton_moe.triton is None or (KERNEL_DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs triton on CUDA, or TRITON_INTERPRET=1 on the CPU")


@needs_kernel
def test_decode_steps_run_the_experts_kernel_over_the_slots(monkeypatch) -> None:
    """Steps of few rows take kernels/triton_moe.py with the slots as its stacked experts (the routing mapped
    to slots, CPU-computed pairs weighted 0 and added after): equal to the grouped path within the kernel's
    tolerance, with ring fills, a CPU expert, and a step whose copies need one-step buffers (grouped path)."""
    ref, moe = moe_layer().to(KERNEL_DEVICE), moe_layer()
    stats = SparkStats()
    off = LayerOffload(moe, hot=[0, 1], ring_slots=2, device=torch.device(KERNEL_DEVICE), rule=OffloadRule(1, 1),
                       stats=stats)
    if KERNEL_DEVICE == "cpu":
        monkeypatch.setattr(triton_moe, "ON_CPU", True)
    launches, kernel = [], triton_moe.moe_experts
    monkeypatch.setattr(triton_moe, "moe_experts", lambda *a: launches.append(a[3]) or kernel(*a))
    for experts in ([[0, 3], [1, 3]], [[0, 4], [1, 2]], [[3, 5], [4, 6], [2, 7]], [[1, 3]]):
        x = torch.randn(len(experts), 32, generator=torch.Generator().manual_seed(1)).to(KERNEL_DEVICE)
        ids = torch.tensor(experts, device=KERNEL_DEVICE)
        weights = torch.full(ids.shape, 0.5, device=KERNEL_DEVICE)
        with torch.no_grad():
            ours = off.experts(x, weights, ids)
            with monkeypatch.context() as m:
                m.setattr(triton_moe, "ENABLED", False)
                want = ref.experts(x, weights, ids)
        torch.testing.assert_close(ours, want, rtol=2e-5, atol=2e-5)
    # the third step's expert 2 finds the ring full of experts the step uses: a one-step buffer, grouped path
    assert launches == [4, 4, 4], "kernel launches over the 4 slots"
    assert stats.cpu_experts == 5 and stats.copies == 3 and stats.ring_hits == 2


@needs_kernel
def test_the_sync_free_step_runs_the_experts_kernel_over_the_slots(monkeypatch) -> None:
    """What a decode graph captures: one launch over the slots, the routing mapped through `slot_table`, a
    missing expert's pairs weighted 0 and marked in `missed`."""
    ref, moe = moe_layer().to(KERNEL_DEVICE), moe_layer()
    off = LayerOffload(moe, hot=[0, 1], ring_slots=2, device=torch.device(KERNEL_DEVICE), rule=OffloadRule(0),
                       stats=SparkStats())
    if KERNEL_DEVICE == "cpu":
        monkeypatch.setattr(triton_moe, "ON_CPU", True)
    launches, kernel = [], triton_moe.moe_experts
    monkeypatch.setattr(triton_moe, "moe_experts", lambda *a: launches.append(a[3]) or kernel(*a))
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(1)).to(KERNEL_DEVICE)
    weights = torch.full((2, 2), 0.5, device=KERNEL_DEVICE)
    off.optimistic = True
    for experts, used in (([[0, 1], [1, 0]], [[0.5, 0.5], [0.5, 0.5]]), ([[0, 5], [1, 0]], [[0.5, 0.0], [0.5, 0.5]])):
        ids = torch.tensor(experts, device=KERNEL_DEVICE)
        with torch.no_grad():
            ours = off.experts(x, weights, ids)
            with monkeypatch.context() as m:
                m.setattr(triton_moe, "ENABLED", False)
                want = ref.experts(x, torch.tensor(used, device=KERNEL_DEVICE), ids)
        torch.testing.assert_close(ours, want, rtol=2e-5, atol=2e-5)
        assert off.missed.nonzero().flatten().tolist() == ([5] if 5 in sum(experts, []) else []), experts
    assert launches == [4, 4] and off.stats.routed == 0


@needs_kernel
@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_offloaded_engine_on_the_kernel_path_gives_the_all_device_tokens(tiny_gguf, monkeypatch, qtype) -> None:
    """As it runs on CUDA (pinned host store, copy stream, decode through the kernel over the slots; Q8_0
    blocks crossing as blocks) against the all-device engine on the same device, fp32 greedy."""
    from lucebox.engine.spark.engine import spark_engine

    path = tiny_gguf("qwen3moe", qtype)
    if KERNEL_DEVICE == "cpu":
        monkeypatch.setattr(triton_moe, "ON_CPU", True)
    prompts = [IDS[:12]] if KERNEL_DEVICE == "cpu" else PROMPTS
    params = SamplingParams(max_tokens=4 if KERNEL_DEVICE == "cpu" else 12, ignore_eos=True)
    econf = EngineConfig(device=KERNEL_DEVICE, dtype="float32", kv_tokens=2048, weights="quantized")
    want = LLMEngine.from_path(path, econf, quiet=True).generate(prompts, params)
    for budget, ring in (("0%", 0), ("40%", 2)):
        ours, spark = spark_engine(path, econf, SparkConfig(budget=budget, ring=ring, cpu_rows=0), quiet=True)
        assert ours.generate(prompts, params) == want, budget
        assert spark.stats.cold > 0 and spark.stats.copies > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "qwen35moe"])
def test_graph_resident_decode_gives_the_eager_tokens_on_cuda(tiny_gguf, qwen35moe_gguf, monkeypatch, qtype) -> None:
    """On CUDA by default: decode steps replayed from CUDA graphs over the resident experts give the eager
    Spark engine's greedy tokens (fp32); a step that routed to a cold expert is replayed after copying it in,
    or run again eagerly without a ring (counted). qwen35moe: a hybrid, its recurrent states put back before a
    step runs again."""
    from lucebox.engine.runtime import warmup
    from lucebox.engine.spark.engine import spark_engine

    warmup.COMPILES.install()
    seen = len(warmup.COMPILES.in_capture)  # process-wide: only this test's captures count
    path = qwen35moe_gguf if qtype == "qwen35moe" else tiny_gguf("qwen3moe", qtype)
    econf = EngineConfig(device="cuda", dtype="float32", kv_tokens=2048, weights="quantized", max_num_seqs=4)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for budget, ring in (("100%", 0), ("40%", 2), ("0%", 0)):
        what = f"{qtype} budget {budget} ring {ring}"
        scfg = SparkConfig(budget=budget, ring=ring, cpu_rows=0)
        monkeypatch.setenv("LUCEBOX_SPARK_GRAPHS", "0")
        eager, _ = spark_engine(path, econf, scfg, quiet=True)
        assert eager.runner.graphs is None
        want = eager.generate(PROMPTS, params)
        del eager
        monkeypatch.delenv("LUCEBOX_SPARK_GRAPHS")  # the default
        ours, spark = spark_engine(path, econf, scfg, quiet=True)
        runner = ours.runner
        assert runner.graphs is not None and runner.prefill_graphs is None and ours.ahead is None, what
        if ring:
            ours.warm_up(progress=False)  # every bucket captured up front, as serving does
        assert ours.generate(PROMPTS, params) == want, what
        assert warmup.COMPILES.in_capture[seen:] == [], what  # each capture rehearsed
        s = spark.stats
        assert runner.graphs.graphs and s.graph_steps + s.redos > 0, what
        if budget == "100%":
            assert s.redos == s.refetches == 0 and s.graph_steps > 0, what
        else:
            assert s.refetches + s.redos > 0, what
        if ring == 0 and budget == "0%":
            assert s.graph_steps == 0, what
        del ours, spark
        torch.cuda.empty_cache()
