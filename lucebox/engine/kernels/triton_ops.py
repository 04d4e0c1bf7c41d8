"""Fused Triton kernels for the decoder's small ops on CUDA, each with the pure-torch reference it must match.

A small model's decode step is bound by kernel launches, not by math: done the
plain torch way, an RMSNorm is three kernels (cast, norm, cast), rotate-half
RoPE four, the K/V cache write two, SwiGLU two, each residual add one. Here
each of those groups is one kernel:

- `rms_norm(x, weight, eps)`: the model's RMSNorm (fp32 math, fp32 weight).
  These norms can also write their output's int8 rows (`ws`), the input of
  the quantized projections that read it (layers.int8_input).
- `add_rms_norm(x, residual, weight, eps)`: the residual add and the next norm
  (`h = h + out; x = norm(h)`), optionally RMS-norming `x` first (Gemma 3's
  sandwich post-norm).
- `rope_qk_and_cache(qkv, ...)`: splits the fused QKV projection, applies the
  per-head q/k RMSNorm (Qwen3, Gemma 3) and rotate-half RoPE, writes K and V
  into the paged cache.
- `act_mul(gate_up, act)`: SiLU / tanh-GELU of the gate times up.
- `gated_rms_norm(out, z, ...)`: Gated DeltaNet's output norm times silu(z).
- `small_linear(x, weight)`: one row times a small dense weight (a MoE router, a
  shared expert's gate), where cuBLAS's tiles leave most of the GPU idle.
- `masked_argmax(logits, bitmasks)`: the greedy token of each row among those
  its grammar's bitmask allows (constrained decoding: one kernel instead of
  unpacking the bits, masking and an argmax, about ten).

Every kernel computes in fp32 and rounds to the activation dtype where the
reference stores a tensor, so it matches the reference to the last bit or
close to it. They only launch kernels and allocate (no host syncs, shapes come
from the inputs), so they are safe inside CUDA graph capture, for any number
of rows T (decode: T = batch; prefill: thousands).

The decoder uses them when `use_kernels(activations)` says so: CUDA tensors,
triton importable and `ENABLED` (env `LUCEBOX_FUSED_OPS=0` turns them off, as
does setting `triton_ops.ENABLED = False` before a forward pass; CUDA graphs
keep what they captured). The references are the CPU path. Tests:
tests/test_triton_ops.py (CUDA, or the CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the references are used
    triton = None
else:
    from lucebox.engine.kernels import pdl
    from lucebox.engine.kernels.triton_qmm import q8_store_run

# Read at forward time: the decoder takes the fused path only while this is True.
ENABLED = os.environ.get("LUCEBOX_FUSED_OPS", "1") != "0"
# Tests only: also run the kernels on CPU tensors (requires TRITON_INTERPRET=1, Triton's interpreter).
ON_CPU = False

ACTS = ("silu", "gelu_tanh")


def use_kernels(x: torch.Tensor) -> bool:
    """Whether the fused kernels should run for activations like `x`."""
    return ENABLED and triton is not None and (x.is_cuda or (ON_CPU and x.device.type == "cpu"))


# ----------------------------------------------------------------------------------------------------------------
# References (pure torch): what the CPU path computes and what the kernels are tested against.


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in fp32, times the (fp32) weight, back in x's dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, x_weight: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); with `x_weight`, x is first rms_norm(x, x_weight)."""
    if x_weight is not None:
        x = rms_norm_ref(x, x_weight, eps)
    new_residual = residual + x
    return rms_norm_ref(new_residual, weight, eps), new_residual


def gated_rms_norm_ref(
    out: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """Gated DeltaNet's output norm: rms_norm(out in `dtype`, weight) * silu(z) per head, out [T, H, D] (fp32),
    z [T, H * D] -> [T, H * D] in `dtype` (each step rounded as the eager block rounds it)."""
    t, heads, dim = out.shape
    y = rms_norm_ref(out.to(dtype), weight, eps) * F.silu(z.reshape(t, heads, dim).to(dtype))
    return y.reshape(t, heads * dim)


def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on x [T, heads, head_dim] with cos/sin [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos[:, None, :], rotated, sin[:, None, :])


def rope_qk_and_cache_ref(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    slots: torch.Tensor | None,
    n_q_heads: int,
    n_kv_heads: int,
    q_norm_w: torch.Tensor | None = None,
    k_norm_w: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of `rope_qk_and_cache` (same arguments and results)."""
    hq, hkv = n_q_heads, n_kv_heads
    qkv = qkv.view(qkv.shape[0], hq + 2 * hkv, qkv.shape[1] // (hq + 2 * hkv))
    q, k, v = qkv[:, :hq], qkv[:, hq: hq + hkv], qkv[:, hq + hkv:]
    if q_norm_w is not None:
        q, k = rms_norm_ref(q, q_norm_w, eps), rms_norm_ref(k, k_norm_w, eps)
    q, k = apply_rotary_ref(q, cos, sin), apply_rotary_ref(k, cos, sin)
    if k_cache is not None:
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)
    return q, k, v


def act_mul_ref(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up, where gate_up = [..., 2F] holds the gate in its first half."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
    return gate * up


def masked_argmax_ref(logits: torch.Tensor, bitmasks: torch.Tensor) -> torch.Tensor:
    """[rows] int64: the first index of each row's largest logit among the tokens whose bit is set in `bitmasks`
    [rows, ceil(vocab / 32)] int32 (bit j of word i: token 32 * i + j), as torch.argmax breaks ties."""
    return logits.float().masked_fill(~unpack_bitmask(bitmasks, logits.shape[-1]), float("-inf")).argmax(-1)


def unpack_bitmask(bitmasks: torch.Tensor, vocab: int) -> torch.Tensor:
    """Bitmasks [rows, words] int32 -> bool [rows, vocab] (True: bit set) on their device."""
    bits = (bitmasks[:, :, None] >> torch.arange(32, dtype=torch.int32, device=bitmasks.device)) & 1
    return bits.view(len(bitmasks), -1)[:, :vocab].bool()


# ----------------------------------------------------------------------------------------------------------------
# Kernels

if triton is not None:

    @triton.jit
    def _rms_norm_kernel(X, W, Y, WS, stride_x, stride_y, stride_ws, n, eps, Q8: tl.constexpr,
                         BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        pdl.enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, 0) / n + eps)
        y = (x * r * w).to(Y.dtype.element_ty)
        tl.store(Y + row * stride_y + cols, y, mask=mask)
        if Q8:  # the output's int8 workspace, as quantize_x would write it from the stored rows (zero past n)
            q8_store_run(WS + row * stride_ws, y.to(tl.float32), 0, n, BLOCK // 32)

    @triton.jit
    def _add_rms_norm_kernel(
        X, R, XW, W, Y, RES, WS, stride_x, stride_r, stride_y, stride_res, stride_ws, n, eps,
        NORM_X: tl.constexpr, Q8: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
    ):
        pdl.enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if NORM_X:  # Gemma 3's post-norm of the sublayer output, stored in the activation dtype
            xw = tl.load(XW + cols, mask=mask, other=0.0).to(tl.float32)
            x = (x * tl.rsqrt(tl.sum(x * x, 0) / n + eps) * xw).to(Y.dtype.element_ty).to(tl.float32)
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(RES.dtype.element_ty)  # the residual stream stays in the activation dtype
        tl.store(RES + row * stride_res + cols, s, mask=mask)
        s = s.to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        y = (s * tl.rsqrt(tl.sum(s * s, 0) / n + eps) * w).to(Y.dtype.element_ty)
        tl.store(Y + row * stride_y + cols, y, mask=mask)
        if Q8:
            q8_store_run(WS + row * stride_ws, y.to(tl.float32), 0, n, BLOCK // 32)

    @triton.jit
    def _gated_norm_kernel(OUT, Z, W, Y, WS, stride_o, stride_z, stride_y, stride_ws, n_cols, eps,
                           Q8: tl.constexpr, D: tl.constexpr):
        """Row program_id(0), head program_id(1): y = rms_norm(o in Y's dtype) * silu(z), each step rounded to
        Y's dtype as torch rounds it; Q8: this head's 32-column blocks of the row's int8 workspace too."""
        t = tl.program_id(0).to(tl.int64)
        hd = tl.program_id(1)
        d = tl.arange(0, D)
        dt = Y.dtype.element_ty
        o = tl.load(OUT + t * stride_o + hd * D + d).to(dt).to(tl.float32)
        w = tl.load(W + d).to(tl.float32)
        normed = (o * tl.rsqrt(tl.sum(o * o, 0) / D + eps) * w).to(dt).to(tl.float32)
        z = tl.load(Z + t * stride_z + hd * D + d).to(tl.float32)
        gate = (z / (1.0 + tl.exp(-z))).to(dt).to(tl.float32)
        y = (normed * gate).to(dt)
        tl.store(Y + t * stride_y + hd * D + d, y)
        if Q8:
            q8_store_run(WS + t * stride_ws, y.to(tl.float32), hd * (D // 32), n_cols, D // 32)

    @triton.jit
    def _norm_rope_heads(
        SRC, NW, OUT, stride_out_h, n_heads, cos_lo, cos_hi, sin_lo, sin_hi, eps,
        NORM: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr,
    ):
        """Load `n_heads` heads at SRC (contiguous, head_dim = 2 * HALF), optionally RMS-norm each with NW,
        rotate, store at OUT; returns the rotated halves (fp32) for the caller to store elsewhere too."""
        h = tl.arange(0, HEADS_PAD)
        d = tl.arange(0, HALF_PAD)
        mask = (h < n_heads)[:, None] & (d < HALF)[None, :]
        src = SRC + h[:, None] * (2 * HALF) + d[None, :]
        lo = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        hi = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        if NORM:  # per-head RMSNorm (Qwen3, Gemma 3), stored in the activation dtype before RoPE
            r = tl.rsqrt((tl.sum(lo * lo, 1) + tl.sum(hi * hi, 1)) / (2 * HALF) + eps)[:, None]
            w_lo = tl.load(NW + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
            w_hi = tl.load(NW + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
            lo = (lo * r * w_lo).to(OUT.dtype.element_ty).to(tl.float32)
            hi = (hi * r * w_hi).to(OUT.dtype.element_ty).to(tl.float32)
        out_lo = lo * cos_lo[None, :] - hi * sin_lo[None, :]
        out_hi = hi * cos_hi[None, :] + lo * sin_hi[None, :]
        out = OUT + h[:, None] * stride_out_h + d[None, :]
        tl.store(out, out_lo.to(OUT.dtype.element_ty), mask=mask)
        tl.store(out + HALF, out_hi.to(OUT.dtype.element_ty), mask=mask)
        return out_lo, out_hi

    @triton.jit
    def _rope_qk_cache_kernel(
        QKV, COS, SIN, SLOTS, QNW, KNW, Q, K, KC, VC,
        stride_qkv, stride_cos, stride_sin, stride_q_t, stride_q_h, stride_k_t, stride_k_h,
        stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h, eps,
        HQ: tl.constexpr, HKV: tl.constexpr, HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr,
        HALF: tl.constexpr, HALF_PAD: tl.constexpr, QK_NORM: tl.constexpr, WRITE: tl.constexpr = True,
        PDL: tl.constexpr = False,
    ):
        pdl.enter(PDL)
        t = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, HALF_PAD)
        dm = d < HALF
        cos_lo = tl.load(COS + t * stride_cos + d, mask=dm, other=0.0).to(tl.float32)
        cos_hi = tl.load(COS + t * stride_cos + HALF + d, mask=dm, other=0.0).to(tl.float32)
        sin_lo = tl.load(SIN + t * stride_sin + d, mask=dm, other=0.0).to(tl.float32)
        sin_hi = tl.load(SIN + t * stride_sin + HALF + d, mask=dm, other=0.0).to(tl.float32)
        row = QKV + t * stride_qkv
        _norm_rope_heads(row, QNW, Q + t * stride_q_t, stride_q_h, HQ, cos_lo, cos_hi, sin_lo, sin_hi, eps,
                         QK_NORM, HALF, HALF_PAD, HQ_PAD)
        k_lo, k_hi = _norm_rope_heads(row + HQ * 2 * HALF, KNW, K + t * stride_k_t, stride_k_h, HKV,
                                      cos_lo, cos_hi, sin_lo, sin_hi, eps, QK_NORM, HALF, HALF_PAD, HKV_PAD)
        # The new rows' K (rotated) and V (as projected) go into the paged cache at their slots.
        slot = tl.load(SLOTS + t).to(tl.int64)
        h = tl.arange(0, HKV_PAD)
        mask = (h < HKV)[:, None] & dm[None, :]
        if WRITE:
            kc = KC + slot * stride_kc_s + h[:, None] * stride_kc_h + d[None, :]
            tl.store(kc, k_lo.to(KC.dtype.element_ty), mask=mask)
            tl.store(kc + HALF, k_hi.to(KC.dtype.element_ty), mask=mask)
        v = row + (HQ + HKV) * 2 * HALF + h[:, None] * (2 * HALF) + d[None, :]
        if WRITE:
            vc = VC + slot * stride_vc_s + h[:, None] * stride_vc_h + d[None, :]
            tl.store(vc, tl.load(v, mask=mask, other=0.0).to(VC.dtype.element_ty), mask=mask)
            tl.store(vc + HALF, tl.load(v + HALF, mask=mask, other=0.0).to(VC.dtype.element_ty), mask=mask)

    @triton.jit
    def _act_mul_kernel(GU, OUT, stride_gu, stride_out, n, GELU: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        g = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GU + row * stride_gu + n + cols, mask=mask, other=0.0).to(tl.float32)
        if GELU:
            # 0.5 g (1 + tanh(z)) == g * sigmoid(2 z), z = sqrt(2 / pi) (g + 0.044715 g^3)
            a = g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
        else:
            a = g * tl.sigmoid(g)
        a = a.to(OUT.dtype.element_ty).to(tl.float32)  # the reference stores act(gate) before the product
        tl.store(OUT + row * stride_out + cols, (a * u).to(OUT.dtype.element_ty), mask=mask)


    @triton.jit(do_not_specialize=["V", "W"])
    def _masked_argmax_kernel(logits_ptr, bits_ptr, out_ptr, V, W, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        best_v = -float("inf")
        best_i = 0
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inside = offs < V
            x = tl.load(logits_ptr + row * V + offs, mask=inside, other=-float("inf")).to(tl.float32)
            word = tl.load(bits_ptr + row * W + offs // 32, mask=inside, other=0)
            x = tl.where(((word >> (offs % 32)) & 1) != 0, x, -float("inf"))
            m = tl.max(x, 0)
            i = tl.argmax(x, 0)  # the first index of the block's largest
            better = m > best_v  # strictly: an equal value later in the row does not win
            best_i = tl.where(better, start + i, best_i)
            best_v = tl.where(better, m, best_v)
        tl.store(out_ptr + row, best_i.to(tl.int64))


if triton is not None:

    @triton.jit
    def _small_gemv_kernel(X, W, Y, N, K, BN: tl.constexpr, BK: tl.constexpr):
        """Y[0, rows] = X[0] @ W[rows].T for BN weight rows a program, K in BK-wide steps, fp32 sums."""
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        n_mask = rn < N
        acc = tl.zeros([BN, BK], tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            x = tl.load(X + k, mask=k < K, other=0.0).to(tl.float32)
            w = tl.load(W + rn[:, None].to(tl.int64) * K + k[None, :], mask=n_mask[:, None] & (k < K)[None, :],
                        other=0.0)
            acc += w.to(tl.float32) * x[None, :]
        tl.store(Y + rn, tl.sum(acc, 1).to(Y.dtype.element_ty), mask=n_mask)


# `small_linear` takes one activation row against a dense 16-bit weight of at most these many rows and columns:
# the shapes it was measured on. H200, CUDA graphs (2026-12-04): a Qwen3-30B-A3B router 128 x 2048 1.80 us
# against F.linear's 4.82; Qwen3.5-35B-A3B's 256 x 2048 1.92 against 5.07, its shared-expert gate 1 x 2048 1.63
# against 3.85 (two cuBLAS kernels). Four rows gained less (3.75 against 4.75 us) and no more was measured: one row.
SMALL_LINEAR_MAX = (512, 2048)


def small_linear_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `small_linear` serves F.linear(x, weight): one row of a fused-ops device, a contiguous fp16 /
    bf16 weight of at most SMALL_LINEAR_MAX, and no gradient wanted (the kernel has no backward)."""
    n, k = weight.shape
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    return (use_kernels(x) and x.dim() == 2 and x.shape[0] == 1 and x.dtype == weight.dtype
            and weight.dtype in (torch.float16, torch.bfloat16)
            and n <= SMALL_LINEAR_MAX[0] and k <= SMALL_LINEAR_MAX[1] and weight.is_contiguous())


def small_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) for one row x [1, K] (see `small_linear_ok`): fp32 sums, rounded to x's dtype."""
    n, k = weight.shape
    x = x.contiguous()
    y = torch.empty(1, n, device=x.device, dtype=x.dtype)
    _small_gemv_kernel[(triton.cdiv(n, 2),)](x, weight, y, n, k, BN=2, BK=1024, num_warps=4)
    return y


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with unit stride along the last dim (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm_launch(n: int) -> tuple[int, int]:
    block = triton.next_power_of_2(n)
    return block, 4 if block <= 1024 else 8 if block <= 4096 else 16


def _check_ws(ws: torch.Tensor | None, rows: int, n: int) -> None:
    if ws is not None and (n % 32 or ws.dtype != torch.int32 or ws.shape != (rows, n // 4 + n // 8)
                           or ws.stride(1) != 1):
        raise ValueError(f"norm: an int8 workspace {tuple(ws.shape)} {ws.dtype} for {rows} rows of {n} "
                         f"(expected int32 [{rows}, {n // 4 + n // 8}], {n} a multiple of 32)")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, ws: torch.Tensor | None = None) -> torch.Tensor:
    """`rms_norm_ref` in one kernel: x [..., N] (fp32/fp16/bf16), weight [N]; returns x's shape and dtype.
    `ws` (triton_qmm.workspace of x's rows): also filled with the output's int8 workspace, in the same launch
    (what quantize_x of the output gives), for the quantized projections that read the normed rows."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} does not fit hidden size {n}")
    x2 = _rows(x)
    _check_ws(ws, x2.shape[0], n)
    y = torch.empty_like(x2)
    block, warps = _norm_launch(n)
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, y if ws is None else ws, x2.stride(0), y.stride(0),
                                     0 if ws is None else ws.stride(0), n, eps, Q8=ws is not None, BLOCK=block,
                                     num_warps=warps, **pdl.launch(x2, x2.shape[0]))
    return y.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, x_weight: torch.Tensor | None = None,
    ws: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm_ref` in one kernel: returns (normed, new_residual), both shaped and typed like x.

    This is the block's `h = h + sublayer_out; x = norm(h)`; `x_weight` (Gemma 3) post-norms the sublayer
    output first. `ws`: also the normed rows' int8 workspace, as in `rms_norm`.
    """
    n = x.shape[-1]
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} does not match "
                         f"x {tuple(x.shape)} {x.dtype}")
    if weight.shape != (n,) or (x_weight is not None and x_weight.shape != (n,)):
        raise ValueError(f"add_rms_norm: norm weights must have shape ({n},)")
    x2, r2 = _rows(x), _rows(residual)
    _check_ws(ws, x2.shape[0], n)
    y, res = torch.empty_like(x2), torch.empty_like(x2)
    block, warps = _norm_launch(n)
    _add_rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight if x_weight is None else x_weight, weight, y, res, y if ws is None else ws,
        x2.stride(0), r2.stride(0), y.stride(0), res.stride(0), 0 if ws is None else ws.stride(0), n, eps,
        NORM_X=x_weight is not None, Q8=ws is not None, BLOCK=block, num_warps=warps, **pdl.launch(x2, x2.shape[0]),
    )
    return y.view(x.shape), res.view(x.shape)


def gated_rms_norm(
    out: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype,
    ws: torch.Tensor | None = None,
) -> torch.Tensor:
    """`gated_rms_norm_ref` in one kernel (four launches and three passes in torch): out [T, H, D] (fp32,
    contiguous heads; D a power of two), z [T, H * D] with unit column stride. `ws` (triton_qmm.workspace of T rows
    of H * D, D a multiple of 32): also the output's int8 workspace, for `ssm_out` on the int8 kernels."""
    t, heads, dim = out.shape
    if dim & (dim - 1) or out.stride(2) != 1 or out.stride(1) != dim or z.shape != (t, heads * dim) or z.stride(1) != 1:
        raise ValueError(f"gated_rms_norm: out {tuple(out.shape)} and z {tuple(z.shape)} are not [T, H, D] and "
                         f"[T, H * D] with contiguous heads, D a power of two")
    if weight.shape != (dim,):
        raise ValueError(f"gated_rms_norm: weight {tuple(weight.shape)} is not ({dim},)")
    if ws is not None and dim % 32:
        raise ValueError(f"gated_rms_norm: an int8 workspace needs heads of whole 32-column blocks, not {dim}")
    _check_ws(ws, t, heads * dim)
    y = torch.empty(t, heads * dim, device=out.device, dtype=dtype)
    _gated_norm_kernel[(t, heads)](out, z, weight, y, y if ws is None else ws, out.stride(0), z.stride(0),
                                   y.stride(0), 0 if ws is None else ws.stride(0), heads * dim, eps,
                                   Q8=ws is not None, D=dim, num_warps=1 if dim <= 128 else 2)
    return y


def rope_qk_and_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    slots: torch.Tensor | None,
    n_q_heads: int,
    n_kv_heads: int,
    q_norm_w: torch.Tensor | None = None,
    k_norm_w: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention input of the new rows, in one kernel.

    qkv [T, (Hq + 2 Hkv) * D]: the fused QKV projection (q heads, then k, then v). cos/sin [T, D].
    Optionally RMS-norms each q and k head (q_norm_w / k_norm_w [D], both or neither), rotates q and k
    (rotate-half RoPE), and writes k and v into the caches [slots, Hkv, D] at rows `slots` [T] (int64);
    caches and slots None: nothing is written (the DFlash drafter's block rows, which are never cached).
    Returns q [T, Hq, D] and k [T, Hkv, D] (rotated, new tensors) and v [T, Hkv, D] (a view of qkv):
    decode attention reads only q (k/v come from the cache), prefill attention over the new rows uses all three.
    A q8_0 cache (int8 [slots, Hkv, D + 2]) is not written here: paged_attention quantizes and writes it.
    """
    hq, hkv = n_q_heads, n_kv_heads
    cached = k_cache is not None
    write = cached and k_cache.dtype != torch.int8
    t = qkv.shape[0]
    dim = k_cache.shape[-1] - (0 if write else 2) if cached else qkv.shape[-1] // (hq + 2 * hkv)
    if qkv.dim() != 2 or qkv.shape[1] != (hq + 2 * hkv) * dim:
        raise ValueError(f"rope_qk_and_cache: qkv {tuple(qkv.shape)} is not [T, ({hq} + 2 * {hkv}) * {dim}]")
    if dim % 2 or cos.shape != (t, dim) or sin.shape != (t, dim) or (cached and slots.shape != (t,)):
        raise ValueError(f"rope_qk_and_cache: cos/sin must be [{t}, {dim}] (even head_dim), slots [{t}]")
    if cached and (k_cache.shape[1:] != (hkv, dim + (0 if write else 2)) or v_cache.shape[1:] != k_cache.shape[1:]):
        raise ValueError(f"rope_qk_and_cache: caches must be [slots, {hkv}, {dim}]")
    if (q_norm_w is None) != (k_norm_w is None):
        raise ValueError("rope_qk_and_cache: give both q_norm_w and k_norm_w, or neither")
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    cos, sin = _rows(cos), _rows(sin)
    q = torch.empty(t, hq, dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(t, hkv, dim, dtype=qkv.dtype, device=qkv.device)
    half = dim // 2
    norm = q_norm_w is not None
    if not cached:  # the kernel stores nothing there (WRITE off); it loads a slot from any tensor of T+ elements
        slots, k_cache, v_cache = cos, k, k
    _rope_qk_cache_kernel[(t,)](
        qkv, cos, sin, slots, q_norm_w if norm else cos, k_norm_w if norm else cos, q, k, k_cache, v_cache,
        qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), eps,
        HQ=hq, HKV=hkv, HQ_PAD=max(2, triton.next_power_of_2(hq)), HKV_PAD=max(2, triton.next_power_of_2(hkv)),
        HALF=half, HALF_PAD=max(2, triton.next_power_of_2(half)), QK_NORM=norm, WRITE=write,
        num_warps=4 if hq * dim <= 4096 else 8, **pdl.launch(qkv, t),
    )
    v = qkv.view(t, hq + 2 * hkv, dim)[:, hq + hkv:]
    return q, k, v


def act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """`act_mul_ref` in one kernel: gate_up [T, 2F] -> act(gate) * up [T, F]; act is "silu" or "gelu_tanh"."""
    if act not in ACTS:
        raise ValueError(f"act_mul: unknown activation {act!r} (expected one of {ACTS})")
    if gate_up.shape[-1] % 2:
        raise ValueError(f"act_mul: gate_up's last dim {gate_up.shape[-1]} is odd")
    gu = _rows(gate_up)
    n = gu.shape[1] // 2
    out = torch.empty(gu.shape[0], n, dtype=gu.dtype, device=gu.device)
    block = min(1024, triton.next_power_of_2(n))
    _act_mul_kernel[(gu.shape[0], triton.cdiv(n, block))](gu, out, gu.stride(0), out.stride(0), n,
                                                          GELU=act == "gelu_tanh", BLOCK=block, num_warps=4)
    return out.view(*gate_up.shape[:-1], n)


def masked_argmax(logits: torch.Tensor, bitmasks: torch.Tensor) -> torch.Tensor:
    """`masked_argmax_ref` in one kernel: logits [rows, vocab] (contiguous rows, any float dtype), bitmasks
    [rows, words] int32 on the same device -> [rows] int64."""
    if bitmasks.shape != (logits.shape[0], (logits.shape[1] + 31) // 32) or bitmasks.dtype != torch.int32:
        raise ValueError(f"masked_argmax: bitmasks {tuple(bitmasks.shape)} {bitmasks.dtype} do not cover logits "
                         f"{tuple(logits.shape)} (int32, one bit per token)")
    logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    _masked_argmax_kernel[(logits.shape[0],)](logits, bitmasks.contiguous(), out, logits.shape[1],
                                              bitmasks.shape[1], BLOCK=2048, num_warps=8)
    return out
