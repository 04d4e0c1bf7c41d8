"""Sane ranges for a model's shape, checked before anything is allocated.

A model file's metadata is untrusted: a missing key, a string where a number
belongs or `block_count = 2**31` must be one clear `ModelFileError` naming the
key and what it holds, never a traceback or a 2**31-entry list. Both loaders
(GGUF metadata and an HF folder's config.json) read their numbers through
`ConfigValues`, which types and range-checks each one, and finish with
`check_config`, which checks how the values fit together.

The ranges are far wider than any real model (the largest today have ~16K
hidden size, ~130 layers, ~260K vocabulary, ~10M context) and narrow enough
that nothing sized by them can exhaust memory before the weights are read.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from lucebox.engine.models.config import ModelConfig
from lucebox.errors import ModelFileError

# ModelConfig field -> (lowest, highest) allowed value.
INT_RANGES: dict[str, tuple[int, int]] = {
    "hidden_size": (1, 1 << 17),
    "intermediate_size": (1, 1 << 20),
    "num_layers": (1, 1024),
    "num_heads": (1, 1024),
    "num_kv_heads": (1, 1024),
    "head_dim": (1, 4096),
    "vocab_size": (1, 1 << 22),
    "max_position": (1, 1 << 26),
    "sliding_window": (1, 1 << 26),
    "sliding_window_pattern": (1, 1024),
    "original_max_position": (0, 1 << 26),
    "conv_kernel": (2, 64),  # Gated DeltaNet (qwen35) causal conv taps
    "linear_heads": (1, 1024),
    "nextn_layers": (0, 64),
    "layer_interval": (1, 1024),
    "n_experts": (1, 1 << 12),
}
# ModelConfig field -> (lowest, highest); both ends excluded (eps 0 divides by zero, theta 0 is no rotation).
FLOAT_RANGES: dict[str, tuple[float, float]] = {
    "rms_norm_eps": (0.0, 1.0),
    "rope_theta": (0.0, 1e15),
    "rope_factor": (0.0, 1e6),
    "softcap": (0.0, 1e6),
    "attn_scale": (0.0, 1e6),
    "beta": (0.0, 1e6),
    "expert_weights_scale": (0.0, 1e3),
}

_MISSING: Any = object()


def describe(value: Any) -> str:
    """A value as words for an error message: `the text "x"`, `a list of 2 items`, `the number 7`."""
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:40] + "…"
        return f"the text {shown!r}"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} item{'s' if len(value) != 1 else ''}"
    if isinstance(value, dict):
        return "an object"
    if value is None:
        return "null"
    return f"a {type(value).__name__}"


class ConfigValues:
    """Typed, range-checked reads of a model's raw config; each error names the file, the key and the value.

    `get(key)` returns the raw value or raises KeyError when absent; `where` names
    the file (and `prefix`, e.g. `llama.`, is put before GGUF keys).
    """

    def __init__(self, where: str, get: Callable[[str], Any], prefix: str = "") -> None:
        self.where = where
        self._get = get
        self.prefix = prefix

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        name = self.prefix + key
        try:
            value = self._get(name)
        except KeyError:
            value = None
        if value is None:
            if default is _MISSING:
                raise ModelFileError(f"{self.where}: {name} is missing")
            return default
        return value

    def whole(self, key: str, field: str, default: Any = _MISSING) -> int:
        """An integer within INT_RANGES[field]; a float that is a whole number counts (JSON writers vary)."""
        value = self.raw(key, default)
        return check_int(self.where, self.prefix + key, value, field)

    def real(self, key: str, field: str, default: Any = _MISSING) -> float:
        value = self.raw(key, default)
        return check_float(self.where, self.prefix + key, value, field)


def check_int(where: str, name: str, value: Any, field: str) -> int:
    """`value` as an int in INT_RANGES[field], or a ModelFileError naming `name`."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelFileError(f"{where}: {name} is {describe(value)}, not a whole number")
    lo, hi = INT_RANGES[field]
    if not lo <= value <= hi:
        raise ModelFileError(f"{where}: {name} is {value}; it must be from {lo} to {hi}")
    return value


def check_float(where: str, name: str, value: Any, field: str) -> float:
    """`value` as a finite float strictly inside FLOAT_RANGES[field], or a ModelFileError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelFileError(f"{where}: {name} is {describe(value)}, not a number")
    lo, hi = FLOAT_RANGES[field]
    if not (math.isfinite(value) and lo < value < hi):
        raise ModelFileError(f"{where}: {name} is {value!r}; it must be above {lo:g} and below {hi:g}")
    return float(value)


def check_config(cfg: ModelConfig, where: str) -> ModelConfig:
    """Every field in range and the fields consistent with each other (ranges again, for derived values)."""
    for field in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "vocab_size", "max_position"):
        check_int(where, f"the model's {field}", getattr(cfg, field), field)
    check_float(where, "the model's rms_norm_eps", cfg.rms_norm_eps, "rms_norm_eps")
    check_float(where, "the model's rope_theta", cfg.rope_theta, "rope_theta")
    if cfg.heads_per_layer and len(cfg.heads_per_layer) != cfg.num_layers:
        raise ModelFileError(f"{where}: the per-layer head counts give {len(cfg.heads_per_layer)} layers "
                             f"for a model of {cfg.num_layers}")
    for heads in {cfg.num_heads, *cfg.heads_per_layer}:
        if heads % cfg.num_kv_heads:
            raise ModelFileError(f"{where}: {heads} attention heads cannot share {cfg.num_kv_heads} "
                                 "key/value heads (the key/value head count must divide the head count)")
    if len(cfg.layer_types) != cfg.num_layers or not set(cfg.layer_types) <= {"full", "sliding", "linear"}:
        raise ModelFileError(f"{where}: the per-layer attention types give {len(cfg.layer_types)} layers "
                             f"for a model of {cfg.num_layers}")
    if cfg.sliding_window is not None:
        check_int(where, "the model's sliding_window", cfg.sliding_window, "sliding_window")
    for name, scaling in (("rope scaling", cfg.rope_scaling), ("local rope scaling", cfg.rope_local_scaling)):
        if scaling.kind != "none":
            check_float(where, f"the {name} factor", scaling.factor, "rope_factor")
    if cfg.rope_local_theta is not None:
        check_float(where, "the model's local rope_theta", cfg.rope_local_theta, "rope_theta")
    if cfg.final_logit_softcap is not None:
        check_float(where, "the final logit softcap", cfg.final_logit_softcap, "softcap")
    if cfg.attn_scale is not None:
        check_float(where, "the attention scale", cfg.attn_scale, "attn_scale")
    if cfg.n_experts and not 1 <= cfg.n_experts_used <= cfg.n_experts:
        raise ModelFileError(f"{where}: {cfg.n_experts_used} experts per token of {cfg.n_experts} experts")
    return cfg
