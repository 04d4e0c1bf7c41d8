"""PFlash: chunk selection rules, scorer scores against a slow reference, sparse vs dense scorer attention,
re-tokenization between different tokenizers, needle retention on the real default model, the benchmark."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lucebox.engine.models.dense_attention import dense_attention
from lucebox.engine.pflash import PFlash, PFlashConfig, ScoredPrompt, same_tokenizer, select_chunks, token_importance
from lucebox.engine.pflash.selection import anchor_chunks, chunk_means, head_tail, smooth
from lucebox.engine.pflash.sparse import select_blocks, sparse_attention
from lucebox.engine.weights.loader import load_model
from lucebox.errors import LuceboxError
from tests.fixtures.tiny_models import tiny_hf_model

# ----- selection on hand-made score vectors ------------------------------------------------------------------


def distinct_ids(n: int) -> list[int]:
    return [10_000 + i for i in range(n)]


def test_smooth_is_an_edge_truncated_average_and_chunks_are_means():
    x = torch.tensor([float(v) for v in [5, 0, 0, 1, 9, 2, 0, 0, 3, 7]])
    k = 5
    want = [sum(x[max(0, i - 2):i + 3].tolist()) / len(x[max(0, i - 2):i + 3]) for i in range(len(x))]
    assert torch.allclose(smooth(x, k), torch.tensor(want))
    assert torch.equal(smooth(x, 1), x)
    assert torch.allclose(chunk_means(x, 4), torch.tensor([1.5, 2.75, 5.0]))  # last chunk: 2 tokens


def test_keeps_head_tail_and_best_chunks_in_order():
    cfg = PFlashConfig(keep_ratio=0.05, pool_kernel=1)  # 1000 chunks -> n_keep 50 = 8 head + 24 tail + 18 best
    n_chunks = 1000
    chunk_score = torch.zeros(n_chunks)
    best = [500, 100, 900, 300, 650, 222, 777, 444, 555, 888, 111, 333, 666, 999 - 30, 50, 60, 70, 80, 90, 95]
    for rank, c in enumerate(best):
        chunk_score[c] = 10.0 - rank * 0.1
    scores = chunk_score.repeat_interleave(32)
    sel = select_chunks(scores, distinct_ids(32 * n_chunks), cfg)
    assert sel.n_chunks == n_chunks and sel.n_keep == 50 and (sel.head, sel.tail) == (8, 24)
    assert sel.kept == sorted(sel.kept) and len(sel.kept) == 50
    assert set(range(8)) | set(range(976, 1000)) <= set(sel.kept)
    assert set(sel.kept) - set(range(8)) - set(range(976, 1000)) == set(best[:18])
    assert sel.anchors == []


def test_head_and_tail_scale_down_to_leave_one_chunk():
    cfg = PFlashConfig(keep_ratio=0.1, pool_kernel=1)
    assert head_tail(100, 10, cfg) == (2, 6)  # 8 + 24 > 9: both scaled by 9/32 and rounded down
    assert head_tail(2000, 200, cfg) == (8, 24)
    assert head_tail(50, 5, cfg) == (1, 3)
    assert head_tail(10, 1, cfg) == (0, 0)
    scores = torch.zeros(100 * 32)
    scores[40 * 32:41 * 32] = 1.0  # chunk 40 is the best, 60 the second best
    scores[60 * 32:61 * 32] = 0.5
    sel = select_chunks(scores, distinct_ids(3200), cfg)
    assert sel.kept == [0, 1, 40, 60] + list(range(94, 100))
    two_chunks = torch.cat([torch.zeros(32), torch.ones(18)])  # 2 chunks -> n_keep 1: no head/tail, the best
    assert select_chunks(two_chunks, distinct_ids(50), cfg).kept == [1]


def test_anchor_chunks_within_radius_of_rare_ngrams():
    cfg = PFlashConfig(keep_ratio=0.25, pool_kernel=1, head_chunks=1, tail_chunks=1)
    S = 64 * 32
    ids = distinct_ids(S)
    gram = [7, 8, 9, 10]
    ids[S - 20:S - 16] = gram  # the question ends the prompt
    ids[500:504] = gram  # chunk 15: the needle
    scores = torch.zeros(S)
    scores[45 * 32:46 * 32] = 1.0
    sel = select_chunks(scores, ids, cfg)
    assert sel.n_keep == 16
    assert sel.anchors == [13, 14, 15, 16, 17]  # radius 2 under 1024 chunks
    assert {0, 63, 45} <= set(sel.kept) and len(sel.kept) == 16
    assert cfg.anchor_params(1023) == (2, 8) and cfg.anchor_params(1024) == (4, 16)
    assert cfg.anchor_params(2047) == (4, 16) and cfg.anchor_params(5000) == (8, 32)
    assert select_chunks(scores, ids, PFlashConfig(**{**cfg.__dict__, "anchors": False})).anchors == []


def test_anchor_hit_limit_and_occurrence_window():
    cfg = PFlashConfig(pool_kernel=1)
    S = 64 * 32
    gram = [7, 8, 9, 10]

    def with_gram(starts: list[int]) -> list[int]:
        ids = distinct_ids(S)
        ids[S - 10:S - 6] = gram
        for p in starts:
            ids[p:p + 4] = gram
        return ids

    eight = [100 + 200 * i for i in range(8)]
    assert anchor_chunks(with_gram(eight), 64, cfg)[:8] == sorted(p // 32 for p in eight)
    assert anchor_chunks(with_gram(eight + [1900]), 64, cfg) == []  # 9 occurrences > max_hits 8
    # An occurrence counts only when the whole n-gram lies within [0, S - 100].
    assert anchor_chunks(with_gram([S - 103]), 64, cfg)[0] == (S - 103) // 32
    assert anchor_chunks(with_gram([S - 102]), 64, cfg) == []


def test_anchor_budget_takes_the_ngram_nearest_the_question_first():
    cfg = PFlashConfig(keep_ratio=0.05, pool_kernel=1, head_chunks=1, tail_chunks=1)  # 100 chunks -> n_keep 5
    S = 100 * 32
    ids = distinct_ids(S)
    ids[S - 20:S - 16] = [7, 8, 9, 10]
    ids[40 * 32 + 5:40 * 32 + 9] = [7, 8, 9, 10]
    ids[S - 60:S - 56] = [1, 2, 3, 4]  # a rare n-gram further from the end: its ring 0 comes second
    ids[70 * 32 + 5:70 * 32 + 9] = [1, 2, 3, 4]
    sel = select_chunks(torch.zeros(S), ids, cfg)
    # The n-gram nearer the prompt's end first, its own chunk, then the rings around it (earlier first).
    assert sel.kept == [0, 39, 40, 41, 99]
    assert sel.anchors == [39, 40, 41]
    assert anchor_chunks(ids, 100, cfg) == [40, 39, 41, 38, 42, 70, 69, 71, 68, 72]


def test_config_is_validated():
    PFlashConfig().validate()
    for bad in ({"keep_ratio": 0}, {"keep_ratio": 1.5}, {"chunk": 0}, {"alpha": 2.0},
                {"sparse_attention": "magic"}, {"head_chunks": -1}):
        with pytest.raises(LuceboxError):
            PFlashConfig(**bad).validate()


# ----- query survival and re-tokenization (real tokenizers of tiny GGUF models) ----------------------------------


TEXT = "".join(f"Sentence {i} says the colour is {['red', 'blue', 'green'][i % 3]}. " for i in range(60))


@pytest.fixture(scope="module")
def tiny_llama(tiny_gguf):
    return load_model(tiny_gguf("llama", "F32"), quiet=True)


@pytest.fixture(scope="module")
def tiny_gemma(tiny_gguf):
    return load_model(tiny_gguf("gemma3", "F32", sliding_window=8), quiet=True)


def scored_by_hand(loaded, text: str, scores_for) -> ScoredPrompt:
    enc = loaded.tokenizer.hf.encode(text, add_special_tokens=False)
    scores = torch.tensor([float(scores_for(i, len(enc.ids))) for i in range(len(enc.ids))])
    return ScoredPrompt(text, list(enc.ids), [tuple(o) for o in enc.offsets], scores, 0.0)


def test_query_survival_appends_the_last_user_message_again(tiny_llama):
    cfg = PFlashConfig(keep_ratio=0.2, pool_kernel=1, chunk=8, head_chunks=1, tail_chunks=4)
    pf = PFlash.for_model(tiny_llama, config=cfg)
    query = "Which colour does sentence 7 name?"
    suffix = "<|im_end|>\n<|im_start|>assistant\n"
    text = f"<|im_start|>user\n{TEXT}{query}{suffix}"
    scored = scored_by_hand(tiny_llama, text, lambda i, n: 1.0 / (1 + i))  # earlier chunks score higher
    S = len(scored.ids)
    assert len(tiny_llama.tokenizer.encode(suffix, add_special=False)) <= 24  # the tail chunks hold the suffix
    res = pf.select(scored, query=query)
    assert res.query_appended
    assert res.text.endswith(query + suffix) and res.text.count(query) == 1
    assert res.ids == [t for a, b in _ranges(res.kept_chunks, 8, S, scored, query) for t in scored.ids[a:b]]
    assert res.text == tiny_llama.tokenizer.decode(res.ids)
    # A message that mostly survived, one over query_max_tokens, or one not in the prompt is not appended.
    kept_all = pf.select(scored, query=query, keep_ratio=1.0)
    assert not kept_all.query_appended and kept_all.text == text and kept_all.ids == scored.ids
    long_limit = PFlashConfig(**{**cfg.__dict__, "query_max_tokens": 5})
    assert not pf.select(scored, query=query, config=long_limit).query_appended
    assert not pf.select(scored, query="not in the prompt").query_appended
    assert pf.select(scored, query="not in the prompt").ids == [
        t for c in res.kept_chunks for t in scored.ids[c * 8:(c + 1) * 8]]


def _ranges(kept, chunk, S, scored, query):
    """The token ranges the survival rule should produce (independent re-derivation)."""
    c0 = scored.text.rfind(query)
    c1 = c0 + len(query)
    qs = min(i for i, o in enumerate(scored.offsets) if o[1] > c0)
    qe = min(i for i, o in enumerate(scored.offsets) if o[0] >= c1)
    toks = [t for c in kept for t in range(c * chunk, min(S, (c + 1) * chunk))]
    return [(t, t + 1) for t in toks if t < qe] + [(qs, qe)] + [(t, t + 1) for t in toks if t >= qe]


def test_retokenizes_between_different_tokenizers(tiny_llama, tiny_gemma):
    assert not same_tokenizer(tiny_llama.tokenizer, tiny_gemma.tokenizer)
    assert same_tokenizer(tiny_llama.tokenizer, load_model(tiny_llama.path, quiet=True).tokenizer)
    cfg = PFlashConfig(keep_ratio=0.3, chunk=16, head_chunks=1, tail_chunks=2)
    pf = PFlash.for_model(tiny_llama, scorer=tiny_gemma, config=cfg)
    assert not pf.shared_tokenizer
    res = pf.compress(TEXT)
    gemma_ids = tiny_gemma.tokenizer.encode(TEXT, add_special=False)
    assert res.scorer_tokens == len(gemma_ids) and res.n_chunks == math.ceil(len(gemma_ids) / 16)
    assert res.original_tokens == len(tiny_llama.tokenizer.encode(TEXT, add_special=False))
    assert res.ids == tiny_llama.tokenizer.encode(res.text, add_special=False)  # target ids of the kept text
    assert 1 < res.ratio and len(res.kept_chunks) == max(1, math.floor(res.n_chunks * 0.3))
    # The text is the kept scorer chunks, in order, and nothing of the dropped ones.
    at = 0
    for c in res.kept_chunks:
        piece = tiny_gemma.tokenizer.decode(gemma_ids[c * 16:(c + 1) * 16]).strip()
        at = res.text.index(piece, at) + len(piece)
    markers = sum(f"Sentence {i} says" in res.text for i in range(60))
    assert 5 < markers < 35  # about 30% of the sentences
    full = pf.compress(TEXT, keep_ratio=1.0)
    assert full.text == TEXT and full.ids == tiny_llama.tokenizer.encode(TEXT, add_special=False)


def test_shared_tokenizer_keeps_the_chunk_ids(tiny_llama):
    pf = PFlash.for_model(tiny_llama, config=PFlashConfig(keep_ratio=0.25, chunk=16, head_chunks=1, tail_chunks=1))
    assert pf.shared_tokenizer
    res = pf.compress(TEXT)
    ids = tiny_llama.tokenizer.encode(TEXT, add_special=False)
    assert res.ids == [t for c in res.kept_chunks for t in ids[c * 16:(c + 1) * 16]]
    assert res.text == "".join(TEXT[a:b] for a, b in _spans(tiny_llama, TEXT, res.kept_chunks, 16))
    assert res.ratio == pytest.approx(len(ids) / len(res.ids))
    assert res.scorer_seconds > 0 and res.total_seconds >= res.scorer_seconds


def _spans(loaded, text, kept, chunk):
    offs = loaded.tokenizer.hf.encode(text, add_special_tokens=False).offsets
    n = len(offs)
    for c in kept:
        a, b = c * chunk, min(n, (c + 1) * chunk)
        yield (0 if a == 0 else offs[a][0]), (len(text) if b == n else offs[b][0])


# ----- scorer scores against a slow reference ---------------------------------------------------------------


def reference_importance(hf, ids: list[int], n_lookahead: int) -> torch.Tensor:
    """Per layer: pre-RoPE q/k from transformers' own layer input and weights, softmax over the causal
    tail, max over heads; max over layers; mean over the queries. Loops, no batching."""
    S = len(ids)
    with torch.no_grad():
        hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
        running = torch.zeros(n_lookahead, S)
        for layer, h in zip(hf.model.layers, hidden):
            attn = layer.self_attn
            x = layer.input_layernorm(h[0])
            d = attn.head_dim
            q = attn.q_proj(x).view(S, -1, d)
            k = attn.k_proj(x).view(S, -1, d)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            group = q.shape[1] // k.shape[1]
            for i in range(n_lookahead):
                pos = S - n_lookahead + i
                for head in range(q.shape[1]):
                    logits = torch.stack([q[pos, head] @ k[s, head // group] for s in range(pos + 1)]) / math.sqrt(d)
                    p = torch.softmax(logits.double(), 0).float()
                    running[i, : pos + 1] = torch.maximum(running[i, : pos + 1], p)
    return running.mean(0)


SCORER_ARCHS = [("llama", {}), ("qwen3", {}), ("gemma3", {"sliding_window": 8})]


@pytest.mark.parametrize("arch,overrides", SCORER_ARCHS)
def test_scores_match_a_slow_reference(tiny_gguf, arch, overrides):
    loaded = load_model(tiny_gguf(arch, "F32", **overrides), quiet=True)
    hf = tiny_hf_model(arch, **overrides)
    ids = random.Random(arch).choices(range(3, loaded.config.vocab_size), k=70)
    cfg = PFlashConfig()
    ours = token_importance(loaded.model, ids, cfg)
    ref = reference_importance(hf, ids, cfg.n_lookahead)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-6)
    assert ours.std() > 0.01  # not a flat vector
    assert ours[-1] <= 1 / cfg.n_lookahead + 1e-6  # the last token is seen by the last query only


# ----- block-sparse scorer attention ------------------------------------------------------------------------


def qkv(S: int, hq: int = 4, hkv: int = 2, d: int = 32, seed: int = 0, device: str = "cpu",
        dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(S, h, d, generator=g).to(device=device, dtype=dtype) for h in (hq, hkv, hkv)]


def masked_reference(q, k, v, keep: torch.Tensor, block: int, scale: float) -> torch.Tensor:
    """SDPA with the element mask the kept blocks stand for (causal inside)."""
    S = q.shape[0]
    blk = torch.arange(S, device=q.device) // block
    elem = keep[:, blk][:, :, blk] & (torch.arange(S)[:, None] >= torch.arange(S)[None, :]).to(q.device)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=elem[None], scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def test_flex_attention_runs_on_cpu_in_this_torch():
    """torch's flex_attention runs eagerly on CPU (unfused, materialized scores): the CPU tests below use it."""
    from torch.nn.attention.flex_attention import flex_attention  # noqa: F401  (import is the check)

    q, k, v = qkv(130)
    out = sparse_attention(q, k, v, PFlashConfig(sparse_block=64, alpha=0.0), 0.2)
    assert out.shape == q.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("window", [None, 50])
def test_sparse_attention_equals_dense_when_the_mask_keeps_everything(window):
    q, k, v = qkv(300)  # not a whole number of blocks: the padding path
    cfg = PFlashConfig(alpha=0.0)
    torch.testing.assert_close(sparse_attention(q, k, v, cfg, 0.15, window), dense_attention(q, k, v, 0.15, window),
                               rtol=1e-5, atol=1e-5)


def test_sparse_attention_drops_exactly_the_unselected_blocks():
    q, k, v = qkv(1000, seed=3)
    u = torch.randn(q.shape[-1], generator=torch.Generator().manual_seed(4))
    q += u  # every query looks for u, found in key blocks 3 and 9
    k[3 * 64:4 * 64] += u
    k[9 * 64:10 * 64] += u
    cfg = PFlashConfig(alpha=0.5, sparse_block=64, sink_blocks=1, window_blocks=1, dense_last_q_blocks=1)
    keep = select_blocks(q, k, cfg, 0.2)
    nb = keep.shape[-1]
    causal_blocks = nb * (nb + 1) // 2 * keep.shape[0]
    assert 0 < keep.sum() < causal_blocks  # the selection really drops blocks
    assert keep[:, :, 0].all() and keep[:, torch.arange(nb), torch.arange(nb)].all() and keep[:, -1].all()
    assert keep[:, 10:, 9].all() and keep[:, 4:, 3].all() and not keep[:, 12:-1, 5].any()
    torch.testing.assert_close(sparse_attention(q, k, v, cfg, 0.2), masked_reference(q, k, v, keep, 64, 0.2),
                               rtol=1e-5, atol=1e-5)
    assert not torch.allclose(sparse_attention(q, k, v, cfg, 0.2), dense_attention(q, k, v, 0.2), atol=1e-3)


@pytest.mark.parametrize("arch,overrides", [("qwen3", {}), ("gemma3", {"sliding_window": 8})])
def test_scorer_with_sparse_attention_equals_dense_when_nothing_is_dropped(tiny_gguf, arch, overrides):
    loaded = load_model(tiny_gguf(arch, "F32", **overrides), quiet=True)
    ids = random.Random(1).choices(range(3, loaded.config.vocab_size), k=300)
    dense = token_importance(loaded.model, ids, PFlashConfig(sparse_attention="dense"))
    sparse = token_importance(loaded.model, ids, PFlashConfig(sparse_attention="flex", alpha=0.0))
    torch.testing.assert_close(sparse, dense, rtol=1e-4, atol=1e-6)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compiled flex_attention)")


@cuda
@pytest.mark.parametrize("window", [None, 200])
def test_cuda_sparse_attention_equals_dense_when_the_mask_keeps_everything(window):
    q, k, v = qkv(1000, hq=8, hkv=2, d=64, device="cuda")
    cfg = PFlashConfig(alpha=0.0)
    torch.testing.assert_close(sparse_attention(q, k, v, cfg, 0.125, window),
                               dense_attention(q, k, v, 0.125, window), rtol=5e-3, atol=5e-3)
    q += torch.randn(q.shape[-1], device="cuda")  # structure, so that the selection drops blocks
    cfg = PFlashConfig(alpha=0.5, sink_blocks=1, window_blocks=1, dense_last_q_blocks=1)
    keep = select_blocks(q, k, cfg, 0.125)
    torch.testing.assert_close(sparse_attention(q, k, v, cfg, 0.125), masked_reference(q, k, v, keep, 128, 0.125),
                               rtol=5e-3, atol=5e-3)


@cuda
def test_cuda_scorer_sparse_equals_dense_in_bf16(tiny_gguf):
    loaded = load_model(tiny_gguf("qwen3", "F32"), device="cuda", dtype=torch.bfloat16, quiet=True)
    ids = random.Random(2).choices(range(3, loaded.config.vocab_size), k=700)
    dense = token_importance(loaded.model, ids, PFlashConfig(sparse_attention="dense"))
    sparse = token_importance(loaded.model, ids, PFlashConfig(sparse_attention="auto", alpha=0.0))
    assert ((sparse - dense).norm() / dense.norm()).item() < 0.02  # bf16 noise only


# ----- needle in a haystack on the real default model ----------------------------------------------------


def test_niah_on_the_default_model_keeps_the_needle(smollm2_path):
    """~2K-token prompts, three depths, keep ratio 0.1: the pass key survives compression and the model,
    given only the compressed prompt, answers it."""
    from lucebox.bench.pflash import Haystack, _documents, run_prompt
    from lucebox.chat.prompt import PromptBuilder
    from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine

    engine = LLMEngine.from_path(smollm2_path, EngineConfig(device="cpu", dtype="float32", max_num_seqs=1,
                                                            kv_tokens=4096), quiet=True)
    builder = PromptBuilder.for_model(engine.loaded)
    hay = Haystack(builder, _documents(None)[0], 2048)
    pflash = PFlash.for_model(engine.loaded, config=PFlashConfig(keep_ratio=0.1))
    report = []
    for depth, key in ((0.3, 48213), (0.5, 70519), (0.8, 36642)):
        text, user, needle = hay.prompt(2048, depth, key)
        res = pflash.compress(text, query=user)
        _, out = run_prompt(engine, res.ids, 12)
        answer = engine.tokenizer.decode(out, skip_special=True)
        report.append({"depth": depth, "tokens": res.original_tokens, "compressed": res.compressed_tokens,
                       "ratio": round(res.ratio, 1), "key_kept": str(key) in res.text, "answer": answer,
                       "correct": str(key) in answer})
    print("NIAH 2K, keep ratio 0.1:", report)
    assert all(r["key_kept"] for r in report), "a pass key was dropped"
    assert all(2000 < r["tokens"] < 2100 and r["ratio"] > 8 for r in report)
    assert sum(r["correct"] for r in report) >= 2


# ----- the benchmark ---------------------------------------------------------------------------------------------


def bench_args(**kw):
    from lucebox.cli import build_parser

    argv = [x for k, v in kw.items() for x in ([f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)]))]
    return build_parser().parse_args(["bench", "pflash", *argv])


def test_bench_retention_writes_json(tiny_gguf, tmp_path: Path, capsys):
    from lucebox.bench.pflash import main

    out = tmp_path / "r.json"
    args = bench_args(model=tiny_gguf("llama", "F32"), device="cpu", lengths="1200,1600", depths="0,100",
                      keep_ratio=0.3, max_new=3, json=out)
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert data["benchmark"] == "pflash-retention" and data["keep_ratio"] == 0.3
    assert [(c["length"], c["depth"]) for c in data["cases"]] == [(1200, 0), (1200, 100), (1600, 0), (1600, 100)]
    for c in data["cases"]:
        assert abs(c["tokens"] - c["length"]) < 40 and c["compressed_tokens"] < c["tokens"]
        assert c["ratio"] > 1 and c["pflash_ttft_s"] > c["scorer_s"] > 0
    assert [s["length"] for s in data["summary"]] == [1200, 1600, "all"]
    assert "pflash acc" in capsys.readouterr().out


def test_bench_speed_on_cpu_at_tiny_shapes_writes_json(tiny_gguf, tmp_path: Path, capsys):
    from lucebox.bench.pflash import main

    out = tmp_path / "s.json"
    args = bench_args(model=tiny_gguf("llama", "F32"), device="cpu", speed=True, target_shape="tiny",
                      scorer_shape="tiny-scorer", speed_lens="600,1200", json=out)
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert data["benchmark"] == "pflash-speed" and data["random_weights"] is True
    assert [r["tokens"] for r in data["results"]] == [600, 1200]
    for r in data["results"]:
        assert r["compressed_tokens"] < r["tokens"] and r["ratio"] > 5
        assert r["pflash_ttft_s"] == pytest.approx(r["scorer_s"] + r["select_s"] + r["target_ttft_s"])
        assert r["speedup"] == pytest.approx(r["full_ttft_s"] / r["pflash_ttft_s"])
    assert "RANDOM weights" in capsys.readouterr().out
