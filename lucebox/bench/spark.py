"""`python -m lucebox bench spark`: Spark expert offload, placement against placement, on the same prompts.

Two traffic kinds: conversation (`--conversation`, default MT-Bench) and code (`--code`, default the
HumanEval-style prompts and SWE-bench issues). Each kind's first `--prompts` conversations calibrate a
profile (counts from prefill and `--gen-len` decoded tokens on the all-device model, written and read back
as `spark calibrate` does); the next `--prompts` are the evaluation prompts. Then, at every budget of
`--budgets` (the experts' device bytes, ring included), on the conversation evaluation prompts, batch 1,
greedy: all-device (the plain engine, CUDA graphs on), uniform placement, calibrated, calibrated + a ring of
`--ring` slots per layer (these eagerly), and calibrated + ring with the graph-resident decode (`+graphs`,
spark/engine.py; CUDA graphs on a GPU, its sync-free step eagerly on the CPU); and at the middle budget,
calibrated + ring (graph-resident where spark.engine.graphs_on says: on CUDA) with each kind's profile on each kind's
prompts (a profile trained on one kind evaluated on the other). Per row: TTFT, decode tok/s (and as a share
of all-device), the cold-hit rate of the decode steps and of the whole request, the rate the calibration
counts predicted for the placement (in-sample here: the bench holds nothing out of calibration, its
evaluation prompts are the held-out ones), copies per second, CPU-computed experts, the share of a `+graphs`
row's decode steps replayed after copying in the cold experts they routed to (`refetch`) or run again eagerly
(`redo`; its decode cold-hit rate counts those eager steps only, the replays' routing never reaching the
host), the greedy tokens' agreement with all-device (1.0 in fp32; bf16 on a GPU may flip near ties), and on
CUDA the device memory the row held at its peak and the KV context the --gpu-memory cap leaves (kv_room).

Random weights route uniformly: `--router-skew zipf:S` biases the router logits to a Zipf popularity of
exponent S (lucebox/engine/spark/simulate.py); rows measured under it are labelled SIMULATION (table title,
JSON `simulation`). `--shape` benchmarks a random-weight qwen3moe (or a qwen35moe hybrid: qwen3.5-35b-a3b) of a
real model's shape (Q4_K_M blocks, tokenizer from --model) instead of --model itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from lucebox.bench.report import environment, print_table, write_json
from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.engine.spark.calibrate import profile_body, render
from lucebox.engine.spark.engine import SparkConfig, spark_engine
from lucebox.engine.spark.placement import Budget
from lucebox.engine.spark.profile import RouteCounter, moe_layers, write_profile
from lucebox.engine.spark.simulate import apply_router_skew, parse_skew
from lucebox.engine.spark.traffic import read_traffic
from lucebox.errors import LuceboxError


@dataclasses.dataclass(frozen=True)
class MoeShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    expert_ff: int


SHAPES = {  # Qwen3-30B-A3B's published config.json, and a small one
    "qwen3-30b-a3b": MoeShape(2048, 48, 32, 4, 128, 128, 8, 768),
    "tiny-moe": MoeShape(256, 4, 4, 2, 64, 16, 2, 256),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def traffic_prompts(files: list[Path], n: int) -> list[list[dict[str, str]]]:
    """Up to `n` conversations from `files`, taken in turn from each file so every file is represented."""
    convs = [read_traffic(f).conversations for f in files]
    out: list[list[dict[str, str]]] = []
    for i in range(max(len(c) for c in convs)):
        out.extend(c[i] for c in convs if i < len(c))
    return out[:n]


def kv_room(engine: LLMEngine, gpu_memory: float | None) -> dict[str, Any]:
    """The device memory a row held at its peak (CUDA: weights, expert slots, KV pool, activations, graphs) and
    the KV context the --gpu-memory cap leaves for one sequence beside it: the tokens of its KV pool plus what
    the rest of the cap holds at the model's bytes per token. None where there is no CUDA cap."""
    from lucebox.engine.runtime import memory_plan
    from lucebox.engine.runtime.kv_cache import KVCache

    if engine.device.type != "cuda":
        return {"peak_gib": None, "kv_tokens_fit": None}
    peak = torch.cuda.max_memory_allocated(engine.device)
    if gpu_memory is None:
        return {"peak_gib": peak / memory_plan.GB, "kv_tokens_fit": None}
    per_token = KVCache.bytes_per_token(engine.model_config, engine.loaded.dtype, engine.kv_dtype)
    pool = engine.kv.pool.num_blocks * engine.kv.block_size
    room = max(int(gpu_memory * memory_plan.GB) - peak, 0)
    return {"peak_gib": peak / memory_plan.GB, "kv_tokens_fit": pool + room // per_token}


def measure(engine: LLMEngine, spark: Any, prompts: list[list[int]], gen_len: int,
            gpu_memory: float | None = None) -> dict[str, Any]:
    """Each prompt alone, greedy: TTFT, decode tok/s, the offload's counters over decode and overall, and the
    device memory held (kv_room)."""
    params = SamplingParams(max_tokens=gen_len, ignore_eos=True)
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)
    engine.generate([prompts[0]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    if spark is not None:
        spark.stats.reset()
    ttfts, decode_s, decode_tokens = [], 0.0, 0
    dec = {"routed": 0, "cold": 0}
    outputs = []
    start = time.perf_counter()
    for ids in prompts:
        t = time.perf_counter()
        stream = engine.stream(ids, params)
        out = [next(stream)]
        _sync(engine.device)
        first = time.perf_counter()
        ttfts.append(first - t)
        before = (spark.stats.routed, spark.stats.cold) if spark is not None else (0, 0)
        out.extend(stream)
        _sync(engine.device)
        decode_s += time.perf_counter() - first
        decode_tokens += len(out) - 1
        if spark is not None:
            dec["routed"] += spark.stats.routed - before[0]
            dec["cold"] += spark.stats.cold - before[1]
        outputs.append(out)
    wall = time.perf_counter() - start
    row: dict[str, Any] = {"ttft_ms": 1000 * float(np.mean(ttfts)), "decode_tok_s": decode_tokens / max(decode_s, 1e-9),
                           "decode_tokens": decode_tokens, "outputs": outputs, **kv_room(engine, gpu_memory)}
    if spark is not None:
        s = spark.stats
        row.update(decode_cold_hit_rate=dec["cold"] / dec["routed"] if dec["routed"] else 0.0,
                   cold_hit_rate=s.cold_hit_rate, copies_per_s=s.copies / wall, cpu_experts=s.cpu_experts,
                   cpu_expert_s=s.cpu_seconds, ring_hits=s.ring_hits, graph_steps=s.graph_steps, redos=s.redos,
                   refetches=s.refetches,
                   predicted_cold_hit_rate=spark.info[
                       "predicted_cold_hit_rate"], hot_experts=spark.info["hot_experts"])
    return row


def agreement(ours: list[list[int]], ref: list[list[int]]) -> float:
    """Greedy tokens equal to the all-device ones before the first difference, over all reference tokens
    (1.0 in fp32 on the CPU; bf16 on a GPU sums in other orders, so a near tie can flip)."""
    same = 0
    for a, b in zip(ours, ref):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same += n
    return same / max(sum(map(len, ref)), 1)


def main(args: argparse.Namespace) -> int:
    from lucebox.chat.prompt import PromptBuilder
    from lucebox.data import data_dir
    from lucebox.fetch import resolve_model

    skew = parse_skew(args.router_skew, getattr(args, "tensor_parallel", None))
    budgets = [Budget.parse(b) for b in args.budgets.split(",") if b.strip()]
    if not budgets:
        raise LuceboxError("--budgets needs at least one budget")
    if args.prompts < 1 or args.gen_len < 2:
        raise LuceboxError("--prompts must be >= 1 and --gen-len >= 2")
    data = data_dir(args.data_dir)
    conv_files = args.conversation or [data / "prompts" / "mt_bench.jsonl"]
    code_files = args.code or [data / "prompts" / "bench_he.jsonl", data / "swe_bench_verified.parquet"]
    kinds = {"conversation": traffic_prompts(conv_files, 2 * args.prompts),
             "code": traffic_prompts(code_files, 2 * args.prompts)}
    for kind, convs in kinds.items():
        if len(convs) < 2:
            raise LuceboxError(f"the {kind} traffic has {len(convs)} conversation(s); it needs 2 (calibrate, evaluate)")
    with tempfile.TemporaryDirectory(prefix="lucebox-spark-") as tmp:
        path = resolve_model(args.model)
        if args.shape is not None:
            from lucebox.bench.random_models import HYBRID_SHAPES, write_random_hybrid_gguf

            hybrids = {k: v for k, v in HYBRID_SHAPES.items() if v.n_experts}
            if args.shape not in SHAPES and args.shape not in hybrids:
                raise LuceboxError(f"unknown --shape {args.shape!r} (choose from {', '.join([*SHAPES, *hybrids])})")
            if not path.is_file():
                raise LuceboxError(f"--shape takes the tokenizer of --model, a GGUF file; {path} is not one")
            context = args.prompt_len + args.gen_len + 256
            if args.shape in hybrids:
                path = write_random_hybrid_gguf(Path(tmp) / "random-moe.gguf", hybrids[args.shape], path, args.mix,
                                                context=context)
            else:
                path = write_random_moe_gguf(Path(tmp) / "random-moe.gguf", SHAPES[args.shape], path, args.mix,
                                             context=context)
        return run(args, path, Path(tmp), kinds, budgets, skew, PromptBuilder)


def run(args: argparse.Namespace, path: Path, tmp: Path, kinds: dict[str, list[Any]], budgets: list[Budget],
        skew: float | None, builder_cls: Any) -> int:
    device = EngineConfig(device=args.device).resolve_device()
    # the same weights in every row: on CUDA Spark keeps GGUF blocks quantized, so the all-device row does too
    weights = "quantized" if args.weights == "auto" and device.type == "cuda" else args.weights
    econf = EngineConfig(device=args.device, dtype=args.dtype, weights=weights, max_num_seqs=1,
                         kv_tokens=args.prompt_len + args.gen_len + 64, gpu_memory=args.gpu_memory)
    base = LLMEngine.from_path(path, econf, quiet=True)
    if skew is not None:
        apply_router_skew(base.loaded.model, skew, base.loaded.dtype)
    builder = builder_cls.for_model(base.loaded)
    limit = min(args.prompt_len, base.n_ctx - args.gen_len - 1)
    split = {k: ([render(builder, base.tokenizer, c, limit) for c in convs[:len(convs) // 2]],
                 [render(builder, base.tokenizer, c, limit) for c in convs[len(convs) // 2:]])
             for k, convs in kinds.items()}
    # calibration on the all-device model, one profile per kind (written and read as `spark calibrate` does)
    profiles = {}
    counter = RouteCounter(moe_layers(base.loaded.model), base.loaded.device)
    counter.attach()
    for kind, (calib, _) in split.items():
        base.generate(calib, SamplingParams(max_tokens=args.gen_len, ignore_eos=True))
        counts = {"train": counter.take(), "heldout": {}}
        body = profile_body(base.loaded, [{"file": kind, "conversations": len(calib),
                                           "tokens": sum(map(len, calib))}], counts, budgets[0],
                            SimpleNamespace(decode_tokens=args.gen_len - 1, heldout_every=0,
                                            max_prompt_tokens=args.prompt_len), skew)
        profiles[kind] = tmp / f"{kind}.profile.json"
        write_profile(profiles[kind], body)
    counter.detach()
    conv_eval = split["conversation"][1]
    rows: list[dict[str, Any]] = []
    ref = measure(base, None, conv_eval, args.gen_len, args.gpu_memory)
    rows.append({"config": "all-device", "budget": "100%", "ring": 0, "profile": None, "eval": "conversation", **ref})
    del base, counter
    _free()

    def offloaded(config: str, budget: Budget, ring: int, profile: str | None, kind: str,
                  graphs: bool | None = False) -> None:
        scfg = SparkConfig(profile=profiles[profile] if profile else None, budget=str(budget), ring=ring,
                           cpu_rows=args.cpu_rows, placement="calibrated" if profile else "uniform", ring_fit=True,
                           graphs=graphs)
        engine, spark = spark_engine(path, econf, scfg, quiet=True)
        if skew is not None:
            apply_router_skew(engine.loaded.model, skew, engine.loaded.dtype)
        row = measure(engine, spark, split[kind][1], args.gen_len, args.gpu_memory)
        row.update(config=config + ("+graphs" if engine.runner.guard is not None else ""), budget=str(budget),
                   ring=spark.info["ring_slots_per_layer"], profile=profile, eval=kind)
        if kind == "conversation":
            row["token_agreement"] = agreement(row["outputs"], ref["outputs"])
        rows.append(row)
        del engine, spark
        _free()

    for budget in budgets:
        offloaded("uniform", budget, 0, None, "conversation")
        offloaded("calibrated", budget, 0, "conversation", "conversation")
        offloaded("calibrated+ring", budget, args.ring, "conversation", "conversation")
        offloaded("calibrated+ring", budget, args.ring, "conversation", "conversation", graphs=True)
    middle = budgets[len(budgets) // 2]
    for profile, kind in (("code", "code"), ("code", "conversation"), ("conversation", "code")):
        offloaded("calibrated+ring", middle, args.ring, profile, kind, graphs=None)
    report(args, path, rows, skew, ref["decode_tok_s"])
    return 0


def report(args: argparse.Namespace, path: Path, rows: list[dict[str, Any]], skew: float | None,
           all_device_tok_s: float) -> None:
    sim = f"SIMULATION: router logits biased to zipf:{skew:g} popularity" if skew is not None else None
    arch = "qwen35moe" if args.shape and "qwen3.5" in args.shape else "qwen3moe"
    model = f"random {args.shape}-shaped {arch} ({args.mix})" if args.shape else str(path)
    title = f"bench spark: {model}" + (f" [{sim}]" if sim else "") + ", batch 1, greedy"
    cols = ["config", "budget", "ring", "profile", "eval", "ttft ms", "decode tok/s", "% all-dev", "cold-hit dec",
            "cold-hit all", "predicted", "copies/s", "cpu experts", "refetch", "redo", "agree", "peak GiB", "KV fits"]
    table = []
    for r in rows:
        pct = 100 * r["decode_tok_s"] / all_device_tok_s if all_device_tok_s else None
        table.append([r["config"], r["budget"], r["ring"], r["profile"], r["eval"], r["ttft_ms"], r["decode_tok_s"],
                      pct, _pct(r.get("decode_cold_hit_rate")), _pct(r.get("cold_hit_rate")),
                      _pct(r.get("predicted_cold_hit_rate")), r.get("copies_per_s"), r.get("cpu_experts"),
                      _pct(_share(r, "refetches")), _pct(_share(r, "redos")), _pct(r.get("token_agreement")),
                      r.get("peak_gib"), r.get("kv_tokens_fit")])
    print_table(title, cols, table)
    device = EngineConfig(device=args.device).resolve_device()
    write_json(args.json, {"benchmark": "spark", "simulation": sim, "model": model, "shape": args.shape,
                           "prompts": args.prompts, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
                           "environment": environment(device),
                           "rows": [{k: v for k, v in r.items() if k != "outputs"} for r in rows]})


def _share(row: dict[str, Any], key: str) -> float | None:
    """The share of a graph-resident row's decode steps replayed after a copy (`refetches`) or run again
    eagerly (`redos`): steps that routed to a cold expert."""
    steps = row.get("graph_steps", 0) + row.get("redos", 0)
    return row[key] / steps if steps else None


def _pct(v: float | None) -> str | None:
    return None if v is None else f"{100 * v:.1f}%"


def write_random_moe_gguf(path: Path, shape: MoeShape, tokenizer_gguf: Path, mix: str, context: int) -> Path:
    """A qwen3moe GGUF of `shape` with random blocks in quant mix `mix` (bench.random_models' random_blocks and
    mix_qtype) and the tokenizer of `tokenizer_gguf`; one random matrix per distinct (shape, type), shared."""
    import gguf

    from lucebox.bench.random_models import add_tokenizer, mix_qtype, random_blocks

    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(f"random {path.stem}")
    w.add_context_length(context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.expert_ff)
    w.add_expert_feed_forward_length(shape.expert_ff)
    w.add_expert_count(shape.n_experts)
    w.add_expert_used_count(shape.top_k)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    n_vocab = add_tokenizer(w, tokenizer_gguf)
    rng = np.random.default_rng(0)
    cache: dict[tuple[Any, ...], tuple[np.ndarray, Any]] = {}

    def add(name: str, shape_: tuple[int, ...], layer: int = 0, qtype: str | None = None) -> None:
        qtype = qtype or mix_qtype(mix, name.split(".")[-2].removesuffix("_exps"), layer, shape.layers)
        rows, cols = int(np.prod(shape_[:-1])), shape_[-1]
        if (shape_, qtype) not in cache:
            if qtype in ("F16", "F32"):
                data = rng.standard_normal((rows, cols), dtype=np.float32) / cols**0.5
                cache[shape_, qtype] = (data.astype(np.float16 if qtype == "F16" else np.float32).reshape(shape_),
                                        None)
            else:
                blocks = random_blocks(rows, cols, qtype, cols**-0.5, rng)
                cache[shape_, qtype] = (blocks.reshape(*shape_[:-1], -1), gguf.GGMLQuantizationType[qtype])
        data, raw = cache[shape_, qtype]
        w.add_tensor(name, data, raw_dtype=raw)

    ones = {n: np.ones(n, dtype=np.float32) for n in (shape.hidden, shape.head_dim)}
    q, kv, e, ff, h = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.n_experts, \
        shape.expert_ff, shape.hidden
    add("token_embd.weight", (n_vocab, h))
    for i in range(shape.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones[h])
        add(p + "attn_q.weight", (q, h), i)
        add(p + "attn_k.weight", (kv, h), i)
        add(p + "attn_v.weight", (kv, h), i)
        w.add_tensor(p + "attn_q_norm.weight", ones[shape.head_dim])
        w.add_tensor(p + "attn_k_norm.weight", ones[shape.head_dim])
        add(p + "attn_output.weight", (h, q), i)
        w.add_tensor(p + "ffn_norm.weight", ones[h])
        add(p + "ffn_gate_inp.weight", (e, h), i, "F32")
        add(p + "ffn_gate_exps.weight", (e, ff, h), i)
        add(p + "ffn_up_exps.weight", (e, ff, h), i)
        add(p + "ffn_down_exps.weight", (e, h, ff), i)
    w.add_tensor("output_norm.weight", ones[h])
    add("output.weight", (n_vocab, h))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
