"""Random-weight GGUFs of real shapes for speed runs: the pieces the bench writers share, and the Qwen3.5 writer.

For timing only. Blocks are random bits with their fp16 scale fields set (nothing is quantized, so a
27B-shaped file takes as long as its bytes take to write), one random matrix per distinct (shape, type) is
shared by every layer (the same bytes are streamed and the same math is done as with the real model), and the
tokenizer comes from another GGUF file. bench/decode.py writes qwen3 files with these pieces, bench/spark.py
qwen3moe ones; `write_random_hybrid_gguf` writes `qwen35` / `qwen35moe` (Qwen3.5-27B, Qwen3.5-35B-A3B) with
the names and keys llama.cpp's converter writes (tests/fixtures/tiny_models.py write_tiny_qwen35_gguf is the
reference for them), in a quant mix that llama.cpp's quantizer would give the file.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from lucebox.errors import LuceboxError

# Per type, from gguf/quants.py: (offset of the fp16 scale d, offset of the fp16 min/dmin field or None, the
# min/d ratio that centres the values). Q4_1/Q5_1 add m (centred at m = ratio * d); K types subtract dmin * m.
_SCALE_FIELDS = {"Q4_0": (0, None, 0.0), "Q4_1": (0, 2, -7.5), "Q5_0": (0, None, 0.0), "Q5_1": (0, 2, -15.5),
                 "Q8_0": (0, None, 0.0), "Q2_K": (80, 82, 1.5), "Q3_K": (108, None, 0.0), "Q4_K": (0, 2, 7.5),
                 "Q5_K": (0, 2, 15.5), "Q6_K": (208, None, 0.0)}


def random_blocks(rows: int, cols: int, qtype: str, std: float, rng: np.random.Generator) -> np.ndarray:
    """Valid random blocks of a [rows, cols] `qtype` matrix with values of about `std` and mean about 0:
    random bits with the fp16 scale fields set (no float matrix is quantized, so an 8B-shaped file takes
    seconds). Returns the uint8 byte matrix GGUFWriter takes."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    if cols % block:
        raise ValueError(f"{qtype} needs rows of a multiple of {block} values, got {cols}")
    data = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    d_at, m_at, ratio = _SCALE_FIELDS[qtype]

    def set_scale(d: float) -> None:
        data[:, d_at:d_at + 2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
        if m_at is not None:
            data[:, m_at:m_at + 2] = np.frombuffer(np.float16(d * ratio).tobytes(), np.uint8)

    set_scale(1.0)
    unit = float(gguf.quants.dequantize(data[: min(len(data), 4096)], kind).std())
    set_scale(std / unit)
    return data.reshape(rows, -1)


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v / ffn_down a Q4_K_M file stores as Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


# llama.cpp's "attention-v-like" tensors (category_is_attn_v in src/llama-quant.cpp): one per layer, counted in
# layer order, so the i-th is layer i's. A Qwen3.5 layer has attn_v (full attention) or attn_qkv (DeltaNet).
# (Before llama.cpp's tensor-category rewrite attn_qkv had a rule of its own, Q5_K in a Q4_K_M file.)
_V_LIKE = ("attn_v", "attn_qkv")


def mix_qtype(mix: str, name: str, layer: int, n_layers: int) -> str:
    """The type of matrix `name` (the part before `.weight`, e.g. `attn_v`, `ffn_down_exps`) of layer `layer` in
    a `mix` file: Q4_K_M as llama.cpp's quantizer assigns it (output Q6_K; the attention-v-like tensor and every
    ffn_down* of the use_more_bits layers Q6_K; the rest Q4_K), or one type for every matrix."""
    if mix != "Q4_K_M":
        return mix
    if name == "output":
        return "Q6_K"
    if (name in _V_LIKE or name.startswith("ffn_down")) and _more_bits(layer, n_layers):
        return "Q6_K"
    return "Q4_K"


# llama.cpp's tensor_type_fallback: a K type whose row length is not a multiple of 256.
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def quantized_by_llama_cpp(name: str, ndim: int) -> bool:
    """Whether llama.cpp's quantizer changes the type of tensor `name` (tensor_allows_quantization): 2-D and 3-D
    `*weight` tensors except norms, routers (ffn_gate_inp) and the conv; so ssm_a, ssm_dt.bias, the shared
    expert's gate vector and every norm stay as the converter wrote them (F32)."""
    return (ndim >= 2 and name.endswith("weight") and "_norm.weight" not in name
            and "ffn_gate_inp.weight" not in name and "ssm_conv1d" not in name)


def tensor_qtype(mix: str, name: str, shape: tuple[int, ...], n_layers: int) -> str:
    """The type of tensor `name` (numpy shape `shape`) in a `mix` file of `n_layers` layers: F32 where llama.cpp
    leaves it unquantized, else `mix_qtype`, falling back as llama.cpp does where a row does not fit the block."""
    import gguf

    if not quantized_by_llama_cpp(name, len(shape)):
        return "F32"
    parts = name.split(".")
    layer = int(parts[1]) if parts[0] == "blk" else 0
    qtype = mix_qtype(mix, parts[-2], layer, n_layers)
    if qtype in _FALLBACK and shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]:
        qtype = _FALLBACK[qtype]
    return qtype


def add_tokenizer(w: Any, tokenizer_gguf: Path, vocab: int | None = None) -> int:
    """Copy the `tokenizer.*` keys of `tokenizer_gguf` into writer `w`; with `vocab` larger than its token list,
    pad the list with `[PAD{i}]` tokens of type UNUSED, as llama.cpp's converter pads a vocab. Returns the
    number of tokens written."""
    import gguf

    reader = gguf.GGUFReader(tokenizer_gguf)
    fields = {k: f for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    n_tokens = len(fields["tokenizer.ggml.tokens"].contents())
    if vocab is not None and vocab < n_tokens:
        raise LuceboxError(f"{tokenizer_gguf} has {n_tokens:,} tokens, more than the shape's vocabulary of "
                           f"{vocab:,}: give --model a tokenizer of at most that many")
    pad = range(n_tokens, vocab if vocab is not None else n_tokens)
    fill = {"tokenizer.ggml.tokens": [f"[PAD{i}]" for i in pad],
            "tokenizer.ggml.token_type": [int(gguf.TokenType.UNUSED)] * len(pad),
            "tokenizer.ggml.scores": [0.0] * len(pad)}
    for key, f in fields.items():
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        value = f.contents()
        if key in fill and pad:
            value = value + fill[key]
        w.add_key_value(key, value, f.types[0], sub_type=sub)
    return n_tokens + len(pad)


# ----- Qwen3.5: `qwen35` (dense FFN) and `qwen35moe` -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HybridShape:
    """A Qwen3.5 text model's shape (the fields of the published config.json files): full attention every
    `interval`-th layer (query + output gate packed in attn_q, partial rotary), Gated DeltaNet elsewhere; a dense
    SwiGLU of `ffn` (qwen35) or `n_experts` experts, `top_k` per token, plus a gated shared expert (qwen35moe)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    linear_k_heads: int
    linear_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    ffn: int = 0
    n_experts: int = 0
    top_k: int = 0
    expert_ff: int = 0
    shared_ff: int = 0
    interval: int = 4
    conv_kernel: int = 4
    vocab: int = 248_320
    rotary_fraction: float = 0.25
    mrope_sections: tuple[int, ...] = (11, 11, 10)
    rope_theta: float = 10_000_000.0
    context: int = 262_144

    @property
    def arch(self) -> str:
        return "qwen35moe" if self.n_experts else "qwen35"


HYBRID_SHAPES = {  # Qwen3.5-27B and Qwen3.5-35B-A3B's published config.json (no MTP block), and small ones
    "qwen3.5-27b": HybridShape(5120, 64, 24, 4, 256, 16, 48, 128, 128, ffn=17408),
    "qwen3.5-35b-a3b": HybridShape(2048, 40, 16, 2, 256, 16, 32, 128, 128, n_experts=256, top_k=8, expert_ff=512,
                                   shared_ff=512),
    # every matrix row a multiple of 256 values, so Q4_K_M needs no fallback type
    "tiny-qwen3.5": HybridShape(256, 6, 4, 2, 64, 2, 4, 64, 64, ffn=512, interval=3, vocab=512,
                                mrope_sections=(3, 3, 2), context=4096),
    "tiny-qwen3.5-moe": HybridShape(256, 6, 4, 2, 64, 2, 4, 64, 64, n_experts=8, top_k=2, expert_ff=256,
                                    shared_ff=256, interval=3, vocab=512, mrope_sections=(3, 3, 2), context=4096),
}


def hybrid_tensors(s: HybridShape, vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, numpy shape, how to fill it) of every tensor, in the converter's names: numpy shapes are
    ggml's reversed ([out, in] for a matrix, [experts, out, in] for the experts)."""
    h, hd, qkv = s.hidden, s.head_dim, 2 * s.linear_k_heads * s.linear_k_dim + s.linear_v_heads * s.linear_v_dim
    value = s.linear_v_heads * s.linear_v_dim
    out: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (vocab, h), "matrix")]
    for i in range(s.layers):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (h,), "ones"), (p + "post_attention_norm.weight", (h,), "ones")]
        if (i + 1) % s.interval == 0:
            out += [(p + "attn_q.weight", (2 * s.heads * hd, h), "matrix"),
                    (p + "attn_k.weight", (s.kv_heads * hd, h), "matrix"),
                    (p + "attn_v.weight", (s.kv_heads * hd, h), "matrix"),
                    (p + "attn_q_norm.weight", (hd,), "ones"), (p + "attn_k_norm.weight", (hd,), "ones"),
                    (p + "attn_output.weight", (h, s.heads * hd), "matrix")]
        else:
            out += [(p + "attn_qkv.weight", (qkv, h), "matrix"), (p + "attn_gate.weight", (value, h), "matrix"),
                    (p + "ssm_beta.weight", (s.linear_v_heads, h), "matrix"),
                    (p + "ssm_alpha.weight", (s.linear_v_heads, h), "matrix"),
                    (p + "ssm_a", (s.linear_v_heads,), "a"), (p + "ssm_dt.bias", (s.linear_v_heads,), "dt"),
                    (p + "ssm_conv1d.weight", (qkv, s.conv_kernel), "conv"),
                    (p + "ssm_norm.weight", (s.linear_v_dim,), "ones"),
                    (p + "ssm_out.weight", (h, value), "matrix")]
        if s.n_experts:
            e = s.n_experts
            out += [(p + "ffn_gate_inp.weight", (e, h), "matrix"),
                    (p + "ffn_gate_exps.weight", (e, s.expert_ff, h), "matrix"),
                    (p + "ffn_up_exps.weight", (e, s.expert_ff, h), "matrix"),
                    (p + "ffn_down_exps.weight", (e, h, s.expert_ff), "matrix"),
                    (p + "ffn_gate_inp_shexp.weight", (h,), "matrix"),
                    (p + "ffn_gate_shexp.weight", (s.shared_ff, h), "matrix"),
                    (p + "ffn_up_shexp.weight", (s.shared_ff, h), "matrix"),
                    (p + "ffn_down_shexp.weight", (h, s.shared_ff), "matrix")]
        else:
            out += [(p + "ffn_gate.weight", (s.ffn, h), "matrix"), (p + "ffn_up.weight", (s.ffn, h), "matrix"),
                    (p + "ffn_down.weight", (h, s.ffn), "matrix")]
    return out + [("output_norm.weight", (h,), "ones"), ("output.weight", (vocab, h), "matrix")]


def _float_values(fill: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Float values that keep a random model's activations finite: matrices of std 1/sqrt(inputs), norms of 1
    (the converter stores Qwen3.5's 1 + w), decay rates A in [1, e] (ssm_a = -A), small dt biases, a conv of
    std 0.5."""
    if fill == "ones":
        return np.ones(shape, dtype=np.float32)
    if fill == "a":
        return -np.exp(rng.uniform(0.0, 1.0, shape)).astype(np.float32)
    std = {"dt": 0.5, "conv": 0.5}.get(fill, shape[-1] ** -0.5)
    return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)


def _file_type(mix: str) -> Any:
    """`general.file_type` of a `mix` file, as llama-quantize labels it (a one-type K mix as its _M file type)."""
    import gguf

    name = {"F32": "ALL_F32", "Q3_K": "MOSTLY_Q3_K_M", "Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M"}.get(
        mix, f"MOSTLY_{mix}")
    if name not in gguf.LlamaFileType.__members__:
        raise ValueError(f"unknown quant mix {mix!r}")
    return gguf.LlamaFileType[name]


def write_random_hybrid_gguf(path: Path, shape: HybridShape, tokenizer_gguf: Path, mix: str = "Q4_K_M",
                             name: str | None = None, seed: int = 0, context: int | None = None) -> Path:
    """A `qwen35` / `qwen35moe` GGUF of `shape` with random weights in quant mix `mix` (Q4_K_M as llama.cpp's
    quantizer assigns it, see `tensor_qtype`; one type such as Q8_0 for every quantizable matrix; or F16), the
    keys llama.cpp reads for these archs, and the tokenizer of `tokenizer_gguf` padded to the shape's vocab.
    One random tensor per distinct (shape, type, fill) is shared by the layers."""
    import gguf

    arch = shape.arch
    w = gguf.GGUFWriter(path, arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name or f"random {arch}")
    w.add_context_length(context or shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    if shape.n_experts:
        w.add_expert_count(shape.n_experts)
        w.add_expert_used_count(shape.top_k)
        w.add_expert_feed_forward_length(shape.expert_ff)
        w.add_expert_shared_feed_forward_length(shape.shared_ff)
    else:
        w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_rope_dimension_count(int(shape.head_dim * shape.rotary_fraction))
    w.add_rope_dimension_sections([*shape.mrope_sections, 0])
    w.add_ssm_conv_kernel(shape.conv_kernel)
    w.add_ssm_state_size(shape.linear_k_dim)
    w.add_ssm_group_count(shape.linear_k_heads)
    w.add_ssm_time_step_rank(shape.linear_v_heads)
    w.add_ssm_inner_size(shape.linear_v_dim * shape.linear_v_heads)
    w.add_full_attention_interval(shape.interval)
    w.add_file_type(_file_type(mix))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab = add_tokenizer(w, tokenizer_gguf, shape.vocab)

    rng = np.random.default_rng(seed)
    cache: dict[tuple[Any, ...], tuple[np.ndarray, Any]] = {}
    for tensor, dims, fill in hybrid_tensors(shape, vocab):
        qtype = tensor_qtype(mix, tensor, dims, shape.layers)
        if (dims, qtype, fill) not in cache:
            if qtype in ("F32", "F16"):
                values = _float_values(fill, dims, rng)
                cache[dims, qtype, fill] = (values.astype(np.float16) if qtype == "F16" else values, None)
            else:
                rows, cols = int(np.prod(dims[:-1])), dims[-1]
                blocks = random_blocks(rows, cols, qtype, cols**-0.5, rng)
                cache[dims, qtype, fill] = (blocks.reshape(*dims[:-1], -1), gguf.GGMLQuantizationType[qtype])
        data, raw = cache[dims, qtype, fill]
        w.add_tensor(tensor, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
