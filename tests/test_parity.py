"""The engine against an independent reference: Hugging Face transformers on the same files.

Tolerance: fp32 on both sides over the same dequantized weights, so the only
differences are the order of floating-point operations (fused vs separate
projections, fused SDPA vs eager softmax attention). We require the largest
logit difference to stay under RTOL = 1e-4 of the largest logit. Measured:
SmolLM2 ~1e-6 relative; Gemma 3, whose residual stream reaches 1e5, ~5e-5 on
an 805-token prompt — the same size as transformers' own fp32-vs-fp64
difference on that prompt (~3e-5), so nothing tighter is meaningful there.
Every real bug we could make (a rope convention, a norm offset, a mask off by
one, a wrong scale) moves logits by more than 1e-2 relative.
"""

from __future__ import annotations

import pytest
import torch

from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams
from tests import hf_reference
from tests.fixtures.tiny_models import ARCHS, QTYPES, transformers_gguf_kwargs
from tests.memory import release_memory

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

RTOL = 1e-4


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    diff = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert diff <= RTOL * scale, f"{what}: max |logit diff| {diff:.2e} > {RTOL} x max |logit| {scale:.1f}"

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
    "Ünïcödé text, 日本語, emoji 🙂 and numbers 1234567890 in one line.",
    # Long enough (> 512 tokens) to cross Gemma 3's sliding window.
    " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(90)) + " The last item is",
]


def engine_for(path, **kw) -> LLMEngine:
    return LLMEngine.from_path(path, EngineConfig(device="cpu", dtype="float32", kv_tokens=4096, **kw), quiet=True)


def hf_model(path, **kwargs):
    """transformers' model of GGUF `path` in fp32 (a real model file's conversion cached: tests/hf_reference.py)."""
    if kwargs:
        m = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, **kwargs
        )
    else:
        m = hf_reference.causal_lm(path)
    m.generation_config.eos_token_id = None  # compare full 32-token continuations
    return m.eval()


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def real_model(request):
    """One real model at a time, both implementations; the memory goes back before the next one loads
    (Gemma 3 270M is ~1 GiB of fp32 weights on each side)."""
    path = request.getfixturevalue(f"{request.param}_path")
    hf = hf_model(path)  # first: a first run's conversion peaks before our engine's memory is held
    engine = engine_for(path)
    yield request.param, engine, hf
    del engine, hf
    release_memory()


REF_ROWS = 256  # logits of this many positions per forward (each side): Gemma 3's full [805, 262144] are 0.8 GiB


def test_real_model_logits_match_transformers(real_model):
    name, engine, hf = real_model
    for text in PROMPTS:
        ids = engine.tokenizer.encode(text, add_special=True)
        diff = scale = 0.0
        for start in range(0, len(ids), REF_ROWS):  # both sides' logits a slice of rows at a time
            rows = torch.arange(start, min(start + REF_ROWS, len(ids)))
            ours = engine.score(ids, rows)
            with torch.no_grad():
                ref = hf(torch.tensor([ids]), logits_to_keep=rows).logits[0].float()
            diff = max(diff, (ours - ref).abs_().max().item())
            scale = max(scale, ref.abs_().max().item())
            del ours, ref
        what = f"{name} on {text[:30]!r} ({len(ids)} tokens)"
        assert diff <= RTOL * scale, f"{what}: max |logit diff| {diff:.2e} > {RTOL} x max |logit| {scale:.1f}"


def test_real_model_greedy_32_tokens_match_transformers(real_model):
    name, engine, hf = real_model
    prompts = [engine.tokenizer.encode(t, add_special=True) for t in PROMPTS[:4]]
    ours = engine.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))  # batched, mixed lengths
    for ids, out in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
        assert out == ref, f"{name}: greedy continuation differs for {engine.tokenizer.decode(ids)[:30]!r}"


TINY_CASES = sorted({(a, "F32") for a in ARCHS} | {("llama", q) for q in QTYPES} | {
    ("qwen2", "Q8_0"), ("qwen3", "Q4_K"), ("gemma3", "Q5_0"), ("gemma3", "Q6_K"), ("mistral", "Q3_K"),
})


@pytest.mark.parametrize("arch,qtype", TINY_CASES)
def test_tiny_gguf_every_arch_and_quant_matches_transformers(tiny_gguf, arch, qtype):
    path = tiny_gguf(arch, qtype)
    engine = engine_for(path)
    hf = hf_model(path, **transformers_gguf_kwargs(arch, qtype))
    ids = list(range(3, 40)) + list(range(100, 140))
    ours = engine.score(ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert_close(ours, ref, f"tiny {arch} {qtype}")


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {"rope_scaling": "llama3"}),
    ("llama", {"rope_scaling": "linear"}),
    ("llama", {"tied": False}),
    ("gemma3", {"rope_scaling": "linear", "sliding_window": 8}),
])
def test_tiny_gguf_rope_scaling_and_untied_heads(tiny_gguf, arch, overrides):
    path = tiny_gguf(arch, "F32", **overrides)
    engine = engine_for(path)
    hf = hf_model(path, **transformers_gguf_kwargs(arch, "F32", **overrides))
    ids = list(range(3, 60))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert_close(engine.score(ids), ref, f"tiny {arch} {overrides}")


@pytest.mark.parametrize("arch,shards,tied", [
    ("llama", 1, True), ("mistral", 2, True), ("qwen2", 1, False), ("qwen3", 3, True), ("gemma3", 2, True),
])
def test_tiny_hf_folder_matches_transformers(tiny_hf_folder, arch, shards, tied):
    folder = tiny_hf_folder(arch, shards=shards, tied=tied)
    engine = engine_for(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = list(range(3, 50))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert_close(engine.score(ids), ref, f"tiny HF {arch}")
    # The same prompt through the tokenizer the folder ships.
    text = "Hello there, the quick brown fox"
    assert engine.tokenizer.encode(text, add_special=True) == transformers.AutoTokenizer.from_pretrained(
        str(folder))(text).input_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_cuda_bf16_error_no_worse_than_transformers_bf16(request, name):
    """In bf16 neither implementation matches fp32 exactly; ours must be as close to
    the fp32 reference as transformers' own bf16 run is (within 2x). Prints the
    numbers and the greedy agreement for the record (`pytest -s`)."""
    path = request.getfixturevalue(f"{name}_path")
    engine = LLMEngine.from_path(path, EngineConfig(device="cuda", dtype="bfloat16"), quiet=True)
    ref32 = hf_model(path).cuda()
    ref16 = hf_model(path).to(device="cuda", dtype=torch.bfloat16)
    agree = total = 0
    for text in PROMPTS:
        ids = engine.tokenizer.encode(text, add_special=True)
        x = torch.tensor([ids], device="cuda")
        with torch.no_grad():
            exact = ref32(x).logits[0].float()
            theirs = (ref16(x).logits[0].float() - exact).abs().max().item()
            greedy32 = ref32.generate(x, max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
        ours = (engine.score(ids).float() - exact).abs().max().item()
        out = engine.generate([ids], SamplingParams(max_tokens=32, ignore_eos=True))[0]
        same = next((i for i, (a, b) in enumerate(zip(out, greedy32)) if a != b), 32)
        agree, total = agree + same, total + 32
        print(f"[bf16 parity] {name} {len(ids):4d} tokens: max|logit-fp32| ours {ours:.4f} transformers-bf16 "
              f"{theirs:.4f}; greedy tokens equal to fp32 reference before first divergence: {same}/32")
        assert ours <= 2 * theirs + 1e-2, f"{name}: bf16 error {ours:.3f} vs transformers bf16 {theirs:.3f}"
    print(f"[bf16 parity] {name}: greedy agreement with the fp32 reference {agree}/{total}")
