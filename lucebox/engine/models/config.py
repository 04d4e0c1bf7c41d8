"""The shape of a model, independent of the file format it came from."""

from __future__ import annotations

from dataclasses import dataclass, field

# Architectures the engine runs, by the name llama.cpp's GGUF files use.
# Llama, SmolLM2 and Mistral share `llama`; Qwen2 adds QKV bias; Qwen3 adds
# q/k norm; Gemma 3 adds sliding-window layers, sandwich norms and GeGLU; Qwen3-MoE is Qwen3 with
# mixture-of-experts FFNs (models/moe.py); Qwen3.5/3.6 (`qwen35`) is a hybrid of Gated DeltaNet and gated
# attention layers (models/qwen35.py). Laguna (`laguna`, not listed: it loads from HF folders only, no GGUF
# arch exists) is the decoder with per-layer head counts, a softplus output gate, sliding-window layers with
# their own rope, and a sigmoid-routed MoE.
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "qwen35", "qwen35moe")
HYBRID_ARCHS = ("qwen35", "qwen35moe")  # qwen35moe: the same layers with MoE FFNs


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
    # Mixture of experts (models/moe.py): in the layers `moe_layers` marks, the FFN is `n_experts` SwiGLU
    # experts of width `expert_ff`, `n_experts_used` per token, picked by a router: "softmax" (Qwen3-MoE,
    # Qwen3.5-MoE: softmax over all experts, then top-k) or "sigmoid" (Laguna: sigmoid scores, top-k on the
    # scores plus a per-expert bias). `norm_topk_prob` renormalises the k weights to sum to 1, then
    # `expert_weights_scale` multiplies them. A shared expert of width `shared_expert_ff` (0: none) runs on
    # every token, scaled by sigmoid(x . w) when `shared_expert_gate` (Qwen3.5-MoE).
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ff: int = 0
    norm_topk_prob: bool = True
    moe_router: str = "softmax"  # softmax | sigmoid
    expert_weights_scale: float = 1.0
    shared_expert_ff: int = 0
    shared_expert_gate: bool = True
    moe_layers: list[bool] = field(default_factory=list)  # one per layer; empty: every layer (if n_experts)
    # Qwen3.5 hybrid (models/qwen35.py): layer type "linear" is a Gated DeltaNet layer with `linear_k_heads`
    # q/k heads of `linear_k_dim` and `linear_v_heads` value heads of `linear_v_dim` (value head h reads q/k
    # head h % linear_k_heads: llama.cpp's tiled order), after a causal conv of `linear_conv_kernel` taps;
    # its full-attention layers gate their output (`attn_output_gate`) and rotate the first `rotary_dim`
    # dims of each head (None: all of them).
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    linear_conv_kernel: int = 0
    attn_output_gate: bool = False
    rotary_dim: int | None = None
    # Laguna: layer i has `heads_per_layer[i]` query heads (empty: `num_heads` everywhere; the K/V heads, hence
    # the cache, are the same in every layer); its attention output is multiplied by softplus(`attn_gate` x),
    # `softplus_gate` values per head (1: one per head, head_dim: one per channel; 0: no gate); its sliding
    # layers rotate the first `rope_local_dim` dims of each head (None: all), its full ones `rotary_dim`.
    heads_per_layer: list[int] = field(default_factory=list)
    softplus_gate: int = 0
    rope_local_dim: int | None = None

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["full"] * self.num_layers

    def layer_heads(self, layer: int) -> int:
        """Query heads of layer `layer`."""
        return self.heads_per_layer[layer] if self.heads_per_layer else self.num_heads

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer`'s FFN is the mixture of experts (else the dense gated MLP)."""
        return self.n_experts > 0 and (not self.moe_layers or self.moe_layers[layer])

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_hybrid(self) -> bool:
        """Some layers keep a per-sequence recurrent state instead of K/V (runtime/recurrent_state.py)."""
        return "linear" in self.layer_types

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep K/V in the paged cache (every layer but the linear-attention ones)."""
        return sum(t != "linear" for t in self.layer_types)

    @property
    def has_sliding_layers(self) -> bool:
        return self.sliding_window is not None and "sliding" in self.layer_types

    def n_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, f, n = self.hidden_size, self.intermediate_size, self.num_layers

        def attn(layer: int) -> int:
            q_size = self.layer_heads(layer) * self.head_dim
            q_rows = 2 * q_size if self.attn_output_gate else q_size
            return h * (q_rows + 2 * self.kv_size + self.layer_heads(layer) * self.softplus_gate) + q_size * h

        key, value = self.linear_k_heads * self.linear_k_dim, self.linear_v_heads * self.linear_v_dim
        linear = h * (2 * key + 2 * value + 2 * self.linear_v_heads) + value * h  # qkv, gate, alpha, beta; out
        moe = h * self.n_experts + 3 * h * (self.n_experts * self.expert_ff + self.shared_expert_ff)
        ffn = sum(moe if self.is_moe(i) else 3 * h * f for i in range(n))
        mixers = sum(linear if t == "linear" else attn(i) for i, t in enumerate(self.layer_types))
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + mixers + ffn + head


def gemma3_layer_types(num_layers: int, pattern: int = 6) -> list[str]:
    """Gemma 3: five sliding-window layers, then one global, repeating."""
    return ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers)]
