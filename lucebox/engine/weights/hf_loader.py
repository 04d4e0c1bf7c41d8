"""Read a Hugging Face model folder: config.json and (sharded) safetensors.

Tensor names are mapped to the GGUF names the model modules use with the
`gguf` package's own HF→GGUF name map, so both formats feed one model code.
Gemma norms get `+1` here (HF stores `w` and multiplies by `1 + w`; the engine
multiplies by the stored weight, as GGUF files already hold `1 + w`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lucebox.engine.models.config import ModelConfig, RopeScaling, gemma3_layer_types
from lucebox.engine.weights.config_check import ConfigValues, check_config, check_float, check_int, describe
from lucebox.errors import ModelFileError

_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
}
_GGUF_ARCH = {"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "gemma3": "GEMMA3"}


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
        intermediate_size=vals.whole("intermediate_size", "intermediate_size"),
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
        qk_norm=family in ("qwen3", "gemma3"),
    )
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
    for file in safetensors_files(folder):
        try:
            with safe_open(str(file), framework="pt") as f:
                for hf_name in f.keys():
                    name = name_map.get_name(hf_name.removeprefix("language_model."), try_suffixes=(".weight", ".bias"))
                    if name is None:
                        continue  # e.g. rotary inv_freq buffers, vision towers
                    tensor = f.get_tensor(hf_name).to(torch.float32)
                    if cfg.arch == "gemma3" and name.endswith("norm.weight"):
                        tensor = tensor + 1.0
                    yield name, tensor.to(device=device, dtype=dtype)
        except (SafetensorError, OSError) as exc:
            raise ModelFileError(f"{file}: corrupt or truncated safetensors file ({exc})") from None
