"""`python -m lucebox bench spec-cost`: what one speculative step costs against a plain one, on any model.

DFlash pays when a verification commits more tokens (tau) than it costs plain steps (r = speculative step time
/ plain step time, at the same decode batch): the speedup is tau / r. tau comes from the drafter and the text
(`bench spec` measures it with a trained drafter); r comes from the engine alone, so it can be measured on a
random-weight model of any shape (`--shape qwen3.5-27b --mix Q4_K_M`, as `bench decode` writes it) with a
random drafter of the real size (`--draft-layers 5`, block 16: the public DFlash drafters' shape). A random
drafter's proposals are rejected, so every timed step drafts and verifies its whole block or tree: the
full cost. Timing is adaptive speculation's own (`spec.adaptive.time_steps`, the engine's steps, CUDA graphs
as the server runs them). The table gives r for the chain and for DDTree at each `--budgets` and the
projected speedup tau / r at `--taus` (none where tau exceeds the rows a step verifies: a step commits at
most that many tokens). `--profile N` then accounts for the difference: N more steps of plain decoding and of
each one-launch configuration at the first batch, profiled kernel by kernel, side by side; the step time less
its kernels' busy time is what the GPU spent idle between them.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path
from typing import Any

from lucebox.bench.report import environment, print_table, write_json
from lucebox.errors import LuceboxError
from lucebox.progress import Progress


def _ints(text: str, what: str, low: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < low:
        raise LuceboxError(f"bench spec-cost: {what} takes a comma-separated list of integers >= {low}, not {text!r}")
    return values


def _taus(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1 or max(values) > 64:
        raise LuceboxError(f"bench spec-cost: --taus takes a comma-separated list of numbers in [1, 64], not {text!r}")
    return values


def main(args: argparse.Namespace) -> int:
    """With `--shape`, first write that random-weight model (to a temporary folder) and bench it instead."""
    budgets, batches = _ints(args.budgets, "--budgets", 1), _ints(args.batch_sizes, "--batch-sizes", 1)
    taus = _taus(args.taus)
    if args.draft_layers < 1 or args.block < 2 or args.steps < 1 or args.context < 1 or args.profile < 0:
        raise LuceboxError("bench spec-cost: --draft-layers >= 1, --block >= 2, --steps >= 1, --context >= 1 "
                           "and --profile >= 0")
    if args.shape is None:
        return _run(args, budgets, batches, taus)
    from lucebox.bench.decode import write_random_model
    from lucebox.fetch import resolve_model

    with tempfile.TemporaryDirectory(prefix="lucebox-spec-cost-") as tmp:
        path = write_random_model(Path(tmp) / f"random-{args.shape}-{args.mix}.gguf", args.shape,
                                  resolve_model(args.model), args.mix, context=4096)
        return _run(argparse.Namespace(**{**vars(args), "model": str(path)}), budgets, batches, taus)


def _run(args: argparse.Namespace, budgets: list[int], batches: list[int], taus: list[float]) -> int:
    from lucebox.cli import engine_from_args
    from lucebox.engine.spec.adaptive import time_steps
    from lucebox.engine.spec.dflash import SpecDecoder
    from lucebox.engine.spec.drafter import DFlashDrafter, drafter_config_for, load_drafter, ready
    from lucebox.engine.weights.quant import linear as quant_linear

    engine = engine_from_args(args, max_num_seqs=max(batches))
    loaded, target = engine.loaded, engine.model_config
    quant_linear.warm_up(loaded.model)  # the quantized kernels' launch configs, as the server's start-up tunes them
    if args.draft:
        drafter = load_drafter(Path(args.draft), target, engine.device, loaded.dtype)
    else:
        dcfg = drafter_config_for(target, layers=args.draft_layers, block_size=args.block,
                                  mask_token_id=target.vocab_size - 1)
        drafter = ready(DFlashDrafter.random(dcfg, seed=0), engine.device, loaded.dtype)
    chain = SpecDecoder(drafter, loaded.model, engine.kv, dtype=loaded.dtype)
    configs = [("chain", chain, True)]
    if engine.device.type == "cuda":  # the same chain in three launches, as a sampled request's steps run
        configs.append(("chain, 3 launches", chain, False))
    for b in budgets:
        tree = SpecDecoder(drafter, loaded.model, engine.kv, ddtree=True, budget=b, dtype=loaded.dtype)
        configs.append((f"ddtree b={b}", tree, True))
        if engine.device.type == "cuda":  # the tree built on the host between three launches (sampled requests)
            configs.append((f"ddtree b={b}, 3 launches", tree, False))
    progress = Progress("bench spec-cost", total=len(configs), unit="configs")
    rows: list[list[Any]] = []
    results: list[dict[str, Any]] = []
    for label, spec, one_launch in configs:
        engine.set_speculation(spec)
        if spec.static is not None:
            spec.static.set_one_launch(one_launch)
        for b, (plain, spec_s) in sorted(time_steps(engine, tuple(batches), args.steps, args.context).items()):
            r, n = spec_s / plain, spec.rows_per_step
            projected = [t / r if t <= n else None for t in taus]  # a step commits at most the rows it verifies
            rows.append([label, n, b, 1e3 * plain, 1e3 * spec_s, r, *projected])
            results.append({"config": label, "rows_verified": n, "batch": b, "context": args.context,
                            "plain_step_ms": 1e3 * plain,
                            "spec_step_ms": 1e3 * spec_s, "cost_ratio": r,
                            "projected_speedup": {f"{t:g}": x for t, x in zip(taus, projected)}})
        progress.advance()
    progress.close()
    if not results:
        engine.set_speculation(None)
        raise LuceboxError("bench spec-cost: no --batch-sizes fit --max-num-seqs and the KV cache")
    cfg = drafter.cfg
    title = (f"bench spec-cost: {target.name} ({loaded.quant} file, {str(loaded.dtype)[6:]}) + "
             f"{'drafter ' + str(args.draft) if args.draft else 'random drafter'} ({cfg.num_layers} "
             f"layer{'s' if cfg.num_layers != 1 else ''}, block "
             f"{cfg.block_size}) on {engine.device}{' [CUDA graphs]' if engine.runner.uses_cuda_graphs else ''}, "
             f"{args.context}-token prompts; "
             f"speedup = tau / r")
    print_table(title, ["config", "rows", "batch", "plain ms", "spec ms", "r", *(f"tau {t:g}" for t in taus)], rows)
    profiled = _profile(engine, configs, results, args) if args.profile else None
    engine.set_speculation(None)
    write_json(args.json, {"benchmark": "spec-cost", "model": str(loaded.path), "shape": args.shape,
                           "drafter": {"path": args.draft, "layers": cfg.num_layers, "block": cfg.block_size},
                           "dtype": str(loaded.dtype), "env": environment(engine.device), "results": results,
                           "profile": profiled})
    return 0


def _profile(engine: Any, configs: list[tuple[str, Any, bool]], results: list[dict[str, Any]],
             args: argparse.Namespace) -> dict[str, Any]:
    """`--profile N`: N steps of plain decoding and of each one-launch configuration at the first measured batch,
    profiled (kernel_profile.recording); a table of the kernels side by side, with each column's busy time and
    launches a step and its step time from the timed run."""
    from lucebox.bench import kernel_profile
    from lucebox.engine.spec.adaptive import time_steps

    batch = results[0]["batch"]
    reports: dict[str, dict[str, Any]] = {}
    for label, spec, one_launch in configs:
        if not one_launch:
            continue
        engine.set_speculation(spec)
        if spec.static is not None:
            spec.static.set_one_launch(True)

        def around(mode: str, _batch: int, label: str = label) -> Any:
            key = "plain" if mode == "plain" else label
            if key in reports:  # plain steps are timed beside every config: profiled once
                return contextlib.nullcontext()
            return kernel_profile.recording(engine.device, args.profile, reports.setdefault(key, {}))

        time_steps(engine, (batch,), args.profile, args.context, around=around)
    timed = {"plain": next(r["plain_step_ms"] for r in results if r["batch"] == batch)}
    timed.update((r["config"], r["spec_step_ms"]) for r in results if r["batch"] == batch)
    labels = list(reports)
    per = {label: {k["name"]: k for k in reports[label]["kernels"]} for label in labels}
    names = sorted({n for kernels in per.values() for n in kernels},
                   key=lambda n: -max(per[label].get(n, {}).get("us_per_step", 0.0) for label in labels))
    rows: list[list[Any]] = [["(step, timed above)", *(x for label in labels for x in (1e3 * timed[label], None))],
                             ["(all kernels: busy, launches)",
                              *(x for label in labels for x in (reports[label]["busy_us_per_step"],
                                                                reports[label]["launches_per_step"]))]]
    for name in names[:30]:
        rows.append([name[:60], *(x for label in labels for x in (per[label].get(name, {}).get("us_per_step"),
                                                                   per[label].get(name, {}).get("calls_per_step")))])
    what = "kernel (CUDA)" if engine.device.type == "cuda" else "op (CPU)"
    print_table(f"bench spec-cost --profile: {args.profile} steps at batch {batch}, us and calls a step by {what}",
                [what, *(f"{label} {c}" for label in labels for c in ("us", "calls"))], rows)
    return {"batch": batch, "steps": args.profile, "step_ms": timed, "reports": reports}
