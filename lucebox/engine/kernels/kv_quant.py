"""q8_0 KV cache: int8 keys/values with one fp16 scale per (slot, KV head), packed in one int8 tensor.

A q8_0 cache row (one slot, one KV head) is `head_dim + 2` int8 bytes: the quantized values, then the
two bytes of the row's fp16 scale (symmetric absmax / 127, so value = int8 * scale). Keeping the scale
in the same row keeps the cache one tensor `[layers, 2, slots, kv_heads, head_dim + 2]`: block copies
(prefix-cache snapshots, host/disk tiers, the speculative decoder's slot moves) carry the scales with
the values without knowing about them. Readers view the cache as fp16 to load the scales
(`scales`): element `head_dim // 2` of each row.

One scale per row rather than per 32 values: the kernels fold it into the scores (K) and the
probabilities (V) instead of dequantizing tiles, and a row costs 2 bytes of scale (1.94x the tokens of
bf16 at head_dim 64, 1.97x at 128; per-32 groups would give 1.88x). The price is precision on rows
with outlier channels: the error bound is absmax(row) / 254 per value (plus 127 * 2^-25 for rows whose
absmax is below ~8e-3, where the fp16 scale is subnormal).
"""

from __future__ import annotations

import torch

KV_DTYPES = ("auto", "bf16", "q8_0")  # the --kv-dtype choices: auto = the model's dtype
SCALE_BYTES = 2  # an fp16 scale at the end of every (slot, head) row
_FP16_MAX = 65504.0


def is_q8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def row_bytes(head_dim: int) -> int:
    """Bytes of one (slot, KV head) row of a q8_0 cache."""
    return head_dim + SCALE_BYTES


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] float -> packed int8 [..., D + 2]: round(x / s) in [-127, 127], then s as fp16 bytes,
    s = absmax(row) / 127 (rounded to fp16; a zero row gets s = 0 and zeros)."""
    d = x.shape[-1]
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / 127.0).clamp(max=_FP16_MAX).to(torch.float16)
    sf = scale.float()
    q = torch.where(sf > 0, xf / torch.where(sf > 0, sf, 1.0), 0.0).round_().clamp_(-127, 127)
    out = torch.empty(*x.shape[:-1], d + SCALE_BYTES, dtype=torch.int8, device=x.device)
    out[..., :d] = q.to(torch.int8)
    out[..., d:] = scale.view(torch.int8)
    return out


def scales(packed: torch.Tensor) -> torch.Tensor:
    """The fp16 scale of every row of a packed tensor [..., D + 2] -> [...] (a view when it can be)."""
    d = packed.shape[-1] - SCALE_BYTES
    tail = packed[..., d:]
    if tail.stride(-1) != 1 or tail.storage_offset() % 2:
        tail = tail.contiguous()
    return tail.view(torch.float16)[..., 0]


def dequantize(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed int8 [..., D + 2] -> [..., D] in `dtype` (computed in fp32, rounded once)."""
    d = packed.shape[-1] - SCALE_BYTES
    return (packed[..., :d].float() * scales(packed).float()[..., None]).to(dtype)


def scale_view(cache: torch.Tensor) -> torch.Tensor:
    """A q8_0 cache [slots, Hkv, D + 2] seen as fp16 [slots, Hkv, (D + 2) / 2] (the kernels' scale pointer)."""
    return cache.view(torch.float16)
