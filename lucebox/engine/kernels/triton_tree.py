"""DDTree draft trees built on the device: `build_tree` for a batch, with no host sync (the one-launch step).

`draft_trees(lp, tok, n, seed)` takes the drafter's top-K log-probs (descending) and ids at each of D depths,
[b, D, K], and each sequence's chain depth [b] (build_tree's `seed`; a strided view is fine), and returns each
sequence's tree of n rows (the root, then n - 1 nodes, parents first): the nodes' tokens [b, n - 1], every
row's parent row and depth [b, n] (the root's: 0) and its ancestor-or-self bits [b, n] (bit a of row r: row a
is r or an ancestor; the attention's `tree_bits`).

One Triton program per sequence runs spec/dflash.py's `build_tree` itself: the top-1 chain to the sequence's
depth, then best-first growth by cumulative log-probability (float64, as the host sums), with the heap as a
frontier in registers (a pop takes the live candidate of the largest value, ties to the first pushed, as
heapq's counter does; -inf candidates too, as the host orders them). Same nodes, same order, as the host's.
On the CPU the one-launch step calls `build_tree` itself (spec/static.py): its eager step may read the host.

Tests: tests/test_spec.py (the kernel against build_tree, on CUDA or the CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: build_tree on the host
    triton = None

# Tests only: run the kernel on CPU tensors too (requires TRITON_INTERPRET=1, Triton's interpreter).
ON_CPU = False


def available(device: torch.device) -> bool:
    return triton is not None and (device.type == "cuda" or (ON_CPU and device.type == "cpu"))


def draft_trees(lp: torch.Tensor, tok: torch.Tensor, n: int, seed: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(nodes [b, n - 1], parent [b, n], depth [b, n], bits [b, n]) int64; 2 <= n <= 64, 0 <= seed <= D (a chain
    longer than the tree fills it, as build_tree's does)."""
    assert available(lp.device), "the tree kernel runs on CUDA (or the CPU under TRITON_INTERPRET=1)"
    b, D, K = lp.shape
    assert 2 <= n <= 64, "a tree of 1 to 63 nodes under its root"
    lp, tok = lp.double().contiguous(), tok.contiguous()  # float64: build_tree's sums, bit for bit
    nodes = torch.empty(b, n - 1, dtype=torch.long, device=lp.device)
    parent, depth, bits = (torch.empty(b, n, dtype=torch.long, device=lp.device) for _ in range(3))
    rows = triton.next_power_of_2(n)
    _tree_kernel[(b,)](lp, tok, seed, seed.stride(0), nodes, parent, depth, bits, D=D, K=K, N=n, ROWS=rows,
                       FRONT=triton.next_power_of_2(2 * n), num_warps=1)
    return nodes, parent, depth, bits


if triton is not None:

    @triton.jit
    def _pick(values, idx, at):
        """values[at] (a scalar) of a register vector."""
        return tl.sum(tl.where(idx == at, values, 0), 0)

    @triton.jit
    def _push(f_val, f_live, f_dep, f_rank, f_par, f_idx, pushed, on, v, d, rank, parent):
        """Append a candidate (value v: child `rank` at depth d under row `parent`) to the frontier if `on`."""
        slot = (f_idx == pushed) & on
        return (tl.where(slot, v, f_val), tl.where(slot, 1, f_live), tl.where(slot, d, f_dep),
                tl.where(slot, rank, f_rank), tl.where(slot, parent, f_par), pushed + on.to(tl.int32))

    @triton.jit
    def _place(cum, par, dep, tok, bits, r_idx, row, on, c, parent, depth, token):
        """Write row `row` (cumulative log-prob c, under `parent`, at `depth`, drafting `token`) if `on`."""
        here = (r_idx == row) & on
        b_row = _pick(bits, r_idx, parent) | (tl.full([], 1, tl.int64) << row)
        return (tl.where(here, c, cum), tl.where(here, parent, par), tl.where(here, depth, dep),
                tl.where(here, token, tok), tl.where(here, b_row, bits))

    @triton.jit
    def _tree_kernel(LP, TOK, SEED, stride_seed, NODES, PARENT, DEPTH, BITS, D: tl.constexpr, K: tl.constexpr,
                     N: tl.constexpr, ROWS: tl.constexpr, FRONT: tl.constexpr):
        # One sequence: rows (root = 0) and a frontier of candidates (depth, rank, parent row, value, live); a
        # pop takes the lowest live slot (the first pushed) of the largest value, -inf included: heapq's pop.
        s = tl.program_id(0)
        lp_row = LP + s * D * K
        tok_row = TOK + s * D * K
        r_idx = tl.arange(0, ROWS)
        f_idx = tl.arange(0, FRONT)
        cum = tl.zeros([ROWS], tl.float64)
        par = tl.zeros([ROWS], tl.int64)
        dep = tl.zeros([ROWS], tl.int64)
        tok = tl.zeros([ROWS], tl.int64)
        bits = tl.where(r_idx == 0, 1, 0).to(tl.int64)
        f_val = tl.full([FRONT], float("-inf"), tl.float64)
        f_dep = tl.zeros([FRONT], tl.int32)
        f_rank = tl.zeros([FRONT], tl.int32)
        f_par = tl.zeros([FRONT], tl.int32)
        f_live = tl.zeros([FRONT], tl.int32)
        L = tl.load(SEED + s * stride_seed).to(tl.int32)
        pushed = 0
        # the top-1 chain to depth L: row d + 1 at depth d + 1, under row d; its rank-1 siblings go to the frontier
        for d in tl.static_range(D):
            on = d < L
            row = d + 1
            base = _pick(cum, r_idx, d)
            cum, par, dep, tok, bits = _place(cum, par, dep, tok, bits, r_idx, row, on,
                                              base + tl.load(lp_row + d * K), d, d + 1, tl.load(tok_row + d * K))
            if K > 1:
                f_val, f_live, f_dep, f_rank, f_par, pushed = _push(
                    f_val, f_live, f_dep, f_rank, f_par, f_idx, pushed, on, base + tl.load(lp_row + d * K + 1), d, 1, d)
        # below the chain: its last row's first child (the root's, for L = 0)
        kid = L < D
        f_val, f_live, f_dep, f_rank, f_par, pushed = _push(
            f_val, f_live, f_dep, f_rank, f_par, f_idx, pushed, kid,
            _pick(cum, r_idx, L) + tl.load(lp_row + L * K, mask=kid, other=0.0), L, 0, L)
        # best-first after the chain: pop the best candidate, push its next sibling and its first child
        for row in tl.static_range(1, N):
            grow = row > L  # rows 1..L are the chain's
            live = f_live != 0
            best = tl.max(tl.where(live, f_val, float("-inf")), 0)
            j = tl.min(tl.where(live & (f_val == best), f_idx, FRONT), 0)
            v = _pick(f_val, f_idx, j)
            d = _pick(f_dep, f_idx, j)
            rank = _pick(f_rank, f_idx, j)
            p = _pick(f_par, f_idx, j)
            f_live = tl.where((f_idx == j) & grow, 0, f_live)
            cum, par, dep, tok, bits = _place(cum, par, dep, tok, bits, r_idx, row, grow, v, p, d + 1,
                                              tl.load(tok_row + d * K + rank))
            base = _pick(cum, r_idx, p)  # the parent's cumulative log-prob
            sib = (rank + 1 < K) & grow
            f_val, f_live, f_dep, f_rank, f_par, pushed = _push(
                f_val, f_live, f_dep, f_rank, f_par, f_idx, pushed, sib,
                base + tl.load(lp_row + d * K + rank + 1, mask=sib, other=0.0), d, rank + 1, p)
            kid = (d + 1 < D) & grow
            f_val, f_live, f_dep, f_rank, f_par, pushed = _push(
                f_val, f_live, f_dep, f_rank, f_par, f_idx, pushed, kid,
                v + tl.load(lp_row + (d + 1) * K, mask=kid, other=0.0), d + 1, 0, row)
        out = s * N + r_idx
        ok = r_idx < N
        tl.store(PARENT + out, par, mask=ok)
        tl.store(DEPTH + out, dep, mask=ok)
        tl.store(BITS + out, bits, mask=ok)
        tl.store(NODES + s * (N - 1) + r_idx - 1, tok, mask=ok & (r_idx > 0))
