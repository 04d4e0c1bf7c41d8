"""Engine core on the real default model: batching, chunked prefill, preemption, seeds, logprobs."""

from __future__ import annotations

import pytest
import torch

from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.errors import LuceboxError

TEXTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def add(a, b):\n    return",
    "List three prime numbers greater than one hundred, separated by commas, and explain briefly why each",
    "Hi",
]


@pytest.fixture(scope="module")
def engine(smollm2_path) -> LLMEngine:
    return LLMEngine.from_path(smollm2_path, EngineConfig(device="cpu", dtype="float32", kv_tokens=8192), quiet=True)


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    return [engine.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def alone(engine, prompts) -> list[list[int]]:
    """Greedy outputs of each prompt run by itself."""
    return [engine.generate([p], SamplingParams(max_tokens=20, ignore_eos=True))[0] for p in prompts]


def test_batched_greedy_equals_each_alone(engine, prompts, alone):
    together = engine.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert together == alone
    assert engine.kv.pool.num_used == 0, "finished sequences must release every KV block"


def test_chunked_prefill_and_staggered_arrivals_give_same_tokens(smollm2_path, prompts, alone):
    # A 7-token step budget cuts every prompt into chunks that interleave with other sequences' decodes.
    eng = LLMEngine.from_path(smollm2_path, EngineConfig(device="cpu", kv_tokens=4096, max_step_tokens=7), quiet=True)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    seqs = [eng.add(prompts[0], params)]
    for p in prompts[1:]:
        eng.step()  # the next request arrives while the earlier ones run
        seqs.append(eng.add(p, params))
    while eng.has_work():
        eng.step()
    assert [s.output_ids for s in seqs] == alone


def test_preemption_when_kv_runs_out_keeps_outputs_exact(smollm2_path, prompts, alone):
    # 9 usable blocks of 16 tokens cannot hold five sequences at once: the newest get preempted and recomputed.
    eng = LLMEngine.from_path(smollm2_path, EngineConfig(device="cpu", kv_tokens=144, block_size=16), quiet=True)
    outs = eng.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert outs == alone
    assert eng.scheduler.num_preemptions > 0
    assert eng.kv.pool.num_used == 0


def test_same_seed_same_output_regardless_of_batch(engine, prompts):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    a = engine.generate([prompts[1]], params)[0]
    b = engine.generate([prompts[0], prompts[1], prompts[2]],
                        [SamplingParams(temperature=0.8, max_tokens=30), params, SamplingParams(max_tokens=5)])[1]
    c = engine.generate([prompts[1]], SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=24,
                                                     ignore_eos=True))[0]
    assert a == b
    assert a != c


def test_logprobs_are_the_models_log_softmax(engine, prompts):
    ids = prompts[0]
    seq_out = engine.generate([ids], SamplingParams(max_tokens=3, logprobs=5, ignore_eos=True))[0]
    seq = engine.add(ids, SamplingParams(max_tokens=3, logprobs=5, ignore_eos=True))
    while not seq.is_finished:
        engine.step()
    assert seq.output_ids == seq_out
    full = engine.score(ids + seq_out).log_softmax(-1)
    for i, lp in enumerate(seq.logprobs):
        row = full[len(ids) - 1 + i]
        assert lp.token_id == seq_out[i]
        assert abs(lp.logprob - row[lp.token_id].item()) < 1e-4
        top_ids = [t for t, _ in lp.top]
        assert top_ids == row.topk(5).indices.tolist()


def test_eos_max_tokens_and_finish_reasons(engine):
    chat = engine.tokenizer.encode("<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n")
    seq = engine.add(chat, SamplingParams(max_tokens=200))
    while not seq.is_finished:
        engine.step()
    assert seq.finish_reason == "stop" and seq.output_ids[-1] in engine.tokenizer.eos_ids
    seq = engine.add(chat, SamplingParams(max_tokens=2, ignore_eos=True))
    while not seq.is_finished:
        engine.step()
    assert seq.finish_reason == "length" and seq.num_output == 2


def test_abort_frees_blocks_at_once(engine, prompts):
    seq = engine.add(prompts[3], SamplingParams(max_tokens=100))
    engine.step()
    assert engine.kv.pool.num_used > 0
    engine.abort(seq)
    assert seq.finish_reason == "cancelled"
    assert engine.kv.pool.num_used == 0 and not engine.has_work()


def test_prompt_longer_than_context_is_refused(engine):
    with pytest.raises(LuceboxError, match="context"):
        engine.add([1] * (engine.n_ctx + 5), SamplingParams())
    with pytest.raises(LuceboxError, match="empty"):
        engine.add([], SamplingParams())


def test_half_precision_runs_on_cpu(smollm2_path, prompts):
    eng = LLMEngine.from_path(smollm2_path, EngineConfig(device="cpu", dtype="bfloat16", kv_tokens=1024), quiet=True)
    assert eng.kv.data.dtype == torch.bfloat16
    out = eng.generate([prompts[0]], SamplingParams(max_tokens=8))[0]
    assert eng.tokenizer.decode(out).strip().startswith("Paris")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")
def test_cuda_graph_decode_matches_eager(smollm2_path):
    """In fp32, CUDA-graph replays (Triton decode kernel) give the same greedy tokens as eager steps (SDPA)."""
    outs = {}
    for graphs in (False, True):
        eng = LLMEngine.from_path(smollm2_path, EngineConfig(device="cuda", dtype="float32", kv_tokens=8192,
                                                             cuda_graphs=graphs), quiet=True)
        assert eng.runner.uses_cuda_graphs == graphs
        prompts = [eng.tokenizer.encode(t) for t in TEXTS]
        outs[graphs] = eng.generate(prompts, SamplingParams(max_tokens=48, ignore_eos=True))
        if graphs:
            assert eng.runner.graphs.graphs, "no graph was captured"
    assert outs[True] == outs[False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")
def test_cuda_bf16_batched_vs_alone_agreement(smollm2_path):
    """In bf16 a batch of 5 runs GEMMs of other shapes than one sequence alone, so greedy paths may part
    after a near-tie; the first token (each prompt's own prefill) must agree, the rest is reported."""
    eng = LLMEngine.from_path(smollm2_path, EngineConfig(device="cuda", dtype="bfloat16", kv_tokens=8192), quiet=True)
    prompts = [eng.tokenizer.encode(t) for t in TEXTS]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    alone = [eng.generate([p], params)[0] for p in prompts]
    together = eng.generate(prompts, params)
    assert [a[0] for a in alone] == [t[0] for t in together]
    prefix = [next((i for i, (x, y) in enumerate(zip(a, t)) if x != y), len(a)) for a, t in zip(alone, together)]
    same = sum(x == y for a, t in zip(alone, together) for x, y in zip(a, t))
    print(f"[bf16 batched vs alone] identical sequences {sum(p == 64 for p in prefix)}/5, "
          f"tokens before first divergence {prefix}, positionally equal tokens {same}/{64 * 5}")
