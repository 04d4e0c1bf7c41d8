"""Read a GGUF file: its metadata into a ModelConfig, its tensors into torch.

The file is memory-mapped by `GGUFFile`; each tensor's bytes go from the map
to the device one at a time. On CUDA the linear weights, embedding and LM head
of the types engine/weights/quant has kernels for stay in their GGUF blocks
(`QuantWeight`), so device memory for weights is about the file's tensor bytes;
float tensors are converted by torch; other quant types are dequantized at
load (by engine/weights/quant's torch code, or `gguf.quants` for types it lacks).

Tensor names stay the GGUF ones (`blk.0.attn_q.weight` …): the model modules
are named after them. Two conversions happen here so the model code has one
convention: llama-arch q/k rows are un-permuted (llama.cpp's converter
interleaves them for its non-NeoX rope; the engine uses rotate-half RoPE), and
that is all — GGUF Gemma norms already hold `1 + w`, which is what the
engine's plain RMSNorm multiplies by.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import quants

from lucebox.engine.models.config import HYBRID_ARCHS, SUPPORTED_ARCHS, ModelConfig, RopeScaling, gemma3_layer_types
from lucebox.engine.weights.config_check import ConfigValues, check_config, check_float, check_int, describe
from lucebox.engine.weights.gguf_file import GGUFFile
from lucebox.engine.weights.quant import QUANT_TYPES, QuantWeight, row_bytes
from lucebox.errors import ModelFileError

log = logging.getLogger(__name__)

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
    """Build the ModelConfig from the `{arch}.*` metadata keys, each typed and range-checked (config_check)."""
    arch = field(reader, "general.architecture")
    if arch is None:
        raise ModelFileError(f"{path}: GGUF has no general.architecture key")
    if not isinstance(arch, str):
        raise ModelFileError(f"{path}: general.architecture is {describe(arch)}, not an architecture name")
    family = "llama" if arch in ("mistral", "mistral3") else arch
    if family not in SUPPORTED_ARCHS:
        raise ModelFileError(
            f"{path}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    meta = ConfigValues(str(path), reader.fields.__getitem__, prefix=f"{arch}.")

    names = {t.name for t in reader.tensors}
    hidden = meta.whole("embedding_length", "hidden_size")
    heads = meta.whole("attention.head_count", "num_heads")
    head_dim = meta.whole("attention.key_length", "head_dim", max(hidden // heads, 1))
    kv_heads = meta.raw("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer list in some files; engine needs one value
        kv_heads = max((check_int(str(path), f"{arch}.attention.head_count_kv", k, "num_kv_heads")
                        for k in kv_heads), default=heads)
    kv_heads = check_int(str(path), f"{arch}.attention.head_count_kv", kv_heads, "num_kv_heads")
    n_layers = meta.whole("block_count", "num_layers")
    if family in HYBRID_ARCHS:  # block_count counts the MTP (next-token prediction) blocks too; they are not run
        n_layers -= check_int(str(path), f"{arch}.nextn_predict_layers", meta.raw("nextn_predict_layers", 0) or 0,
                              "nextn_layers")
    tokens = field(reader, "tokenizer.ggml.tokens")
    if tokens is not None and not isinstance(tokens, list):
        raise ModelFileError(f"{path}: tokenizer.ggml.tokens is {describe(tokens)}, not a list of token strings")
    vocab = meta.whole("vocab_size", "vocab_size", len(tokens) if tokens else None)
    rope_dim = meta.whole("rope.dimension_count", "head_dim", head_dim)
    if rope_dim != head_dim and family not in HYBRID_ARCHS:
        raise ModelFileError(f"{path}: partial rotary embeddings (rope dim {rope_dim} < head dim {head_dim})")
    name = field(reader, "general.name", path.stem)

    cfg = ModelConfig(
        arch=family,
        name=name if isinstance(name, str) else path.stem,
        vocab_size=vocab,
        hidden_size=hidden,
        # An all-MoE model (qwen35moe) may have no dense FFN width: the experts' stands in, unused.
        intermediate_size=meta.whole("feed_forward_length", "intermediate_size",
                                     meta.raw("expert_feed_forward_length", None)),
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=meta.real("attention.layer_norm_rms_epsilon", "rms_norm_eps", 1e-6),
        max_position=meta.whole("context_length", "max_position", 4096),
        rope_theta=meta.real("rope.freq_base", "rope_theta", 10000.0),
        rope_scaling=_rope_scaling(meta),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
    )
    if family == "gemma3":
        pattern = check_int(str(path), f"{arch}.attention.sliding_window_pattern",
                            meta.raw("attention.sliding_window_pattern", 6) or 6, "sliding_window_pattern")
        cfg.sliding_window = meta.whole("attention.sliding_window", "sliding_window", 512)
        cfg.layer_types = gemma3_layer_types(n_layers, pattern)
        cfg.rope_local_theta = meta.real("rope.freq_base_swa", "rope_theta", 10000.0)
        cfg.hidden_act = "gelu_tanh"
        cfg.embed_scale = hidden**0.5
        cfg.sandwich_norm = True
        # llama.cpp: Gemma 3 27B scales queries by hidden/heads, the others by head_dim.
        cfg.attn_scale = max(hidden // heads, 1) ** -0.5 if n_layers == 62 else head_dim**-0.5
        softcap = meta.raw("final_logit_softcapping", None) or None  # 0: no softcap
        cfg.final_logit_softcap = None if softcap is None else meta.real("final_logit_softcapping", "softcap")
    if family in HYBRID_ARCHS:
        hybrid_config(cfg, meta, rope_dim)
    if meta.raw("expert_count", 0):
        moe_config(cfg, meta, names)
    return check_config(cfg, str(path))


def hybrid_config(cfg: ModelConfig, meta: ConfigValues, rope_dim: int) -> None:
    """Qwen3.5's Gated DeltaNet shape from the `{arch}.ssm.*` keys, as llama.cpp reads them (v_dim from
    inner_size / time_step_rank), and its layer pattern: layer i is recurrent unless (i + 1) % interval == 0,
    or as `{arch}.attention.recurrent_layers` lists it."""
    cfg.linear_conv_kernel = meta.whole("ssm.conv_kernel", "conv_kernel")
    cfg.linear_k_dim = meta.whole("ssm.state_size", "head_dim")
    cfg.linear_k_heads = meta.whole("ssm.group_count", "linear_heads")
    cfg.linear_v_heads = meta.whole("ssm.time_step_rank", "linear_heads")
    inner = meta.whole("ssm.inner_size", "intermediate_size")
    if inner % cfg.linear_v_heads or cfg.linear_v_heads % cfg.linear_k_heads:
        raise ModelFileError(f"{meta.where}: {meta.prefix}ssm.inner_size {inner} over {cfg.linear_v_heads} value "
                             f"heads, and {cfg.linear_k_heads} key heads, do not divide")
    cfg.linear_v_dim = inner // cfg.linear_v_heads
    recurrent = meta.raw("attention.recurrent_layers", None)
    if isinstance(recurrent, list) and len(recurrent) >= cfg.num_layers:
        cfg.layer_types = ["linear" if r else "full" for r in recurrent[:cfg.num_layers]]
    else:
        interval = meta.whole("full_attention_interval", "layer_interval", 4)
        cfg.layer_types = ["full" if (i + 1) % interval == 0 else "linear" for i in range(cfg.num_layers)]
    cfg.qk_norm = cfg.attn_output_gate = True
    cfg.rotary_dim = rope_dim


def moe_config(cfg: ModelConfig, meta: ConfigValues, names: set[str]) -> None:
    """The experts' shape from the `{arch}.expert_*` keys, as llama.cpp reads them for qwen3moe / qwen35moe
    (softmax router, top-k weights renormalised); a layer is MoE where the file has its router."""
    cfg.n_experts = meta.whole("expert_count", "n_experts")
    cfg.n_experts_used = meta.whole("expert_used_count", "n_experts")
    cfg.expert_ff = meta.whole("expert_feed_forward_length", "intermediate_size")
    if meta.raw("expert_shared_feed_forward_length", 0):
        cfg.shared_expert_ff = meta.whole("expert_shared_feed_forward_length", "intermediate_size")
    gating = meta.raw("expert_gating_func", 1)  # llama.cpp: 1 softmax, 2 sigmoid
    if gating not in (1, 2):
        raise ModelFileError(f"{meta.where}: {meta.prefix}expert_gating_func is {describe(gating)}, "
                             "not 1 (softmax) or 2 (sigmoid)")
    cfg.moe_router = "softmax" if gating == 1 else "sigmoid"
    if meta.raw("expert_weights_scale", 0):  # 0 or absent: unscaled
        cfg.expert_weights_scale = meta.real("expert_weights_scale", "expert_weights_scale")
    cfg.moe_layers = [f"blk.{i}.ffn_gate_inp.weight" in names for i in range(cfg.num_layers)]


def _rope_scaling(meta: ConfigValues) -> RopeScaling:
    kind = meta.raw("rope.scaling.type", "none") or "none"
    factor = meta.raw("rope.scaling.factor", 1.0) or 1.0  # 0 means unset, as llama.cpp reads it
    factor = check_float(meta.where, f"{meta.prefix}rope.scaling.factor", factor, "rope_factor")
    if kind == "none" or factor == 1.0:
        return RopeScaling()
    if kind not in ("linear", "yarn"):
        raise ModelFileError(f"{meta.where}: unsupported rope scaling type {describe(kind)}")
    attn = meta.raw("rope.scaling.attn_factor", None)
    return RopeScaling(
        kind=kind,
        factor=factor,
        original_max_position=meta.whole("rope.scaling.original_context_length", "original_max_position", 0),
        beta_fast=check_float(meta.where, f"{meta.prefix}rope.scaling.yarn_beta_fast",
                              meta.raw("rope.scaling.yarn_beta_fast", 32.0) or 32.0, "beta"),
        beta_slow=check_float(meta.where, f"{meta.prefix}rope.scaling.yarn_beta_slow",
                              meta.raw("rope.scaling.yarn_beta_slow", 1.0) or 1.0, "beta"),
        attention_factor=None if attn is None else meta.real("rope.scaling.attn_factor", "attn_scale"),
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


# Weights the model multiplies by (or gathers rows of): kept in their GGUF blocks when the type has kernels.
_LINEAR_SUFFIXES = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_qkv.weight",
                    "attn_gate.weight", "ssm_out.weight", "ffn_gate.weight",
                    "ffn_up.weight", "ffn_down.weight", "ffn_gate_inp.weight", "ffn_gate_exps.weight",
                    "ffn_up_exps.weight", "ffn_down_exps.weight", "ffn_gate_up_exps.weight", "ffn_gate_shexp.weight",
                    "ffn_up_shexp.weight", "ffn_down_shexp.weight")
_TORCH_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def keeps_quantized(name: str, qtype: str) -> bool:
    """Whether tensor `name` of type `qtype` loads as a QuantWeight (else as a dense tensor)."""
    if qtype not in QUANT_TYPES:
        return False
    head_or_embedding = name in ("token_embd.weight", "output.weight")
    return head_or_embedding or (name.startswith("blk.") and name.endswith(_LINEAR_SUFFIXES))


def _raw(reader: GGUFFile, t: Any) -> torch.Tensor:
    """The tensor's bytes as a uint8 torch view of the memory map (no copy; read-only, so copy before writing)."""
    with warnings.catch_warnings():  # the map is read-only; every caller copies before any write
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(reader._map, dtype=torch.uint8, count=t.n_bytes, offset=t.offset)


def dense_weight_bytes(reader: GGUFFile, dtype: torch.dtype) -> int:
    """Bytes the file's weights take held dense in `dtype` (what the pre-quantized path allocates)."""
    item = torch.empty((), dtype=dtype).element_size()
    return sum(int(np.prod([int(d) for d in t.shape])) * item for t in reader.tensors)


def weights_policy(dense_bytes: int, free_bytes: int, cap_bytes: int | None = None, moe: bool = False) -> str:
    """What `--weights auto` holds on CUDA: the blocks ("quantized") for a mixture of experts whose experts are
    quantized (`moe`), or when the dense weights would take more than half of what the process may use (the
    device's free memory, or less under a `--gpu-memory` cap); else "dense". Not yet "both" (the blocks and a
    dense copy, faster than either alone at every batch size where it fits): that path has not yet run on a GPU,
    so it is opt-in until it has (`--weights both`)."""
    room = free_bytes if cap_bytes is None else min(free_bytes, cap_bytes)
    return "quantized" if moe or dense_bytes > room // 2 else "dense"


def quantized_experts(reader: GGUFFile) -> bool:
    """Whether the file holds a mixture of experts' stacked expert weights (`blk.N.ffn_*_exps.weight`) in a quant
    type the kernels keep quantized."""
    return any(t.name.endswith("_exps.weight") and t.tensor_type.name in QUANT_TYPES for t in reader.tensors)


def auto_weights(reader: GGUFFile, dtype: torch.dtype, device: torch.device, cap_bytes: int | None = None) -> str:
    """The `auto` weights policy (`weights_policy`) for this file on `device`: "dense" on the CPU and for files
    with no quantized tensors.

    Measured (H100, Qwen3-8B-shaped Q4_K_M, one run of `bench decode --weights quantized --compare-dense`,
    2026-12-07): the blocks decode 339 tok/s at batch 1 against dense bf16's 171 (1.98x), 2,483 against 2,566 at
    batch 16 and 3,430 against 5,054 at batch 32; dense prefills 512 tokens at 45.3-45.8K tok/s against the
    blocks' 21.3-21.4K (H200, 2026-12-05). `--weights both` runs each step on the faster of the two. A model whose
    dense copy does not fit keeps only its blocks so it loads at all (a 27B Q4_K_M on a 24 GB card). MoE (H200,
    Qwen3-30B-A3B-shaped Q4_K_M, 2026-12-04): the blocks decode 313 tok/s at batch 1 against dense bf16's 231 and
    1,615 against 1,521 at batch 16, in 17 of 57 GiB: blocks only, with 3.4x the room for KV.
    """
    if device.type != "cuda" or not any(keeps_quantized(t.name, t.tensor_type.name) for t in reader.tensors):
        return "dense"
    moe = quantized_experts(reader)
    free, _ = torch.cuda.mem_get_info(device)
    room = free if cap_bytes is None else min(free, cap_bytes)
    dense = dense_weight_bytes(reader, dtype)
    policy = weights_policy(dense, free, cap_bytes, moe)
    log.info("weights: %s (%sdense %.1f GiB against %.1f GiB %s; --weights both|quantized|dense overrides)",
             "quantized blocks" if policy == "quantized" else "dense", "quantized experts; " if moe else "",
             dense / 2**30, room / 2**30, "free" if cap_bytes is None or free <= cap_bytes else "of --gpu-memory")
    return policy


def iter_gguf_tensors(
    reader: GGUFFile, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
    weights: str = "auto",
    cap_bytes: int | None = None,
) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    """Yield (GGUF name, tensor in numpy row-major shape) straight from the memory map.

    With `weights` "quantized" or "both" (default "auto": `auto_weights`) the linear weights, embedding and LM
    head of a type in `quant.QUANT_TYPES` come as a QuantWeight: the file's block bytes copied to `device` as they
    are, with "both" their dense copy in `dtype` beside them (QuantWeight.dense, dequantized on `device`).
    Everything else is dense in `dtype`: F32/F16/BF16 converted by torch, the listed quant types
    dequantized by engine/weights/quant's torch code on `device`, and any other type by `gguf.quants` (numpy),
    logged once per type.
    """
    device = torch.device(device)
    if weights not in ("auto", "both", "quantized", "dense"):
        raise ValueError(f"weights {weights!r}: choose from auto, both, quantized, dense")
    if weights == "auto":
        weights = auto_weights(reader, dtype, device, cap_bytes)
    keep = weights in ("both", "quantized")
    slow: set[str] = set()
    for t in reader.tensors:
        qtype = t.tensor_type.name
        shape = tuple(reversed([int(d) for d in t.shape]))
        if t.name.endswith("_exps.weight"):  # [n_expert, rows, cols]: one matrix of every expert's rows
            shape = (shape[0] * shape[1], shape[2])
        elif t.name.endswith("ffn_gate_inp_shexp.weight"):  # {n_embd} in the file, a [1, n_embd] linear here
            shape = (1, *shape)
        q_rows = cfg.arch == "llama" and (t.name.endswith("attn_q.weight") or t.name.endswith("attn_q.bias"))
        k_rows = cfg.arch == "llama" and (t.name.endswith("attn_k.weight") or t.name.endswith("attn_k.bias"))
        heads = cfg.num_heads if q_rows else cfg.num_kv_heads
        tensor: torch.Tensor | QuantWeight
        if qtype in _TORCH_FLOATS:
            tensor = _raw(reader, t).view(_TORCH_FLOATS[qtype]).reshape(shape).to(device=device, dtype=dtype, copy=True)
        elif qtype in QUANT_TYPES:
            rows = _raw(reader, t).reshape(-1, row_bytes(qtype, int(t.shape[0])))
            qw = QuantWeight(rows.to(device, copy=True), qtype, int(t.shape[0]), dtype)
            if q_rows or k_rows:  # whole rows move, so the blocks are un-permuted as they are
                qw = qw.map_rows(lambda r, heads=heads: unpermute_qk(r, heads))
                q_rows = k_rows = False
            if keep and keeps_quantized(t.name, qtype):
                tensor = qw.with_dense() if weights == "both" else qw
            else:
                tensor = qw.dequantize(dtype).reshape(shape)
        else:
            if qtype not in slow:
                slow.add(qtype)
                log.info("%s: %s tensors have no quantized kernels; dequantizing them at load (numpy)",
                         reader.path.name, qtype)
            try:
                arr = quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError:
                raise ModelFileError(f"tensor {t.name}: quant type {qtype} is not supported") from None
            arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(shape)
            tensor = torch.from_numpy(arr).to(device=device, dtype=dtype)
        if q_rows or k_rows:
            tensor = unpermute_qk(tensor, heads)  # type: ignore[arg-type]
        if t.name.endswith("ffn_gate_up_exps.weight"):
            yield from split_gate_up_exps(t.name, tensor, cfg.n_experts)
        else:
            yield t.name, tensor


def split_gate_up_exps(name: str, w: torch.Tensor | QuantWeight,
                       n_experts: int) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    """llama.cpp's optional fused `ffn_gate_up_exps` [n_expert, 2 ff, n_embd] (each expert's ff gate rows,
    then its ff up rows) as the `ffn_gate_exps` and `ffn_up_exps` the model holds: rows copied, blocks kept."""
    def half(rows: torch.Tensor, i: int) -> torch.Tensor:
        return rows.reshape(n_experts, 2, -1, rows.shape[-1])[:, i].reshape(-1, rows.shape[-1]).contiguous()

    for i, part in enumerate(("gate", "up")):
        out = w.map_rows(lambda r, i=i: half(r, i)) if isinstance(w, QuantWeight) else half(w, i)
        yield name.replace("gate_up_exps", f"{part}_exps"), out


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row interleave (its `permute` in convert_hf_to_gguf)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
