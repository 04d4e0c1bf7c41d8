"""Pure-torch dequantization of GGUF blocks, bit-exact with `gguf.quants.dequantize`.

Each function takes the raw blocks as a uint8 tensor [n_blocks, type_size] (CPU or CUDA) and returns fp32
[n_blocks, block_size]. The arithmetic follows gguf/quants.py operation by operation (same products in the
same order, each rounded to fp32; in place where a product's operands only swap), so the result equals the
numpy reference bit for bit. This is the CPU path of the quantized linear, the reference the Triton kernels are
tested against, and the row gather of a quantized embedding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Dequant = Callable[[torch.Tensor], torch.Tensor]


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte `at` of every block, as fp32 [n, 1]."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, L] bytes -> [n, 2L]: the L low nibbles, then the L high nibbles (ggml's order within a block)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits32(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The 32 bits of the little-endian uint32 at byte `at`, as uint8 [n, 32] (bit i at column i)."""
    qh = blocks[:, at:at + 4].contiguous().view(torch.int32)
    shifts = torch.arange(32, device=blocks.device, dtype=torch.int32)
    return ((qh >> shifts) & 1).to(torch.uint8)


def q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    q = _nibbles(b[:, 2:18]).to(torch.int8) - 8
    return q.float().mul_(d)


def q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    return _nibbles(b[:, 4:20]).float().mul_(d).add_(m)


def q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    q = (_nibbles(b[:, 6:22]) | (_bits32(b, 2) << 4)).to(torch.int8) - 16
    return q.float().mul_(d)


def q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles(b[:, 8:24]) | (_bits32(b, 4) << 4)
    return q.float().mul_(d).add_(m)


def q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    return b[:, 2:34].contiguous().view(torch.int8).float().mul_(d)


def k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 packed bytes -> eight 6-bit scales and eight 6-bit mins, each [n, 8] uint8."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _shifts(n: int, step: int, device: torch.device) -> torch.Tensor:
    """uint8 [0, step, 2 step, ...] made on `device` (no host-to-device copy, so CUDA graphs can capture it)."""
    return (torch.arange(n, device=device, dtype=torch.int32) * step).to(torch.uint8)


def _k_low4(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K's 128 bytes -> [n, 8, 32] low 4 bits: each 32 bytes give a sub-block of lows, then of highs."""
    q = qs.reshape(-1, 4, 1, 32) >> _shifts(2, 4, qs.device).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(-1, 8, 32)


def q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = k_scale_min(b[:, 4:16])
    d = (d * sc.float()).reshape(n, 8, 1)
    dm = (dmin * mn.float()).reshape(n, 8, 1)
    return _k_low4(b[:, 16:144]).float().mul_(d).sub_(dm).reshape(n, 256)


def q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = k_scale_min(b[:, 4:16])
    d = (d * sc.float()).reshape(n, 8, 1)
    dm = (dmin * mn.float()).reshape(n, 8, 1)
    qh = (b[:, 16:48].reshape(n, 1, 32) >> _shifts(8, 1, b.device).reshape(1, 8, 1)) & 1
    q = _k_low4(b[:, 48:176]) | (qh << 4)
    return q.float().mul_(d).sub_(dm).reshape(n, 256)


def q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b, 208) * scales).reshape(n, 16, 1)
    ql = b[:, 0:128].reshape(n, 2, 1, 64) >> _shifts(2, 4, b.device).reshape(1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(n, 8, 32)
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> _shifts(4, 2, b.device).reshape(1, 1, 4, 1)
    qh = (qh & 0x03).reshape(n, 8, 32)
    q = (ql | (qh << 4)).to(torch.int8) - 32
    return q.reshape(n, 16, 16).float().mul_(d).reshape(n, 256)


# GGML type name -> (block size, bytes per block, dequantizer).
FORMATS: dict[str, tuple[int, int, Dequant]] = {
    "Q4_0": (32, 18, q4_0),
    "Q4_1": (32, 20, q4_1),
    "Q5_0": (32, 22, q5_0),
    "Q5_1": (32, 24, q5_1),
    "Q8_0": (32, 34, q8_0),
    "Q4_K": (256, 144, q4_k),
    "Q5_K": (256, 176, q5_k),
    "Q6_K": (256, 210, q6_k),
}


def dequantize(data: torch.Tensor, qtype: str, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows of raw blocks [rows, cols / block * type_size] uint8 -> [rows, cols] in `dtype` (computed in fp32)."""
    block, size, fn = FORMATS[qtype]
    rows = data.shape[0]
    out = fn(data.reshape(-1, size)).reshape(rows, cols)
    return out if dtype == torch.float32 else out.to(dtype)
