"""`python -m lucebox spark calibrate --model M --traffic FILES... --out PROFILE`.

Replays the traffic (traffic.py) through the model: each conversation rendered with the model's chat
template, prefilled, then `--decode-tokens` greedy tokens decoded; a RouteCounter (profile.py) counts every
routed (token, expert) pair per layer. Every `--heldout-every`-th conversation (over all files, in the order
given) is held out: its counts are kept apart and give the predicted cold-hit rate of the hot set the
training counts choose. Writes the profile (profile.py documents its keys) and prints one summary line.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

from lucebox.engine.spark import placement
from lucebox.engine.spark.placement import GB, Budget
from lucebox.engine.spark.profile import (
    RouteCounter,
    expert_bytes,
    layout,
    layout_id,
    moe_layers,
    router_fingerprint,
    write_profile,
)
from lucebox.engine.spark.simulate import apply_router_skew, parse_skew
from lucebox.engine.spark.traffic import read_traffic
from lucebox.errors import LuceboxError

log = logging.getLogger("lucebox.spark")


def render(builder: Any, tokenizer: Any, conv: list[dict[str, str]], limit: int) -> list[int]:
    """A conversation's prompt ids through the chat template (raw text if the template refuses it)."""
    try:
        ids = builder.render_ids(conv, add_generation_prompt=True)
    except LuceboxError:
        ids = tokenizer.encode("\n\n".join(m["content"] for m in conv), add_special=True)
    return ids[:limit]


def main(args: argparse.Namespace) -> int:
    from lucebox.chat.prompt import PromptBuilder
    from lucebox.cli import engine_config, engine_from_args
    from lucebox.engine.runtime.sampler import SamplingParams
    from lucebox.fetch import resolve_model
    from lucebox.progress import Progress

    for flag, value, least in (("--decode-tokens", args.decode_tokens, 0), ("--heldout-every", args.heldout_every, 0),
                               ("--max-prompt-tokens", args.max_prompt_tokens, 1), ("--batch", args.batch, 1)):
        if value < least:
            raise LuceboxError(f"{flag} must be >= {least}, got {value}")
    if args.heldout_every == 1:
        raise LuceboxError("--heldout-every 1 would hold out everything: give 0 (none) or N >= 2")
    budget = Budget.parse(args.expert_gpu_budget)
    skew = parse_skew(args.router_skew, getattr(args, "tensor_parallel", None))
    files = [read_traffic(p) for p in args.traffic]  # bad files fail before the model loads
    if not args.out.parent.is_dir():
        raise LuceboxError(f"--out {args.out}: no folder {args.out.parent}")
    if args.offload_budget is not None:
        from lucebox.engine.spark.engine import SparkConfig, spark_engine

        engine, _ = spark_engine(resolve_model(args.model), engine_config(args, cuda_graphs=False),
                                 SparkConfig(budget=args.offload_budget, placement="uniform"))
    else:
        engine = engine_from_args(args, cuda_graphs=False)
    loaded = engine.loaded
    layers = moe_layers(loaded.model)
    if skew is not None:
        apply_router_skew(loaded.model, skew, loaded.dtype)
    builder = PromptBuilder.for_model(loaded)
    limit = min(args.max_prompt_tokens, engine.n_ctx - args.decode_tokens - 1)
    jobs: dict[str, list[list[int]]] = {"train": [], "heldout": []}
    per_file = []
    index = 0
    for f in files:
        entry = {"file": f.path.name, "sha256": f.sha256, "conversations": 0, "tokens": 0,
                 "heldout_conversations": 0, "heldout_tokens": 0}
        for conv in f.conversations:
            ids = render(builder, engine.tokenizer, conv, limit)
            index += 1
            held = args.heldout_every > 0 and index % args.heldout_every == 0
            jobs["heldout" if held else "train"].append(ids)
            prefix = "heldout_" if held else ""
            entry[prefix + "conversations"] += 1
            entry[prefix + "tokens"] += len(ids)
        per_file.append(entry)
    counter = RouteCounter(layers, loaded.device)
    counter.attach()
    params = SamplingParams(max_tokens=args.decode_tokens + 1, ignore_eos=True)
    counts: dict[str, dict[int, list[int]]] = {}
    start = time.monotonic()
    try:
        for split, prompts in jobs.items():
            progress = Progress(f"spark calibrate ({split})", total=len(prompts), unit="conversations")
            for i in range(0, len(prompts), args.batch):
                engine.generate(prompts[i:i + args.batch], params)
                progress.advance(len(prompts[i:i + args.batch]))
            progress.close()
            counts[split] = counter.take()
    finally:
        counter.detach()
    seconds = time.monotonic() - start
    body = profile_body(loaded, per_file, counts, budget, args, skew)
    write_profile(args.out, body)
    tokens = sum(e["tokens"] for e in per_file)
    held = sum(e["heldout_tokens"] for e in per_file)
    pred, uni = body["predicted_cold_hit_rate"], body["uniform_cold_hit_rate"]
    rate = ("no held-out conversations (--heldout-every, or more traffic)" if pred is None else
            f"predicted cold-hit rate {pred:.1%} on the held-out split (uniform placement {uni:.1%})")
    print(f"{args.out}: {tokens} tokens calibrated, {held} held out, in {seconds:.1f}s; budget {budget}: "
          f"{body['placement']['hot_experts']} of {body['placement']['experts']} experts hot; {rate}"
          + (f"; SIMULATION zipf:{skew:g}" if skew is not None else ""))
    return 0


def profile_body(loaded: Any, per_file: list[dict[str, Any]],
                 counts: dict[str, dict[int, list[int]]], budget: Budget, args: argparse.Namespace,
                 skew: float | None) -> dict[str, Any]:
    """The profile's keys (profile.py's docstring) from the counted splits."""
    model = loaded.model
    lay = layout(model, loaded.config.arch, loaded.quant)
    sizes = {i: expert_bytes(m) for i, m in moe_layers(model).items()}
    total = lay["n_experts"] * sum(sizes.values())
    budget_bytes = min(budget.bytes(total), total)
    hot = placement.calibrated(counts["train"], sizes, budget_bytes)
    uni = placement.uniform(lay["n_experts"], sizes, budget_bytes)
    heldout = counts["heldout"]
    return {
        "layout": lay, "layout_id": layout_id(lay), "router_fingerprint": router_fingerprint(model),
        "router_skew": None if skew is None else f"zipf:{skew:g} (simulation)",
        "model": str(loaded.path), "traffic": per_file, "decode_tokens": args.decode_tokens,
        "heldout_every": args.heldout_every, "max_prompt_tokens": args.max_prompt_tokens,
        "routed": {split: sum(sum(v) for v in c.values()) for split, c in counts.items()},
        "counts": {str(k): v for k, v in counts["train"].items()},
        "heldout_counts": {str(k): v for k, v in heldout.items()},
        "placement": {"budget": str(budget), "budget_bytes": budget_bytes, "budget_gb": round(budget_bytes / GB, 4),
                      "expert_bytes_total": total, "hot": {str(k): v for k, v in hot.items()},
                      "hot_experts": sum(len(v) for v in hot.values()), "experts": lay["n_experts"] * len(sizes)},
        "predicted_cold_hit_rate": placement.cold_hit_rate(heldout, hot),
        "uniform_cold_hit_rate": placement.cold_hit_rate(heldout, uni),
        "train_cold_hit_rate": placement.cold_hit_rate(counts["train"], hot),
    }
