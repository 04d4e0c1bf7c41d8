"""`bench sample`: one sampling step over a batch of the model's own next-token distributions.

It times top-k/top-p cut from each row's largest logits (the sampler's path, engine/runtime/sampler.py) against
a full-vocabulary sort of every row (the same code with NUCLEUS_CANDIDATES at the vocabulary size: the path it
replaced, still its fallback), both in the same run, and the whole `sample()` (seeded rows, the draw included).
The rows are real: the model answers a suite's prompts greedily, then its logits at every answer position come
from one teacher-forced pass (`LLMEngine.score`), so the nuclei have the sizes decoding meets. A second set of
rows, random logits (std 3), is the worst case: every row's nucleus lies past the candidates.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from lucebox.bench.report import environment, print_table, write_json
from lucebox.errors import LuceboxError


def main(args: argparse.Namespace) -> int:
    if args.rows < 1 or args.steps < 1 or not 0 < args.top_p <= 1 or args.top_k < 0 or args.temperature <= 0:
        raise LuceboxError("bench sample: --rows and --steps >= 1, 0 < --top-p <= 1, --top-k >= 0, --temperature > 0")
    from lucebox.cli import engine_from_args

    engine = engine_from_args(args, max_num_seqs=8)
    model_rows = answer_logits(engine, args.rows, args.suite, args.data_dir)
    flat = torch.randn(model_rows.shape, generator=torch.Generator().manual_seed(0)).to(model_rows.device) * 3
    results = [measure(name, rows, args) for name, rows in (("model answers", model_rows), ("random, std 3", flat))]
    env = environment(engine.device)
    title = (f"bench sample: {args.rows} rows x {model_rows.shape[1]} logits, temperature {args.temperature}, "
             f"top-p {args.top_p}, top-k {args.top_k or 'off'} ({env['device']})")
    print_table(title, ["logits", "nucleus p50", "p99", "max", "past candidates", "full sort ms", "candidates ms",
                        "speedup", "same tokens kept", "sample() ms"],
                [[r["logits"], r["nucleus"]["p50"], r["nucleus"]["p99"], r["nucleus"]["max"],
                  f"{r['past_candidates']:.1%}", r["full_sort_ms"], r["candidates_ms"],
                  f"{r['full_sort_ms'] / r['candidates_ms']:.2f}x", f"{r['same_kept']:.1%}", r["sample_ms"]]
                 for r in results])
    write_json(args.json, {"benchmark": "sample", "model": str(args.model), "env": env, "rows": args.rows,
                           "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                           "results": results})
    return 0


def answer_logits(engine: Any, n_rows: int, suite: str, data_dir: Any) -> torch.Tensor:
    """[n_rows, vocab] fp32 logits at answer positions: greedy answers to the suite's prompts, scored whole."""
    from lucebox.bench.suites import load_suite
    from lucebox.chat.prompt import PromptBuilder
    from lucebox.engine.runtime.sampler import SamplingParams

    builder = PromptBuilder.for_model(engine.loaded)
    got: list[torch.Tensor] = []
    for messages in load_suite(suite, data_dir):
        prompt = builder.render_ids(messages)
        answer = engine.generate([prompt], SamplingParams(max_tokens=64))[0]
        ids = prompt + answer
        rows = torch.arange(len(prompt) - 1, len(ids) - 1)  # the logits that chose each answer token
        got.append(engine.score(ids, rows))
        if sum(len(g) for g in got) >= n_rows:
            break
    logits = torch.cat(got)
    if len(logits) < n_rows:
        raise LuceboxError(f"bench sample: the {suite} suite's answers give {len(logits)} rows, fewer than --rows")
    pick = sorted(random.Random(0).sample(range(len(logits)), n_rows))
    return logits[pick].contiguous()


def measure(name: str, logits: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """The two top-k/top-p paths and `sample()` on `logits`, with the rows' nucleus sizes."""
    from lucebox.engine.runtime import sampler

    params = sampler.SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    batch = [params] * len(logits)
    kept = torch.isfinite(sampler.filter_logits(logits, batch))
    sizes = kept.sum(-1).float().cpu()
    fast_ms = _time(lambda: sampler.filter_logits(logits, batch), args.steps, logits.device)
    candidates = sampler.NUCLEUS_CANDIDATES
    sampler.NUCLEUS_CANDIDATES = logits.shape[-1]  # the fallback's full sort, for every row
    try:
        kept_sorted = torch.isfinite(sampler.filter_logits(logits, batch))
        sort_ms = _time(lambda: sampler.filter_logits(logits, batch), args.steps, logits.device)
    finally:
        sampler.NUCLEUS_CANDIDATES = candidates
    rows = [sampler.SampleRow(params, [], [], seed=i, position=0) for i in range(len(logits))]
    sample_ms = _time(lambda: sampler.sample(logits, rows), args.steps, logits.device)
    return {"logits": name, "nucleus": {"p50": float(sizes.quantile(0.5)), "p99": float(sizes.quantile(0.99)),
                                        "max": float(sizes.max())},
            "past_candidates": float((sizes > candidates).float().mean()),
            "full_sort_ms": sort_ms, "candidates_ms": fast_ms,
            "same_kept": float((kept == kept_sorted).all(-1).float().mean().item()), "sample_ms": sample_ms}


def _time(fn: Callable[[], Any], steps: int, device: torch.device) -> float:
    """Milliseconds per call, after one warm-up call (synchronized on a CUDA device)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - start) / steps * 1e3
