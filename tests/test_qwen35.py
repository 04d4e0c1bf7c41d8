"""Qwen3.5 hybrid (`qwen35`: Gated DeltaNet + gated attention; `qwen35moe`: the same with MoE FFNs) against
transformers 5.24, fp32 on the CPU.

Tiny random models (tests/fixtures/tiny_models.py: 6 layers, 2 of them full attention, 4 linear value heads
over 2 key heads, partial rotary; the MoE one 8 experts, top 2, a gated shared expert) built by transformers
and loaded by Lucebox from their HF folder and from the GGUF llama.cpp's converter would write of them.
Tolerance: test_parity's (max |logit diff| <= 1e-4 x max |logit|); transformers' own fp32 differs from its
fp64 by ~2e-5 relative on the 150-token prompt.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lucebox.engine.models.qwen35 import chunk_gated_delta, recurrent_gated_delta_step
from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams
from tests.fixtures.tiny_models import tiny_qwen35_model, write_tiny_qwen35_gguf, write_tiny_qwen35_hf
from tests.test_parity import assert_close

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

CHUNK = 16  # the engine's prefill budget per step in these tests: the prompts below take several chunks


def prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in torch.randint(3, 380, (n,), generator=torch.Generator().manual_seed(seed))]


ARCHS = {"qwen35": False, "qwen35moe": True}  # arch -> moe
FORMATS = [(arch, fmt) for arch in ARCHS for fmt in ("hf", "gguf")]


@pytest.fixture(scope="module")
def references() -> dict[str, object]:
    return {arch: tiny_qwen35_model(seed=0, moe=moe) for arch, moe in ARCHS.items()}


@pytest.fixture(scope="module")
def reference(references):
    return references["qwen35"]


@pytest.fixture(scope="module")
def all_files(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("qwen35")
    out = {}
    for arch, moe in ARCHS.items():
        out[arch, "hf"] = write_tiny_qwen35_hf(root / arch / "hf", moe=moe)
        out[arch, "gguf"] = write_tiny_qwen35_gguf(root / arch / "gguf" / "tiny.gguf", moe=moe)
    return out


@pytest.fixture(scope="module")
def files(all_files) -> dict[str, Path]:
    return {fmt: all_files["qwen35", fmt] for fmt in ("hf", "gguf")}


def engine(path: Path, **kw) -> LLMEngine:
    kw.setdefault("max_step_tokens", CHUNK)
    kw.setdefault("kv_tokens", 2048)
    return LLMEngine.from_path(path, EngineConfig(device="cpu", dtype="float32", **kw), quiet=True)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


_GENERATED: dict[tuple[int, tuple[int, ...], int], list[int]] = {}


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation (computed once per model and prompt: the HF and GGUF tests share it)."""
    key = (id(model), tuple(ids), n)
    if key not in _GENERATED:
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        _GENERATED[key] = out[0, len(ids):].tolist()
    return _GENERATED[key]


def test_chunked_delta_rule_is_the_recurrence() -> None:
    """The chunked (WY) prefill form against the per-token recurrence, from a non-zero state, over a length
    that is not a multiple of the block (150 = 2 x 64 + 22)."""
    g = torch.Generator().manual_seed(0)
    T, H, dk, dv = 150, 3, 8, 5
    q, k = (torch.nn.functional.normalize(torch.randn(T, H, dk, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(T, H, dv, generator=g)
    decay = -torch.rand(T, H, generator=g) * 2
    beta = torch.rand(T, H, generator=g)
    s0 = torch.randn(H, dk, dv, generator=g)
    out, s = chunk_gated_delta(q, k, v, decay, beta, s0)
    state, ref = s0[None], []
    for t in range(T):
        o, state = recurrent_gated_delta_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], decay[t:t + 1], beta[t:t + 1],
                                              state)
        ref.append(o[0])
    torch.testing.assert_close(out, torch.stack(ref), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, state[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("arch", "fmt"), FORMATS)
def test_logits_match_transformers(all_files, references, arch: str, fmt: str) -> None:
    """Every position's logits over a 150-token prompt in one pass (3 blocks of the chunked delta rule)."""
    e = engine(all_files[arch, fmt])
    cfg = e.model_config
    assert (cfg.arch, cfg.layer_types.count("full"), cfg.rotary_dim) == (arch, 2, 8)
    assert cfg.n_experts == (8 if ARCHS[arch] else 0)
    assert e.kv.data.shape[0] == 2  # K/V for the attention layers only
    ids = prompt(150, 1)
    with torch.no_grad():
        ref = references[arch](torch.tensor([ids])).logits[0]
    assert_close(e.score(ids), ref, f"{arch} {fmt}")


@pytest.mark.parametrize(("arch", "fmt"), FORMATS)
def test_greedy_matches_generate(all_files, references, arch: str, fmt: str) -> None:
    """A 45-token prompt prefilled in 16-token chunks (states carried across chunks), then 12 decode steps:
    the tokens of transformers' greedy generate."""
    ids = prompt(45, 2)
    assert engine(all_files[arch, fmt]).generate([ids], greedy(12))[0] == hf_greedy(references[arch], ids, 12)


def test_vl_checkpoint_layout(files, tmp_path) -> None:
    """Published Qwen3.5 checkpoints are the VL model: config under `text_config`, text weights under
    `model.language_model.`, plus a vision tower and an MTP head the engine skips. Same logits as the text-only
    folder."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src = files["hf"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / name)
    text = json.loads((src / "config.json").read_text())
    conf = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
            "tie_word_embeddings": text["tie_word_embeddings"], "text_config": text, "vision_config": {}}
    (tmp_path / "config.json").write_text(json.dumps(conf))
    weights = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
               for k, v in load_file(src / "model.safetensors").items()}
    weights["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    weights["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(weights, tmp_path / "model.safetensors")
    ids = prompt(30, 9)
    assert torch.equal(engine(tmp_path).score(ids), engine(src).score(ids))


def test_gguf_with_mtp_block(files, tmp_path) -> None:
    """A GGUF whose block_count includes the MTP block (`nextn_predict_layers`): the model is the layers before
    it, and the same logits as the file without it."""
    path = write_tiny_qwen35_gguf(tmp_path / "mtp.gguf", mtp=True)
    e = engine(path)
    assert e.model_config.num_layers == 6
    ids = prompt(30, 10)
    assert torch.equal(e.score(ids), engine(files["gguf"]).score(ids))


def test_quantized_blocks(tmp_path) -> None:
    """A Q8_0 file with its projections (attn_qkv, attn_gate, ssm_out included) kept as quantized blocks computes
    what the same file dequantized at load computes, on a prompt across prefill chunks and decodes."""
    from lucebox.engine.models.layers import Linear

    path = write_tiny_qwen35_gguf(tmp_path / "q8.gguf", qtype="Q8_0")
    quant, dense = engine(path, weights="quantized"), engine(path, weights="dense")
    kept = {n for n, m in quant.loaded.model.named_modules() if isinstance(m, Linear) and m.qtype == "Q8_0"}
    assert {"blk.0.attn_qkv", "blk.0.attn_gate", "blk.0.ssm_out", "blk.2.attn_q", "output"} <= kept
    ids = prompt(40, 8)
    assert_close(quant.score(ids), dense.score(ids), "qwen35 Q8_0 blocks")
    assert quant.generate([ids], greedy(6)) == dense.generate([ids], greedy(6))


def test_batched_equals_alone(files) -> None:
    """Three sequences of different lengths in the same steps: prefill chunks of two sequences in one step,
    decodes batched into one recurrent update over their slots, and decodes next to another's prefill.
    Each gets what it gets alone."""
    e = engine(files["gguf"])
    prompts = [prompt(9, 4), prompt(37, 3), prompt(23, 11)]
    alone = [e.generate([p], greedy(10))[0] for p in prompts]
    seqs = [e.add(p, greedy(10)) for p in prompts]
    shapes = set()
    while e.has_work():
        e.step()
        rows = [n for _, _, n in e.last_step]  # 1: a decode, or rarely a one-row prefill chunk
        shapes.add((rows.count(1), sum(n > 1 for n in rows)))
    assert [s.output_ids for s in seqs] == alone
    assert any(d >= 1 and p >= 1 for d, p in shapes) and any(p >= 2 for _, p in shapes) and (3, 0) in shapes
    assert e.kv.states.num_free == e.kv.states.num_slots


def test_slot_reuse_and_preemption(files, reference) -> None:
    """One state slot (max_num_seqs 1): the second sequence waits, then runs in the slot the first gave back.
    A KV pool too small for both: the newer one is preempted and recomputed from position 0. Same tokens."""
    a, b = prompt(30, 5), prompt(20, 6)
    want = [hf_greedy(reference, a, 8), hf_greedy(reference, b, 8)]
    one_slot = engine(files["hf"], max_num_seqs=1)
    assert one_slot.kv.states.num_slots == 1
    assert one_slot.generate([a, b], greedy(8)) == want
    # Room for two sequences but one state slot held elsewhere: admission waits for a slot, not for blocks.
    held = engine(files["hf"], max_num_seqs=2)
    taken = held.kv.states.allocate()
    seqs = [held.add(a, greedy(8)), held.add(b, greedy(8))]
    held.step()
    assert held.scheduler.running == seqs[:1] and list(held.scheduler.waiting) == seqs[1:]
    while held.has_work():
        held.step()
    assert [s.output_ids for s in seqs] == want
    held.kv.states.free(taken)
    tight = engine(files["hf"], kv_tokens=48, block_size=8)
    assert tight.generate([a, b], greedy(8)) == want
    assert tight.scheduler.num_preemptions > 0
    assert tight.kv.states.num_free == tight.kv.states.num_slots


# The text_config of the published Qwen/Qwen3.5-27B and Qwen/Qwen3.5-35B-A3B config.json files (their
# layer_types lists are the full_attention_interval 4 rule), inside the VL wrapper they ship in.
_TEXT_27B = {"model_type": "qwen3_5_text", "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
             "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 248320,
             "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
             "linear_num_value_heads": 48, "linear_value_head_dim": 128, "full_attention_interval": 4,
             "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "attn_output_gate": True,
             "mtp_num_hidden_layers": 1,
             "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                                 "rope_theta": 10000000, "partial_rotary_factor": 0.25}}
_TEXT_35B = {**{k: v for k, v in _TEXT_27B.items() if k != "intermediate_size"}, "model_type": "qwen3_5_moe_text",
             "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
             "linear_num_value_heads": 32, "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
             "shared_expert_intermediate_size": 512}


@pytest.mark.parametrize(("wrapper", "text", "arch", "params_b", "state_mib"), [
    ("qwen3_5", _TEXT_27B, "qwen35", 26.9, 149.6), ("qwen3_5_moe", _TEXT_35B, "qwen35moe", 34.7, 62.8)])
def test_real_configs(tmp_path, wrapper: str, text: dict, arch: str, params_b: float, state_mib: float) -> None:
    """The published configs read as the issue states them: every 4th layer attends, rotary on 64 of 256
    dims, 16 key / 48 (32) value heads of 128; the parameter count without the vision tower and MTP head;
    ~150 MB of fp32 state per sequence for the 27B."""
    import json

    from lucebox.engine.runtime.recurrent_state import RecurrentStates
    from lucebox.engine.weights.loader import read_model_config

    conf = {"model_type": wrapper, "tie_word_embeddings": False, "text_config": text, "vision_config": {}}
    (tmp_path / "config.json").write_text(json.dumps(conf))
    cfg = read_model_config(tmp_path)
    assert cfg.arch == arch
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full"] == list(range(3, cfg.num_layers, 4))
    assert (cfg.head_dim, cfg.rotary_dim, cfg.linear_k_heads, cfg.linear_k_dim, cfg.linear_v_dim) == (256, 64, 16,
                                                                                                      128, 128)
    assert cfg.num_kv_layers == cfg.num_layers // 4
    assert round(cfg.n_params() / 1e9, 1) == params_b
    assert round(RecurrentStates.bytes_per_slot(cfg) / 2**20, 1) == state_mib


def test_serves_a_chat_request(files) -> None:
    """`lucebox serve` of the tiny qwen35 GGUF answers a chat completion (its prefix cache on, by default)."""
    import httpx

    from tests.live_server import start_server

    server = start_server(files["gguf"], kv_tokens=1024)
    try:
        r = httpx.post(server.base_url + "/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 5,
                             "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] >= 1
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
        props = httpx.get(server.url + "/props", timeout=10).json()
        assert props["pflash"]["mode"] == "off"  # its scorer would be this hybrid model: off, with a log line
    finally:
        server.stop()
