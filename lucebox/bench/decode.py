"""`python -m lucebox bench decode`: prefill and decode speed, this engine vs transformers.

Both run the same model file on the same device in the same process:
- prefill tok/s: one prompt of L tokens, time to its first sampled token;
- decode tok/s: B sequences (32-token prompts) generating `gen_len` tokens
  each, counting only the steps after every prefill is done.
transformers runs eager with its KV cache (`DynamicCache`), greedy, the way
`generate` does it, but timed around the same steps.

Each decode row also gives the weight bandwidth it achieved: the bytes of
every weight a decode step streams (quantized blocks as stored, dense weights,
the LM head; not the embedding, of which a step reads a few rows) times steps
per second, against a device-to-device copy measured in the same run (bytes
read plus written, as gpt-fast reports it). `--compare-dense` times the same
file again held dense in the model dtype (the pre-quantized-kernel path), in
the same process. `write_random_quant_gguf` writes random-weight GGUFs of real
shapes in any quant mix (e.g. a Qwen3-8B-shaped Q4_K_M) for such runs;
`--shape NAME [--mix Q4_K_M]` writes one to a temporary folder (qwen3, qwen3moe, and
the Qwen3.5 hybrids of bench/random_models.py, e.g. qwen3.5-27b, qwen3.5-35b-a3b;
the tokenizer comes from --model, a GGUF file) and benches it instead of --model.
`--peer-bench PATH` runs that llama-bench on the same file in the same run
(`-p 512 -n 128 -ngl 99 -fa 1 -o json`, after this engine has released the
device) and puts its pp512 / tg128 beside the prefill 512 and batch-1 decode
rows. Quantized kernels are tuned and checked for the model's shapes first
(engine/weights/quant/linear.warm_up), as a server's start-up would.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lucebox.bench import kernel_profile
from lucebox.bench.random_models import add_tokenizer, mix_qtype, random_blocks
from lucebox.bench.report import environment, print_table, write_json
from lucebox.engine.runtime.llm_engine import LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.engine.weights.quant import linear as quant_linear
from lucebox.progress import Progress

REPEATS = 3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def _median(fn: Callable[[], Any], device: torch.device) -> float:
    fn()  # warm-up (allocations, CUDA graph capture, kernel selection)
    return statistics.median(_timed(fn, device) for _ in range(REPEATS))


def _profile(path: Path, config: Any, device: torch.device, dtype: torch.dtype, weights: str, batch: int,
             steps: int) -> dict[str, Any]:
    """`--profile`: the file loaded again as before (held as `weights` says) in `config` without CUDA graphs or
    decoding one step ahead, so that every kernel launch is seen; `steps` decode steps at `batch` profiled."""
    from lucebox.engine.weights.loader import load_model

    gc.collect()  # the timed engine's reference cycles (runner, graphs): its weights and KV go first
    if device.type == "cuda":
        torch.cuda.empty_cache()
    eager = LLMEngine(load_model(path, device=device, dtype=dtype, quiet=True, weights=weights),
                      dataclasses.replace(config, cuda_graphs=False, ahead=False))
    return kernel_profile.profile_decode(eager, [_prompt(eager, 256, seed=2000 + i) for i in range(batch)], steps)


def _prompt(engine: LLMEngine, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    low = max(engine.tokenizer.special_ids | {0}) + 1 if engine.tokenizer.special_ids else 1
    return torch.randint(low, engine.model_config.vocab_size, (n,), generator=g).tolist()


def lucebox_prefill(engine: LLMEngine, ids: list[int]) -> None:
    engine.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))


def lucebox_decode(engine: LLMEngine, prompts: list[list[int]], gen_len: int) -> float:
    """Seconds spent in decode steps after all prefills finished."""
    seqs = [engine.add(p, SamplingParams(max_tokens=gen_len, ignore_eos=True)) for p in prompts]
    while any(s.num_output == 0 for s in seqs):
        engine.step()
    _sync(engine.device)
    t = time.perf_counter()
    while any(not s.is_finished for s in seqs):
        engine.step()
    _sync(engine.device)
    return time.perf_counter() - t


def hf_prefill(model: Any, ids: list[int], device: torch.device) -> None:
    with torch.no_grad():
        model(torch.tensor([ids], device=device), use_cache=True)


def hf_decode(model: Any, prompts: list[list[int]], gen_len: int, device: torch.device) -> float:
    from transformers import DynamicCache

    x = torch.tensor(prompts, device=device)
    with torch.no_grad():
        cache = DynamicCache()
        out = model(x, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        _sync(device)
        t = time.perf_counter()
        for _ in range(gen_len - 1):
            out = model(tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        _sync(device)
    return time.perf_counter() - t


def load_hf(path: Any, engine: LLMEngine) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=engine.loaded.dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=engine.loaded.dtype)
    return model.to(engine.device).eval()


def weight_bytes(model: torch.nn.Module, batch: int = 1) -> int:
    """Bytes of weights one decode step of `batch` rows streams: every linear (blocks as stored or dense), the
    LM head (the tied embedding counts once, as the head), norms; the embedding itself only gives a few rows.
    A MoE layer's routed experts count as the share a step reads under uniform routing: the expected number
    of distinct experts among batch x top-k picks, 1 - (1 - k/E)^batch of them (8 of 128 at batch 1). A weight
    held both ways (--weights both) counts the blocks or the dense copy, whichever serves `batch` rows."""
    routed: dict[int, float] = {}  # id of an expert stack's Linear -> its share
    for block in getattr(model, "blk", []):
        moe = getattr(block, "moe", None)
        if moe is not None:
            share = 1 - (1 - moe.top_k / moe.n_experts) ** batch
            routed.update({id(p): share for p in (moe.ffn_gate_exps, moe.ffn_up_exps, moe.ffn_down_exps)})
    total = 0.0
    tied = model.cfg.tie_word_embeddings  # type: ignore[union-attr]
    for name, m in model.named_modules():
        if name == "token_embd" and not tied:
            continue
        if getattr(m, "qtype", None) is not None:
            n = m.qdata.numel()
            if "qdense" in m._buffers:  # --weights both: the copy that serves this many rows
                from lucebox.engine.kernels.triton_qmm import dense_serves

                if dense_serves(batch, m.quant):
                    n = m.qdense.numel() * m.qdense.element_size()
        else:
            n = sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
        total += n * routed.get(id(m), 1.0)
    return int(total)


def held_as(model: torch.nn.Module) -> str:
    """How the loaded model holds its GGUF quant blocks: "both" (with dense copies), "quantized" or "dense"."""
    quant = [m for m in model.modules() if getattr(m, "qtype", None) is not None]
    if not quant:
        return "dense"
    return "both" if any("qdense" in m._buffers for m in quant) else "quantized"


def copy_bandwidth(device: torch.device, n_bytes: int = 1 << 30) -> float | None:
    """Device-to-device copy bandwidth in bytes/s (read + write), median of 10; None off CUDA."""
    if device.type != "cuda":
        return None
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * n_bytes / statistics.median(times)


PEER_ARGS = ["-p", "512", "-n", "128", "-ngl", "99", "-fa", "1", "-o", "json"]


def peer_bench(tool: Path, model_file: Path, timeout: float = 1800) -> dict[str, Any]:
    """Run llama-bench on `model_file` and read its JSON: a list of tests, each with n_prompt, n_gen and
    avg_ts (tok/s). Returns {"pp512": tok/s, "tg128": tok/s, "tests": [...]} (a missing test is None)."""
    cmd = [str(tool), "-m", str(model_file), *PEER_ARGS]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    tests = json.loads(proc.stdout[proc.stdout.index("["):])
    found: dict[str, Any] = {"pp512": None, "tg128": None}
    for t in tests:
        if t.get("n_prompt") == 512 and not t.get("n_gen"):
            found["pp512"] = float(t["avg_ts"])
        elif t.get("n_gen") == 128 and not t.get("n_prompt"):
            found["tg128"] = float(t["avg_ts"])
    return {**found, "tool": str(tool), "args": PEER_ARGS,
            "tests": [{k: t.get(k) for k in ("n_prompt", "n_gen", "avg_ts", "stddev_ts", "backends", "build_commit",
                                               "model_type", "n_gpu_layers", "flash_attn")} for t in tests]}


def _decode_cases(engine: LLMEngine, label: str, batch_sizes: list[int], gen: int, hf: Any, copy_bw: float | None,
                  rows: list[list[Any]], results: list[dict[str, Any]], progress: Progress) -> None:
    device = engine.device
    for b in batch_sizes:
        w_bytes = weight_bytes(engine.loaded.model, b)
        prompts = [_prompt(engine, 32, seed=1000 + i) for i in range(b)]
        ours = b * (gen - 1) / statistics.median(lucebox_decode(engine, prompts, gen) for _ in range(REPEATS))
        theirs = None
        if hf:
            hf_decode(hf, prompts, 4, device)  # warm-up
            theirs = b * (gen - 1) / statistics.median(hf_decode(hf, prompts, gen, device) for _ in range(REPEATS))
        gbs = w_bytes * ours / b / 1e9
        frac = gbs * 1e9 / copy_bw if copy_bw else None
        rows.append([f"decode batch {b}{label}", "tok/s", ours, theirs, ours / theirs if theirs else None, gbs, frac])
        results.append({"kind": "decode", "batch": b, "gen_len": gen, "weights": label.strip(" ()") or "as loaded",
                        "lucebox_tok_s": ours, "transformers_tok_s": theirs, "weight_bytes": w_bytes,
                        "weight_gb_s": gbs, "fraction_of_copy_bandwidth": frac})
        progress.advance()


def random_shapes() -> dict[str, Any]:
    """Every shape `--shape` takes: bench.pflash's (qwen3), bench.spark's (qwen3moe), bench.random_models'
    (qwen35, qwen35moe)."""
    from lucebox.bench.pflash import SHAPES as DENSE
    from lucebox.bench.random_models import HYBRID_SHAPES
    from lucebox.bench.spark import SHAPES as MOE

    return {**DENSE, **MOE, **HYBRID_SHAPES}


def write_random_model(path: Path, shape_name: str, tokenizer_gguf: Path, mix: str, context: int) -> Path:
    """The random-weight GGUF of a `random_shapes` shape in quant mix `mix`, with the tokenizer of
    `tokenizer_gguf` (padded to a Qwen3.5 shape's vocab)."""
    from lucebox.bench.random_models import HybridShape, write_random_hybrid_gguf
    from lucebox.bench.spark import MoeShape, write_random_moe_gguf
    from lucebox.errors import LuceboxError

    shapes = random_shapes()
    if shape_name not in shapes:
        raise LuceboxError(f"unknown --shape {shape_name!r} (choose from {', '.join(shapes)})")
    if tokenizer_gguf.is_dir() or tokenizer_gguf.suffix != ".gguf":
        raise LuceboxError(f"--shape takes the tokenizer of --model, a GGUF file; {tokenizer_gguf} is not one")
    shape = shapes[shape_name]
    if isinstance(shape, HybridShape):
        return write_random_hybrid_gguf(path, shape, tokenizer_gguf, mix, name=f"random {shape_name}",
                                        context=context)
    if isinstance(shape, MoeShape):
        return write_random_moe_gguf(path, shape, tokenizer_gguf, mix, context=context)
    return write_random_quant_gguf(path, shape, tokenizer_gguf, mix, name=f"random {shape_name}", context=context)


def main(args: argparse.Namespace) -> int:
    """With `--shape`, first write that random-weight model (to a temporary folder) and bench it instead."""
    if getattr(args, "shape", None) is None:
        return _run(args)
    import tempfile

    from lucebox.fetch import resolve_model

    context = max(4096, max(int(x) for x in args.prompt_lens.split(",") if x) + args.gen_len + 256)
    with tempfile.TemporaryDirectory(prefix="lucebox-decode-") as tmp:
        path = write_random_model(Path(tmp) / f"random-{args.shape}-{args.mix}.gguf", args.shape,
                                  resolve_model(args.model), args.mix, context)
        return _run(argparse.Namespace(**{**vars(args), "model": str(path)}))


def _run(args: argparse.Namespace) -> int:
    from lucebox.cli import engine_from_args

    prompt_lens = [int(x) for x in args.prompt_lens.split(",") if x]
    batch_sizes = [int(x) for x in args.batch_sizes.split(",") if x]
    step_tokens = getattr(args, "max_step_tokens", None) or max(prompt_lens + [2048])
    engine = engine_from_args(args, max_num_seqs=max(batch_sizes), max_step_tokens=step_tokens)
    device = engine.device
    compare = getattr(args, "compare_dense", False)
    hf = None if args.no_hf else load_hf(engine.loaded.path, engine)
    tuned = quant_linear.warm_up(engine.loaded.model)  # start-up: tune + check the quantized kernels (CUDA)
    if tuned:
        print(f"tuned the quantized kernels: {quant_linear.summary(tuned)}", flush=True)
    copy_bw = copy_bandwidth(device)
    rows: list[list[Any]] = []
    results: list[dict[str, Any]] = []
    progress = Progress("bench decode", total=len(prompt_lens) + len(batch_sizes) * (2 if compare else 1),
                        unit="cases")

    for n in prompt_lens:
        ids = _prompt(engine, n, seed=n)
        ours = n / _median(lambda ids=ids: lucebox_prefill(engine, ids), device)
        theirs = n / _median(lambda ids=ids: hf_prefill(hf, ids, device), device) if hf else None
        rows.append([f"prefill {n} tokens", "tok/s", ours, theirs, ours / theirs if theirs else None, None, None])
        results.append({"kind": "prefill", "tokens": n, "lucebox_tok_s": ours, "transformers_tok_s": theirs})
        progress.advance()

    gen = args.gen_len
    held = held_as(engine.loaded.model)
    _decode_cases(engine, {"dense": "", "quantized": " (quantized)", "both": " (quantized + dense)"}[held],
                  batch_sizes, gen, hf, copy_bw, rows, results, progress)
    title = (f"bench decode: {engine.model_config.name} ({engine.loaded.quant} file, {str(engine.loaded.dtype)[6:]}) "
             f"on {device}{' [CUDA graphs]' if engine.runner.uses_cuda_graphs else ''}"
             f"{f'; copy bandwidth {copy_bw / 1e9:,.0f} GB/s' if copy_bw else ''}")
    # the allocator's peak (weights, KV, activations, graph pools): what --gpu-memory caps, less the CUDA context
    peak = torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None
    if peak is not None:
        title += f"; peak device memory {peak:.2f} GiB"
    env, cuda_graphs, dtype = environment(device), engine.runner.uses_cuda_graphs, engine.loaded.dtype
    model_path = engine.loaded.path
    if compare:
        from lucebox.engine.weights.loader import load_model

        path, config = engine.loaded.path, engine.config
        del engine
        gc.collect()  # the engine holds reference cycles (runner, graphs): free its weights and KV now
        if device.type == "cuda":
            torch.cuda.empty_cache()
        dense = LLMEngine(load_model(path, device=device, dtype=dtype, quiet=True, weights="dense"), config)
        _decode_cases(dense, f" ({label_dense(dtype)})", batch_sizes, gen, None, copy_bw, rows, results, progress)
    progress.close()
    profiled = None
    if getattr(args, "profile", 0):
        config = (dense if compare else engine).config
        engine = dense = None  # free the device for the eager copy
        profiled = _profile(Path(model_path), config, device, dtype, held, batch_sizes[0], args.profile)
    peer = None
    if getattr(args, "peer_bench", None):
        engine = dense = None  # free the device for the peer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        peer = peer_bench(args.peer_bench, Path(model_path))
        title += f"; llama.cpp: {Path(args.peer_bench).name} {' '.join(PEER_ARGS)}"
    for row, res in zip(rows, results):
        theirs = None
        if peer and res["kind"] == "prefill" and res["tokens"] == 512:
            theirs = peer["pp512"]
        elif peer and res["kind"] == "decode" and res["batch"] == 1 and res["weights"] != label_dense(dtype):
            theirs = peer["tg128"]
        res["llama_cpp_tok_s"] = theirs
        row.insert(5, theirs)
        row.insert(6, row[2] / theirs if theirs else None)

    print_table(title, ["case", "unit", "lucebox", "transformers", "ratio", "llama.cpp", "vs llama.cpp",
                        "weight GB/s", "of copy BW"], rows)
    if profiled is not None:
        print_table(f"bench decode --profile: {profiled['steps']} eager decode steps at batch {profiled['batch']} "
                    f"on {profiled['device']}: {profiled['busy_us_per_step']:,.1f} us busy and "
                    f"{profiled['launches_per_step']:,.0f} launches a step", kernel_profile.COLUMNS,
                    kernel_profile.table_rows(profiled))
    write_json(args.json, {"benchmark": "decode", "model": str(model_path),
                           "dtype": str(dtype), "cuda_graphs": cuda_graphs, "env": env,
                           "copy_bandwidth_gb_s": copy_bw / 1e9 if copy_bw else None,
                           "peak_device_memory_gib": peak, "results": results,
                           "peer_bench": peer, "profile": profiled})
    return 0


def label_dense(dtype: torch.dtype) -> str:
    """The `weights` field of the --compare-dense decode rows."""
    return f"dense {str(dtype)[6:]}"


# ----- random-weight GGUFs of real shapes, in any quant mix ------------------------------------------------------

def write_random_quant_gguf(path: Path, shape: Any, tokenizer_gguf: Path, mix: str = "Q4_K_M",
                            name: str = "random", seed: int = 0, context: int = 4096) -> Path:
    """A Qwen3-architecture GGUF of `shape` (bench.pflash.Shape) with random weights in quant mix `mix`
    (Q4_K_M, or one of engine/weights/quant's types, or F16) and the tokenizer of `tokenizer_gguf`. For timing only:
    one random matrix per distinct (shape, type) is shared by the layers (same bytes streamed, same math)."""
    import gguf

    w = gguf.GGUFWriter(path, "qwen3")
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name)
    w.add_context_length(context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    n_vocab = add_tokenizer(w, tokenizer_gguf)
    rng = np.random.default_rng(seed)
    cache: dict[tuple[int, int, str], tuple[np.ndarray, Any]] = {}

    def add(tensor: str, rows: int, cols: int, layer: int = 0) -> None:
        qtype = mix_qtype(mix, tensor.split(".")[-2], layer, shape.layers)
        if (rows, cols, qtype) not in cache:
            if qtype == "F16":
                cache[rows, cols, qtype] = ((rng.standard_normal((rows, cols), dtype=np.float32)
                                             / cols**0.5).astype(np.float16), None)
            else:
                cache[rows, cols, qtype] = (random_blocks(rows, cols, qtype, cols**-0.5, rng),
                                            gguf.GGMLQuantizationType[qtype])
        data, raw = cache[rows, cols, qtype]
        w.add_tensor(tensor, data, raw_dtype=raw)

    ones = {n: np.ones(n, dtype=np.float32) for n in (shape.hidden, shape.head_dim)}
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    add("token_embd.weight", n_vocab, shape.hidden)
    for i in range(shape.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones[shape.hidden])
        add(p + "attn_q.weight", q, shape.hidden, i)
        add(p + "attn_k.weight", kv, shape.hidden, i)
        add(p + "attn_v.weight", kv, shape.hidden, i)
        w.add_tensor(p + "attn_q_norm.weight", ones[shape.head_dim])
        w.add_tensor(p + "attn_k_norm.weight", ones[shape.head_dim])
        add(p + "attn_output.weight", shape.hidden, q, i)
        w.add_tensor(p + "ffn_norm.weight", ones[shape.hidden])
        add(p + "ffn_gate.weight", shape.ffn, shape.hidden, i)
        add(p + "ffn_up.weight", shape.ffn, shape.hidden, i)
        add(p + "ffn_down.weight", shape.hidden, shape.ffn, i)
    w.add_tensor("output_norm.weight", ones[shape.hidden])
    if not shape.tied:
        add("output.weight", n_vocab, shape.hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
