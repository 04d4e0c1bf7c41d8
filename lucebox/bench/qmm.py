"""`bench qmm`: the quantized matmul kernels alone, on a model shape's weight matrices.

For each quant type, matrix and number of activation rows it times (in a CUDA graph, as decode runs them) the
best correct launch config of the float kernels and of the int8-activation kernels, the tuner's two families
(engine/kernels/triton_qmm.py), and cuBLAS on a dense bf16 weight of the same shape in the same run, the
baseline a dense model would run. Weight bandwidth is the quantized bytes over the best time, and its fraction
of a copy-bandwidth measurement made in the same run. Random blocks with finite scales: the kernels' speed does
not depend on the values.

`--sweep`: at one activation row, also every int8-gemv config of a wider grid (`sweep_configs`: ~60 per type,
compiled and checked like the tuner's), reporting the fastest beside the tuner's best: how stop 34 found the Q4_K
configs the tuner now tries. Slow (minutes; Q6_K's kernel compiles ~2.5 s a config).
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch

from lucebox.bench.report import environment, print_table, write_json
from lucebox.errors import LuceboxError

TYPES = ("Q4_K", "Q6_K", "Q8_0")
MAX_ROWS = 32  # triton_qmm.SMALL_MAX (not imported: the argument check runs where triton is not installed)


def matrices(shape_name: str, vocab: int) -> list[tuple[str, int, int]]:
    """(name, out rows, in columns) of the distinct weight matrices of a dense --shape (bench decode's names):
    q, k/v, o, gate|up (fused, as the engine holds it), down and the LM head."""
    from lucebox.bench.pflash import SHAPES

    if shape_name not in SHAPES:
        raise LuceboxError(f"bench qmm: unknown --shape {shape_name!r} (choose from {', '.join(SHAPES)})")
    s = SHAPES[shape_name]
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return [("attn_q", q, s.hidden), ("attn_k / attn_v", kv, s.hidden), ("attn_output", s.hidden, q),
            ("ffn_gate|up", 2 * s.ffn, s.hidden), ("ffn_down", s.hidden, s.ffn), ("output", vocab, s.hidden)]


def sweep_configs(qtype: str) -> list[tuple]:
    """The int8 gemv launch configs `--sweep` tries: (BN, NB, warps, split, "q8x") with BN * NB (row, super-block)
    pairs a step (each spread over 8 threads for Q4_K, 4 for Q6_K), at least 8 per warp and at most 128."""
    grid = itertools.product((1, 2, 4, 8, 16), (2, 4, 8, 16), (1, 2, 4), (1, 2))
    return [(bn, nb, warps, split, "q8x") for bn, nb, warps, split in grid if 8 * warps <= bn * nb <= 128]


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        values = []
    if not values or any(v < 1 or v > MAX_ROWS for v in values):
        raise LuceboxError(f"bench qmm: --rows takes a comma-separated list of 1..{MAX_ROWS}, not {text!r}")
    return values


def main(args: argparse.Namespace) -> int:
    types = [t for t in args.types.split(",") if t]
    if not types or any(t not in TYPES for t in types):
        raise LuceboxError(f"bench qmm: --types takes {', '.join(TYPES)}, not {args.types!r}")
    rows_list = _ints(args.rows)
    mats = matrices(args.shape, args.vocab)
    if not torch.cuda.is_available():
        raise LuceboxError("bench qmm times the CUDA kernels: this machine has no CUDA device")
    return run(args, types, rows_list, mats, torch.device("cuda"))


def run(args: argparse.Namespace, types: list[str], rows_list: list[int], mats: list[tuple[str, int, int]],
        device: torch.device) -> int:
    """The measurements (CUDA; tests run it on the CPU under Triton's interpreter with the timer stubbed)."""
    try:
        from lucebox.engine.kernels import triton_qmm
    except ImportError as e:
        raise LuceboxError(f"bench qmm needs triton ({e})") from None
    import triton.testing

    from lucebox.bench.decode import copy_bandwidth

    copy_bw = copy_bandwidth(device)
    sweep = bool(getattr(args, "sweep", False))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter's dots want fp32
    rows: list[list[Any]] = []
    results: list[dict[str, Any]] = []
    for name, n, k in mats:
        xs = {m: torch.randn(m, k, device=device, dtype=dtype) for m in rows_list}
        dense = torch.randn(n, k, device=device, dtype=dtype) * k**-0.5
        timer = triton.testing.do_bench_cudagraph
        baseline = {m: timer(lambda x=x, d=dense: torch.mm(x, d.T), rep=20) for m, x in xs.items()}
        del dense
        for qtype in types:
            w = triton_qmm.random_weight(qtype, n, k, device, dtype)
            for m, x in xs.items():
                timed = triton_qmm.time_candidates(x, w, triton_qmm.candidates(qtype, m))
                flt = min((t for c, t in timed if len(c) == 4), default=None)
                int8 = min((t for c, t in timed if len(c) == 5 and c[-1] == "q8x"), default=None)
                cublas = baseline[m]
                best = min(t for t in (flt, int8) if t is not None) if timed else None
                gbs = w.data.numel() / (best * 1e-3) / 1e9 if best else None
                row = [name, qtype, f"{n}x{k}", m, flt and flt * 1e3, int8 and int8 * 1e3, cublas * 1e3, gbs,
                       gbs * 1e9 / copy_bw if gbs and copy_bw else None, cublas / best if best else None]
                result = {"matrix": name, "qtype": qtype, "n": n, "k": k, "rows": m,
                          "float_us": flt and flt * 1e3, "int8_us": int8 and int8 * 1e3,
                          "cublas_bf16_us": cublas * 1e3, "weight_gb_s": gbs,
                          "configs": [{"config": list(c), "us": t * 1e3} for c, t in timed]}
                if sweep:
                    tried = {c for c, _ in timed}
                    wide = [] if m > 1 or qtype not in triton_qmm.Q8X_CANDIDATES else triton_qmm.time_candidates(
                        x, w, [c for c in sweep_configs(qtype) if c not in tried])
                    top = min(wide, key=lambda ct: ct[1], default=None)
                    row += [top and top[1] * 1e3, top and "/".join(map(str, top[0][:4]))]
                    result["sweep"] = top and {"config": list(top[0]), "us": top[1] * 1e3}
                rows.append(row)
                results.append(result)
                print(f"bench qmm: {name} {qtype} {n}x{k} rows {m} done", flush=True)
            del w
    env = environment(device)
    title = (f"bench qmm: {args.shape} matrices on {env.get('gpu', device)} (CUDA graphs)"
             f"{f'; copy bandwidth {copy_bw / 1e9:,.0f} GB/s' if copy_bw else ''}")
    print_table(title, ["matrix", "type", "shape", "rows", "float us", "int8 us", "bf16 cuBLAS us", "weight GB/s",
                        "of copy BW", "vs bf16 cuBLAS"] + (["sweep best us", "its BN/NB/warps/split"] if sweep else []),
                rows)
    write_json(args.json, {"benchmark": "qmm", "shape": args.shape, "env": env,
                           "copy_bandwidth_gb_s": copy_bw / 1e9 if copy_bw else None, "results": results})
    return 0
