"""The shape of a model, independent of the file format it came from."""

from __future__ import annotations

from dataclasses import dataclass, field

# Architectures the engine runs, by the name llama.cpp's GGUF files use.
# Llama, SmolLM2 and Mistral share `llama`; Qwen2 adds QKV bias; Qwen3 adds
# q/k norm; Gemma 3 adds sliding-window layers, sandwich norms and GeGLU.
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")


@dataclass
class RopeScaling:
    """Rope scaling as the model's config states it (`none` when absent)."""

    kind: str = "none"  # none | linear | llama3 | yarn
    factor: float = 1.0
    original_max_position: int = 0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None = derived from factor


@dataclass
class ModelConfig:
    arch: str
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    rope_theta: float
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm per head on q and k
    # Gemma 3: every `sliding_window_pattern`-th layer is global, the rest see
    # only the last `sliding_window` positions and use `rope_local_theta`.
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)  # "full" | "sliding", one per layer
    rope_local_theta: float | None = None
    rope_local_scaling: RopeScaling = field(default_factory=RopeScaling)
    hidden_act: str = "silu"  # silu (SwiGLU) | gelu_tanh (GeGLU)
    embed_scale: float = 1.0  # Gemma multiplies embeddings by sqrt(hidden_size)
    attn_scale: float | None = None  # None = head_dim ** -0.5
    sandwich_norm: bool = False  # Gemma 3: norms after attention and after the FFN too
    final_logit_softcap: float | None = None

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["full"] * self.num_layers

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def has_sliding_layers(self) -> bool:
        return self.sliding_window is not None and "sliding" in self.layer_types

    def n_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, f, n = self.hidden_size, self.intermediate_size, self.num_layers
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        per_layer = attn + 3 * h * f
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + n * per_layer + head


def gemma3_layer_types(num_layers: int, pattern: int = 6) -> list[str]:
    """Gemma 3: five sliding-window layers, then one global, repeating."""
    return ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers)]
