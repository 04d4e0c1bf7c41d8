"""The random-weight Qwen3.5 GGUFs the speed checks time (bench/random_models.py): a tiny shape of each arch
loads in Lucebox with its blocks kept quantized and generates finite logits; its keys and tensor names are
the ones the converter-faithful tiny writer (write_tiny_qwen35_gguf) gives the same arch, so Lucebox and
llama.cpp read one contract; its Q4_K_M types are llama.cpp's rule; the real shapes have the published sizes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lucebox.bench.decode import random_shapes
from lucebox.bench.random_models import HYBRID_SHAPES, hybrid_tensors, tensor_qtype, write_random_hybrid_gguf
from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.engine.weights.gguf_loader import open_gguf
from tests.fixtures.tiny_models import write_tiny_gguf, write_tiny_qwen35_gguf

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TINY = {"qwen35": "tiny-qwen3.5", "qwen35moe": "tiny-qwen3.5-moe"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tok") / "tok.gguf", "qwen3")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, tokenizer: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("random")
    return {arch: write_random_hybrid_gguf(root / f"{arch}.gguf", HYBRID_SHAPES[name], tokenizer, "Q4_K_M")
            for arch, name in TINY.items()}


@pytest.mark.parametrize("arch", TINY)
def test_keys_and_tensor_names_are_the_converters(tmp_path: Path, files: dict[str, Path], arch: str) -> None:
    ref = open_gguf(write_tiny_qwen35_gguf(tmp_path / "ref.gguf", moe=arch == "qwen35moe"))
    got = open_gguf(files[arch])
    assert got.get("general.architecture") == ref.get("general.architecture") == arch
    assert set(got.fields) == set(ref.fields)
    assert {t.name for t in got.tensors} == {t.name for t in ref.tensors}


@pytest.mark.parametrize("arch", TINY)
def test_tiny_shape_loads_quantized_and_generates_finite_logits(files: dict[str, Path], arch: str) -> None:
    shape = HYBRID_SHAPES[TINY[arch]]
    e = LLMEngine.from_path(files[arch], EngineConfig(device="cpu", dtype="float32", weights="quantized",
                                                      kv_tokens=256, max_step_tokens=64), quiet=True)
    cfg = e.model_config
    assert cfg.layer_types == ["full" if (i + 1) % shape.interval == 0 else "linear" for i in range(shape.layers)]
    assert (cfg.vocab_size, cfg.linear_v_heads, cfg.linear_k_heads, cfg.linear_v_dim, cfg.n_experts) == (
        shape.vocab, shape.linear_v_heads, shape.linear_k_heads, shape.linear_v_dim, shape.n_experts)
    kept = {m.qtype for m in e.loaded.model.modules() if getattr(m, "qtype", None)}
    assert {"Q4_K", "Q6_K"} <= kept, f"blocks kept quantized: {kept}"
    seq = e.new_sequence(list(range(10, 26)), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                                             logprobs=3))
    e.scheduler.add(seq)
    while not seq.is_finished:
        e.step()
    assert len(seq.output_ids) == 3
    for step in seq.logprobs:
        lps = [lp for _, lp in step.top]
        assert all(math.isfinite(lp) for lp in lps)
        assert lps[0] > -math.log(shape.vocab) + 1e-3, "the logits are not all equal"


def test_q4_k_m_types_are_llama_cpps_rule() -> None:
    """Qwen3.5-27B: layer i's attn_v (full attention) or attn_qkv (DeltaNet), and its ffn_down, are Q6_K for
    llama.cpp's use_more_bits layers (the first and last eighth, every third between), output Q6_K, other
    matrices Q4_K; norms, the conv, ssm_a, ssm_dt and routers stay F32; a row that is no multiple of 256 falls
    back (Q4_K -> Q5_0, Q6_K -> Q8_0)."""
    shape = HYBRID_SHAPES["qwen3.5-27b"]
    more = set(range(8)) | set(range(10, 56, 3)) | set(range(56, 64))
    types = {name: tensor_qtype("Q4_K_M", name, dims, 64) for name, dims, _ in hybrid_tensors(shape, 248_320)}
    for i in range(64):
        v_like = f"blk.{i}.attn_v.weight" if i % 4 == 3 else f"blk.{i}.attn_qkv.weight"
        want = "Q6_K" if i in more else "Q4_K"
        assert (types[v_like], types[f"blk.{i}.ffn_down.weight"]) == (want, want), i
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    for name in ("attn_gate", "ssm_alpha", "ssm_beta", "ssm_out", "ffn_gate", "ffn_up"):
        assert types[f"blk.0.{name}.weight"] == "Q4_K", name
    for name in ("attn_q", "attn_k", "attn_output"):
        assert types[f"blk.3.{name}.weight"] == "Q4_K", name
    for name in ("ssm_a", "ssm_dt.bias", "ssm_conv1d.weight", "ssm_norm.weight", "attn_norm.weight",
                 "post_attention_norm.weight"):
        assert types[f"blk.0.{name}"] == "F32", name
    assert types["blk.3.attn_q_norm.weight"] == "F32"
    moe = {name: tensor_qtype("Q4_K_M", name, dims, 40)
           for name, dims, _ in hybrid_tensors(HYBRID_SHAPES["qwen3.5-35b-a3b"], 248_320)}
    assert (moe["blk.0.ffn_down_exps.weight"], moe["blk.0.ffn_down_shexp.weight"]) == ("Q6_K", "Q6_K")
    assert (moe["blk.5.ffn_down_exps.weight"], moe["blk.5.ffn_down_shexp.weight"]) == ("Q4_K", "Q4_K")
    assert moe["blk.0.ffn_gate_inp.weight"] == moe["blk.0.ffn_gate_inp_shexp.weight"] == "F32"
    assert moe["blk.0.ffn_up_exps.weight"] == "Q4_K"
    assert tensor_qtype("Q4_K_M", "blk.0.attn_qkv.weight", (384, 64), 8) == "Q8_0"
    assert tensor_qtype("Q4_K_M", "blk.1.attn_gate.weight", (64, 96), 8) == "Q5_0"


def test_the_written_file_has_the_rule_s_types(files: dict[str, Path]) -> None:
    for arch, path in files.items():
        shape = HYBRID_SHAPES[TINY[arch]]
        for t in open_gguf(path).tensors:
            dims = tuple(reversed([int(d) for d in t.shape]))
            assert t.tensor_type.name == tensor_qtype("Q4_K_M", t.name, dims, shape.layers), t.name


@pytest.mark.parametrize(("name", "billions"), [("qwen3.5-27b", (26.5, 27.5)), ("qwen3.5-35b-a3b", (34.0, 35.5))])
def test_real_shapes_have_the_published_size(name: str, billions: tuple[float, float]) -> None:
    """The text model's parameters (no vision tower, no MTP block) near the name's count, and `bench decode
    --shape` takes both names."""
    params = sum(math.prod(dims) for _, dims, _ in hybrid_tensors(HYBRID_SHAPES[name], 248_320))
    assert billions[0] < params / 1e9 < billions[1], params
    assert name in random_shapes()


def test_vocab_is_padded_as_the_converter_pads(files: dict[str, Path], tokenizer: Path) -> None:
    tokens = open_gguf(files["qwen35"]).get("tokenizer.ggml.tokens")
    base = open_gguf(tokenizer).get("tokenizer.ggml.tokens")
    assert tokens[:len(base)] == base and len(tokens) == HYBRID_SHAPES[TINY["qwen35"]].vocab
    assert tokens[-1] == f"[PAD{len(tokens) - 1}]"


def test_bench_decode_shape_writes_the_model_and_benches_it(tmp_path: Path, tokenizer: Path) -> None:
    """`bench decode --shape tiny-qwen3.5`: the random file is written, timed, and handed to the peer (a
    stand-in llama-bench), and goes with its temporary folder."""
    from lucebox.cli import main
    from tests.test_bench_decode import fake_llama_bench

    tool, log = fake_llama_bench(tmp_path / "bin")
    out = tmp_path / "bench.json"
    assert main(["bench", "decode", "--model", str(tokenizer), "--shape", "tiny-qwen3.5", "--device", "cpu",
                 "--no-hf", "--prompt-lens", "16", "--batch-sizes", "1", "--gen-len", "3", "--peer-bench",
                 str(tool), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    model = Path(report["model"])
    assert model.name == "random-tiny-qwen3.5-Q4_K_M.gguf" and not model.exists()
    assert json.loads(log.read_text())[:2] == ["-m", str(model)]
    assert {r["kind"] for r in report["results"]} == {"prefill", "decode"}
    assert all(r["lucebox_tok_s"] > 0 for r in report["results"])
