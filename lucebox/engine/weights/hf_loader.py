"""Read a Hugging Face model folder: config.json and (sharded) safetensors.

Tensor names are mapped to the GGUF names the model modules use with the
`gguf` package's own HF→GGUF name map, so both formats feed one model code.
Gemma norms get `+1` here (HF stores `w` and multiplies by `1 + w`; the engine
multiplies by the stored weight, as GGUF files already hold `1 + w`). Experts
are stacked into GGUF's one tensor per projection (`ExpertStacker`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lucebox.engine.models.config import HYBRID_ARCHS, ModelConfig, RopeScaling, gemma3_layer_types
from lucebox.engine.weights.config_check import ConfigValues, check_config, check_float, check_int, describe
from lucebox.errors import ModelFileError

_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "qwen3_moe": "qwen3moe",
    "qwen3_5_text": "qwen35",
    "qwen3_5": "qwen35",
    "qwen3_5_moe_text": "qwen35moe",
    "qwen3_5_moe": "qwen35moe",
    "laguna": "laguna",
}
_GGUF_ARCH = {"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "gemma3": "GEMMA3", "qwen3moe": "QWEN3MOE",
              "qwen35": "QWEN35", "qwen35moe": "QWEN35MOE",
              # gguf has no Laguna arch; Step-3.5's map names all its tensors (g_proj: the head-wise gate).
              "laguna": "STEP35"}


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFileError(f"{path.parent}: missing {path.name}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFileError(f"{path}: invalid JSON ({exc})") from None


def hf_config(folder: Path) -> ModelConfig:
    raw = read_json(folder / "config.json")
    if not isinstance(raw, dict):
        raise ModelFileError(f"{folder}/config.json holds {describe(raw)}, not an object")
    if isinstance(raw.get("text_config"), dict) and raw.get("model_type") in ("gemma3",):
        raw = {**raw["text_config"], "model_type": "gemma3_text"}
    if isinstance(raw.get("text_config"), dict) and raw.get("model_type") in ("qwen3_5", "qwen3_5_moe"):  # VL
        raw = {**raw["text_config"], "model_type": raw["model_type"] + "_text",
               "tie_word_embeddings": raw.get("tie_word_embeddings", False)}
    model_type = raw.get("model_type", "")
    family = _MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ModelFileError(
            f"{folder}: unsupported architecture {model_type!r} (supported: {', '.join(sorted(_MODEL_TYPES))})"
        )
    where = f"{folder}/config.json"
    vals = ConfigValues(where, raw.__getitem__)
    hidden = vals.whole("hidden_size", "hidden_size")
    heads = vals.whole("num_attention_heads", "num_heads")
    n_layers = vals.whole("num_hidden_layers", "num_layers")
    head_dim = vals.whole("head_dim", "head_dim", max(hidden // heads, 1))
    try:
        rope = _rope_params(raw)
    except (AttributeError, TypeError, ValueError) as exc:
        raise ModelFileError(f"{where}: bad rope settings ({exc})") from None
    cfg = ModelConfig(
        arch=family,
        name=str(raw.get("_name_or_path") or folder.name),
        vocab_size=vals.whole("vocab_size", "vocab_size"),
        hidden_size=hidden,
        # qwen3_5_moe has no dense FFN width: the experts' stands in, unused.
        intermediate_size=vals.whole("intermediate_size", "intermediate_size", raw.get("moe_intermediate_size")),
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=vals.whole("num_key_value_heads", "num_kv_heads", heads),
        head_dim=head_dim,
        rms_norm_eps=vals.real("rms_norm_eps", "rms_norm_eps", 1e-6),
        max_position=vals.whole("max_position_embeddings", "max_position", 4096),
        rope_theta=rope["full"][0],
        rope_scaling=rope["full"][1],
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", family == "gemma3")),
        attention_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
        qk_norm=family in ("qwen3", "gemma3", "qwen3moe", "laguna", *HYBRID_ARCHS),
    )
    if family in HYBRID_ARCHS:
        hybrid_config(cfg, vals, raw)
    if family == "qwen3moe":
        moe_config(cfg, vals, raw)
    if family == "laguna":
        laguna_config(cfg, vals, raw, rope)
    if model_type == "mistral" and raw.get("sliding_window"):
        cfg.sliding_window = vals.whole("sliding_window", "sliding_window")
        cfg.layer_types = ["sliding"] * n_layers
    if family == "gemma3":
        cfg.sliding_window = vals.whole("sliding_window", "sliding_window", 512)
        types = raw.get("layer_types")
        if types:
            if not isinstance(types, list):
                raise ModelFileError(f"{where}: layer_types is {describe(types)}, not a list")
            cfg.layer_types = ["sliding" if t == "sliding_attention" else "full" for t in types]
        else:
            pattern = check_int(where, "sliding_window_pattern", raw.get("sliding_window_pattern") or 6,
                                "sliding_window_pattern")
            cfg.layer_types = gemma3_layer_types(n_layers, pattern)
        cfg.rope_local_theta, cfg.rope_local_scaling = rope["sliding"]
        cfg.hidden_act = "gelu_tanh"
        cfg.embed_scale = hidden**0.5
        cfg.sandwich_norm = True
        scalar = raw.get("query_pre_attn_scalar") or head_dim
        cfg.attn_scale = check_float(where, "query_pre_attn_scalar", scalar, "attn_scale") ** -0.5
        softcap = raw.get("final_logit_softcapping") or None  # 0: no softcap
        cfg.final_logit_softcap = None if softcap is None else check_float(where, "final_logit_softcapping",
                                                                             softcap, "softcap")
    return check_config(cfg, where)


def hybrid_config(cfg: ModelConfig, vals: ConfigValues, raw: dict[str, Any]) -> None:
    """Qwen3.5's Gated DeltaNet shape, partial rotary and layer pattern (`layer_types`, else every
    `full_attention_interval`-th layer attends: transformers' rule)."""
    cfg.linear_conv_kernel = vals.whole("linear_conv_kernel_dim", "conv_kernel", 4)
    cfg.linear_k_heads = vals.whole("linear_num_key_heads", "linear_heads", 16)
    cfg.linear_v_heads = vals.whole("linear_num_value_heads", "linear_heads", 32)
    cfg.linear_k_dim = vals.whole("linear_key_head_dim", "head_dim", 128)
    cfg.linear_v_dim = vals.whole("linear_value_head_dim", "head_dim", 128)
    if cfg.linear_v_heads % cfg.linear_k_heads:
        raise ModelFileError(f"{vals.where}: {cfg.linear_v_heads} linear value heads cannot share "
                             f"{cfg.linear_k_heads} key heads")
    if raw.get("attn_output_gate", True) is not True or cfg.attention_bias:
        raise ModelFileError(f"{vals.where}: attn_output_gate false or attention_bias true is not supported "
                             "(no Qwen3.5 has them)")
    types = raw.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or not set(types) <= {"linear_attention", "full_attention"}:
            raise ModelFileError(f"{vals.where}: layer_types is {describe(types)}, not a list of "
                                 "linear_attention / full_attention")
        cfg.layer_types = ["linear" if t == "linear_attention" else "full" for t in types]
    else:
        interval = vals.whole("full_attention_interval", "layer_interval", 4)
        cfg.layer_types = ["full" if (i + 1) % interval == 0 else "linear" for i in range(cfg.num_layers)]
    rope = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    factor = check_float(vals.where, "partial_rotary_factor",
                         rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25)), "rope_factor")
    cfg.rotary_dim = int(cfg.head_dim * factor)
    cfg.attn_output_gate = True
    if cfg.arch == "qwen35moe":  # every layer: softmax router, top-k renormalised, gated shared expert
        cfg.n_experts = vals.whole("num_experts", "n_experts")
        cfg.n_experts_used = vals.whole("num_experts_per_tok", "n_experts")
        cfg.expert_ff = vals.whole("moe_intermediate_size", "intermediate_size")
        cfg.shared_expert_ff = vals.whole("shared_expert_intermediate_size", "intermediate_size")
        cfg.norm_topk_prob = cfg.shared_expert_gate = True


def laguna_config(cfg: ModelConfig, vals: ConfigValues, raw: dict[str, Any],
                  rope: dict[str, tuple[float, RopeScaling]]) -> None:
    """Laguna (transformers' `laguna`): query heads per layer, a softplus output gate (per head, or per channel
    with gating "per-element"), full and sliding-window layers each with their rope base, scaling and partial
    rotary factor, layer i's FFN dense or MoE as `mlp_layer_types` says (default: layer 0 dense), a sigmoid
    router whose top-k weights sum to 1 times `moe_routed_scaling_factor`, and an ungated shared expert."""
    where, n = vals.where, cfg.num_layers

    def per_layer(key: str, default: list, allowed: set | None = None) -> list:
        value = raw.get(key)
        value = default if value is None else value
        ok = isinstance(value, list) and len(value) == n and (
            allowed is None or all(isinstance(v, str) and v in allowed for v in value))
        if not ok:
            what = f" of {' / '.join(sorted(allowed))}" if allowed else ""
            raise ModelFileError(f"{where}: {key} is {describe(value)}, not a list{what} of one per layer ({n})")
        return value

    heads = per_layer("num_attention_heads_per_layer", [cfg.num_heads] * n)
    cfg.heads_per_layer = [check_int(where, f"num_attention_heads_per_layer[{i}]", v, "num_heads")
                           for i, v in enumerate(heads)]
    gating = raw.get("gating", True)
    if gating is True or gating == "per-head":
        cfg.softplus_gate = 1
    elif gating == "per-element":
        cfg.softplus_gate = cfg.head_dim
    else:
        raise ModelFileError(f'{where}: gating is {describe(gating)}; true, "per-head" or "per-element" expected')
    types = per_layer("layer_types", ["full_attention"] * n, {"full_attention", "sliding_attention"})
    cfg.layer_types = ["sliding" if t == "sliding_attention" else "full" for t in types]
    cfg.sliding_window = vals.whole("sliding_window", "sliding_window", 512)
    cfg.rope_local_theta, cfg.rope_local_scaling = rope["sliding"]
    params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    for kind, attr in (("full_attention", "rotary_dim"), ("sliding_attention", "rope_local_dim")):
        sub = params.get(kind) if isinstance(params.get(kind), dict) else {}
        factor = check_float(where, f"rope_parameters.{kind}.partial_rotary_factor",
                             sub.get("partial_rotary_factor", 0.5 if kind == "full_attention" else 1.0),
                             "rope_factor")
        dim = int(cfg.head_dim * factor)  # transformers' rounding
        if dim < 2 or dim % 2 or dim > cfg.head_dim:
            raise ModelFileError(f"{where}: rope_parameters.{kind} rotates {dim} of {cfg.head_dim} dims per head "
                                 "(an even number from 2 to head_dim expected)")
        setattr(cfg, attr, dim)
    mlp = per_layer("mlp_layer_types", ["dense"] + ["sparse"] * (n - 1), {"dense", "sparse"})
    cfg.moe_layers = [t == "sparse" for t in mlp]
    cfg.n_experts = vals.whole("num_experts", "n_experts", 256)
    cfg.n_experts_used = vals.whole("num_experts_per_tok", "n_experts", 8)
    cfg.expert_ff = vals.whole("moe_intermediate_size", "intermediate_size", 512)
    cfg.shared_expert_ff = vals.whole("shared_expert_intermediate_size", "intermediate_size", 512)
    cfg.moe_router, cfg.norm_topk_prob, cfg.shared_expert_gate = "sigmoid", True, False
    cfg.expert_weights_scale = vals.real("moe_routed_scaling_factor", "expert_weights_scale", 1.0)
    if raw.get("moe_router_logit_softcapping") or raw.get("moe_apply_router_weight_on_input"):
        raise ModelFileError(f"{where}: moe_router_logit_softcapping and moe_apply_router_weight_on_input are not "
                             "supported (models/moe.py's router has neither)")


# Laguna's router bias: `mlp.experts.e_score_correction_bias` in checkpoints (transformers renames it at load),
# `mlp.gate.` in memory; as `mlp.gate.e_score_correction.bias` the gguf map knows it (deepseek-v3's converter
# name). The checkpoints' `mlp.shared_expert.` (Qwen2-MoE's name) the map knows as it is.
_LAGUNA_BIAS = re.compile(r"\.mlp\.(?:experts|gate)\.e_score_correction_bias$")


def _qwen35_key(hf_name: str) -> str:
    """The text model's name for the gguf map (the VL checkpoint nests it under `model.language_model.`);
    "" for what the engine does not run (vision tower, MTP head)."""
    if hf_name.startswith(("mtp.", "model.visual.", "visual.")):
        return ""
    name = hf_name.replace("model.language_model.", "model.", 1)
    return name.replace(".linear_attn.dt_bias", ".linear_attn.dt_proj.bias")  # as llama.cpp's converter renames it


def qwen35_tensor(name: str, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """An HF Qwen3.5 tensor (fp32) in llama.cpp's convention, what the engine runs: norms hold 1 + w (not
    `ssm_norm`), ssm_a = -exp(A_log), the conv weight [channels, taps], and value heads in tiled order
    (HF groups the value heads of one key head together; llama.cpp interleaves them: value head
    j * k_heads + g reads key head g)."""
    if name.endswith("norm.weight") and not name.endswith("ssm_norm.weight"):
        t = t + 1.0
    elif name.endswith("ssm_a"):
        t = -torch.exp(t)
    elif name.endswith("ssm_conv1d.weight"):
        t = t.squeeze(1)
    kh, per_k = cfg.linear_k_heads, cfg.linear_v_heads // max(cfg.linear_k_heads, 1)
    if per_k <= 1 or not name.startswith("blk."):
        return t
    vd, qk = cfg.linear_v_dim, 2 * cfg.linear_k_heads * cfg.linear_k_dim

    def tiled(x: torch.Tensor, dim: int, head_dim: int) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(*shape[:dim], kh, per_k, head_dim, *shape[dim + 1:])
        return x.transpose(dim, dim + 1).reshape(shape)

    kind = name.split(".", 2)[2]
    if kind in ("attn_qkv.weight", "ssm_conv1d.weight"):  # only the value rows / channels
        return torch.cat((t[:qk], tiled(t[qk:], 0, vd)))
    if kind == "attn_gate.weight":
        return tiled(t, 0, vd)
    if kind in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_a", "ssm_dt.bias"):
        return tiled(t, 0, 1)
    if kind == "ssm_out.weight":
        return tiled(t, 1, vd)
    return t


def moe_config(cfg: ModelConfig, vals: ConfigValues, raw: dict[str, Any]) -> None:
    """Qwen3-MoE's experts: softmax router; layer i is MoE unless listed in `mlp_only_layers`, and when
    (i + 1) is a multiple of `decoder_sparse_step` (transformers' rule)."""
    # Hub configs say num_experts; transformers 5 writes num_local_experts (its attribute_map's target).
    cfg.n_experts = vals.whole("num_experts" if "num_experts" in raw else "num_local_experts", "n_experts")
    cfg.n_experts_used = vals.whole("num_experts_per_tok", "n_experts")
    cfg.expert_ff = vals.whole("moe_intermediate_size", "intermediate_size")
    cfg.norm_topk_prob = bool(raw.get("norm_topk_prob", False))  # transformers' default
    step = vals.whole("decoder_sparse_step", "num_layers", 1)
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ModelFileError(f"{vals.where}: mlp_only_layers is {describe(dense)}, not a list of layer numbers")
    cfg.moe_layers = [i not in dense and (i + 1) % step == 0 for i in range(cfg.num_layers)]


def _rope_params(raw: dict[str, Any]) -> dict[str, tuple[float, RopeScaling]]:
    """Rope base and scaling for full and sliding layers, from either config style.

    transformers < 5 writes `rope_theta` + `rope_scaling` (+ Gemma's
    `rope_local_base_freq`); transformers 5 writes `rope_parameters`, per layer
    type for Gemma 3.
    """
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params:
        if "full_attention" in params:
            full = params["full_attention"]
            local = params.get("sliding_attention", {"rope_theta": 10000.0})
        else:
            full = local = params
        return {
            "full": (float(full.get("rope_theta", 10000.0)), _scaling(full)),
            "sliding": (float(local.get("rope_theta", 10000.0)), _scaling(local)),
        }
    theta = float(raw.get("rope_theta", 10000.0))
    return {
        "full": (theta, _scaling(raw.get("rope_scaling"))),
        "sliding": (float(raw.get("rope_local_base_freq", 10000.0)), RopeScaling()),
    }


def _scaling(d: dict[str, Any] | None) -> RopeScaling:
    if not d:
        return RopeScaling()
    kind = d.get("rope_type") or d.get("type") or "default"
    if kind == "default":
        return RopeScaling()
    if kind not in ("linear", "llama3", "yarn"):
        raise ModelFileError(f"unsupported rope scaling type {kind!r}")
    return RopeScaling(
        kind=kind,
        factor=float(d.get("factor", 1.0)),
        original_max_position=int(d.get("original_max_position_embeddings") or 0),
        low_freq_factor=float(d.get("low_freq_factor", 1.0)),
        high_freq_factor=float(d.get("high_freq_factor", 4.0)),
        beta_fast=float(d.get("beta_fast") or 32.0),
        beta_slow=float(d.get("beta_slow") or 1.0),
        attention_factor=d.get("attention_factor"),
    )


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelFileError(f"{index}: no weight_map")
        files = sorted({folder / name for name in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{folder}: no *.safetensors weights")
    for f in files:
        if not f.exists():
            raise ModelFileError(f"{folder}: shard {f.name} named in the index is missing")
    return files


def count_tensors(folder: Path) -> int:
    """Number of tensors in the folder's safetensors files (headers only)."""
    from safetensors import SafetensorError, safe_open

    total = 0
    for file in safetensors_files(folder):
        try:
            with safe_open(str(file), framework="pt") as f:
                total += len(list(f.keys()))
        except (SafetensorError, OSError) as exc:
            raise ModelFileError(f"{file}: corrupt or truncated safetensors file ({exc})") from None
    return total


def iter_hf_tensors(
    folder: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (GGUF name, tensor) for every weight the engine uses."""
    import gguf
    from safetensors import SafetensorError, safe_open

    name_map = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, _GGUF_ARCH[cfg.arch]), cfg.num_layers)
    # MoE models may keep dense FFN layers, whose tensors their GGUF arch does not list.
    dense_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_layers) if cfg.n_experts else None
    experts = ExpertStacker(cfg.n_experts)
    for file in safetensors_files(folder):
        try:
            with safe_open(str(file), framework="pt") as f:
                for hf_name in f.keys():
                    key = hf_name.removeprefix("language_model.")
                    if cfg.arch in HYBRID_ARCHS:
                        key = _qwen35_key(key)
                    elif cfg.arch == "laguna":
                        key = _LAGUNA_BIAS.sub(".mlp.gate.e_score_correction.bias", key)
                    if experts.takes(key):
                        for name, tensor in experts.add(key, f.get_tensor(hf_name)):
                            yield name, tensor.to(device=device, dtype=dtype)
                        continue
                    name = name_map.get_name(key, try_suffixes=(".weight", ".bias"))
                    if name is None and dense_map is not None:
                        name = dense_map.get_name(key, try_suffixes=(".weight", ".bias"))
                    if name is None:
                        continue  # e.g. rotary inv_freq buffers, vision towers
                    tensor = f.get_tensor(hf_name).to(torch.float32)
                    if cfg.arch == "gemma3" and name.endswith("norm.weight"):
                        tensor = tensor + 1.0
                    elif cfg.arch in HYBRID_ARCHS:
                        tensor = qwen35_tensor(name, tensor, cfg)
                    yield name, tensor.to(device=device, dtype=dtype)
        except (SafetensorError, OSError) as exc:
            raise ModelFileError(f"{file}: corrupt or truncated safetensors file ({exc})") from None
    experts.check_complete(folder)


class ExpertStacker:
    """HF expert weights -> GGUF's stacked expert tensors, `blk.N.ffn_{gate,up,down}_exps.weight`, each
    [n_experts * rows, cols] (expert e's rows at e * rows, as in a GGUF file).

    Two HF layouts: one tensor per expert and projection (`mlp.experts.E.gate_proj.weight`, what
    transformers 5 `save_pretrained` writes and hub checkpoints hold), gathered until every expert of a
    layer's projection is there; and the fused 3-D form transformers 5 holds in memory
    (`mlp.experts.gate_up_proj` [E, 2 ff, hidden], `mlp.experts.down_proj` [E, hidden, ff]).
    """

    _PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
    _FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj")

    def __init__(self, n_experts: int) -> None:
        self.n_experts = n_experts
        self.pending: dict[tuple[int, str], dict[int, torch.Tensor]] = {}

    def takes(self, hf_name: str) -> bool:
        match = self._PER_EXPERT.fullmatch(hf_name) or self._FUSED.fullmatch(hf_name)
        return self.n_experts > 0 and match is not None

    def add(self, hf_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The stacked tensors this HF tensor completes (none until a projection has all its experts)."""
        fused = self._FUSED.fullmatch(hf_name)
        if fused is not None:
            layer, kind = int(fused.group(1)), fused.group(2)
            if kind == "down":
                return [(f"blk.{layer}.ffn_down_exps.weight", tensor.flatten(0, 1))]
            gate, up = tensor.chunk(2, dim=1)
            return [(f"blk.{layer}.ffn_gate_exps.weight", gate.flatten(0, 1)),
                    (f"blk.{layer}.ffn_up_exps.weight", up.flatten(0, 1))]
        m = self._PER_EXPERT.fullmatch(hf_name)
        assert m is not None
        layer, expert, proj = int(m.group(1)), int(m.group(2)), m.group(3)
        if expert >= self.n_experts:
            raise ModelFileError(f"{hf_name}: expert {expert} of a model with {self.n_experts} experts")
        got = self.pending.setdefault((layer, proj), {})
        got[expert] = tensor
        if len(got) < self.n_experts:
            return []
        del self.pending[(layer, proj)]
        return [(f"blk.{layer}.ffn_{proj}_exps.weight", torch.cat([got[e] for e in range(self.n_experts)]))]

    def check_complete(self, folder: Path) -> None:
        for (layer, proj), got in sorted(self.pending.items()):
            missing = next(e for e in range(self.n_experts) if e not in got)
            raise ModelFileError(
                f"{folder}: missing tensor model.layers.{layer}.mlp.experts.{missing}.{proj}_proj.weight")
