"""DFlash speculative decoding: lossless against plain decoding, chain and DDTree, alone and batched."""

from __future__ import annotations

import gc
import itertools
import os
from pathlib import Path

import pytest
import torch

from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.engine.spec.dflash import build_tree
from lucebox.engine.spec.drafter import DFlashDrafter, drafter_config_for, load_drafter, save_drafter
from lucebox.engine.weights.loader import read_model_config
from lucebox.errors import ModelFileError


def random_drafter(target_path: Path, folder: Path, *, layers: int = 1, block: int = 8, seed: int = 0,
                   target_layers: list[int] | None = None) -> Path:
    cfg = read_model_config(target_path)
    dcfg = drafter_config_for(cfg, layers=layers, block_size=block, mask_token_id=cfg.vocab_size - 1,
                              target_layers=target_layers)
    save_drafter(DFlashDrafter.random(dcfg, seed=seed, std=0.2), folder)
    return folder


def engine(path: Path, device: str = "cpu", **kw) -> LLMEngine:
    return LLMEngine.from_path(path, EngineConfig(device=device, dtype="float32", kv_tokens=4096, **kw), quiet=True)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")


PROMPTS = [list(range(5, 30)), list(range(100, 140, 3)), [7, 9, 11], list(range(200, 260))]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("ddtree", [False, True])
def test_greedy_spec_equals_plain_on_tiny_random_pairs(tiny_gguf, tmp_path, arch, ddtree):
    target = tiny_gguf(arch, "F32", **({"sliding_window": 8} if arch == "gemma3" else {}))
    draft = random_drafter(target, tmp_path / "d", layers=2, block=6)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = engine(target).generate(PROMPTS, params)
    spec = engine(target, draft=str(draft), ddtree=ddtree, ddtree_budget=9)
    alone = [spec.generate([p], params)[0] for p in PROMPTS]
    together = spec.generate(PROMPTS, params)
    assert alone == plain
    assert together == plain
    assert spec.spec.stats.steps > 0
    assert spec.kv.pool.num_used == 0 and spec.spec.kv.pool.num_used == 0


def test_spec_respects_max_tokens_and_eos_inside_a_block(tiny_gguf, tmp_path):
    target = tiny_gguf("llama", "F32")
    draft = random_drafter(target, tmp_path / "d", block=8)
    plain = engine(target)
    spec = engine(target, draft=str(draft))
    for n in (1, 2, 5, 13):
        p = SamplingParams(max_tokens=n, ignore_eos=True)
        assert spec.generate([PROMPTS[0]], p) == plain.generate([PROMPTS[0]], p)
    # Make a token the model emits early an EOS: both stop at the same place.
    first = plain.generate([PROMPTS[1]], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    stop = SamplingParams(max_tokens=20, stop_token_ids=frozenset({first[6]}))
    a, b = plain.generate([PROMPTS[1]], stop)[0], spec.generate([PROMPTS[1]], stop)[0]
    assert a == b and a[-1] == first[6] and len(a) <= 7


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("ddtree", [False, True])
def test_speculative_steps_launched_ahead_equal_plain(tiny_gguf, tmp_path, ddtree, device, monkeypatch):
    """Greedy one-launch speculative steps launched one step ahead (runtime/ahead.py; eager on the CPU, CUDA
    graphs on the GPU), each row's last token and start taken on the device from the step in flight: plain
    decoding's tokens, with sequences ending by length or at an EOS while their next step is in flight (a
    wasted row), and every block back after."""
    from lucebox.engine.spec import static as static_mod

    monkeypatch.setattr(static_mod, "TREE_ONE_LAUNCH", True)
    target = tiny_gguf("llama", "F32")
    draft = random_drafter(target, tmp_path / "d", layers=2, block=6)
    plain_engine = engine(target, device)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (40, 7, 23, 31)]
    plain = plain_engine.generate(PROMPTS, params)
    spec = engine(target, device, draft=str(draft), ddtree=ddtree, ddtree_budget=9, spec_static=True,
                  spec_adaptive=False, ahead=True)
    assert spec.generate(PROMPTS, params) == plain
    assert spec.ahead.spec_steps > 10
    # The adaptive rule on: the random drafter is stopped, its plain steps run ahead, and a probe that starts as
    # a plain step launches makes the next step speculative (a catch-up chunk first), not that one.
    adaptive = engine(target, device, draft=str(draft), ddtree=ddtree, ddtree_budget=9, spec_static=True, ahead=True)
    long = SamplingParams(max_tokens=80, ignore_eos=True)
    assert adaptive.generate(PROMPTS, long) == plain_engine.generate(PROMPTS, long)
    stats = adaptive.adaptive.stats
    assert stats.stops > 0 and stats.probes > 0 and adaptive.ahead.steps > adaptive.ahead.spec_steps > 0
    stop = SamplingParams(max_tokens=30, stop_token_ids=frozenset({plain[0][9]}))
    assert spec.generate(PROMPTS, stop) == plain_engine.generate(PROMPTS, stop)
    assert spec.ahead.wasted > 0, "no sequence ended with its next step in flight: the case is not covered"
    assert spec.kv.pool.num_used == 0 and spec.spec.kv.pool.num_used == 0 and not spec.has_work()


SHIPPED = Path(__file__).resolve().parent.parent / "model_cards" / "drafters" / "smollm2-135m-instruct-dflash"


def chat_prompt(tok, text: str) -> list[int]:
    return tok.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


HELD_OUT = ["What is the capital of France?", "Natalia sold clips to 48 of her friends in April, and then she sold "
            "half as many clips in May. How many clips did Natalia sell altogether in April and May?",
            "Write a Python function that returns the n-th Fibonacci number."]


def test_a_held_sequence_stops_within_a_block_of_its_hold(tiny_gguf, tmp_path):
    """Speculation commits a verified block at once, so a sequence held at N output tokens (Sequence.hold_at)
    stops at N or a few tokens past it, never a block past; it gets no step while held, and once the hold
    is lifted it goes on losslessly."""
    target = tiny_gguf("llama", "F32")
    draft = random_drafter(target, tmp_path / "d", block=6)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = engine(target).generate(PROMPTS, params)
    spec = engine(target, draft=str(draft))
    seqs = [spec.add(p, params) for p in PROMPTS]
    holds = (0, 4, 11)
    for s, at in zip(seqs, holds):
        s.hold_at = at
    while spec.has_work():
        spec.step()
    assert seqs[3].output_ids == plain[3]
    for i, (s, at) in enumerate(zip(seqs, holds)):
        assert at <= s.num_output < at + 6 and not s.is_finished, (at, s.num_output)
        assert s.output_ids == plain[i][:s.num_output]
    assert spec.step() == [] and spec.spec.stats.steps > 0
    for s in seqs:
        s.hold_at = None
    while spec.has_work():
        spec.step()
    assert [s.output_ids for s in seqs] == plain
    assert spec.kv.pool.num_used == 0 and spec.spec.kv.pool.num_used == 0


def test_default_model_greedy_spec_equals_plain_with_its_shipped_drafter(smollm2_path, monkeypatch):
    """fp32: chain and DDTree give plain decoding's tokens, one sequence alone and three batched; also the
    fixed-shape steps (CUDA graphs on the GPU, eager here), where a greedy chain or tree is the one-launch step
    that builds the tree, walks it and compacts its KV on the device."""
    from lucebox.engine.spec import static as static_mod

    monkeypatch.setattr(static_mod, "TREE_ONE_LAUNCH", True)  # the tree's one-launch step (the default)
    plain = engine(smollm2_path)
    prompts = [chat_prompt(plain.tokenizer, q) for q in HELD_OUT]
    params = SamplingParams(max_tokens=24, ignore_eos=True)  # CI time: 4 engines x 4 sequences on the CPU
    ref = plain.generate(prompts, params)
    for ddtree, static in ((False, False), (True, False), (False, True), (True, True)):
        # the fixed-shape steps launched one step ahead, as on CUDA (runtime/ahead.py)
        spec = engine(smollm2_path, draft=str(SHIPPED), ddtree=ddtree, ddtree_budget=22, spec_static=static,
                      ahead=static)
        assert spec.generate(prompts[:1], params) == ref[:1]
        assert spec.generate(prompts, params) == ref
        assert spec.spec.stats.acceptance_length > 1.0
        if static:
            assert {k[0] for k in spec.spec.static.graphs} == {"tree" if ddtree else "chain"}  # one launch
            assert spec.ahead.spec_steps > 5, "the speculative steps did not run ahead"
        del spec  # one speculative engine at a time: CI's memory limit is 6 GB
        gc.collect()


def test_shipped_drafter_beats_a_fresh_one_on_held_out_prompts(smollm2_path, tmp_path):
    from lucebox.engine.weights.loader import load_model
    from lucebox.train.acceptance import measure_acceptance

    loaded = load_model(smollm2_path, device=torch.device("cpu"), dtype=torch.float32, quiet=True)
    fresh = tmp_path / "fresh"
    shipped = load_drafter(SHIPPED, loaded.config, "cpu", torch.float32)
    save_drafter(DFlashDrafter.random(shipped.cfg, seed=0), fresh)
    prompts = [chat_prompt(loaded.tokenizer, q) for q in HELD_OUT]
    taus = {name: measure_acceptance(loaded, d, prompts, 48, ddtree=True, budget=22).tau
            for name, d in (("fresh", fresh), ("shipped", SHIPPED))}
    print("DDTree tau on held-out prompts:", taus)
    assert taus["fresh"] < 1.05 and taus["shipped"] > taus["fresh"] + 0.2


def test_mismatched_drafter_is_refused(tiny_gguf, tmp_path):
    a = tiny_gguf("llama", "F32")
    b = tiny_gguf("qwen3", "F32")
    draft = random_drafter(a, tmp_path / "d")
    with pytest.raises(ModelFileError, match="hidden size|vocabulary"):
        load_drafter(draft, read_model_config(b).__class__(**{**read_model_config(a).__dict__,
                                                              "hidden_size": 32}), "cpu", torch.float32)
    with pytest.raises(ModelFileError, match="config.json"):
        engine(a, draft=str(tmp_path))


def test_a_loaded_drafter_keeps_its_weights_in_fused_projections_without_copies(tiny_gguf, tmp_path):
    """`ready` fuses q/k/v and gate/up into one matrix each for the kernels; the named weights become views of
    them (no second copy), and what is saved and loaded is unchanged."""
    a = tiny_gguf("qwen3", "F32")
    folder = random_drafter(a, tmp_path / "d")
    cfg = read_model_config(a)
    drafter = load_drafter(folder, cfg, "cpu", torch.float32)
    saved = drafter.state_dict()
    save_drafter(drafter, tmp_path / "again")
    again = load_drafter(tmp_path / "again", cfg, "cpu", torch.float32).state_dict()
    assert saved.keys() == again.keys() and all(torch.equal(saved[k], again[k]) for k in saved)
    for layer in drafter.layers:
        att, mlp = layer.self_attn, layer.mlp
        assert torch.equal(layer.qkv_weight, torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]))
        assert torch.equal(layer.gate_up_weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        for w in (att.q_proj.weight, att.v_proj.weight, layer.kv_weight):
            assert w.untyped_storage().data_ptr() == layer.qkv_weight.untyped_storage().data_ptr()
        assert mlp.up_proj.weight.untyped_storage().data_ptr() == layer.gate_up_weight.untyped_storage().data_ptr()


def test_build_tree_seeds_the_chain_then_grows_best_first():
    # 3 depths, top-3 each
    lp = [[-0.1, -1.0, -3.0], [-0.2, -0.5, -4.0], [-0.3, -2.0, -5.0]]
    ids = [[10, 11, 12], [20, 21, 22], [30, 31, 32]]
    # the whole chain first (the default), then by cumulative log-prob: sibling 21 of 20 (-0.6), its child 30
    # (-0.9), 11 (-1.0)
    tokens, parents = build_tree(lp, ids, budget=6)
    assert tokens[:3] == [10, 20, 30] and parents[:3] == [0, 1, 2]  # the top-1 chain under the root (row 0)
    assert tokens[3:] == [21, 30, 11] and parents[3:] == [1, 4, 0]
    assert build_tree(lp, ids, 6, seed=3) == (tokens, parents)
    # best-first from the root: 10 (-0.1), 20 (-0.3), then the tie at -0.6 in push order: sibling 21 before 20's
    # child 30; 30 under 21 (-0.9) before 11 (-1.0). The chain's end is the fifth node, not the third.
    assert build_tree(lp, ids, 6, seed=0) == ([10, 20, 21, 30, 30, 11], [0, 1, 1, 2, 3, 0])
    assert build_tree(lp, ids, 3, seed=0) == ([10, 20, 21], [0, 1, 1])  # a shallow sibling beats the chain's end
    assert build_tree(lp, ids, 3, seed=1) == ([10, 20, 21], [0, 1, 1])
    assert build_tree(lp, ids, 3, seed=2) == ([10, 20, 21], [0, 1, 1])
    assert build_tree(lp, ids, 2, seed=3) == ([10, 20], [0, 1])  # a chain longer than the tree fills it


def test_seed_depth_follows_the_acceptance_so_far(tiny_gguf, tmp_path):
    """A sequence's tree keeps the chain twice as deep as its steps commit: the engine's figure until the
    sequence has four steps of its own; the whole chain before any step."""
    from lucebox.engine.runtime.sequence import Sequence

    target = tiny_gguf("llama", "F32")
    eng = engine(target, draft=str(random_drafter(target, tmp_path / "d", layers=1, block=8)), ddtree=True,
                 ddtree_budget=10)
    spec, seq = eng.spec, Sequence([1, 2, 3], SamplingParams())
    assert spec.seed_depth(seq) == 7  # no step yet: the whole chain (block 8: 7 drafted tokens)
    spec.stats.steps, spec.stats.committed = 10, 15  # the engine: 1.5 tokens a step
    assert spec.seed_depth(seq) == 3
    seq.spec_steps, seq.spec_committed = 3, 30  # too few steps of its own
    assert spec.seed_depth(seq) == 3
    seq.spec_steps, seq.spec_committed = 4, 9  # 2.25 a step: 4.5 -> 5
    assert spec.seed_depth(seq) == 5
    seq.spec_steps, seq.spec_committed = 4, 32
    assert spec.seed_depth(seq) == 7  # at most the block


@pytest.mark.parametrize("seed", range(20))
def test_build_tree_keeps_the_most_probable_nodes(seed):
    """Unseeded, the tree is the `budget` paths of the largest cumulative log-prob among all K^1 + ... + K^D:
    what a drafter's own probabilities say accepts the most tokens; parents precede children."""
    gen = torch.Generator().manual_seed(seed)
    D, K, budget = 4, 3, 1 + seed % 17
    lp = torch.randn(D, K, generator=gen).mul(1.5).log_softmax(-1).sort(-1, descending=True).values.tolist()
    ids = [[100 * d + r for r in range(K)] for d in range(D)]
    tokens, parents = build_tree(lp, ids, budget, seed=0)
    assert len(tokens) == budget and all(p <= i for i, p in enumerate(parents))
    every = [sum(lp[d][r] for d, r in enumerate(ranks)) for n in range(1, D + 1)
             for ranks in itertools.product(range(K), repeat=n)]
    cum, depth = [0.0], [0]  # row 0: the root
    for t, p in zip(tokens, parents):
        depth.append(depth[p] + 1)
        assert t // 100 == depth[-1] - 1  # the node's token is one of its depth's
        cum.append(cum[p] + lp[t // 100][t % 100])
    assert sorted(cum[1:], reverse=True) == pytest.approx(sorted(every, reverse=True)[:budget])


def _draft_top(b: int, D: int, K: int, seed: int, ties: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lp = torch.randn(b, D, K, generator=gen).mul(2)
    if ties == "some":  # a few values repeated, exact zeros and -inf: ties everywhere
        lp = lp.round()
        lp[:, :, -1] = float("-inf")
    if ties == "peaked":  # one finite token per depth (masked logits): the tree grows on -inf candidates
        lp[:, :, 1:] = float("-inf")
    lp = lp.log_softmax(-1).sort(-1, descending=True).values
    return lp, torch.randperm(1000, generator=gen)[: b * D * K].view(b, D, K)


def _check_tree(nodes, parent, depth, bits, n: int) -> None:
    """Parents before children, depths that follow the parents, bits of the ancestor-or-self rows."""
    for r in range(1, n):
        assert parent[r] < r and depth[r] == depth[parent[r]] + 1
    for r in range(n):
        ancestors, a = 1 << r, r
        while a:
            a = int(parent[a])
            ancestors |= 1 << a
        assert int(bits[r]) & ((1 << 64) - 1) == ancestors


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs CUDA, or TRITON_INTERPRET=1 on the CPU")
@pytest.mark.parametrize("shape", [(4, 15, 8, 22), (3, 7, 8, 9), (1, 4, 3, 30), (2, 15, 8, 63), (3, 7, 8, 5)])
def test_tree_kernel_is_build_tree(shape, monkeypatch):
    """The Triton tree kernel runs build_tree itself: the same nodes in the same order, ties included."""
    from lucebox.engine.kernels import triton_tree

    if triton_tree.triton is None:
        pytest.skip("no triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(triton_tree, "ON_CPU", device == "cpu")
    b, D, K, budget = shape
    for ties in ("", "some", "peaked"):
        lp, tok = _draft_top(b, D, K, budget, ties=ties)
        # every chain depth in turn, the whole chain and none among them; a column of a wider buffer, as the
        # graphs pass it
        seeds = torch.zeros(b, 3, dtype=torch.long)
        seeds[:, 0] = (torch.arange(b) * 5 + len(ties)) % (D + 1)
        nodes, parent, depth, bits = (t.cpu() for t in triton_tree.draft_trees(
            lp.to(device), tok.to(device), budget + 1, seeds.to(device)[:, 0]))
        for i in range(b):
            want_tokens, want_parents = build_tree(lp[i].tolist(), tok[i].tolist(), budget, int(seeds[i, 0]))
            assert nodes[i].tolist() == want_tokens and parent[i, 1:].tolist() == want_parents
            _check_tree(nodes[i], parent[i], depth[i], bits[i], budget + 1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("ddtree", [False, True, "one launch"])
def test_static_steps_equal_dynamic_steps(tiny_gguf, tmp_path, arch, ddtree, device, monkeypatch):
    """The fixed-shape step (CUDA graphs on the GPU, eager on the CPU) gives the same tokens as the dynamic one,
    greedy and sampled (three launches); a greedy tree in one launch (TREE_ONE_LAUNCH, the default) or three."""
    from lucebox.engine.spec import static as static_mod

    monkeypatch.setattr(static_mod, "TREE_ONE_LAUNCH", ddtree == "one launch")
    one_launch_tree, ddtree = ddtree == "one launch", bool(ddtree)
    target = tiny_gguf(arch, "F32", **({"sliding_window": 8} if arch == "gemma3" else {}))
    draft = random_drafter(target, tmp_path / "d", layers=2, block=6)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain_engine = engine(target, device)
    plain = plain_engine.generate(PROMPTS, params)
    static = engine(target, device, draft=str(draft), ddtree=ddtree, ddtree_budget=9, spec_static=True)
    assert static.spec.static is not None
    assert static.generate(PROMPTS, params) == plain
    assert static.spec.static.graphs, "the static path did not run"
    # greedy: every step is the one-launch step (a chain's, or a tree's built on the device); CUDA's warm-up
    # captures every kind
    kinds = {"tree"} if one_launch_tree else {"draft", "verify", "extend"} if ddtree else {"chain"}
    captured = {k[0] for k in static.spec.static.graphs}
    assert captured == kinds if device == "cpu" else kinds <= captured
    assert static.kv.pool.num_used == 0 and static.spec.kv.pool.num_used == 0
    sampled = SamplingParams(max_tokens=30, temperature=0.9, seed=3, ignore_eos=True)
    dynamic = engine(target, device, draft=str(draft), ddtree=ddtree, ddtree_budget=9, spec_static=False)
    drawn = static.generate(PROMPTS[:2], sampled)
    assert drawn == dynamic.generate(PROMPTS[:2], sampled)
    # A seed's noise is a function of (seed, output position): speculating or not, the same tokens.
    assert drawn == plain_engine.generate(PROMPTS[:2], sampled)


@CUDA
@pytest.mark.parametrize("ddtree", [False, True])
def test_cuda_graph_spec_launched_ahead_with_the_shipped_drafter(smollm2_path, ddtree):
    """fp32 on CUDA, where one-launch speculative steps run one step ahead by default: with a drafter whose
    steps commit several tokens (so each next step's start comes from the device), plain decoding's tokens."""
    cfg = dict(device="cuda", dtype="float32", kv_tokens=8192)
    plain = LLMEngine.from_path(smollm2_path, EngineConfig(**cfg), quiet=True)
    prompts = [chat_prompt(plain.tokenizer, q) for q in HELD_OUT]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (64, 23, 41)]
    ref = plain.generate(prompts, params)
    spec = LLMEngine.from_path(smollm2_path, EngineConfig(**cfg, draft=str(SHIPPED), ddtree=ddtree, ddtree_budget=22,
                                                          spec_adaptive=False), quiet=True)
    assert spec.generate(prompts[:1], params[:1]) == ref[:1]
    assert spec.generate(prompts, params) == ref
    assert spec.ahead.spec_steps > 10 and spec.spec.stats.acceptance_length > 1.5
    assert spec.kv.pool.num_used == 0 and not spec.has_work()


@CUDA
@pytest.mark.parametrize("ddtree", [False, True])
def test_cuda_graph_spec_equals_plain(smollm2_path, tmp_path, ddtree):
    """On CUDA the speculative steps replay CUDA graphs; in fp32 they give plain decoding's tokens."""
    draft = random_drafter(smollm2_path, tmp_path / "d", layers=1, block=8, target_layers=[2, 15, 27])
    cfg = dict(device="cuda", dtype="float32", kv_tokens=8192)
    plain = LLMEngine.from_path(smollm2_path, EngineConfig(**cfg), quiet=True)
    spec = LLMEngine.from_path(smollm2_path, EngineConfig(**cfg, draft=str(draft), ddtree=ddtree, ddtree_budget=12),
                               quiet=True)
    assert spec.spec.static is not None
    tok = plain.tokenizer
    prompts = [tok.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"),
               tok.encode("def fib(n):\n    "), tok.encode("The three primary colors are")]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    assert spec.generate(prompts, params) == plain.generate(prompts, params)
    assert any(k[0] == ("tree" if ddtree else "chain") for k in spec.spec.static.graphs)
    # The random drafter does not pay: the adaptive rule stops it, and those plain steps run ahead (graphs).
    assert spec.adaptive.stats.stops > 0 and spec.ahead is not None and spec.ahead.steps > 0
    # Its prompts, and the chunks that catch its context up when a probe drafts again, replay prefill graphs.
    assert spec.runner.prefill_graphs is not None and spec.runner.prefill_graphs.replays > 0
