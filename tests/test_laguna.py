"""Laguna (poolside Laguna-XS.2's architecture, transformers' `laguna`) against transformers 5.24, fp32 on the CPU.

A tiny random model (tests/fixtures/tiny_models.py LAGUNA_SHAPE: 4 layers, layer 0 full attention with yarn
rope on half of each head, layers 1-3 a 16-token sliding window with default rope on all of it; 4 then 6 query
heads over 2 K/V heads; a softplus output gate per head; layer 0 a dense SwiGLU, layers 1-3 8 experts top-2
behind a sigmoid router with a selection bias, plus a shared expert) built by transformers and loaded by
Lucebox from its HF folder. Prompts are longer than the window and than one 16-token prefill chunk.
Tolerance: test_parity's (max |logit diff| <= 1e-4 x max |logit|).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from lucebox.engine.kernels import triton_moe, triton_ops
from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.engine.runtime.sequence import Chunk, Sequence
from lucebox.engine.weights.loader import read_model_config
from lucebox.errors import ModelFileError
from tests.fixtures.tiny_models import tiny_laguna_model, write_tiny_laguna_hf
from tests.test_parity import assert_close

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

CHUNK = 16  # the engine's prefill budget per step here: the tiny window's size, so prompts take several chunks


def prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in torch.randint(3, 380, (n,), generator=torch.Generator().manual_seed(seed))]


@pytest.fixture(scope="module")
def reference():
    return tiny_laguna_model(seed=0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_laguna_hf(tmp_path_factory.mktemp("laguna") / "hf", seed=0)


def engine(path: Path, **kw) -> LLMEngine:
    kw.setdefault("max_step_tokens", CHUNK)
    kw.setdefault("kv_tokens", 2048)
    return LLMEngine.from_path(path, EngineConfig(device="cpu", dtype="float32", **kw), quiet=True)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@torch.no_grad()
def chunked_logits(e: LLMEngine, ids: list[int], chunk: int) -> torch.Tensor:
    """Every position's logits with the prompt prefilled `chunk` rows a step (each chunk attends to the
    cached K/V of the ones before it), as the scheduler runs a long prompt."""
    model = e.loaded.model
    seq = Sequence(list(ids), SamplingParams())
    seq.block_table = e.kv.pool.allocate(e.kv.blocks_for(len(ids)))
    try:
        out = []
        for start in range(0, len(ids), chunk):
            inputs = e.runner.prepare([Chunk(seq, start, min(chunk, len(ids) - start))])
            hidden, _ = model(inputs.input_ids, inputs.positions, e.kv.data, inputs.meta)
            out.append(model.logits(hidden).float())
        return torch.cat(out)
    finally:
        e.kv.pool.decref(seq.block_table)


def test_config(folder) -> None:
    """config.json as Lucebox reads it: per-layer heads, layer kinds and rotary dims, the MoE layers."""
    cfg = read_model_config(folder)
    assert (cfg.arch, cfg.heads_per_layer, cfg.num_kv_heads, cfg.softplus_gate) == ("laguna", [4, 6, 6, 6], 2, 1)
    assert (cfg.layer_types, cfg.sliding_window) == (["full", "sliding", "sliding", "sliding"], 16)
    assert (cfg.rotary_dim, cfg.rope_local_dim, cfg.rope_scaling.kind, cfg.rope_local_scaling.kind) == (
        16, 32, "yarn", "none")
    assert (cfg.moe_layers, cfg.moe_router, cfg.expert_weights_scale) == ([False, True, True, True], "sigmoid", 2.5)
    assert (cfg.shared_expert_ff, cfg.shared_expert_gate, cfg.tie_word_embeddings) == (48, False, False)
    ref = sum(p.numel() for n, p in tiny_laguna_model().named_parameters()
              if not n.endswith(("norm.weight", "e_score_correction_bias")))
    assert cfg.n_params() == ref


def test_logits_match_transformers(folder, reference) -> None:
    """Every position's logits over a 150-token prompt (about 9 windows), in one pass and prefilled in 16-token
    chunks (the sliding layers then read keys of earlier chunks from the cache)."""
    e = engine(folder)
    assert e.kv.data.shape[0] == 4 and e.kv.data.shape[3] == 2  # K/V per layer, 2 heads each: one cache shape
    ids = prompt(150, 1)
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits[0]
    assert_close(e.score(ids), ref, "laguna one pass")
    assert_close(chunked_logits(e, ids, CHUNK), ref, "laguna chunked")


def test_greedy_matches_generate(folder, reference) -> None:
    """A 45-token prompt prefilled in 16-token chunks, then 20 decode steps (past more than one window): the
    tokens of transformers' greedy generate."""
    ids = prompt(45, 2)
    assert engine(folder).generate([ids], greedy(20))[0] == hf_greedy(reference, ids, 20)


def test_batched_equals_alone(folder) -> None:
    """Three sequences of different lengths in the same steps (prefill chunks beside decodes, decodes of
    different context lengths batched, each layer's head count over one cache): each gets what it gets alone."""
    e = engine(folder)
    prompts = [prompt(9, 4), prompt(37, 3), prompt(23, 11)]
    alone = [e.generate([p], greedy(12))[0] for p in prompts]
    seqs = [e.add(p, greedy(12)) for p in prompts]
    shapes = set()
    while e.has_work():
        e.step()
        rows = [n for _, _, n in e.last_step]
        shapes.add((rows.count(1), sum(n > 1 for n in rows)))
    assert [s.output_ids for s in seqs] == alone
    assert any(d >= 1 and p >= 1 for d, p in shapes) and (3, 0) in shapes


def test_prefix_cache_hit_equals_no_cache(folder) -> None:
    """Not a hybrid: the prefix cache is on. A prompt again (its blocks shared), and one extending it, give
    what an engine without the cache gives (the window's keys come back from the shared blocks)."""
    from lucebox.cache.manager import CacheConfig
    from tests.test_cache_async import run

    first, longer = prompt(40, 7), prompt(40, 7) + prompt(20, 8)
    cold = [engine(folder).generate([p], greedy(8))[0] for p in (first, longer)]
    e = engine(folder)
    e.enable_prefix_cache(CacheConfig(gpu=True, min_tokens=16))
    try:
        assert run(e, first, 8).output_ids == cold[0]
        again, extended = run(e, first, 8), run(e, longer, 8)
        assert again.num_cached >= 32 and extended.num_cached >= 32
        assert [again.output_ids, extended.output_ids] == cold
    finally:
        e.cache.clear()
        e.cache.poll()


@pytest.mark.parametrize("ddtree", [False, True])
def test_speculative_equals_plain(folder, tmp_path, ddtree: bool) -> None:
    """A random tiny DFlash drafter on the Laguna target, chain and tree verify (many rows per step through
    every layer's head count, the window and the experts): plain decoding's tokens."""
    from lucebox.engine.spec.drafter import DFlashDrafter, drafter_config_for, save_drafter

    cfg = read_model_config(folder)
    dcfg = drafter_config_for(cfg, layers=1, block_size=6, mask_token_id=cfg.vocab_size - 1)
    save_drafter(DFlashDrafter.random(dcfg, seed=0, std=0.2), tmp_path / "d")
    prompts = [prompt(25, 9), prompt(40, 10)]
    plain = engine(folder).generate(prompts, greedy(12))
    spec = engine(folder, draft=str(tmp_path / "d"), ddtree=ddtree, ddtree_budget=9)
    assert spec.generate(prompts, greedy(12)) == plain
    assert spec.spec.stats.steps > 0


def test_pflash_scores_match_a_slow_reference(folder, reference) -> None:
    """The PFlash scorer runs Laguna's blocks with its own dense attention (the output gate recomputed from
    the layer input, partial rotary in the full layer, the window in the others): its token importances are
    those the slow reference computes from transformers' layers."""
    from lucebox.engine.pflash import PFlashConfig, token_importance
    from tests.test_pflash import reference_importance

    ids = prompt(70, 12)
    cfg = PFlashConfig()
    ours = token_importance(engine(folder).loaded.model, ids, cfg)
    torch.testing.assert_close(ours, reference_importance(reference, ids, cfg.n_lookahead), rtol=1e-4, atol=1e-6)
    assert ours.std() > 0.01


def test_per_element_gate(tmp_path) -> None:
    """gating "per-element": one gate value per channel (g_proj of heads x head_dim rows)."""
    path = write_tiny_laguna_hf(tmp_path / "hf", seed=3, gating="per-element")
    assert read_model_config(path).softplus_gate == 32
    ids = prompt(40, 5)
    with torch.no_grad():
        ref = tiny_laguna_model(seed=3, gating="per-element")(torch.tensor([ids])).logits[0]
    assert_close(engine(path).score(ids), ref, "laguna per-element gate")


@pytest.mark.parametrize(("change", "message"), [
    ({"num_attention_heads_per_layer": [4, 6, 6]}, r"num_attention_heads_per_layer is a list of 3 items"),
    ({"num_attention_heads_per_layer": [4, 5, 6, 6]}, r"5 attention heads cannot share 2"),
    ({"layer_types": ["full_attention", "linear_attention", "sliding_attention", "sliding_attention"]},
     r"layer_types is a list of 4 items, not a list of full_attention / sliding_attention"),
    ({"gating": "per-token"}, r"gating is the text 'per-token'"),
    ({"moe_router_logit_softcapping": 30.0}, r"moe_router_logit_softcapping .* not supported"),
])
def test_bad_configs_are_model_file_errors(folder, tmp_path, change: dict, message: str) -> None:
    conf = {**json.loads((folder / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ModelFileError, match=message):
        read_model_config(tmp_path)


def test_real_config(tmp_path) -> None:
    """Laguna-XS.2's config.json fields (from the project's facts file): 48 query heads in the 10
    full-attention layers (every 4th from 0), 64 in the 30 sliding ones, rotary on 64 of 128 dims in full
    layers and all 128 in sliding ones, layer 0 dense; about 33.4B parameters."""
    conf = {"model_type": "laguna", "architectures": ["LagunaForCausalLM"], "vocab_size": 100352,
            "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 40, "num_attention_heads": 48,
            "num_attention_heads_per_layer": [48, 64, 64, 64] * 10, "num_key_value_heads": 8, "head_dim": 128,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "sliding_window": 512,
            "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"] * 10,
            "mlp_layer_types": ["dense"] + ["sparse"] * 39, "num_experts": 256, "num_experts_per_tok": 8,
            "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "moe_routed_scaling_factor": 2.5,
            "gating": True, "tie_word_embeddings": False, "attention_bias": False,
            "rope_parameters": {
                "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 32.0,
                                   "original_max_position_embeddings": 4096, "beta_slow": 1.0, "beta_fast": 64.0,
                                   "attention_factor": 1.0, "partial_rotary_factor": 0.5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}
    (tmp_path / "config.json").write_text(json.dumps(conf))
    cfg = read_model_config(tmp_path)
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full"] == list(range(0, 40, 4))
    assert {cfg.layer_heads(i) for i in range(0, 40, 4)} == {48} and cfg.layer_heads(1) == 64
    assert (cfg.rotary_dim, cfg.rope_local_dim, cfg.rope_theta, cfg.rope_local_theta) == (64, 128, 5e5, 1e4)
    assert (cfg.rope_scaling.factor, cfg.rope_scaling.original_max_position, cfg.rope_scaling.beta_fast) == (
        32.0, 4096, 64.0)
    assert (cfg.n_experts, cfg.n_experts_used, cfg.is_moe(0), cfg.is_moe(1)) == (256, 8, False, True)
    assert round(cfg.n_params() / 1e9, 1) == 33.4


@pytest.mark.skipif(triton_ops.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the fused path on the CPU needs triton's interpreter (TRITON_INTERPRET=1)")
def test_fused_path_gives_the_eager_tokens(folder, monkeypatch) -> None:
    """The block's fused path (Triton norms, rope_qk_and_cache on the sliding layers, the eager q/k/v on the
    partial-rotary full layer, the experts' kernel) gives the eager path's greedy tokens, across the window."""
    ids = prompt(20, 6)
    eager = engine(folder).generate([ids], greedy(6))
    monkeypatch.setattr(triton_ops, "ON_CPU", True)
    monkeypatch.setattr(triton_moe, "ON_CPU", True)
    calls = []
    rope = triton_ops.rope_qk_and_cache
    monkeypatch.setattr(triton_ops, "rope_qk_and_cache", lambda *a, **kw: calls.append(1) or rope(*a, **kw))
    assert engine(folder).generate([ids], greedy(6)) == eager
    assert calls, "the fused path must have run"
