"""The tiny model fixtures are real model files: gguf reads them, transformers loads and runs them.

transformers is the independent reference here (it has its own GGUF reader, tensor mapping, llama q/k
un-permutation and Gemma norm handling), so an F32 GGUF that gives the same logits as the transformers model
built from the same seed proves the file follows llama.cpp's conventions.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests.fixtures import tiny_models
from tests.fixtures.tiny_models import (
    ARCHS,
    K_QTYPES,
    QTYPES,
    gguf_qtype_counts,
    llama3_rope_factors,
    random_k_blocks,
    sentencepiece_model_proto,
    tiny_config,
    tiny_hf_model,
    tiny_vocab,
    transformers_gguf_kwargs,
    write_tiny_gguf,
    write_tiny_hf_folder,
)

# The factories, as the lead's conftest.py exposes them.
tiny_gguf = tiny_models.tiny_gguf
tiny_hf_folder = tiny_models.tiny_hf_folder

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

# Every qtype on llama, every arch in F32, and a spread of the rest over the other archs.
GGUF_CASES = sorted({("llama", q) for q in QTYPES} | {(a, "F32") for a in ARCHS} | {
    ("mistral", "Q4_0"), ("mistral", "Q3_K"), ("qwen2", "Q8_0"), ("qwen2", "Q5_K"), ("qwen3", "BF16"),
    ("qwen3", "Q4_K"), ("gemma3", "F16"), ("gemma3", "Q4_1"), ("gemma3", "Q6_K"), ("gemma3", "Q2_K"),
})

TEXTS = ["Hello there, the quick brown fox jumps over the lazy dog.", "digits 12345 and 3.14; tabs\tand\nlines",
         "Ünïcödé, 日本語 and emoji \U0001f600 fall back to bytes"]

# llama.cpp tensor names, typed out here on purpose (the writer takes them from gguf.constants).
LAYER_TENSORS = {
    "llama": ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"],
    "qwen2": ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"],
    "qwen3": ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "ffn_norm",
              "ffn_gate", "ffn_up", "ffn_down"],
    "gemma3": ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
               "post_attention_norm", "ffn_norm", "post_ffw_norm", "ffn_gate", "ffn_up", "ffn_down"],
}
LAYER_TENSORS["mistral"] = LAYER_TENSORS["llama"]


def field(reader: gguf.GGUFReader, key: str):
    f = reader.fields[key]
    return f.contents()


def load_gguf_reference(path: Path, **kwargs):
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **kwargs)
    return model.eval()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.fixture(scope="session")
def hf_models() -> dict:
    """transformers models built in memory from the same seeds, keyed by (arch, overrides)."""
    cache: dict = {}

    def get(arch: str, **overrides):
        key = (arch, repr(sorted(overrides.items())))
        if key not in cache:
            cache[key] = tiny_hf_model(arch, **overrides)
        return cache[key]

    return get


# --------------------------------------------------------------------------------------------------------------
# Vocabulary


@pytest.mark.parametrize("arch", ARCHS)
def test_vocab_is_consistent(arch: str) -> None:
    v = tiny_vocab(arch)
    assert 300 <= len(v.tokens) <= 512
    assert len(set(v.tokens)) == len(v.tokens)
    assert len(v.token_types) == len(v.tokens)
    if v.model == "gpt2":
        assert [v.tokens[i] for i in (0, 1, 2)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        assert {v.token_types[i] for i in (0, 1, 2)} == {3}
        assert v.tokens[v.eos_id] == "<|im_end|>" and "<|im_start|>" in v.chat_template
        for merge in v.merges:  # every merge makes a token of the vocab out of two tokens of the vocab
            left, right = merge.split(" ")
            assert left in v.tokens and right in v.tokens and left + right in v.tokens
    else:
        assert v.scores is not None and len(v.scores) == len(v.tokens)
        assert all(f"<0x{b:02X}>" in v.tokens for b in range(256))
        assert v.token_types[v.id("<0x41>")] == 6  # BYTE
        assert v.token_types[v.unk_id] == 2  # UNKNOWN
        names = {"mistral": ("<s>", "</s>", "<unk>"), "gemma3": ("<bos>", "<eos>", "<unk>")}[arch]
        assert (v.tokens[v.bos_id], v.tokens[v.eos_id], v.tokens[v.unk_id]) == names
        if arch == "gemma3":
            assert {"<start_of_turn>", "<end_of_turn>", "<pad>"} <= set(v.tokens)
            assert v.tokens[v.eot_id] == "<end_of_turn>"


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_vocab_size_override_is_exact(arch: str) -> None:
    assert len(tiny_vocab(arch, 500).tokens) == 500
    with pytest.raises(ValueError, match="vocab"):
        tiny_vocab(arch, 100)


# --------------------------------------------------------------------------------------------------------------
# GGUF files


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_metadata_and_tensor_names(tiny_gguf, arch: str) -> None:
    cfg = tiny_config(arch)
    reader = gguf.GGUFReader(tiny_gguf(arch))
    gguf_arch = "llama" if arch == "mistral" else arch
    assert field(reader, "general.architecture") == gguf_arch
    assert field(reader, "general.name") == cfg.name
    keys = ["context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
            "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "rope.freq_base"]
    keys += {"llama": ["vocab_size", "rope.dimension_count"], "mistral": ["vocab_size", "rope.dimension_count"],
             "qwen2": [], "qwen3": ["attention.key_length", "attention.value_length"],
             "gemma3": ["attention.key_length", "attention.value_length", "attention.sliding_window"]}[arch]
    for key in keys:
        assert f"{gguf_arch}.{key}" in reader.fields, key
    assert field(reader, f"{gguf_arch}.block_count") == cfg.num_layers
    assert field(reader, f"{gguf_arch}.attention.head_count_kv") == cfg.num_kv_heads
    if arch in ("qwen3", "gemma3"):
        assert field(reader, f"{gguf_arch}.attention.key_length") == cfg.head_dim != cfg.hidden_size // cfg.num_heads

    v = tiny_vocab(arch)
    assert field(reader, "tokenizer.ggml.model") == v.model
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == len(v.tokens)
    assert ("tokenizer.ggml.merges" in reader.fields) == (v.model == "gpt2")
    assert ("tokenizer.ggml.scores" in reader.fields) == (v.model == "llama")
    assert field(reader, "tokenizer.chat_template") == v.chat_template

    names = {t.name for t in reader.tensors}
    expected = {"token_embd.weight", "output_norm.weight"}
    for i in range(cfg.num_layers):
        expected |= {f"blk.{i}.{t}.weight" for t in LAYER_TENSORS[arch]}
        if arch == "qwen2":
            expected |= {f"blk.{i}.attn_{t}.bias" for t in "qkv"}
    assert names == expected  # tied: no output.weight
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert list(emb.shape) == [cfg.hidden_size, len(v.tokens)]  # ggml order: ne0 = row length


def test_gguf_untied_head_and_gemma_norms(tiny_gguf) -> None:
    reader = gguf.GGUFReader(tiny_gguf("llama", tied=False))
    assert "output.weight" in {t.name for t in reader.tensors}
    # Gemma norms carry llama.cpp's +1: HF stores offsets around 0, the file values around 1.
    reader = gguf.GGUFReader(tiny_gguf("gemma3"))
    for t in reader.tensors:
        if t.name.endswith("norm.weight"):
            assert abs(float(np.mean(t.data)) - 1.0) < 0.1, t.name


@pytest.mark.parametrize(("arch", "qtype"), GGUF_CASES)
def test_gguf_loads_in_transformers(tiny_gguf, hf_models, arch: str, qtype: str) -> None:
    path = tiny_gguf(arch, qtype)
    counts = gguf_qtype_counts(path)
    cfg = tiny_config(arch, qtype)
    matrices = 7 * cfg.num_layers  # q k v o gate up down
    assert counts.get(qtype, 0) >= matrices, counts  # every weight matrix really is in that type
    reader = gguf.GGUFReader(path)
    for t in reader.tensors:
        if len(t.shape) == 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name  # norms and biases stay F32
    assert field(reader, "general.file_type") is not None

    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = load_gguf_reference(path)
    ids = tok(TEXTS[0], return_tensors="pt").input_ids
    assert ids.shape[1] > 5
    out = logits(model, ids)
    assert out.shape == (1, ids.shape[1], len(tiny_vocab(arch).tokens))
    assert torch.isfinite(out).all()
    assert 0.1 < float(out.std()) < 50.0

    if qtype in K_QTYPES:
        return  # random blocks: not a quantization of the seed's float weights
    ref = logits(hf_models(arch), ids)
    if qtype == "F32":
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)  # same model: permutations and +1 undone
    else:
        corr = float(torch.corrcoef(torch.stack([out.flatten(), ref.flatten()]))[0, 1])
        assert corr > {"F16": 0.999, "BF16": 0.99, "Q8_0": 0.99}.get(qtype, 0.8), corr


def test_k_quant_blocks_are_valid_and_scaled() -> None:
    rng = np.random.default_rng(0)
    for qtype in K_QTYPES:
        data = random_k_blocks(8, 512, qtype, 0.05, rng)
        values = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype])
        assert values.shape == (8, 512)
        assert np.isfinite(values).all()
        assert 0.04 < values.std() < 0.06, qtype
        assert abs(values.mean()) < 0.01, qtype
    with pytest.raises(ValueError, match="multiple of 256"):
        random_k_blocks(2, 64, "Q4_K", 0.05, rng)


def test_rows_that_do_not_fit_fall_back_like_llama_cpp(tmp_path: Path) -> None:
    # hidden 96 is a multiple of 32 but not of 256: Q4_K cannot hold those rows, ffn_down (ffn 512) can.
    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", qtype="Q4_K", hidden_size=96, num_heads=3,
                           num_kv_heads=1, intermediate_size=512)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ffn_down.weight"] == "Q4_K"
    assert types["blk.0.attn_q.weight"] == "Q8_0"


def test_llama3_rope_freqs_match_transformers() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = tiny_config("llama", rope_scaling="llama3")
    conf = transformers.LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads,
                                    head_dim=cfg.head_dim, rope_parameters={**cfg.rope_scaling,
                                                                            "rope_theta": cfg.rope_theta})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](conf, "cpu")
    plain = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    factors = torch.from_numpy(llama3_rope_factors(cfg)).double()
    assert factors.min() == 1.0 and factors.max() == cfg.rope_scaling["factor"]  # both ends are exercised
    torch.testing.assert_close(plain / factors, scaled.double(), rtol=1e-5, atol=0)


@pytest.mark.parametrize(("arch", "scaling"), [("llama", "llama3"), ("llama", "linear"), ("gemma3", "linear")])
def test_gguf_rope_scaling(tiny_gguf, hf_models, arch: str, scaling: str) -> None:
    path = tiny_gguf(arch, rope_scaling=scaling)
    reader = gguf.GGUFReader(path)
    names = {t.name for t in reader.tensors}
    if scaling == "llama3":
        assert "rope_freqs.weight" in names and f"{arch}.rope.scaling.type" not in reader.fields
    else:
        assert "rope_freqs.weight" not in names
        assert field(reader, f"{arch}.rope.scaling.type") == "linear"
        assert field(reader, f"{arch}.rope.scaling.factor") == 8.0
    # transformers ignores GGUF rope scaling; told about it, it computes the same model as the HF one.
    model = load_gguf_reference(path, **transformers_gguf_kwargs(arch, rope_scaling=scaling))
    ids = torch.arange(3, 43)[None]  # 40 positions: past gemma3's sliding window of 16 too
    torch.testing.assert_close(logits(model, ids), logits(hf_models(arch, rope_scaling=scaling), ids),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("arch", "overrides"), [("qwen3", {"head_dim": 32}), ("gemma3", {"head_dim": 64}),
                                                 ("gemma3", {"rope_local_theta": 500.0, "sliding_window": 8}),
                                                 ("llama", {"tied": False, "num_kv_heads": 1})])
def test_gguf_overrides_with_reference_kwargs(tiny_gguf, hf_models, arch: str, overrides: dict) -> None:
    path = tiny_gguf(arch, **overrides)
    model = load_gguf_reference(path, **transformers_gguf_kwargs(arch, **overrides))
    ids = torch.arange(3, 40)[None]
    torch.testing.assert_close(logits(model, ids), logits(hf_models(arch, **overrides), ids), atol=1e-4, rtol=1e-4)


def test_bad_options_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny arch"):
        write_tiny_gguf(tmp_path / "a.gguf", "gpt2")
    with pytest.raises(ValueError, match="unknown qtype"):
        write_tiny_gguf(tmp_path / "a.gguf", "llama", qtype="Q9_K")
    with pytest.raises(ValueError, match="hiden_size"):
        write_tiny_gguf(tmp_path / "a.gguf", "llama", hiden_size=32)
    with pytest.raises(ValueError, match="global layer"):
        write_tiny_gguf(tmp_path / "a.gguf", "gemma3", num_layers=2)
    with pytest.raises(ValueError, match="llama3"):
        write_tiny_gguf(tmp_path / "a.gguf", "gemma3", rope_scaling="llama3")
    with pytest.raises(ValueError, match="sliding window"):
        write_tiny_gguf(tmp_path / "a.gguf", "mistral", sliding_window=32)


def test_tiny_gguf_factory_caches(tiny_gguf) -> None:
    a = tiny_gguf("qwen2", "Q8_0")
    assert tiny_gguf("qwen2", "Q8_0") == a
    b = tiny_gguf("qwen2", "Q8_0", seed=1)
    assert b != a and b.read_bytes() != a.read_bytes()
    assert math.isclose(b.stat().st_size, a.stat().st_size, rel_tol=0.01)


# --------------------------------------------------------------------------------------------------------------
# Tokenizers: the GGUF metadata and the HF folder's tokenizer.json describe the same tokenizer


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_and_hf_tokenizers_agree(tiny_gguf, tiny_hf_folder, arch: str) -> None:
    path = tiny_gguf(arch)
    from_gguf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    from_folder = transformers.AutoTokenizer.from_pretrained(tiny_hf_folder(arch))
    v = tiny_vocab(arch)
    for text in TEXTS:
        ids = from_folder(text).input_ids
        assert from_gguf(text).input_ids == ids, text
        assert (ids[0] == v.bos_id) == v.add_bos
        assert from_folder.decode(ids, skip_special_tokens=True) == text
    messages = [{"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": "Write a poem."}]
    rendered = from_folder.apply_chat_template(messages, tokenize=False, add_generation_prompt=arch != "mistral")
    assert rendered == from_gguf.apply_chat_template(messages, tokenize=False, add_generation_prompt=arch != "mistral")
    turn_end = v.tokens[v.eot_id]
    assert rendered.count(turn_end) == (1 if arch == "mistral" else 3)  # mistral: </s> after answers only
    assert v.eot_id in from_folder(rendered, add_special_tokens=False).input_ids  # specials stay whole


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_sentencepiece_style_vocab_matches_sentencepiece(tiny_hf_folder, arch: str) -> None:
    sentencepiece = pytest.importorskip("sentencepiece")
    sp = sentencepiece.SentencePieceProcessor(model_proto=sentencepiece_model_proto(tiny_vocab(arch)))
    from_folder = transformers.AutoTokenizer.from_pretrained(tiny_hf_folder(arch))
    for text in [*TEXTS, " leading space and  double  spaces", "  two\n\nlines ", "x"]:
        ids = sp.encode(text)
        assert from_folder(text, add_special_tokens=False).input_ids == ids, text
        assert any(i > 300 for i in ids) and sp.decode(ids) == text


# --------------------------------------------------------------------------------------------------------------
# Hugging Face folders


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_folder_loads_in_transformers(tiny_hf_folder, hf_models, arch: str) -> None:
    folder = tiny_hf_folder(arch)
    files = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= files
    conf = json.loads((folder / "config.json").read_text())
    assert "rope_parameters" not in conf and conf["rope_theta"] > 0 and conf["torch_dtype"] == "float32"
    assert conf["vocab_size"] == len(tiny_vocab(arch).tokens) and conf["tie_word_embeddings"] is True
    if arch == "gemma3":
        assert conf["rope_local_base_freq"] == 10_000.0 and conf["sliding_window"] == 16
        assert conf["layer_types"].count("full_attention") == 1
    tok_conf = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok_conf["chat_template"] == tiny_vocab(arch).chat_template
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["eos_token_id"] in (tiny_vocab(arch).eos_id, [tiny_vocab(arch).eos_id, tiny_vocab(arch).eot_id])

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                    "gemma3": "Gemma3ForCausalLM"}[arch]
    ids = torch.arange(3, 40)[None]
    out = logits(model, ids)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, logits(hf_models(arch), ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("arch", "dtype", "overrides"), [
    ("llama", "bfloat16", {"rope_scaling": "llama3"}),
    ("qwen3", "float16", {}),
    ("gemma3", "float32", {"rope_scaling": "linear"}),
    ("mistral", "float32", {"sliding_window": 8}),
])
def test_hf_folder_sharded(tiny_hf_folder, hf_models, arch: str, dtype: str, overrides: dict) -> None:
    folder = tiny_hf_folder(arch, dtype=dtype, shards=3, tied=False, **overrides)
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert not (folder / "model.safetensors").exists()
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert "lm_head.weight" in index["weight_map"]
    conf = json.loads((folder / "config.json").read_text())
    assert conf["torch_dtype"] == dtype and conf["tie_word_embeddings"] is False
    if "rope_scaling" in overrides:
        assert conf["rope_scaling"]["rope_type"] == overrides["rope_scaling"]

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.arange(3, 40)[None]
    out = logits(model, ids)
    ref = logits(hf_models(arch, tied=False, **overrides), ids)
    if dtype == "float32":
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:  # weights rounded to 16 bits: same model up to that rounding
        corr = float(torch.corrcoef(torch.stack([out.flatten(), ref.flatten()]))[0, 1])
        assert corr > 0.99, corr


def test_hf_folder_transformers_style_config(tmp_path: Path, hf_models) -> None:
    folder = write_tiny_hf_folder(tmp_path / "g", "gemma3", config_style="transformers", rope_scaling="linear")
    conf = json.loads((folder / "config.json").read_text())
    assert conf["rope_parameters"]["full_attention"]["rope_type"] == "linear"
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.arange(3, 40)[None]
    torch.testing.assert_close(logits(model, ids), logits(hf_models("gemma3", rope_scaling="linear"), ids),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="shards"):
        write_tiny_hf_folder(tmp_path / "x", "llama", shards=1000)
