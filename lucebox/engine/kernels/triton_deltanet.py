"""One decode step of a Gated DeltaNet layer (models/qwen35.py) in two Triton launches, on the state slots.

The plain-torch decode of a linear layer is ~30 small kernels (gather the slots' states, the conv window,
SiLU, two L2 norms, the decay and beta, two einsums, the outer product, scatter the states back at the
commit). Here, for every decoding row of the step:

- `_conv_kernel`, one program per (row, head of q, k or v channels): the causal conv over the slot's last
  `kernel - 1` inputs and the new one, SiLU, and for q/k heads the L2 norm (q also times k_dim^-1/2); it
  rolls the conv state (the oldest input out, the new one in) into the destination slot;
- `_delta_kernel`, one program per (row, value head, block of value columns): the decay
  g = ssm_a * softplus(alpha + dt_bias) and beta = sigmoid(beta_x), the gated delta rule
  S <- e^g S; S <- S + k (beta (v - k^T S))^T and the output o = q^T S, reading the state from its slot
  and writing it back. Columns of S are independent in this rule, so the value columns split the work.

Each program reads and writes only its own channels or state columns, so the destination may be the source
slot itself (`in place`: what a CUDA graph replay does; a replay cannot raise half-way, so nothing is left
half-written) or a staging buffer that `StateRows.commit` copies into the slots after the forward pass (the
eager step, which keeps the contract that a step that raises leaves every state as it was). No host syncs,
shapes from the inputs: safe inside CUDA graph capture. fp32 throughout, like the torch path.

Prefill: `_scan_kernel` (`chunk_scan`) is the sequential part of the chunked (WY) form of
models/qwen35.py's `chunk_gated_delta`, its pass over the 64-row blocks, in one launch per piece instead of
four matmuls per block from Python; the blocks' triangular solves before it stay batched torch (cuBLAS).

Speculative verification: `_tree_kernel` (`tree_step`) runs a chain's or a DDTree's rows one after another in
one launch, each from its parent row's state, keeping every row's state for the acceptance (the torch path
runs one batched recurrent step per depth). Tests: tests/test_triton_deltanet.py (CUDA, or
the CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path
    triton = None

# On by default since tests/test_triton_deltanet.py passed on the H200 (2026-12-02);
# LUCEBOX_DELTANET_KERNEL=0 falls back to the plain-torch recurrence (a check, never faster).
ENABLED = os.environ.get("LUCEBOX_DELTANET_KERNEL", "1") == "1"
# The verification kernel (`tree_step`): on since it passed its tests on the H200 and cut a 27B-shaped hybrid's
# speculative step 2-7x (bench spec-cost, 2026-12-04); LUCEBOX_DELTANET_TREE_KERNEL=0 turns it off (the torch
# recurrence a depth at a time, which a verification CUDA graph cannot take: spec/static.py then stays off).
TREE_ENABLED = os.environ.get("LUCEBOX_DELTANET_TREE_KERNEL", "1") == "1"
# Tests only: run the kernels on CPU tensors too (requires TRITON_INTERPRET=1, Triton's interpreter).
ON_CPU = False


def use_kernel(x: torch.Tensor) -> bool:
    """Whether the decode rows of activations `x` take the kernels."""
    return ENABLED and triton is not None and (x.is_cuda or (ON_CPU and x.device.type == "cpu"))


def use_tree_kernel(x: torch.Tensor) -> bool:
    """Whether a verification's rows of activations `x` take `tree_step`."""
    return TREE_ENABLED and use_kernel(x)


if triton is not None:

    # The slot ids are views into a step's packed device array, at any offset: no alignment variants (one compile).
    @triton.jit(do_not_specialize_on_alignment=["IN_SLOTS", "OUT_SLOTS", "CONV_IN", "CONV_OUT"])
    def _conv_kernel(MIXED, W, CONV_IN, IN_SLOTS, CONV_OUT, OUT_SLOTS, Y, stride_m, stride_y, stride_in, stride_out,
                     q_scale, eps, KH: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, K: tl.constexpr,
                     BD: tl.constexpr):
        """Row program_id(0), head program_id(1) (q heads, then k heads, then v heads) of the conv outputs."""
        row = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1)
        is_v = j >= 2 * KH
        width = tl.where(is_v, DV, DK)
        c0 = tl.where(is_v, 2 * KH * DK + (j - 2 * KH) * DV, j * DK)
        d = tl.arange(0, BD)
        mask = d < width
        c = (c0 + d).to(tl.int64)
        src = CONV_IN + tl.load(IN_SLOTS + row).to(tl.int64) * stride_in + c * (K - 1)
        dst = CONV_OUT + tl.load(OUT_SLOTS + row).to(tl.int64) * stride_out + c * (K - 1)
        x = tl.load(MIXED + row * stride_m + c, mask=mask, other=0.0).to(tl.float32)
        # Column m of the state is read (for the tap and as the next column's successor) before it is written,
        # by the thread that writes it: in place is safe.
        cur = tl.load(src, mask=mask, other=0.0)
        acc = tl.zeros([BD], dtype=tl.float32)
        for m in tl.static_range(K - 1):
            acc += cur * tl.load(W + c * K + m, mask=mask, other=0.0)
            if m + 1 < K - 1:
                nxt = tl.load(src + m + 1, mask=mask, other=0.0)
            else:
                nxt = x
            tl.store(dst + m, nxt, mask=mask)
            cur = nxt
        acc += x * tl.load(W + c * K + K - 1, mask=mask, other=0.0)
        y = acc * tl.sigmoid(acc)
        norm = tl.rsqrt(tl.sum(tl.where(mask, y * y, 0.0), 0) + eps) * tl.where(j < KH, q_scale, 1.0)
        y = tl.where(j < 2 * KH, y * norm, y)  # q and k heads: L2 norm (and q's scale)
        tl.store(Y + row * stride_y + c, y, mask=mask)

    @triton.jit(do_not_specialize_on_alignment=["IN_SLOTS", "OUT_SLOTS"])
    def _delta_kernel(Y, ALPHA, BETA, A, DT_BIAS, S_IN, IN_SLOTS, S_OUT, OUT_SLOTS, OUT, stride_y, stride_a,
                      stride_b, stride_in, stride_out, stride_o, KH: tl.constexpr, DK: tl.constexpr,
                      DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        """Row program_id(0), value head program_id(1) (it reads q/k head h % KH), value columns block
        program_id(2): the state's columns updated and their outputs."""
        row = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        kh = h % KH
        dk = tl.arange(0, BK)
        dv = tl.program_id(2) * BV + tl.arange(0, BV)
        k_mask, v_mask = dk < DK, dv < DV
        y = Y + row * stride_y
        q = tl.load(y + kh * DK + dk, mask=k_mask, other=0.0)
        k = tl.load(y + (KH + kh) * DK + dk, mask=k_mask, other=0.0)
        v = tl.load(y + 2 * KH * DK + h * DV + dv, mask=v_mask, other=0.0)
        z = tl.load(ALPHA + row * stride_a + h).to(tl.float32) + tl.load(DT_BIAS + h)
        softplus = tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))  # torch's threshold
        decay = tl.exp(tl.load(A + h) * softplus)
        beta = tl.sigmoid(tl.load(BETA + row * stride_b + h).to(tl.float32))
        at = h.to(tl.int64) * DK * DV + dk[:, None] * DV + dv[None, :]
        mask = k_mask[:, None] & v_mask[None, :]
        s = tl.load(S_IN + tl.load(IN_SLOTS + row).to(tl.int64) * stride_in + at, mask=mask, other=0.0) * decay
        delta = (v - tl.sum(s * k[:, None], 0)) * beta
        s = s + k[:, None] * delta[None, :]
        tl.store(S_OUT + tl.load(OUT_SLOTS + row).to(tl.int64) * stride_out + at, s, mask=mask)
        tl.store(OUT + row * stride_o + h * DV + dv, tl.sum(s * q[:, None], 0), mask=v_mask)


    @triton.jit(do_not_specialize=["n"])  # one compile for every tree size
    def _tree_kernel(Q, K, V, ALPHA, BETA, A, DT_BIAS, PARENT, STATES, OUT, n, stride_a, stride_b,
                     H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        """Value head program_id(0), value columns block program_id(1): a verification's n rows in order, row r
        from the state its parent left (STATES[PARENT[r]]) into STATES[r + 1], its output into OUT[r]; the
        decay, beta and update exactly as `_delta_kernel` computes them."""
        h = tl.program_id(0).to(tl.int64)
        dk = tl.arange(0, BK)
        dv = tl.program_id(1) * BV + tl.arange(0, BV)
        k_mask, v_mask = dk < DK, dv < DV
        at = h * DK * DV + dk[:, None] * DV + dv[None, :]
        mask = k_mask[:, None] & v_mask[None, :]
        a, dt = tl.load(A + h), tl.load(DT_BIAS + h)
        for r in range(n):
            s = tl.load(STATES + tl.load(PARENT + r).to(tl.int64) * H * DK * DV + at, mask=mask, other=0.0)
            row = r * H + h
            q = tl.load(Q + row * DK + dk, mask=k_mask, other=0.0)
            k = tl.load(K + row * DK + dk, mask=k_mask, other=0.0)
            v = tl.load(V + row * DV + dv, mask=v_mask, other=0.0)
            z = tl.load(ALPHA + r * stride_a + h) + dt
            softplus = tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))  # torch's threshold
            beta = tl.sigmoid(tl.load(BETA + r * stride_b + h))
            s = s * tl.exp(a * softplus)
            delta = (v - tl.sum(s * k[:, None], 0)) * beta
            s = s + k[:, None] * delta[None, :]
            tl.store(STATES + (r + 1) * H * DK * DV + at, s, mask=mask)
            tl.store(OUT + row * DV + dv, tl.sum(s * q[:, None], 0), mask=v_mask)
            tl.debug_barrier()  # a later row may read this state back as its parent's

    @triton.jit(do_not_specialize=["n"])  # one compile for every block count
    def _scan_kernel(U, W, QD, ATTN, KD, BLOCK_DECAY, S, OUT, n, C: tl.constexpr, DK: tl.constexpr,
                     DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        """Head program_id(0), value columns block program_id(1): the chunked delta rule's pass over the
        sequence's n blocks of C rows, the state's columns kept in registers from block to block."""
        h = tl.program_id(0).to(tl.int64)
        r = tl.arange(0, C)
        dk = tl.arange(0, BK)
        dv = tl.program_id(1) * BV + tl.arange(0, BV)
        k_mask, v_mask = dk < DK, dv < DV
        at_s = h * DK * DV + dk[:, None] * DV + dv[None, :]
        s_mask = k_mask[:, None] & v_mask[None, :]
        s = tl.load(S + at_s, mask=s_mask, other=0.0)
        for i in range(n):
            block = h * n + i
            rows_k = block * C * DK + r[:, None] * DK + dk[None, :]
            rows_v = block * C * DV + r[:, None] * DV + dv[None, :]
            w = tl.load(W + rows_k, mask=k_mask[None, :], other=0.0)
            v_new = tl.load(U + rows_v, mask=v_mask[None, :], other=0.0) - tl.dot(w, s, input_precision="ieee")
            q = tl.load(QD + rows_k, mask=k_mask[None, :], other=0.0)
            a = tl.load(ATTN + block * C * C + r[:, None] * C + r[None, :])
            o = tl.dot(q, s, input_precision="ieee") + tl.dot(a, v_new, input_precision="ieee")
            tl.store(OUT + rows_v, o, mask=v_mask[None, :])
            kd = tl.load(KD + rows_k, mask=k_mask[None, :], other=0.0)
            s = s * tl.load(BLOCK_DECAY + block) + tl.dot(tl.trans(kd), v_new, input_precision="ieee")
        tl.store(S + at_s, s, mask=s_mask)


def chunk_scan(u: torch.Tensor, w: torch.Tensor, q_decayed: torch.Tensor, attn: torch.Tensor,
               k_decayed: torch.Tensor, block_decay: torch.Tensor, state: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequential part of models/qwen35.py's `chunk_gated_delta` in one launch (its Python loop is a few
    small matmuls per block and head group, launch-bound): u [H, n, C, Dv], w, q_decayed, k_decayed
    [H, n, C, Dk], attn [H, n, C, C], block_decay [H, n] and the state [H, Dk, Dv] at the first block, fp32 ->
    (outputs [H, n, C, Dv], the state after the last block). C a power of two >= 16."""
    H, n, C, DV = u.shape
    DK = w.shape[-1]
    args = [t.contiguous() for t in (u, w, q_decayed, attn, k_decayed, block_decay)]
    state = state.contiguous().clone()
    out = torch.empty_like(args[0])
    BK = max(16, triton.next_power_of_2(DK))
    # One pipeline stage: the loop carries the state, so prefetching the next block's four tiles only costs
    # shared memory (Qwen3.5's Dk = Dv = 128 with C = 64 asked 256 KiB at the default stages, over the H200's
    # 227 KiB); narrower value blocks where the key dimension is wide.
    BV = min(32 if BK <= 64 else 16, max(16, triton.next_power_of_2(DV)))
    _scan_kernel[(H, triton.cdiv(DV, BV))](*args, state, out, n, C=C, DK=DK, DV=DV, BK=BK, BV=BV, num_warps=8,
                                           num_stages=1)
    return out, state


def tree_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
              ssm_a: torch.Tensor, dt_bias: torch.Tensor, parents: torch.Tensor, states: torch.Tensor,
              out: torch.Tensor) -> None:
    """A speculative verification's n rows of one linear layer in one launch (the torch path is one batched
    recurrent step per depth, ~10 launches each): q, k [n, v_heads, k_dim] (normed, tiled over the value
    heads), v [n, v_heads, v_dim], alpha and beta [n, v_heads] (the projections before softplus and sigmoid),
    ssm_a and dt_bias [v_heads], parents [n] (row r's parent state: 0 the slot's, 1 + p after row p < r), all
    fp32; states [n + 1, v_heads, k_dim, v_dim] holding the slot's state at 0 receives each row's state
    after it; out [n, v_heads, v_dim] its outputs."""
    n, H, DK = q.shape
    DV = v.shape[-1]
    assert states.shape == (n + 1, H, DK, DV) and states.is_contiguous() and out.is_contiguous()
    assert alpha.stride(-1) == 1 and beta.stride(-1) == 1
    BV = min(32, triton.next_power_of_2(DV))
    _tree_kernel[(H, triton.cdiv(DV, BV))](
        q.contiguous(), k.contiguous(), v.contiguous(), alpha, beta, ssm_a, dt_bias, parents, states, out, n,
        alpha.stride(0), beta.stride(0), H=H, DK=DK, DV=DV, BK=triton.next_power_of_2(DK), BV=BV)


def decode_step(mixed: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
                ssm_a: torch.Tensor, dt_bias: torch.Tensor, conv_in: torch.Tensor, ssm_in: torch.Tensor,
                in_slots: torch.Tensor, conv_out: torch.Tensor, ssm_out: torch.Tensor, out_slots: torch.Tensor,
                out: torch.Tensor, k_heads: int, eps: float = 1e-6) -> torch.Tensor:
    """One gated delta-rule step for B decoding rows of one linear layer, writing `out` [B, v_heads, v_dim].

    mixed [B, conv channels] (the qkv projection), alpha and beta [B, v_heads] (the `ssm_alpha`, `ssm_beta`
    projections, before softplus and sigmoid), in any float dtype (read as fp32); conv_weight [channels, kernel],
    ssm_a and dt_bias [v_heads]: fp32. Row b reads slot in_slots[b] of conv_in [slots, channels, kernel - 1]
    and ssm_in [slots, v_heads, k_dim, v_dim] and writes its new states to slot out_slots[b] of conv_out and
    ssm_out (the same tensors and slots to update in place). The state tensors' slots must be contiguous."""
    B, C = mixed.shape
    H, DK, DV = ssm_in.shape[1:]
    K = conv_weight.shape[1]
    assert K >= 2 and C == 2 * k_heads * DK + H * DV and H % k_heads == 0
    for t in (conv_in, conv_out, ssm_in, ssm_out):
        assert t.dtype == torch.float32 and t[0].is_contiguous()
    assert mixed.stride(-1) == 1 and out.is_contiguous() and conv_weight.is_contiguous()
    y = torch.empty(B, C, dtype=torch.float32, device=mixed.device)
    _conv_kernel[(B, 2 * k_heads + H)](
        mixed, conv_weight, conv_in, in_slots, conv_out, out_slots, y, mixed.stride(0), y.stride(0),
        conv_in.stride(0), conv_out.stride(0), DK**-0.5, eps, KH=k_heads, DK=DK, DV=DV, K=K,
        BD=triton.next_power_of_2(max(DK, DV)))
    BV = min(32, triton.next_power_of_2(DV))
    _delta_kernel[(B, H, triton.cdiv(DV, BV))](
        y, alpha, beta, ssm_a, dt_bias, ssm_in, in_slots, ssm_out, out_slots, out, y.stride(0), alpha.stride(0),
        beta.stride(0), ssm_in.stride(0), ssm_out.stride(0), out.stride(0), KH=k_heads, DK=DK, DV=DV,
        BK=triton.next_power_of_2(DK), BV=BV)
    return out
