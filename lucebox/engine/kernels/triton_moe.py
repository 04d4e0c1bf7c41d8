"""The router and routed experts of a decode step in Triton (grouped matmuls), the routing kept on the device.

`moe_experts(x, weights, ids, n_experts, gate, up, down, act)` computes what models/moe.py's grouped eager
path computes, sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), from expert weights stacked by rows as GGUF
stores them ([n_experts * ff, hidden] gate and up, [n_experts * hidden, ff] down), each projection dense
or kept in its GGUF blocks (any type of dequant.FORMATS; triton_qmm's `_part` dequantizes in registers):

- `_route_kernel` (in `route`): the router's softmax (or sigmoid plus selection bias), top-k, renormalisation
  and scale, one program per row, from the router's logits;
- `_align_kernel` sorts the (row, expert) pairs by expert (stable) and finds each expert's range: one
  launch, by counting (decode has at most a few hundred pairs);
- `_grouped_kernel`, one program per (expert, block of output columns): loops over its expert's pairs in
  tiles of BM rows, so each routed expert's weights are read once per step whatever the batch; for gate
  and up (one launch computing act(gate) * up when both are of one type) it gathers the pairs' input rows,
  for down it scales each pair's output by its routing weight and writes it back in pair order;
- the sum over each row's k pairs at the end (a torch op, fixed order: no atomics, so a row's result does
  not depend on the rest of the batch);
- for steps of at most PAIR_ROWS rows over Q4_K / Q6_K / Q8_0 experts, instead of the grouped kernel, one
  int8-activation gemv per (row, expert) pair (`_by_pair`, triton_qmm.pair_gemv): 7x the grouped kernel.

Nothing reads the routing on the host, so a decode step with it can be captured in a CUDA graph (the eager
path reads per-expert counts on the host). Prefill's thousands of rows keep the eager path's cuBLAS matmuls.
Tests: tests/test_moe.py (CUDA, or the CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import torch

from lucebox.engine.kernels import graph_mode
from lucebox.engine.weights.quant import QuantWeight

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the eager path
    triton = None
else:
    from lucebox.engine.kernels.triton_qmm import _TYPES, _part, pair_gemv, pair_ok, quantize_x

# LUCEBOX_MOE_KERNEL=0 keeps CUDA on the eager path (a debugging switch, like LUCEBOX_FUSED_OPS).
ENABLED = os.environ.get("LUCEBOX_MOE_KERNEL", "1") != "0"
# Tests only: run the kernel on CPU tensors too (requires TRITON_INTERPRET=1, Triton's interpreter).
ON_CPU = False
# Steps of at most this many rows (decode batches) take the kernel, and any step a CUDA graph captures;
# larger ones the eager path (a host sync for the per-expert counts, then a matmul per routed expert).
# LUCEBOX_MOE_MAX_ROWS=N sets it: prefill steps of up to N rows then take the grouped kernel too, so
# `bench decode --prompt-lens` compares the two paths end to end (`bench moe --rows` times the kernel alone).
_max_env = os.environ.get("LUCEBOX_MOE_MAX_ROWS", "64")
MAX_ROWS = int(_max_env) if _max_env.isdigit() else 64
BM = 16  # pairs per tile (tl.dot's smallest M)
ALIGN_PAIRS = 1024  # `_align` sorts at most this many pairs in its kernel, more with torch's sort
# Steps of at most this many rows whose gate and up are Q4_K / Q6_K / Q8_0 blocks take one int8-activation gemv
# per (row, expert) pair (`_by_pair`) instead of the grouped kernel. The gemv reads an expert once per pair that
# routes to it (the grouped kernel once per step), but near the bandwidth limit: 7.0-8.3x the grouped kernel at
# 1 to 16 rows on the H200 (`bench moe`, Qwen3-30B-A3B's layer). Above 16 rows: not measured, the grouped kernel.
# LUCEBOX_MOE_PAIR_ROWS=N sets it (0: the grouped kernel only; a debugging and benchmarking switch).
_pair_env = os.environ.get("LUCEBOX_MOE_PAIR_ROWS", "16")
PAIR_ROWS = int(_pair_env) if _pair_env.isdigit() else 16


def use_kernel(x: torch.Tensor) -> bool:
    """Whether the routed experts of activations `x` [T, hidden] run here."""
    on_device = x.is_cuda or (ON_CPU and x.device.type == "cpu")
    small = x.shape[0] <= MAX_ROWS or graph_mode.for_graph(x)
    return ENABLED and triton is not None and on_device and small


if triton is not None:

    @triton.jit
    def _route_kernel(LOGITS, BIAS, W_OUT, ID_OUT, E, stride_l, scale, TOP_K: tl.constexpr, SIGMOID: tl.constexpr,
                      NORM: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr):
        """Row `row` of the logits [T, E] -> its TOP_K expert ids (best first) and their weights."""
        row = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BE)
        e_mask = e < E
        z = tl.load(LOGITS + row * stride_l + e, mask=e_mask, other=-float("inf")).to(tl.float32)
        if SIGMOID:
            score = tl.sigmoid(z)
            pick = tl.where(e_mask, score + tl.load(BIAS + e, mask=e_mask, other=0.0).to(tl.float32), -float("inf"))
        else:
            p = tl.exp(z - tl.max(z, 0))
            score = p / tl.sum(p, 0)
            pick = tl.where(e_mask, score, -float("inf"))
        j = tl.arange(0, BK)
        ids = tl.zeros([BK], dtype=tl.int64)
        w = tl.zeros([BK], dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            best = tl.argmax(pick, 0)
            ids = tl.where(j == k, best.to(tl.int64), ids)
            w = tl.where(j == k, tl.sum(tl.where(e == best, score, 0.0), 0), w)
            pick = tl.where(e == best, -float("inf"), pick)
        if NORM:
            w = w / tl.sum(w, 0)
        tl.store(ID_OUT + row * TOP_K + j, ids, mask=j < TOP_K)
        tl.store(W_OUT + row * TOP_K + j, (w * scale).to(W_OUT.dtype.element_ty), mask=j < TOP_K)

    @triton.jit
    def _align_kernel(IDS, ORDER, STARTS, P, E, BP: tl.constexpr, BE: tl.constexpr, BQ: tl.constexpr):
        """Program i places pairs [i * BQ, (i + 1) * BQ): pair q goes to STARTS[e] + (earlier pairs of its
        expert e), STARTS[e] being the number of pairs of experts below e (written by program 0)."""
        q = tl.program_id(0) * BQ + tl.arange(0, BQ)
        q_mask = q < P
        p = tl.arange(0, BP)
        ids = tl.load(IDS + p, mask=p < P, other=E).to(tl.int32)  # padding sorts after every expert
        mine = tl.load(IDS + q, mask=q_mask, other=E).to(tl.int32)
        e = tl.arange(0, BE)
        count = tl.histogram(ids, BE)
        below = tl.cumsum(count, 0) - count  # [BE]: pairs of experts < e
        if tl.program_id(0) == 0:
            tl.store(STARTS + e, below, mask=e <= E)
        start = tl.sum(tl.where(mine[:, None] == e[None, :], below[None, :], 0), axis=1)
        earlier = (ids[None, :] == mine[:, None]) & (p[None, :] < q[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        tl.store(ORDER + start + rank, q, mask=q_mask)

    @triton.jit
    def _grouped_kernel(X, ORDER, STARTS, W, W2, Y, WTS, N, K, n_chunks, row_bytes, stride_x, stride_y,
                        X_PER_ROW: tl.constexpr, GATHER_X: tl.constexpr, SCATTER_Y: tl.constexpr,
                        DUAL: tl.constexpr, GELU: tl.constexpr,
                        QTYPE: tl.constexpr, CHUNK: tl.constexpr, NB: tl.constexpr, L: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                        F32_DOT: tl.constexpr):
        """For the sorted pairs m of this program's expert e: Y[.] = X[.] @ W_e.T over columns block
        program_id(1), W_e being rows [e * N, (e + 1) * N) of W (dense [rows, K] when QTYPE < 0, else GGUF
        blocks of that type). DUAL: Y[.] = act(X[.] @ W_e.T) * (X[.] @ W2_e.T) (gate and up of one type; act
        SiLU, or tanh-GELU when GELU). X's row is the pair's token (ORDER[m] // X_PER_ROW) when GATHER_X,
        else m; Y's row is the pair (ORDER[m]) when SCATTER_Y, and then scaled by the pair's weight
        WTS[ORDER[m]]; else m. F32_DOT: both dot operands in fp32 (Triton's interpreter computes bf16 dots
        wrongly), else in X's dtype."""
        expert = tl.program_id(0)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        n_mask = rn < N
        w_rows = expert.to(tl.int64) * N + rn
        start = tl.load(STARTS + expert)
        end = tl.load(STARTS + expert + 1)
        for m0 in range(start, end, BM):
            m = m0 + tl.arange(0, BM)
            m_mask = m < end
            pair = tl.load(ORDER + m, mask=m_mask, other=0).to(tl.int64)
            if GATHER_X:
                xr = pair // X_PER_ROW
            else:
                xr = m.to(tl.int64)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            acc2 = tl.zeros((BM, BN), dtype=tl.float32)
            if QTYPE < 0:
                for k0 in range(0, K, BK):
                    k = k0 + tl.arange(0, BK)
                    k_mask = k < K
                    x = tl.load(X + xr[:, None] * stride_x + k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                                other=0.0)
                    w = tl.load(W + w_rows[:, None] * K + k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                                other=0.0)
                    if F32_DOT:
                        x = x.to(tl.float32)
                    acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PREC)
                    if DUAL:
                        w2 = tl.load(W2 + w_rows[:, None] * K + k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                                     other=0.0)
                        acc2 = tl.dot(x, tl.trans(w2.to(x.dtype)), acc2, input_precision=PREC)
            else:
                wrow = W + w_rows[:, None, None] * row_bytes
                xrow = X + xr[:, None, None] * stride_x
                j = tl.arange(0, L)[None, None, :]
                for g in range(0, n_chunks, NB):
                    c = g + tl.arange(0, NB)[None, :, None]
                    cm = n_mask[:, None, None] & (c < n_chunks)
                    for p in tl.static_range(CHUNK // L):
                        w = _part(wrow, c, cm, QTYPE, p)
                        x = tl.load(xrow + c * CHUNK + p * L + j, mask=m_mask[:, None, None] & (c < n_chunks),
                                    other=0.0)
                        x = tl.reshape(x, (BM, NB * L))
                        if F32_DOT:
                            x = x.to(tl.float32)
                        acc = tl.dot(x, tl.trans(tl.reshape(w, (BN, NB * L)).to(x.dtype)), acc, input_precision=PREC)
                        if DUAL:
                            w2 = _part(W2 + w_rows[:, None, None] * row_bytes, c, cm, QTYPE, p)
                            w2 = tl.reshape(w2, (BN, NB * L))
                            acc2 = tl.dot(x, tl.trans(w2.to(x.dtype)), acc2, input_precision=PREC)
            if DUAL:
                if GELU:  # 0.5 g (1 + tanh(z)) == g * sigmoid(2 z), z = sqrt(2 / pi) (g + 0.044715 g^3)
                    acc = acc * tl.sigmoid(1.5957691216057308 * (acc + 0.044715 * acc * acc * acc)) * acc2
                else:
                    acc = acc * tl.sigmoid(acc) * acc2
            if SCATTER_Y:
                yr = pair
                acc = acc * tl.load(WTS + pair, mask=m_mask, other=0.0).to(tl.float32)[:, None]
            else:
                yr = m.to(tl.int64)
            tl.store(Y + yr[:, None] * stride_y + rn[None, :], acc.to(Y.dtype.element_ty),
                     mask=m_mask[:, None] & n_mask[None, :])

    @triton.jit
    def _weighted_sum_kernel(Y, WTS, OUT, N, TOP_K: tl.constexpr, BN: tl.constexpr):
        # OUT[t, :] = sum_j WTS[t, j] * Y[t * TOP_K + j, :], in fp32 in a fixed order (j = 0, 1, ...).
        t = tl.program_id(0)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        mask = cols < N
        acc = tl.zeros([BN], tl.float32)
        for j in tl.static_range(TOP_K):
            w = tl.load(WTS + t * TOP_K + j).to(tl.float32)
            y = tl.load(Y + (t * TOP_K + j).to(tl.int64) * N + cols, mask=mask, other=0.0)
            acc += w * y.to(tl.float32)
        tl.store(OUT + t.to(tl.int64) * N + cols, acc.to(OUT.dtype.element_ty), mask=mask)


Weight = torch.Tensor | QuantWeight


def route(logits: torch.Tensor, top_k: int, router: str, norm: bool, scale: float, bias: torch.Tensor | None,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """models/moe.py `MoE.route` from the router's logits [T, E]: (weights [T, k] in `dtype`, ids [T, k])."""
    logits = logits.contiguous()
    t, n_experts = logits.shape
    weights = torch.empty(t, top_k, device=logits.device, dtype=dtype)
    ids = torch.empty(t, top_k, device=logits.device, dtype=torch.int64)
    if t:
        # one warp: the top-k loop's reductions stay in registers (H200, CUDA graphs, one row: 2.4 us for 128
        # experts, 3.0 for 256, against 4.1 and 4.3 with 4 warps)
        _route_kernel[(t,)](logits, bias, weights, ids, n_experts, logits.stride(0), scale, TOP_K=top_k,
                            SIGMOID=router == "sigmoid", NORM=norm, BE=triton.next_power_of_2(n_experts),
                            BK=triton.next_power_of_2(top_k), num_warps=1)
    return weights, ids


def _grouped(x: torch.Tensor, order: torch.Tensor, starts: torch.Tensor, w: Weight, rows: int,
             out: torch.Tensor, *, x_per_row: int, gather_x: bool, weights: torch.Tensor | None = None,
             up: Weight | None = None, act: str = "silu") -> None:
    """out[.] = x[.] @ (expert rows of w).T for every sorted pair (see `_grouped_kernel`); with `weights`,
    out[pair] = weights[pair] * (...); with `up` (of w's type), out[.] = act(x[.] @ w.T) * (x[.] @ up.T)."""
    n_experts = starts.numel() - 1
    f32_dot = x.device.type == "cpu"  # the interpreter
    prec = "ieee" if x.dtype == torch.float32 or f32_dot else "tf32"
    if isinstance(w, QuantWeight):
        qtype, chunk, nb, part = _TYPES[w.qtype]
        data, n_chunks, row_bytes, bn, bk = w.data, w.cols // chunk, w.data.shape[1], 16, 16  # bk unused
    else:
        qtype, chunk, nb, part = -1, 1, 1, 1
        data, n_chunks, row_bytes, bn, bk = w, 0, 0, 32, 64
    up_data = None if up is None else up.data if isinstance(up, QuantWeight) else up
    _grouped_kernel[(n_experts, triton.cdiv(rows, bn))](
        x, order, starts, data, up_data, out, weights, rows, x.shape[1], n_chunks, row_bytes, x.stride(0),
        out.stride(0), X_PER_ROW=x_per_row, GATHER_X=gather_x, SCATTER_Y=weights is not None, DUAL=up is not None,
        GELU=act == "gelu_tanh", QTYPE=qtype, CHUNK=chunk, NB=nb, L=part, BM=BM, BN=bn, BK=bk, PREC=prec,
        F32_DOT=f32_dot, num_warps=4)


def _align(ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs of `ids` [T, k] sorted by expert: (order [T * k]: sorted position -> pair, starts [E + 1])."""
    pairs = ids.numel()
    if pairs > ALIGN_PAIRS:  # a prefill chunk: the kernel's [BQ, pairs] comparison would not fit a program
        flat = ids.reshape(-1)
        counts = torch.bincount(flat, minlength=n_experts)
        starts = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).to(torch.int32)
        return torch.argsort(flat, stable=True).to(torch.int32), starts
    order = torch.empty(pairs, device=ids.device, dtype=torch.int32)
    starts = torch.empty(n_experts + 1, device=ids.device, dtype=torch.int32)
    bq = 64
    _align_kernel[(triton.cdiv(pairs, bq),)](ids.contiguous(), order, starts, pairs, n_experts,
                                            BP=triton.next_power_of_2(pairs), BE=triton.next_power_of_2(n_experts + 1),
                                            BQ=bq, num_warps=4)
    return order, starts


def _by_pair(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, n_experts: int, gate: QuantWeight,
             up: QuantWeight, down: Weight, act: str, ws: torch.Tensor | None = None) -> torch.Tensor:
    """`moe_experts` for a step of a few rows: x quantized to int8 once (or its workspace `ws` given), gate and
    up (one launch when of one type) and then down as one gemv per (row, expert) pair (triton_qmm.pair_gemv), the k
    outputs of a row weighted and summed in fp32 in one launch (`_weighted_sum_kernel`; four torch ops took ~10 us
    a layer on the H200). A down the gemv cannot take (dense, or another type) runs on the grouped kernel. A row's
    result does not depend on the rest of the batch. `bench moe` on the H200 (a random Qwen3-30B-A3B-shaped layer,
    128 experts, top-8, Q4_K gate and up, Q4_K / Q6_K down; CUDA graphs; 2026-12-03, with a bf16 sum, before the
    fp32 one and the fused launches): 1 row
    18.3 / 20.1 us against the grouped kernel's 129 / 156 us (1.16 TB/s against 0.16), 4 rows 46.7 / 55.3 us against
    338 / 456 us, 16 rows 125 / 156 us against 879 / 1,100 us."""
    from lucebox.engine.kernels import triton_ops

    t, hidden = x.shape
    top_k = ids.shape[1]
    ff = down.cols if isinstance(down, QuantWeight) else down.shape[1]
    pairs = t * top_k
    flat = ids.reshape(-1).contiguous()
    if ws is None:
        ws = quantize_x(x)
    gate_up = torch.empty(pairs, 2 * ff, device=x.device, dtype=x.dtype)
    if (gate.qtype == up.qtype and gate.data.shape == up.data.shape
            and (up.data.data_ptr() - gate.data.data_ptr()) % 4 == 0):
        pair_gemv(ws, gate, flat, ff, gate_up, top_k, second=up)
    else:
        pair_gemv(ws, gate, flat, ff, gate_up, top_k)
        pair_gemv(ws, up, flat, ff, gate_up[:, ff:], top_k)
    y = torch.empty(pairs, hidden, device=x.device, dtype=x.dtype)  # by pair
    if pair_ok(down):  # act(gate) * up quantized for the down gemv in one launch
        pair_gemv(quantize_x(gate_up, act), down, flat, hidden, y, 1)
        out = torch.empty_like(x)
        bn = min(512, triton.next_power_of_2(hidden))
        _weighted_sum_kernel[(t, triton.cdiv(hidden, bn))](y, weights.contiguous(), out, hidden, TOP_K=top_k, BN=bn)
        return out
    h = triton_ops.act_mul(gate_up, act) if triton_ops.use_kernels(x) else triton_ops.act_mul_ref(gate_up, act)
    order, starts = _align(ids, n_experts)
    _grouped(h, order, starts, down, hidden, y, x_per_row=1, gather_x=True, weights=weights.contiguous())
    return y.view(t, top_k, hidden).sum(dim=1)


def _qtype(w: Weight) -> str | None:
    return w.qtype if isinstance(w, QuantWeight) else None


def pairs_read_int8(rows: int, gate: Weight, up: Weight) -> bool:
    """Whether `moe_experts` runs a step of `rows` rows on the per-(row, expert) int8 gemvs (_by_pair), which read
    x as its int8 workspace (a norm kernel can write it: layers.int8_input)."""
    return 0 < rows <= PAIR_ROWS and pair_ok(gate) and pair_ok(up)


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, n_experts: int, gate: Weight,
                up: Weight, down: Weight, act: str = "silu", ws: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, hidden], routing weights and expert ids [T, k], the stacked expert weights (each dense or
    quantized) -> [T, hidden] in x's dtype: the routed experts' weighted sum (models/moe.py `MoE.experts`).
    `ws`: x's int8 workspace where its norm wrote one (used where pairs_read_int8)."""
    from lucebox.engine.kernels import triton_ops

    x = x.contiguous()
    t, hidden = x.shape
    top_k = ids.shape[1]
    ff = down.cols if isinstance(down, QuantWeight) else down.shape[1]
    if t == 0:
        return torch.empty_like(x)
    if pairs_read_int8(t, gate, up):
        return _by_pair(x, weights, ids, n_experts, gate, up, down, act, ws)
    pairs = t * top_k
    order, starts = _align(ids, n_experts)
    if _qtype(gate) == _qtype(up):  # gate, up and act in one launch
        h = torch.empty(pairs, ff, device=x.device, dtype=x.dtype)  # by sorted pair
        _grouped(x, order, starts, gate, ff, h, x_per_row=top_k, gather_x=True, up=up, act=act)
    else:
        gate_up = torch.empty(pairs, 2 * ff, device=x.device, dtype=x.dtype)
        _grouped(x, order, starts, gate, ff, gate_up[:, :ff], x_per_row=top_k, gather_x=True)
        _grouped(x, order, starts, up, ff, gate_up[:, ff:], x_per_row=top_k, gather_x=True)
        h = triton_ops.act_mul(gate_up, act) if triton_ops.use_kernels(x) else triton_ops.act_mul_ref(gate_up, act)
    y = torch.empty(pairs, hidden, device=x.device, dtype=x.dtype)  # by pair, weighted
    _grouped(h, order, starts, down, hidden, y, x_per_row=1, gather_x=False, weights=weights.contiguous())
    return y.view(t, top_k, hidden).sum(dim=1)
