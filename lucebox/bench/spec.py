"""`python -m lucebox bench spec`: DFlash speculative decoding vs plain decoding of the same engine.

Per suite (HumanEval, GSM8K, MATH, MT-Bench first turns; never used in
drafter training), batch 1, greedy, up to `--max-new` tokens per prompt:
plain decoding, chain verify, and DDTree at a few budgets, then temperature 1
for plain and chain. Reports per configuration the acceptance length τ
(tokens per target forward), decode tok/s and the speedup over plain decoding
measured in the same run. Greedy speculative output is checked equal to
plain output (it must be, in fp32: speculation is lossless), and the greedy
token agreement rate is reported (`agree`: in bf16 a verify pass and a plain
step may round a close call differently).

Each configuration runs every suite after one start-up warm-up of its own
(`LLMEngine.warm_up`: every CUDA graph bucket its steps can reach, the adaptive
rule's measured cost ratio), as the server runs it: a graph captured inside a
timed run (each new context bucket of a speculative step captures three) was
counted as decode time.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from lucebox.bench.report import environment, print_table, write_json
from lucebox.bench.suites import SUITES, load_suite
from lucebox.engine.runtime.llm_engine import LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.errors import LuceboxError
from lucebox.progress import Progress


def _sync(engine: LLMEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def run_config(engine: LLMEngine, spec: Any, prompts: list[list[int]], params: SamplingParams,
               seed: int | None) -> dict[str, Any]:
    """Generate every prompt alone (batch 1) with the engine's current speculation `spec` (warmed up);
    returns outputs, tokens, seconds and τ."""
    if spec is not None:
        spec.stats.steps = spec.stats.committed = spec.stats.drafted = 0
    if engine.adaptive is not None:  # each configuration starts as a fresh server would
        engine.adaptive.forget()
    outputs = []
    _sync(engine)
    t = time.perf_counter()
    for i, ids in enumerate(prompts):
        p = SamplingParams(**{**params.__dict__, "seed": None if seed is None else seed + i})
        outputs.append(engine.generate([ids], p)[0])
    _sync(engine)
    seconds = time.perf_counter() - t
    tokens = sum(len(o) for o in outputs)
    tau = spec.stats.acceptance_length if spec is not None else 1.0
    return {"outputs": outputs, "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "tau": tau}


def agreement(outputs: list[list[int]], plain: list[list[int]]) -> float:
    """The greedy token agreement rate with plain decoding: each prompt's tokens up to its first difference from
    the plain output, over all plain tokens (1.0: identical; in bf16 a verify pass and a decode step may round
    differently, and after the first different token the two outputs go their own ways)."""
    same = 0
    for out, ref in zip(outputs, plain):
        for a, b in zip(out, ref):
            if a != b:
                break
            same += 1
    return same / max(1, sum(len(ref) for ref in plain))


def _depth(text: str) -> int:
    if not text.isdigit():
        raise LuceboxError(f"--tree-chain: {text!r} is neither auto nor a depth")
    return int(text)


def main(args: argparse.Namespace) -> int:
    from lucebox.chat.prompt import PromptBuilder
    from lucebox.cli import engine_from_args
    from lucebox.engine.spec.dflash import SpecDecoder
    from lucebox.engine.spec.drafter import load_drafter
    from lucebox.model_cards import card_dirs, find_card

    chains = [None if c == "auto" else _depth(c) for c in args.tree_chain.split(",") if c]
    engine = engine_from_args(args, max_num_seqs=1)
    loaded = engine.loaded
    draft = args.draft
    if draft is None:
        from lucebox.fetch import lucebox_home

        card = find_card([loaded.config.name, loaded.path.stem, loaded.path.stem.split(".")[0]],
                         card_dirs(lucebox_home()))
        draft = card.drafter_path() if card else None
    if draft is None:
        raise LuceboxError("no drafter: pass --draft DIR (the model card names none for this model)")
    drafter = load_drafter(Path(draft), loaded.config, engine.device, loaded.dtype)
    budgets = [int(b) for b in args.budgets.split(",") if b]
    chain = SpecDecoder(drafter, loaded.model, engine.kv, dtype=loaded.dtype)
    configs: list[tuple[str, Any]] = [("plain", None), ("chain", chain)]
    configs += [(f"ddtree b={b}" + ("" if c is None else f" chain={c}"),
                 SpecDecoder(drafter, loaded.model, engine.kv, ddtree=True, budget=b, dtype=loaded.dtype,
                             tree_chain=c))
                for b in budgets for c in chains]
    builder = PromptBuilder.for_model(loaded)
    suites = [s for s in args.suite.split(",") if s]
    for s in suites:
        if s not in SUITES:
            raise LuceboxError(f"unknown suite {s!r} (choose from {', '.join(SUITES)})")
    greedy = SamplingParams(max_tokens=args.max_new)
    hot = SamplingParams(temperature=1.0, max_tokens=args.max_new)
    hot_labels = {configs[0][0], configs[1][0]} | ({configs[-1][0]} if budgets else set())
    prompts = {s: [builder.render_ids(m) for m in load_suite(s, args.data_dir)[: args.prompts]] for s in suites}
    progress = Progress("bench spec", total=len(suites) * (len(configs) + len(hot_labels)), unit="runs")
    runs: dict[tuple[str, str, str], dict[str, Any]] = {}
    for label, spec in configs:  # one warm-up per configuration, then every suite
        engine.set_speculation(spec)
        engine.warm_up(progress=False)
        for suite in suites:
            runs[suite, label, "greedy"] = run_config(engine, spec, prompts[suite], greedy, seed=None)
            progress.advance()
            if label in hot_labels:
                runs[suite, label, "T=1"] = run_config(engine, spec, prompts[suite], hot, seed=1234)
                progress.advance()
    rows: list[list[Any]] = []
    results: list[dict[str, Any]] = []
    for suite in suites:
        for sampling in ("greedy", "T=1"):
            base = runs[suite, "plain", sampling]
            for label, _ in configs:
                r = runs.get((suite, label, sampling))
                if r is None:
                    continue
                greedy_run = sampling == "greedy"
                same = r["outputs"] == base["outputs"] if greedy_run else None
                agree = agreement(r["outputs"], base["outputs"]) if greedy_run else None
                rows.append([suite, label, sampling, r["tau"], r["tok_s"], r["tok_s"] / base["tok_s"], same, agree])
                results.append({"suite": suite, "config": label, "temperature": 0 if greedy_run else 1,
                                "tau": r["tau"], "tok_s": r["tok_s"], "speedup": r["tok_s"] / base["tok_s"],
                                "tokens": r["tokens"],
                                **({"identical_to_plain": same, "agreement": agree} if greedy_run else {})})
    progress.close()
    engine.set_speculation(None)
    title = (f"bench spec: {loaded.config.name} + DFlash drafter {draft} ({drafter.cfg.num_layers} layers, block "
             f"{drafter.cfg.block_size}) on {engine.device}, batch 1, {args.prompts} prompts/suite, "
             f"max {args.max_new} new tokens")
    print_table(title, ["suite", "config", "sampling", "tau", "tok/s", "speedup", "identical", "agree"], rows)
    write_json(args.json, {"benchmark": "spec", "model": str(loaded.path), "drafter": str(draft),
                           "dtype": str(loaded.dtype), "env": environment(engine.device), "results": results})
    return 0
