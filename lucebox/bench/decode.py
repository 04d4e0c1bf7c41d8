"""`python -m lucebox bench decode`: prefill and decode speed, this engine vs transformers.

Both run the same model file on the same device in the same process:
- prefill tok/s: one prompt of L tokens, time to its first sampled token;
- decode tok/s: B sequences (32-token prompts) generating `gen_len` tokens
  each, counting only the steps after every prefill is done.
transformers runs eager with its KV cache (`DynamicCache`), greedy, the way
`generate` does it, but timed around the same steps.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from lucebox.bench.report import environment, print_table, write_json
from lucebox.engine.llm_engine import LLMEngine
from lucebox.engine.sampler import SamplingParams
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


def main(args: argparse.Namespace) -> int:
    from lucebox.cli import engine_from_args

    prompt_lens = [int(x) for x in args.prompt_lens.split(",") if x]
    batch_sizes = [int(x) for x in args.batch_sizes.split(",") if x]
    engine = engine_from_args(args, max_num_seqs=max(batch_sizes), max_step_tokens=max(prompt_lens + [2048]))
    device = engine.device
    hf = None if args.no_hf else load_hf(engine.loaded.path, engine)
    rows: list[list[Any]] = []
    results: list[dict[str, Any]] = []
    progress = Progress("bench decode", total=len(prompt_lens) + len(batch_sizes), unit="cases")

    for n in prompt_lens:
        ids = _prompt(engine, n, seed=n)
        ours = n / _median(lambda ids=ids: lucebox_prefill(engine, ids), device)
        theirs = n / _median(lambda ids=ids: hf_prefill(hf, ids, device), device) if hf else None
        rows.append([f"prefill {n} tokens", "tok/s", ours, theirs, ours / theirs if theirs else None])
        results.append({"kind": "prefill", "tokens": n, "lucebox_tok_s": ours, "transformers_tok_s": theirs})
        progress.advance()

    gen = args.gen_len
    for b in batch_sizes:
        prompts = [_prompt(engine, 32, seed=1000 + i) for i in range(b)]
        ours = b * (gen - 1) / statistics.median(lucebox_decode(engine, prompts, gen) for _ in range(REPEATS))
        theirs = None
        if hf:
            hf_decode(hf, prompts, 4, device)  # warm-up
            theirs = b * (gen - 1) / statistics.median(hf_decode(hf, prompts, gen, device) for _ in range(REPEATS))
        rows.append([f"decode batch {b}", "tok/s", ours, theirs, ours / theirs if theirs else None])
        results.append({"kind": "decode", "batch": b, "gen_len": gen, "lucebox_tok_s": ours,
                        "transformers_tok_s": theirs})
        progress.advance()
    progress.close()

    cfg = engine.model_config
    title = (f"bench decode: {cfg.name} ({engine.loaded.quant} file, {str(engine.loaded.dtype)[6:]}) on {device}"
             f"{' [CUDA graphs]' if engine.runner.uses_cuda_graphs else ''}")
    print_table(title, ["case", "unit", "lucebox", "transformers", "ratio"], rows)
    write_json(args.json, {"benchmark": "decode", "model": str(engine.loaded.path), "dtype": str(engine.loaded.dtype),
                           "cuda_graphs": engine.runner.uses_cuda_graphs, "env": environment(device),
                           "results": results})
    return 0
