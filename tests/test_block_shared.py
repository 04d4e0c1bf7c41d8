"""One transformer block for the target, the PFlash scorer and the drafter trainer: their hidden states agree.

The reference is the target's own forward as serving runs it (DecoderModel.forward over the paged KV cache,
prefilled in two chunks so the second attends through the cache). The scorer's layer outputs (its dense and
its block-sparse attention) and the trainer's target features (TargetFeatures, several sequences in one
forward) must equal it layer by layer, on a Llama-style model (plain pre-norm, SwiGLU, GQA), a Qwen3-style
one (q/k norm) and a Gemma-3-style one (sandwich norms, GeGLU, sliding-window layers with their own RoPE
base, window shorter than the prompt). A copy of the block's math that drifts (a norm skipped, the wrong
RoPE table or window) fails here.
"""

from __future__ import annotations

import random

import pytest
import torch

from lucebox.engine.models.dense_attention import causal_mask, dense_attention
from lucebox.engine.pflash import PFlashConfig
from lucebox.engine.pflash.scorer import score_prompt
from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.engine.runtime.sequence import Chunk, Sequence
from lucebox.train.features import TargetFeatures

ARCHS = {  # arch -> tiny-model overrides
    "llama": {"num_layers": 3},
    "qwen3": {"num_layers": 3},
    "gemma3": {"sliding_window": 8},  # 6 layers: 5 sliding, 1 global
}


def target_layers(engine: LLMEngine, tokens: list[int], split: int) -> list[torch.Tensor]:
    """Every layer's output [S, hidden] from the target's forward: tokens[:split], then the rest over the cache."""
    kv, runner, model = engine.kv, engine.runner, engine.loaded.model
    seq = Sequence(list(tokens), SamplingParams())
    seq.block_table = kv.pool.allocate(kv.blocks_for(len(tokens)))
    parts = []
    try:
        for start, end in ((0, split), (split, len(tokens))):
            inputs = runner.prepare([Chunk(seq, start, end - start)])
            with torch.inference_mode():
                _, feats = model(inputs.input_ids, inputs.positions, kv.data, inputs.meta,
                                 capture=range(model.cfg.num_layers))
            parts.append(feats)
    finally:
        kv.pool.decref(seq.block_table)
    return [torch.cat(chunks) for chunks in zip(*parts)]


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = float((got - want).abs().max() / want.abs().max())
    assert err < 1e-5, f"{what}: relative error {err:.2e}"


@pytest.mark.parametrize("arch", list(ARCHS))
def test_scorer_and_trainer_hidden_states_are_the_targets(tiny_gguf, arch):
    path = tiny_gguf(arch, "F32", **ARCHS[arch])
    engine = LLMEngine.from_path(path, EngineConfig(device="cpu", dtype="float32", kv_tokens=512), quiet=True)
    model = engine.loaded.model
    n_layers = model.cfg.num_layers
    if arch == "gemma3":  # the case is what it claims: sliding layers with their own table, a window < S
        assert any(b.sliding for b in model.blk) and not all(b.sliding for b in model.blk)
        assert "sliding" in model.rotary
    rng = random.Random(0)
    tokens = [rng.randrange(3, model.cfg.vocab_size) for _ in range(40)]
    other = [rng.randrange(3, model.cfg.vocab_size) for _ in range(23)]
    want = target_layers(engine, tokens, split=17)

    # The scorer cannot capture the last layer: it skips that layer's attention output and MLP.
    for mode, extra in (("dense", {}), ("flex", {"alpha": 0.0, "sparse_block": 16})):
        cfg = PFlashConfig(sparse_attention=mode, **extra)  # alpha 0: every causal block kept, i.e. dense
        _, got = score_prompt(model, tokens, cfg, capture=range(n_layers - 1))
        assert len(got) == n_layers - 1
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"scorer ({mode}) layer {i}")

    feats = TargetFeatures(engine, list(range(n_layers)))([other, tokens])
    for i, (g, w) in enumerate(zip(feats[1], want)):
        assert_same(g, w, f"trainer features layer {i}")


def test_dense_attention_is_the_causal_softmax():
    """Both dense_attention paths (is_causal, and an explicit mask with K/V repeated per query head) equal the
    softmax over the keys causal_mask allows, with grouped heads."""
    torch.manual_seed(0)
    S, Hq, Hkv, D, window = 11, 4, 2, 8, 4
    q, k, v = torch.randn(S, Hq, D), torch.randn(S, Hkv, D), torch.randn(S, Hkv, D)
    pos = torch.arange(S)

    def naive(mask: torch.Tensor) -> torch.Tensor:
        kk, vv = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
        logits = torch.einsum("qhd,khd->hqk", q, kk) * 0.3
        p = logits.masked_fill(~mask, float("-inf")).softmax(-1)
        return torch.einsum("hqk,khd->qhd", p, vv)

    causal, sliding = causal_mask(pos, pos), causal_mask(pos, pos, window)
    assert sliding[7].tolist() == [False] * 4 + [True] * 4 + [False] * 3  # q - window < p <= q
    torch.testing.assert_close(dense_attention(q, k, v, 0.3), naive(causal))
    torch.testing.assert_close(dense_attention(q, k, v, 0.3, window), naive(sliding))
    torch.testing.assert_close(dense_attention(q, k, v, 0.3, mask=causal), naive(causal))
    batched = dense_attention(q[None].repeat(2, 1, 1, 1), k[None].repeat(2, 1, 1, 1), v[None].repeat(2, 1, 1, 1),
                              0.3, mask=torch.stack([causal, sliding]))
    torch.testing.assert_close(batched[1], naive(sliding))
