"""`bench moe`: one MoE layer's routed experts alone, the grouped kernel against the per-pair gemvs.

For a --shape of bench spark (128 experts, top-8 for Qwen3-30B-A3B), gate and up in Q4_K and down in each of
--down types (a Q4_K_M file holds both), at each number of decode rows it times, in CUDA graphs as decode runs
them, `triton_moe.moe_experts` on the grouped kernel (PAIR_ROWS 0) and on one int8-activation gemv per (row,
expert) pair (triton_qmm.pair_gemv), both in the same run, with random routing. Weight bandwidth counts the
routed experts' bytes once per step (what either path must read at least), and its fraction of a copy-bandwidth
measurement made in the same run. `err` is the pair path's relative difference from the grouped path (int8
activations against bf16 dots). Rows above 64 (prefill chunks, which take the grouped kernel only with
LUCEBOX_MOE_MAX_ROWS raised) time the grouped kernel alone, with its TFLOP/s. Random blocks with finite scales: the
kernels' speed does not depend on them.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from lucebox.bench.report import environment, print_table, write_json
from lucebox.errors import LuceboxError

DOWN_TYPES = ("Q4_K", "Q6_K", "Q8_0")
MAX_ROWS = 8192  # prefill chunks: the grouped kernel alone (the per-pair gemvs are timed up to PAIR_MAX rows)
PAIR_MAX = 64


def _rows(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        values = []
    if not values or any(v < 1 or v > MAX_ROWS for v in values):
        raise LuceboxError(f"bench moe: --rows takes a comma-separated list of 1..{MAX_ROWS}, not {text!r}")
    return values


def main(args: argparse.Namespace) -> int:
    from lucebox.bench.spark import SHAPES

    if args.shape not in SHAPES:
        raise LuceboxError(f"bench moe: unknown --shape {args.shape!r} (choose from {', '.join(SHAPES)})")
    downs = [t for t in args.down.split(",") if t]
    if not downs or any(t not in DOWN_TYPES for t in downs):
        raise LuceboxError(f"bench moe: --down takes {', '.join(DOWN_TYPES)}, not {args.down!r}")
    rows = _rows(args.rows)
    if not torch.cuda.is_available():
        raise LuceboxError("bench moe times the CUDA kernels: this machine has no CUDA device")
    return run(args, SHAPES[args.shape], downs, rows, torch.device("cuda"))


def run(args: argparse.Namespace, shape: Any, downs: list[str], rows_list: list[int], device: torch.device) -> int:
    """The measurements (CUDA; tests run it on the CPU under Triton's interpreter with the timer stubbed)."""
    try:
        from lucebox.engine.kernels import triton_moe, triton_qmm
    except ImportError as e:
        raise LuceboxError(f"bench moe needs triton ({e})") from None
    import triton.testing

    from lucebox.bench.decode import copy_bandwidth
    from lucebox.engine.weights.quant.qtensor import row_bytes

    copy_bw = copy_bandwidth(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter's dots want fp32
    e, k, h, ff = shape.n_experts, shape.top_k, shape.hidden, shape.expert_ff
    gen = torch.Generator(device="cpu").manual_seed(0)
    gate = triton_qmm.random_weight("Q4_K", e * ff, h, device, dtype)
    up = triton_qmm.random_weight("Q4_K", e * ff, h, device, dtype)
    table: list[list[Any]] = []
    results: list[dict[str, Any]] = []
    saved = triton_moe.PAIR_ROWS
    try:
        for dq in downs:
            down = triton_qmm.random_weight(dq, e * h, ff, device, dtype)
            per_expert = 2 * ff * row_bytes("Q4_K", h) + h * row_bytes(dq, ff)
            for t in rows_list:
                x = torch.randn(t, h, generator=gen).to(device=device, dtype=dtype)
                ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(device)
                weights = torch.softmax(torch.randn(t, k, generator=gen), -1).to(device=device, dtype=dtype)
                routed = ids.unique().numel()
                times, outs = {}, {}
                paths = (("grouped", 0), ("pair", PAIR_MAX)) if t <= PAIR_MAX else (("grouped", 0),)
                for path, pair_rows in paths:
                    triton_moe.PAIR_ROWS = pair_rows

                    def call(x: torch.Tensor = x, weights: torch.Tensor = weights, ids: torch.Tensor = ids,
                             down: Any = down) -> torch.Tensor:
                        return triton_moe.moe_experts(x, weights, ids, e, gate, up, down)

                    outs[path] = call().float()
                    times[path] = triton.testing.do_bench_cudagraph(call, rep=30)
                pair = "pair" in times
                err = ((outs["pair"] - outs["grouped"]).norm() / outs["grouped"].norm()).item() if pair else None
                gbs = {p: routed * per_expert / (ms * 1e-3) / 1e9 for p, ms in times.items()}
                best = "pair" if pair else "grouped"
                frac = gbs[best] * 1e9 / copy_bw if copy_bw else None
                # 2 x 3 matmuls of hidden x ff per (row, expert) pair: prefill chunks are compute, not bandwidth
                tflops = 6 * t * k * h * ff / (min(times.values()) * 1e-3) / 1e12
                pair_us = times["pair"] * 1e3 if pair else None
                speedup = times["grouped"] / times["pair"] if pair else None
                table.append([dq, t, routed, times["grouped"] * 1e3, pair_us, gbs["grouped"], gbs.get("pair"),
                              frac, tflops, speedup, err])
                results.append({"down": dq, "rows": t, "routed_experts": routed, "grouped_us": times["grouped"] * 1e3,
                                "pair_us": pair_us, "grouped_gb_s": gbs["grouped"],
                                "pair_gb_s": gbs.get("pair"), "best_of_copy_bw": frac, "best_tflop_s": tflops,
                                "speedup": speedup, "relative_difference": err})
                print(f"bench moe: down {dq} rows {t} done", flush=True)
    finally:
        triton_moe.PAIR_ROWS = saved
    env = environment(device)
    bw = f"; copy bandwidth {copy_bw / 1e9:,.0f} GB/s" if copy_bw else ""
    title = (f"bench moe: {args.shape} routed experts ({e} experts, top-{k}, gate/up Q4_K) on "
             f"{env.get('gpu', device)} (CUDA graphs){bw}")
    print_table(title, ["down", "rows", "experts", "grouped us", "pair us", "grouped GB/s", "pair GB/s", "of copy BW",
                        "TFLOP/s", "pair vs grouped", "err"], table)
    write_json(args.json, {"benchmark": "moe", "shape": args.shape, "env": env, "pair_rows_default": saved,
                           "pair_config": {q: list(c) for q, c in triton_qmm.PAIR_CONFIG.items()},
                           "copy_bandwidth_gb_s": copy_bw / 1e9 if copy_bw else None, "results": results})
    return 0
