"""Read a GGUF file: its metadata into a ModelConfig, its tensors into torch.

The file is memory-mapped by `GGUFFile`; each tensor is dequantized by
`gguf.quants` one at a time and converted straight to the target dtype and
device, so peak host memory stays near one fp32 tensor beyond the result.

Tensor names stay the GGUF ones (`blk.0.attn_q.weight` …): the model modules
are named after them. Two conversions happen here so the model code has one
convention: llama-arch q/k rows are un-permuted (llama.cpp's converter
interleaves them for its non-NeoX rope; the engine uses rotate-half RoPE), and
that is all — GGUF Gemma norms already hold `1 + w`, which is what the
engine's plain RMSNorm multiplies by.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import quants

from lucebox.engine.config import SUPPORTED_ARCHS, ModelConfig, RopeScaling, gemma3_layer_types
from lucebox.engine.gguf_file import GGUFFile
from lucebox.errors import ModelFileError

# Types gguf.quants can dequantize (plus the plain float ones).
_FLOAT_TYPES = {"F32", "F16"}


def open_gguf(path: Path) -> GGUFFile:
    """Open and validate a GGUF file; any structural problem is a ModelFileError."""
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"{path}: no such file")
    return GGUFFile(path)


def field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """One metadata value as a Python value (str, int, float, list)."""
    return reader.get(key, default)


def gguf_config(reader: GGUFFile, path: Path) -> ModelConfig:
    """Build the ModelConfig from the `{arch}.*` metadata keys."""
    arch = field(reader, "general.architecture")
    if arch is None:
        raise ModelFileError(f"{path}: GGUF has no general.architecture key")
    family = "llama" if arch in ("mistral", "mistral3") else arch
    if family not in SUPPORTED_ARCHS:
        raise ModelFileError(
            f"{path}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})"
        )

    def key(k: str, default: Any = None) -> Any:
        return field(reader, f"{arch}.{k}", default)

    names = {t.name for t in reader.tensors}
    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer list in some files; engine needs one value
        kv_heads = max(kv_heads)
    n_layers = int(key("block_count"))
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = int(key("vocab_size", len(tokens) if tokens else 0))
    rope_dim = key("rope.dimension_count", head_dim)
    if int(rope_dim) != head_dim:
        raise ModelFileError(f"{path}: partial rotary embeddings (rope dim {rope_dim} < head dim {head_dim})")

    cfg = ModelConfig(
        arch=family,
        name=str(field(reader, "general.name", path.stem)),
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position=int(key("context_length", 4096)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(key),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
    )
    if family == "gemma3":
        pattern = int(key("attention.sliding_window_pattern", 6) or 6)
        cfg.sliding_window = int(key("attention.sliding_window", 512))
        cfg.layer_types = gemma3_layer_types(n_layers, pattern)
        cfg.rope_local_theta = float(key("rope.freq_base_swa", 10000.0))
        cfg.hidden_act = "gelu_tanh"
        cfg.embed_scale = hidden**0.5
        cfg.sandwich_norm = True
        # llama.cpp: Gemma 3 27B scales queries by hidden/heads, the others by head_dim.
        cfg.attn_scale = (hidden // heads) ** -0.5 if n_layers == 62 else head_dim**-0.5
        cfg.final_logit_softcap = key("final_logit_softcapping")
    return cfg


def _rope_scaling(key: Any) -> RopeScaling:
    kind = key("rope.scaling.type", "none") or "none"
    factor = float(key("rope.scaling.factor", 1.0) or 1.0)
    if kind == "none" or factor == 1.0:
        return RopeScaling()
    if kind not in ("linear", "yarn"):
        raise ModelFileError(f"unsupported rope scaling type {kind!r}")
    return RopeScaling(
        kind=kind,
        factor=factor,
        original_max_position=int(key("rope.scaling.original_context_length", 0) or 0),
        beta_fast=float(key("rope.scaling.yarn_beta_fast", 32.0) or 32.0),
        beta_slow=float(key("rope.scaling.yarn_beta_slow", 1.0) or 1.0),
        attention_factor=key("rope.scaling.attn_factor"),
    )


def dominant_quant(reader: GGUFFile) -> str:
    """The quant type holding the most weight bytes, e.g. `Q4_1`."""
    by_type: dict[str, int] = {}
    for t in reader.tensors:
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + t.n_bytes
    return max(by_type, key=by_type.__getitem__) if by_type else "none"


def check_quant_types(reader: GGUFFile, path: Path) -> None:
    """Refuse, before loading anything, a file with a type gguf cannot dequantize."""
    known = getattr(quants, "_type_traits", None)  # the registry `quants.dequantize` dispatches on
    if known is None:
        return

    for t in reader.tensors:
        name = t.tensor_type.name
        if name not in _FLOAT_TYPES and t.tensor_type not in known:
            raise ModelFileError(f"{path}: tensor {t.name} has unsupported quant type {name}")


def iter_gguf_tensors(
    reader: GGUFFile, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (GGUF name, dequantized tensor in numpy row-major shape)."""

    for t in reader.tensors:
        try:
            arr = quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ModelFileError(f"tensor {t.name}: quant type {t.tensor_type.name} is not supported") from None
        shape = tuple(reversed([int(d) for d in t.shape]))
        arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(shape)
        if not arr.flags.writeable:  # F32 tensors come back as views of the read-only map
            arr = arr.copy()
        tensor = torch.from_numpy(arr)
        if cfg.arch == "llama" and (t.name.endswith("attn_q.weight") or t.name.endswith("attn_q.bias")):
            tensor = unpermute_qk(tensor, cfg.num_heads)
        elif cfg.arch == "llama" and (t.name.endswith("attn_k.weight") or t.name.endswith("attn_k.bias")):
            tensor = unpermute_qk(tensor, cfg.num_kv_heads)
        yield t.name, tensor.to(device=device, dtype=dtype)


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row interleave (its `permute` in convert_hf_to_gguf)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
