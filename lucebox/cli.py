"""Command line: `python -m lucebox [serve|pull|generate|bench|...]`; no command means `serve`.

Every user-facing failure is a `LuceboxError`: printed as one line on stderr
with exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lucebox.errors import LuceboxError


def add_engine_args(p: argparse.ArgumentParser, positional: bool = False) -> None:
    """Flags shared by every command that loads a model; `positional` also takes the model as `MODEL`."""
    if positional:
        p.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                       help="the model, as with --model (llama-server and vLLM take it this way)")
    p.add_argument("--model", "-m", default=None,
                   help="GGUF file, Hugging Face folder, or a known name (smollm2, gemma3-270m); default smollm2")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA) | float32 | bfloat16 | float16")
    p.add_argument("--ctx-size", "-c", type=int, default=None, dest="n_ctx", help="context length (default: model's)")
    p.add_argument("--weights", choices=["auto", "both", "quantized", "dense"], default="auto",
                   help="GGUF quant blocks: auto (kept quantized on CUDA only when the dense copy would not fit, "
                        "and for quantized experts) | both (the blocks and a dense copy: the blocks serve steps of "
                        "up to 16 rows, the copy prefill and bigger batches; not yet run on a GPU) | quantized | "
                        "dense")
    p.add_argument("--kv-dtype", default=None, metavar="TYPE",
                   help="KV cache storage: auto (the model's dtype) | bf16 (a bf16 model) | q8_0 (int8 with a scale "
                        "per token and KV head: ~1.9x the tokens in the same memory); env LUCEBOX_KV_DTYPE for serve")
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GB",
                   help="device memory this process may use, in GB of 2^30 bytes (weights, activations, CUDA "
                        "graphs, KV cache); the KV cache gets what remains (default: what is free on the device); "
                        "CUDA only")
    p.add_argument("--chat-template-file", type=Path, default=None, help="jinja chat template overriding the model's")
    p.add_argument("--tensor-parallel", "-tp", type=int, default=None, metavar="N",
                   help="split the model over N processes, one per GPU (gloo on the CPU); under torchrun, "
                        "WORLD_SIZE of them on any hosts (README: Several GPUs)")


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    """Engine flags `serve` and `generate` share (one builder, so both commands load the model alike)."""
    p.add_argument("--model-card", type=Path, default=None, help="model card JSON (default: looked up by model name)")
    p.add_argument("--max-step-tokens", type=int, default=None, help="prefill chunk budget per step (default 2048)")
    p.add_argument("--prefill-pacing", action="store_true",
                   help="while streams decode, cap prefill chunks from measured step times (lower inter-token "
                        "latency beside a long prompt, less throughput; off by default)")
    p.add_argument("--kv-tokens", type=int, default=None, help="KV cache size in tokens (default: from memory)")
    p.add_argument("--draft", default=None, help="DFlash drafter folder (default: none, plain decoding)")
    p.add_argument("--no-draft", action="store_true", help="plain decoding even when a drafter is available")
    p.add_argument("--ddtree", action="store_true", help="verify a draft tree (DDTree) instead of a chain")
    p.add_argument("--ddtree-budget", type=int, default=None, help="draft tree nodes per verification (default 22)")
    p.add_argument("--spec-adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="per request, decode plainly while drafts do not pay, probing again later (default on)")
    add_spark_args(p)


def add_spark_args(p: argparse.ArgumentParser) -> None:
    """Spark MoE expert offload (lucebox/engine/spark): hot experts on the device, cold ones in host memory."""
    p.add_argument("--spark", type=Path, default=None, metavar="PROFILE",
                   help="serve a MoE model with its experts placed by this profile (`spark calibrate`)")
    p.add_argument("--expert-gpu-budget", default=None, metavar="GB|N%",
                   help="device memory for expert weights, ring slots included: GB, or a percentage of the expert "
                        "bytes (default: the profile's; without --spark, a uniform placement of this budget); "
                        "under -tp N each GPU takes 1/N of it for its own experts")
    p.add_argument("--spark-ring", type=int, default=None, metavar="N",
                   help="spare device slots per MoE layer for cold experts, least recently used out (default "
                        "n_experts/8, at most 32, at most half the budget)")
    p.add_argument("--spark-cpu-rows", type=int, default=None, metavar="N",
                   help="compute a cold expert routed to at most N rows of a step on the CPU instead of copying it "
                        "(default: measured at load, see lucebox/engine/spark/offload.py)")
    p.add_argument("--router-skew", default=None, metavar="zipf:S",
                   help="SIMULATION for random-weight MoE models (which route uniformly): bias the router logits "
                        "to a Zipf popularity of exponent S, as `spark calibrate --router-skew` did for the profile "
                        "(lucebox/engine/spark/simulate.py); changes the model's outputs, /props says so")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Flags of the server itself (socket, auth, batching, prefix cache, PFlash)."""
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1; 0.0.0.0 to expose)")
    p.add_argument("--port", type=int, default=None, help="default 8080")
    p.add_argument("--api-key", default=None, help="require this key (Bearer or x-api-key); env LUCEBOX_API_KEY")
    p.add_argument("--no-cors", action="store_true", help="no CORS headers: only same-origin pages (/status) work")
    p.add_argument("--cors-origins", default=None, metavar="LIST",
                   help="browser origins allowed besides loopback ones, comma-separated: https://app.example, "
                        "http://host:* (any port), * (any page: logged as a warning); env LUCEBOX_CORS_ORIGINS")
    p.add_argument("--allowed-hosts", default=None, metavar="LIST",
                   help="Host header names accepted besides loopback ones and --host (DNS rebinding guard), "
                        "comma-separated; * turns the check off; env LUCEBOX_ALLOWED_HOSTS")
    p.add_argument("--max-connections", type=int, default=None,
                   help="open connections at most (default: 3/4 of the open-file limit, at most 4096)")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds to receive a whole request, head and body (default 60)")
    p.add_argument("--max-body-mb", type=int, default=None, help="largest request body in MiB (default 16)")
    p.add_argument("--shutdown-grace", type=float, default=None,
                   help="seconds in-flight requests get after SIGTERM before open streams end with an error "
                        "event (default 10)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences decoded together (default 16)")
    p.add_argument("--max-queue", type=int, default=None, help="waiting requests before 503 (default 256)")
    p.add_argument("--stream-pace-us", type=float, default=None,
                   help="per active stream, the least microseconds between a stream's events; steps in between "
                        "go out together (default 200: 64 streams write every 12.8 ms, 1-4 every step; 0: every step)")
    p.add_argument("--no-prefix-cache", action="store_true", help="no KV reuse across requests")
    p.add_argument("--no-gpu-prefix-cache", action="store_true", help="keep no finished KV blocks on the device")
    p.add_argument("--prefix-cache-slots", type=int, default=None, help="RAM turn-boundary snapshots (default 32)")
    p.add_argument("--prefill-cache-slots", type=int, default=None, help="RAM exact-prompt snapshots (default 4)")
    p.add_argument("--cache-ram", type=int, default=None, metavar="MB",
                   help="RAM for those snapshots together, least recently used evicted first (default 4096; "
                        "0: none, and then nothing reaches --kv-cache-dir either)")
    p.add_argument("--kv-cache-dir", type=Path, default=None, help="persist snapshots here (memory-mapped files)")
    p.add_argument("--kv-cache-budget", type=int, default=None, help="disk budget in MB (default 4096)")
    p.add_argument("--kv-cache-min-tokens", type=int, default=None, help="don't persist shorter prefixes (256)")
    # PFlash speculative prefill (values checked by ServerConfig, so a bad one is one line and exit 2)
    p.add_argument("--prefill-compression", default=None, metavar="off|auto|always",
                   help="compress long prompts with a scorer before prefill (default auto: above the threshold)")
    p.add_argument("--prefill-threshold", default=None, metavar="N",
                   help="auto compresses prompts longer than N tokens (default 32000)")
    p.add_argument("--prefill-keep-ratio", default=None, metavar="R",
                   help="fraction of prompt chunks kept, in (0, 1] (default 0.05)")
    p.add_argument("--prefill-drafter", default=None, metavar="PATH",
                   help="PFlash scorer model: GGUF file, HF folder or known name (default: the model itself)")
    p.add_argument("--prefill-skip-park", action="store_true",
                   help="keep a separate scorer on the GPU when idle (default: parked in pinned host memory)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lucebox", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command")

    p = sub.add_parser("serve", help="serve the OpenAI and Anthropic APIs (the default command)")
    add_engine_args(p, positional=True)
    add_decoding_args(p)
    add_serve_args(p)
    p.set_defaults(func=_lazy("lucebox.serve", "main"))

    p = sub.add_parser("pull", help="download a known model into the cache and print its path")
    p.add_argument("name", nargs="?", default="smollm2")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    add_engine_args(p, positional=True)
    add_decoding_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", "-p", help="user message (or raw text with --raw)")
    src.add_argument("--messages", help="JSON list of chat messages, or @FILE holding it")
    p.add_argument("--raw", action="store_true", help="no chat template: the prompt is the model's input text")
    p.add_argument("--max-tokens", "-n", type=int, default=256)
    p.add_argument("--temperature", "-t", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--show-ids", action="store_true", help="print the generated token ids on stderr at the end")
    p.add_argument("--warm-up", action="store_true",
                   help="capture every CUDA graph and compile every kernel before generating, as `serve` does "
                        "(default: lazily, which is quicker for one prompt)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("bench", help="benchmarks (decode, qmm, moe, serve, agent, spec, spec-cost, sample, cache, "
                                     "pflash, spark)")
    bench = p.add_subparsers(dest="bench", required=True)
    b = bench.add_parser("decode", help="prefill and decode tok/s, this engine vs transformers")
    add_engine_args(b)
    b.add_argument("--prompt-lens", default="128,512,2048")
    b.add_argument("--batch-sizes", default="1,4,16")
    b.add_argument("--gen-len", type=int, default=64)
    b.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    b.add_argument("--max-step-tokens", type=int, default=None,
                   help="prefill chunk size (default: the longest --prompt-lens, at least 2048, so each prompt is "
                        "one chunk); lower it with --gpu-memory to fit a long prompt in chunks")
    b.add_argument("--compare-dense", action="store_true",
                   help="also time decode with the file's quantized weights held dense (dequantized at load)")
    b.add_argument("--peer-bench", type=Path, default=None, metavar="PATH_TO_llama-bench",
                   help="also run this llama-bench on the same file (pp512, tg128) and report it alongside")
    b.add_argument("--shape", default=None,
                   help="bench a random-weight GGUF of this shape (qwen3-8b, qwen3-30b-a3b, qwen3.5-27b, "
                        "qwen3.5-35b-a3b, ...; written to a temporary folder) with --model's tokenizer, instead "
                        "of --model (with --no-hf: the weights are random)")
    b.add_argument("--mix", default="Q4_K_M", help="--shape: the weights' quant mix (Q4_K_M, Q8_0, F16)")
    b.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="also profile this many decode steps at the first --batch-sizes, eagerly (the model loaded "
                        "again without CUDA graphs): a table of kernels by time a step (ops on the CPU)")
    b.add_argument("--json", type=Path, default=Path("bench_decode.json"), help="where to write the results")
    b.set_defaults(func=_lazy("lucebox.bench.decode", "main"))

    b = bench.add_parser("qmm", help="the quantized matmul kernels alone (float and int8 families) vs bf16 cuBLAS, "
                                     "per weight matrix of a model shape (CUDA)")
    b.add_argument("--shape", default="qwen3-8b", help="a dense --shape of bench decode (default qwen3-8b)")
    b.add_argument("--vocab", type=int, default=151_936, help="LM head rows (default: Qwen3's 151,936)")
    b.add_argument("--types", default="Q4_K,Q6_K,Q8_0", help="comma-separated quant types (Q4_K, Q6_K, Q8_0)")
    b.add_argument("--rows", default="1,16", help="activation rows: 1 (decode) and up to 32 (batches, verify)")
    b.add_argument("--sweep", action="store_true",
                   help="at one row, also time a wider grid of int8 gemv configs (~60 a type; minutes) and show the "
                        "fastest beside the tuner's")
    b.add_argument("--json", type=Path, default=Path("bench_qmm.json"), help="where to write the results")
    b.set_defaults(func=_lazy("lucebox.bench.qmm", "main"))

    b = bench.add_parser("moe", help="one MoE layer's routed experts alone: the grouped kernel vs the per-pair "
                                     "int8 gemvs, by decode rows (CUDA)")
    b.add_argument("--shape", default="qwen3-30b-a3b", help="an MoE --shape of bench spark (default qwen3-30b-a3b)")
    b.add_argument("--down", default="Q4_K,Q6_K", help="comma-separated down-projection types (Q4_K, Q6_K, Q8_0)")
    b.add_argument("--rows", default="1,2,4,8,16",
                   help="activation rows: decode (1..64, both paths) and prefill chunks (up to 8192, grouped only)")
    b.add_argument("--json", type=Path, default=Path("bench_moe.json"), help="where to write the results")
    b.set_defaults(func=_lazy("lucebox.bench.moe", "main"))

    b = bench.add_parser("serve", help="serving throughput and latency: concurrent streaming requests over HTTP")
    add_engine_args(b)
    b.add_argument("--url", default=None,
                   help="benchmark this running server (http://host:port) instead of starting one")
    b.add_argument("--max-num-seqs", type=int, default=None,
                   help="the started server's batch size (default: the largest --concurrency)")
    b.add_argument("--kv-tokens", type=int, default=None, help="the started server's KV cache size in tokens")
    b.add_argument("--concurrency", default="1,4,16,64", help="requests in flight; one level per value")
    b.add_argument("--prompt-len", type=int, default=256,
                   help="prompt tokens per request, chat template included (about)")
    b.add_argument("--gen-len", type=int, default=128, help="max_tokens per request")
    b.add_argument("--requests", type=int, default=None,
                   help="requests per level (default max(8, 2 x concurrency); the sequential baseline runs this "
                        "many, at most 32, default 8)")
    b.add_argument("--dialect", choices=["chat", "anthropic"], default="chat")
    b.add_argument("--constrained", action="store_true",
                   help="also: run every level again with each answer held to a JSON object (constrained decoding) "
                        "and report its tok/s against the free level")
    b.add_argument("--long-prompt", type=int, default=None, metavar="N",
                   help="also: while streams decode (the largest --concurrency, at most 8), send one N-token prompt "
                        "and report their inter-token latency during its prefill against their steady one")
    b.add_argument("--data-dir", type=Path, default=None,
                   help="folder with swe_bench_verified.parquet or prompts/*.jsonl (default: lucebox/data)")
    b.add_argument("--api-key", default=None, help="key to send (default: env LUCEBOX_API_KEY)")
    b.add_argument("--json", type=Path, default=Path("bench_serve.json"), help="where to write the results")
    b.set_defaults(func=_lazy("lucebox.bench.serve", "main"))

    b = bench.add_parser("spec", help="DFlash speculative decoding vs plain decoding, per suite")
    add_engine_args(b)
    b.add_argument("--draft", default=None, help="drafter folder (default: the model card's)")
    b.add_argument("--suite", default="humaneval,gsm,math,mtbench", help="comma-separated suites")
    b.add_argument("--prompts", type=int, default=10, help="prompts per suite")
    b.add_argument("--max-new", type=int, default=256, help="max new tokens per prompt")
    b.add_argument("--budgets", default="8,16,32", help="DDTree budgets to run")
    b.add_argument("--tree-chain", default="auto",
                   help="DDTree chain depths to compare, comma-separated: auto (as the server: twice the tokens "
                        "a step so far) or N (the top-1 chain to depth N for every step; block - 1: the whole "
                        "chain, as DFLASH.md's C++ server)")
    b.add_argument("--spec-adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="the adaptive rule, as serving runs it (default on): a prompt whose drafts do not pay "
                        "decodes plainly; off: every step drafts")
    b.add_argument("--data-dir", type=Path, default=None, help="data folder (default: lucebox/data)")
    b.add_argument("--json", type=Path, default=Path("bench_spec.json"), help="where to write the results")
    b.set_defaults(func=_lazy("lucebox.bench.spec", "main"))
    b = bench.add_parser("spec-cost", help="a speculative step's time against a plain one (chain, DDTree), on any "
                         "model or random --shape, and the speedup it projects at given acceptance lengths")
    add_engine_args(b)
    b.add_argument("--shape", default=None, help="bench a random-weight GGUF of this shape (as bench decode: "
                   "qwen3-8b, qwen3.5-27b, ...) with --model's tokenizer")
    b.add_argument("--mix", default="Q4_K_M", help="--shape's quant mix (as bench decode)")
    b.add_argument("--draft", default=None, help="a drafter folder (default: a random drafter of --draft-layers)")
    b.add_argument("--draft-layers", type=int, default=5, help="the random drafter's layers (default 5)")
    b.add_argument("--block", type=int, default=16, help="the random drafter's block: chain rows verified (16)")
    b.add_argument("--budgets", default="22", help="DDTree budgets (default 22: 23 rows verified)")
    b.add_argument("--batch-sizes", default="1", help="decode batch sizes (default 1)")
    b.add_argument("--steps", type=int, default=8, help="timed steps per mode (default 8)")
    b.add_argument("--context", type=int, default=32,
                   help="prompt tokens before the timed steps: the context they attend over (default 32)")
    b.add_argument("--taus", default="6,7,8", help="acceptance lengths to project the speedup at (default 6,7,8)")
    b.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="then profile this many steps of plain decoding and of each one-launch configuration at "
                        "the first batch: the kernels (CUDA; ops on the CPU) side by side, us and calls a step")
    b.add_argument("--json", type=Path, default=Path("bench_spec_cost.json"), help="where to write the results")
    b.set_defaults(func=_lazy("lucebox.bench.spec_cost", "main"))

    b = bench.add_parser("sample", help="one sampling step over the model's own distributions: top-k/top-p from "
                         "each row's largest logits vs a full sort of every row, and the whole sample()")
    add_engine_args(b)
    b.add_argument("--rows", type=int, default=256, help="rows sampled at once (default 256)")
    b.add_argument("--temperature", type=float, default=0.9)
    b.add_argument("--top-p", type=float, default=0.95)
    b.add_argument("--top-k", type=int, default=0, help="0: off (default)")
    b.add_argument("--suite", default="mtbench", help="the prompts the model answers (default mtbench)")
    b.add_argument("--data-dir", type=Path, default=None, help="data folder (default: lucebox/data)")
    b.add_argument("--steps", type=int, default=20, help="timed calls per path (default 20)")
    b.add_argument("--json", type=Path, default=Path("bench_sample.json"), help="where to write the results")
    b.set_defaults(func=_lazy("lucebox.bench.sample", "main"))

    b = bench.add_parser("cache", help="prefix cache on replayed agent sessions: TTFT per turn, per tier, restart")
    add_engine_args(b)
    b.add_argument("--sessions", type=int, default=3)
    b.add_argument("--turns", type=int, default=4)
    b.add_argument("--system-chars", type=int, default=12000, help="system prompt length (characters)")
    b.add_argument("--user-chars", type=int, default=1500, help="user turn length (characters)")
    b.add_argument("--gen-len", type=int, default=32, help="assistant tokens per turn")
    b.add_argument("--kv-cache-dir", type=Path, default=None, help="disk tier folder (default: a temp folder)")
    b.add_argument("--data-dir", type=Path, default=None, help="data folder (default: lucebox/data)")
    b.add_argument("--json", type=Path, default=Path("bench_cache.json"), help="where to write the results")
    b.set_defaults(func=_lazy("lucebox.bench.cache", "main"))
    b = bench.add_parser("agent", help="agent sessions (long shared prefix, growing history): TTFT per turn, "
                         "cold and warm, p50/p99, stalls; against --url servers too (llama-server, vLLM)")
    add_engine_args(b)
    add_agent_bench_args(b)
    b.set_defaults(func=_lazy("lucebox.bench.agent", "main"))
    b = bench.add_parser("pflash", help="PFlash prompt compression: needle retention, or TTFT at long lengths")
    add_engine_args(b)
    add_pflash_bench_args(b)
    b.set_defaults(func=_lazy("lucebox.bench.pflash", "main"))

    b = bench.add_parser("spark", help="Spark expert offload: decode tok/s, TTFT and cold-hit rates per placement "
                         "and budget, and a profile of one traffic kind on another")
    add_engine_args(b)
    add_spark_bench_args(b)
    b.set_defaults(func=_lazy("lucebox.bench.spark", "main"))

    p = sub.add_parser("spark", help="Spark MoE expert offload: calibrate a placement profile on traffic")
    spark = p.add_subparsers(dest="spark", required=True)
    c = spark.add_parser("calibrate", help="count routing per (layer, expert) on replayed traffic; write a profile")
    add_engine_args(c)
    add_spark_calibrate_args(c)
    c.set_defaults(func=_lazy("lucebox.engine.spark.calibrate", "main"))

    p = sub.add_parser("train-drafter", help="train a DFlash drafter for a target by self-distillation")
    add_train_args(p)
    p.set_defaults(func=_lazy("lucebox.train.command", "main"))
    from lucebox.clients.cli import add_clients_parser

    add_clients_parser(sub, _lazy)
    return parser


def add_agent_bench_args(b: argparse.ArgumentParser) -> None:
    """The `bench agent` flags (besides the engine flags)."""
    b.add_argument("--url", default=None,
                   help="benchmark this running OpenAI-compatible server (http://host:port) instead of starting one")
    b.add_argument("--max-num-seqs", type=int, default=None,
                   help="the started server's batch size (default: --concurrency)")
    b.add_argument("--kv-tokens", type=int, default=None, help="the started server's KV cache size in tokens")
    b.add_argument("--sessions", type=int, default=3, help="sessions sharing the system prefix")
    b.add_argument("--turns", type=int, default=10, help="turns per session")
    b.add_argument("--prefix-tokens", type=int, default=None,
                   help="system prefix length in tokens, about (default 20000, or what the context leaves)")
    b.add_argument("--turn-tokens", type=int, default=512, help="most tokens one turn appends")
    b.add_argument("--max-tokens", type=int, default=1, help="max_tokens per turn (1: the turn measures prefill)")
    b.add_argument("--concurrency", type=int, default=1,
                   help="1: sessions interleave, one request at a time; C: sessions run concurrently, C in flight")
    b.add_argument("--seed", type=int, default=0, help="picks the texts; a new seed is a new, uncached prefix")
    b.add_argument("--data-dir", type=Path, default=None, help="data folder (default: lucebox/data)")
    b.add_argument("--api-key", default=None, help="key to send (default: env LUCEBOX_API_KEY)")
    b.add_argument("--json", type=Path, default=Path("bench_agent.json"), help="where to write the results")


def add_pflash_bench_args(b: argparse.ArgumentParser) -> None:
    """The `bench pflash` flags (besides the engine flags)."""
    b.add_argument("--scorer", default=None, help="scorer model file or folder (default: the model itself)")
    b.add_argument("--keep-ratio", type=float, default=None,
                   help="fraction of chunks kept (default 0.1 for retention, 0.05 for --speed)")
    b.add_argument("--lengths", default="1024,2048,4096,7680", help="retention: prompt lengths in tokens")
    b.add_argument("--depths", default="0,25,50,75,100", help="retention: needle depths in percent")
    b.add_argument("--trials", type=int, default=1, help="retention: pass keys per length and depth")
    b.add_argument("--max-new", type=int, default=16, help="retention: answer tokens")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--data-dir", type=Path, default=None, help="data folder for filler text (default: lucebox/data)")
    b.add_argument("--speed", action="store_true", help="TTFT at long lengths with random-weight models")
    b.add_argument("--speed-lens", default="16384,32768,65536,131072", help="--speed: prompt lengths")
    b.add_argument("--target-shape", default="qwen3-8b", help="--speed: qwen3-8b | qwen3-0.6b | tiny | tiny-scorer")
    b.add_argument("--scorer-shape", default="qwen3-0.6b", help="--speed: qwen3-8b | qwen3-0.6b | tiny | tiny-scorer")
    b.add_argument("--max-step-tokens", type=int, default=8192, help="the engine's prefill chunk")
    b.add_argument("--json", type=Path, default=Path("bench_pflash.json"), help="where to write the results")


def add_spark_bench_args(b: argparse.ArgumentParser) -> None:
    """The `bench spark` flags (besides the engine flags); lucebox/bench/spark.py says what it measures."""
    b.add_argument("--budgets", default="40%,60%,80%",
                   help="expert device budgets, comma-separated: GB or percentages of the expert bytes")
    b.add_argument("--ring", type=int, default=8, help="ring slots per MoE layer of the +ring rows (default 8)")
    b.add_argument("--cpu-rows", type=int, default=None,
                   help="the CPU rule's rows (default: measured at load, lucebox/engine/spark/offload.py)")
    b.add_argument("--router-skew", default=None, metavar="zipf:S",
                   help="SIMULATION for random weights: bias router logits to a Zipf popularity of exponent S; "
                        "labelled in the output")
    b.add_argument("--shape", default=None, help="benchmark a random-weight MoE of this shape (qwen3-30b-a3b, "
                   "tiny-moe; the hybrids qwen3.5-35b-a3b, tiny-qwen3.5-moe) with --model's tokenizer, instead of "
                   "--model")
    b.add_argument("--mix", default="Q4_K_M", help="--shape: the weights' quant mix (Q4_K_M, Q8_0, F16)")
    b.add_argument("--prompts", type=int, default=8, help="prompts per traffic kind to calibrate, and to evaluate")
    b.add_argument("--prompt-len", type=int, default=512, help="prompt tokens at most")
    b.add_argument("--gen-len", type=int, default=64, help="tokens generated per prompt")
    b.add_argument("--conversation", type=Path, nargs="+", default=None, metavar="FILE",
                   help="conversation traffic (default: MT-Bench from the data folder)")
    b.add_argument("--code", type=Path, nargs="+", default=None, metavar="FILE",
                   help="code traffic (default: bench_he.jsonl and SWE-bench from the data folder)")
    b.add_argument("--data-dir", type=Path, default=None, help="data folder (default: lucebox/data)")
    b.add_argument("--json", type=Path, default=Path("bench_spark.json"), help="where to write the results")


def add_spark_calibrate_args(p: argparse.ArgumentParser) -> None:
    """The `spark calibrate` flags besides the engine flags."""
    p.add_argument("--traffic", type=Path, nargs="+", required=True, metavar="FILE",
                   help="prompt files: .jsonl (chat requests: messages / prompt / turns per line), .parquet "
                        "(SWE-bench issues), .md/.txt (one system prompt each)")
    p.add_argument("--out", type=Path, required=True, help="the profile to write (JSON)")
    p.add_argument("--expert-gpu-budget", default="60%", metavar="GB|N%",
                   help="budget the stored hot set is chosen for: GB of expert weights on the device, or a "
                        "percentage of the expert bytes (default 60%%; serving re-derives it for its own budget)")
    p.add_argument("--decode-tokens", type=int, default=0,
                   help="greedy tokens decoded after each prefill, their routing counted too (default 0)")
    p.add_argument("--heldout-every", type=int, default=5,
                   help="hold out every N-th conversation for the predicted cold-hit rate (default 5; 0: none)")
    p.add_argument("--max-prompt-tokens", type=int, default=4096, help="cut longer prompts (default 4096)")
    p.add_argument("--batch", type=int, default=8, help="conversations prefilled together (default 8)")
    p.add_argument("--router-skew", default=None, metavar="zipf:S",
                   help="SIMULATION for random-weight models: bias router logits to a Zipf popularity of "
                        "exponent S (see lucebox/engine/spark/simulate.py); recorded in the profile")
    p.add_argument("--offload-budget", default=None, metavar="GB|N%",
                   help="for a model that does not fit the device: calibrate with its experts offloaded, a uniform "
                        "placement of this budget (the counts are the same; only the speed differs)")


def add_train_args(p: argparse.ArgumentParser) -> None:
    """`python -m lucebox train-drafter` flags."""
    p.add_argument("--target", "-m", default=None, help="target model: GGUF file, HF folder or known name "
                   "(default smollm2)")
    p.add_argument("--out", type=Path, required=True, help="output folder: the drafter (public layout), "
                   "checkpoint/ (16 MB shards), features.bin, examples.npz, train_log.jsonl, summary.json")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", help="target dtype: auto (fp32 on CPU, bf16 on CUDA) | float32 | "
                   "bfloat16 | float16")
    g = p.add_argument_group("data")
    g.add_argument("--data-dir", type=Path, default=None, help="data folder (default: lucebox/data)")
    g.add_argument("--prompts", type=Path, action="append", default=[],
                   help="extra training prompts, JSONL with `messages` or `prompt` per line (repeatable)")
    g.add_argument("--sources", default="swe_bench,agent,smoke,math,code,chat,file",
                   help="training prompt sources (comma-separated; see lucebox/train/data.py)")
    g.add_argument("--max-prompts", type=int, default=None, help="use a seeded random subset of this many prompts")
    g.add_argument("--swe-per-issue", type=int, default=4, help="instructions per SWE-bench issue (1-8)")
    g.add_argument("--math-prompts", type=int, default=600, help="generated math word problems")
    g.add_argument("--self-prompts", type=int, default=0, metavar="N",
                   help="also N user messages the target writes itself from the start of a user turn (some steered "
                        "toward code, math and writing; lucebox/train/self_prompts.py)")
    g.add_argument("--max-prompt-tokens", type=int, default=2048, help="drop longer prompts")
    g.add_argument("--max-new-tokens", type=int, default=256, help="response length the target generates")
    g.add_argument("--temperature", type=float, default=0.0, help="response sampling (0 = greedy)")
    g.add_argument("--responses", type=int, default=1,
                   help="responses per prompt: the first at --temperature, the others sampled (seeded)")
    g.add_argument("--sample-temperature", type=float, default=1.0, help="temperature of the extra --responses")
    g.add_argument("--gen-batch", type=int, default=64, help="sequences generated together")
    g = p.add_argument_group("drafter")
    g.add_argument("--layers", type=int, default=2, help="drafter layers")
    g.add_argument("--block-size", type=int, default=16, help="block size B (drafts B-1 tokens)")
    g.add_argument("--target-layers", default=None, help="target layer ids to condition on, e.g. 1,8,14,21,27 "
                   "(default: --n-target-layers spread over the depth)")
    g.add_argument("--n-target-layers", type=int, default=5, help="how many target layers by default")
    g.add_argument("--heads", type=int, default=None, help="attention heads (default: the target's)")
    g.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: the target's)")
    g.add_argument("--head-dim", type=int, default=None, help="head dim (default: the target's)")
    g.add_argument("--intermediate", type=int, default=None, help="FFN size (default: the target's)")
    g.add_argument("--mask-token-id", type=int, default=None, help="MASK token (default: an unused special token)")
    g.add_argument("--init", type=Path, default=None, help="start from this drafter folder instead of random")
    g.add_argument("--save-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=None, help="optimizer steps (default: --epochs over the data)")
    g.add_argument("--epochs", type=float, default=6.0)
    g.add_argument("--batch", type=int, default=8, help="sequences per step")
    g.add_argument("--anchors", type=int, default=512, help="blocks per sequence, at most")
    g.add_argument("--lr", type=float, default=6e-4)
    g.add_argument("--warmup", type=float, default=0.04, help="warm-up fraction of the steps")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--gamma", type=float, default=None, help="loss decay over block rows (default 7 for B=16)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--feature-cache", choices=["auto", "on", "off"], default="auto",
                   help="capture the target's features of every example once, in OUT/features.bin (memory-mapped, "
                        "reused by every epoch and --resume; on the GPU when they fit in 30%% of its free memory); "
                        "off: run the target in every step (auto: on when they fit on the disk)")
    g.add_argument("--max-rows", type=int, default=None,
                   help="block rows per packed drafter forward (default 65536 with flex attention, 4096 with dense; "
                        "a step with more takes several forwards, the same loss: memory only)")
    g.add_argument("--attention", choices=["auto", "flex", "dense"], default="auto",
                   help="the packed forward's attention: flex_attention block masks (auto on CUDA) or dense masks "
                        "(auto on CPU; on CUDA, a fallback)")
    g.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    g.add_argument("--export", action="store_true",
                   help="only write OUT's drafter (config.json, model.safetensors) from OUT/checkpoint, and exit")
    g.add_argument("--bench-trainer", type=int, default=0, metavar="STEPS",
                   help="time STEPS steps of the per-sequence and of the packed training step on the same data, "
                        "print rows/s of each (OUT/bench_trainer.json), and exit without training")
    g.add_argument("--time-limit", type=float, default=None, help="checkpoint and stop after this many seconds "
                   "of training (continue with --resume)")
    g.add_argument("--time-budget", type=float, default=None, help="fit the step count (and the LR schedule) "
                   "to this many seconds of training, measured as it goes (at most --steps/--epochs)")
    g.add_argument("--stop-after", type=int, default=None, help="checkpoint and stop after this many steps")
    g.add_argument("--wall-limit", type=float, default=None, help="checkpoint and stop this many seconds after the "
                   "command started, its data and features included (for machines that end a command at a set "
                   "time; continue with --resume)")
    g = p.add_argument_group("progress and evaluation")
    g.add_argument("--log-every", type=int, default=10)
    g.add_argument("--save-every", type=int, default=500)
    g.add_argument("--eval-every", type=int, default=0, help="measure tau every N steps (default: at checkpoints)")
    g.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts for tau (0: no evaluation)")
    g.add_argument("--eval-tokens", type=int, default=128, help="new tokens per held-out prompt")
    g.add_argument("--eval-ddtree-budget", type=int, default=22, help="also measure DDTree tau at the end (0: no)")
    g.add_argument("--quiet", action="store_true")


def _lazy(module: str, attr: str) -> Callable[[argparse.Namespace], int]:
    """Import a command's module only when it runs (keeps `--help` and `pull` fast)."""

    def run(args: argparse.Namespace) -> int:
        import importlib

        return getattr(importlib.import_module(module), attr)(args)

    return run


def cmd_pull(args: argparse.Namespace) -> int:
    from lucebox.fetch import pull

    print(pull(args.name))
    return 0


def engine_config(args: argparse.Namespace, **overrides: Any) -> Any:
    """The EngineConfig the engine flags (add_engine_args) ask for."""
    from lucebox.engine.runtime.llm_engine import EngineConfig

    if getattr(args, "spec_adaptive", None) is not None:  # bench spec --no-spec-adaptive
        overrides.setdefault("spec_adaptive", args.spec_adaptive)
    return EngineConfig(device=args.device, dtype=args.dtype, n_ctx=args.n_ctx,
                        weights=getattr(args, "weights", "auto"), kv_dtype=getattr(args, "kv_dtype", None) or "auto",
                        gpu_memory=getattr(args, "gpu_memory", None),
                        tensor_parallel=getattr(args, "tensor_parallel", None) or 1, **overrides)


def engine_from_args(args: argparse.Namespace, **overrides: Any) -> Any:
    from lucebox.engine.runtime.llm_engine import LLMEngine
    from lucebox.fetch import resolve_model

    return LLMEngine.from_path(resolve_model(args.model), engine_config(args, **overrides))


def parse_messages(text: str) -> list[dict]:
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text(encoding="utf-8")
        except OSError as exc:
            raise LuceboxError(f"--messages {text}: {exc.strerror}") from None
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LuceboxError(f"--messages is not valid JSON: {exc}") from None
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise LuceboxError("--messages must be a JSON list of objects with a role")
    return messages


def generate_config(args: argparse.Namespace) -> Any:
    """The server configuration `generate` loads with: serve's defaults (environment included), generate's flags,
    one sequence, no prefix cache or PFlash (one prompt, nothing to reuse or compress), and no start-up warm-up
    unless `--warm-up` asks for it (for one prompt, capturing every graph bucket only costs time)."""
    from lucebox.serve import ServerConfig

    settings = vars(build_parser().parse_args(["serve"]))
    settings.update({k: v for k, v in vars(args).items() if k in settings and k != "command"})
    settings.update(max_num_seqs=1, no_prefix_cache=True, prefill_compression="off")
    cfg = ServerConfig.from_args(argparse.Namespace(**settings))
    cfg.warm_up = bool(getattr(args, "warm_up", False))
    return cfg


def cmd_generate(args: argparse.Namespace) -> int:
    from lucebox.api.common import ServerContext
    from lucebox.engine.runtime.sampler import SamplingParams
    from lucebox.serve import load_into

    messages = parse_messages(args.messages) if args.messages else None
    if args.raw and messages:
        raise LuceboxError("--raw takes --prompt, not --messages")
    cfg = generate_config(args)
    ctx = ServerContext(model_id=cfg.model or "lucebox", n_ctx=cfg.n_ctx or 0)
    engine = load_into(ctx, cfg)  # as `serve` loads it: model card, chat template, drafter
    builder = ctx.prompt
    if args.raw:
        ids = engine.tokenizer.encode(args.prompt, add_special=True)
    else:
        ids = builder.render_ids(messages or [{"role": "user", "content": args.prompt}])
    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed, max_tokens=args.max_tokens,
    )
    try:
        params.validate()
    except ValueError as exc:
        raise LuceboxError(str(exc)) from None
    detok = engine.tokenizer.detokenizer(skip_special=True)
    out_ids = []
    for tok in engine.stream(ids, params):
        out_ids.append(tok)
        sys.stdout.write(detok.push(tok))
        sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")
    if args.show_ids:
        print(json.dumps(out_ids), file=sys.stderr)
    return 0


def tp_follower(args: argparse.Namespace) -> int:
    """A rank other than 0 under torchrun: run rank 0's steps on this rank's shard (engine/parallel/worker.py)."""
    from lucebox.engine.parallel.worker import follower_main
    from lucebox.engine.runtime.llm_engine import EngineConfig

    device = EngineConfig(device=args.device).resolve_device()
    return follower_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device.type)


def take_positional_model(args: argparse.Namespace) -> None:
    """`serve MODEL` / `generate MODEL` mean `--model MODEL`; both, naming different models, is an error."""
    path = getattr(args, "model_path", None)
    if path is None:
        return
    if args.model is not None and args.model != path:
        raise LuceboxError(f"the model is given twice: {path!r} and --model {args.model!r} (give one)")
    args.model = path


def parse_argv(argv: list[str]) -> argparse.Namespace:
    """Parse a command line as `main` does: no command means `serve`; `clients run`'s arguments after `--`
    go to the client verbatim."""
    from lucebox.clients.cli import split_passthrough

    parser = build_parser()
    argv = list(argv)
    commands = set(parser._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    first = next((a for a in argv if a not in ("-v", "--verbose")), None)
    if first is None or (first not in commands and first not in ("-h", "--help")):
        argv.insert(argv.index(first) if first else len(argv), "serve")
    argv, passthrough = split_passthrough(argv)
    args = parser.parse_args(argv)
    if passthrough is not None:
        args.args = [*args.args, *passthrough]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_argv(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    try:
        take_positional_model(args)
        if (getattr(args, "tensor_parallel", None) or 1) > 1 and int(os.environ.get("RANK", "0")) > 0:
            return tp_follower(args)  # torchrun started this rank: it serves no requests
        return args.func(args)
    except LuceboxError as exc:
        print(f"lucebox: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
