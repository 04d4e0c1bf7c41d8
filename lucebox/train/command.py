"""Train a DFlash drafter for a target by self-distillation (docs/spec/DFLASH.md, "Training a drafter").

`python -m lucebox train-drafter --target MODEL --out DIR`:

1. Prompts: the training split of lucebox.train.data (the suites `bench spec`
   measures are never used), rendered with the target's chat template; with
   `--self-prompts N` also N user messages the target writes itself
   (lucebox.train.self_prompts; cached in OUT/self-prompts.npz).
2. Responses: the target generates them (greedy by default), batched through
   LLMEngine. The token ids are cached in OUT/examples.npz: a second run, or a
   resumed one, does not regenerate (an interrupted generation resumes too).
   `--responses N` adds N-1 sampled responses per prompt (`--sample-temperature`,
   seeded; OUT/examples-1.npz ...).
3. Target features: before the first step the frozen target runs one full forward
   per sequence capturing `target_layer_ids` (the feature at position j is those
   layers' outputs at j, after token j), stored in OUT/features.bin (memory-mapped,
   reused by every epoch and by --resume; `--feature-cache off`: recomputed in
   every step instead, for data too large for the disk).
   Training step, per sequence `tok` (prompt + response, length T):
   - up to `anchors` positions a are drawn among the response positions with
     a <= T-B; anchor a makes the block [tok[a], MASK x (B-1)] at positions
     a..a+B-1, which attends to the context features of positions < a only
     (strictly), to its own B rows both ways, and to no other block. This is
     exactly what SpecDecoder.draft_logprobs sees when it drafts after tok[0..a]
     are committed (context = features 0..a-1, first block token = tok[a]);
   - row k (1..B-1) predicts tok[a+k]; cross-entropy weighted w_k = exp(-(k-1)/gamma);
     the logits are the target's LM head (the tensor the target itself uses:
     tied embedding or `output`) applied to drafter.norm(h), as at inference.
   All sequences of a step and all their blocks go through the drafter in one packed
   forward (lucebox.train.packed: flex_attention block masks on CUDA), the same loss as
   one sequence at a time. AdamW, linear warm-up then cosine decay, gradient clipping;
   bf16 autocast on CUDA, fp32 on CPU. `--bench-trainer N` times N steps of the
   per-sequence and of the packed step on the same data instead of training.
4. Checkpoints: OUT/config.json + OUT/model.safetensors (the public layout, via
   save_drafter) and OUT/checkpoint/ (fp32 weights, optimizer, step; shards of at most
   16 MB and an index.json) for `--resume`; `--export` rewrites the public layout from
   OUT/checkpoint alone. The acceptance length tau, measured by the real decode loop
   (LLMEngine with the drafter, greedy) on held-out prompts, is printed at the
   start (fresh drafter), at checkpoints and at the end.

Training metrics, per log line: the weighted loss, `acc@k` (row k's accuracy),
`tau(walk)` = what chain decoding would get along the trained sequences (computed
from the blocks when every response position was an anchor: the metric that must
equal the decode loop's tau on those sequences; a trainer with an off-by-one shows
high accuracy and a real tau ~ 1) and `tau(blocks)` = 1 + the mean accepted rows of
a block (uniform over positions, so optimistic when misses cluster where a decode
loop's blocks start, right after a rejection); then tok/s, rows/s (block rows trained
per second, the figure `--bench-trainer` compares) and the ETA of the run.

This module is the command: main, and run_training (the loop with its log lines, checkpoints, evaluations
and run limits). The pieces live beside it: examples.py (step 2), features.py (the target's features),
loss.py (the objective of step 3), trainer.py (the optimizer and checkpoints), acceptance.py (tau, measured
and simulated), data.py (step 1's prompts), packed.py (the packed forward), checkpoint.py (sharded
checkpoints).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lucebox.engine.runtime.llm_engine import DTYPES, EngineConfig
from lucebox.engine.spec.drafter import DFlashDrafter, load_drafter, save_drafter
from lucebox.engine.weights.loader import LoadedModel
from lucebox.errors import LuceboxError
from lucebox.train.acceptance import BlockStats, measure_acceptance
from lucebox.train.examples import generate_examples, generation_engine
from lucebox.train.log import hms, say
from lucebox.train.loss import loss_gamma
from lucebox.train.trainer import FEATURES, TrainConfig, Trainer, export_drafter, lr_at, new_drafter

BENCH = "bench_trainer.json"
EXAMPLES = "examples.npz"
SELF_PROMPTS = "self-prompts.npz"  # the user messages --self-prompts had the target write
TRAIN_LOG = "train_log.jsonl"
SUMMARY = "summary.json"


@dataclass
class RunOptions:
    """What a run does besides the optimization (may change between resumed runs)."""

    out: Path
    log_every: int = 10
    save_every: int = 500
    eval_every: int = 0  # 0: at every checkpoint
    eval_prompts: list[list[int]] = field(default_factory=list)
    eval_tokens: int = 128
    eval_ddtree_budget: int = 22  # 0: no DDTree measurement at the end
    time_limit: float | None = None  # seconds; then checkpoint and stop
    time_budget: float | None = None  # seconds; the step count (and LR schedule) shrinks to fit
    stop_after: int | None = None  # steps in this run; then checkpoint and stop
    deadline: float | None = None  # time.monotonic() at which to checkpoint and stop (--wall-limit)
    quiet: bool = False


def _log_row(step: int, total: int, stats: BlockStats, lr: float, seconds: float, tokens: int) -> dict[str, Any]:
    acc = stats.accuracy
    return {"step": step, "total": total, "loss": stats.mean_loss, "acc": acc, "tau_walk": stats.tau_walk,
            "tau_blocks": stats.tau_blocks, "lr": lr,
            "blocks": stats.blocks, "seconds": seconds, "tok_s": tokens / max(seconds, 1e-9),
            "rows_s": stats.blocks * (len(acc) + 1) / max(seconds, 1e-9)}


def _fmt_row(r: dict[str, Any], eta: float | None) -> str:
    acc = r["acc"]
    picks = [k for k in (1, 2, 4, 8, 15) if k <= len(acc)]
    accs = " ".join(f"{acc[k - 1]:.2f}" for k in picks)
    return (f"step {r['step']}/{r['total']} loss {r['loss']:.4f} acc@1 {acc[0] if acc else float('nan'):.3f} "
            f"acc@{','.join(map(str, picks))} [{accs}] tau(walk) {r['tau_walk']:.2f} tau(blocks) {r['tau_blocks']:.2f} "
            f"lr {r['lr']:.2e} "
            f"{r['tok_s']:,.0f} tok/s {r['rows_s']:,.0f} rows/s" + (f" eta {hms(eta)}" if eta is not None else ""))


def run_training(trainer: Trainer, opts: RunOptions) -> dict[str, Any]:
    """Train to the configured step count (or the run's limits), with progress, checkpoints and evaluations."""
    out = opts.out
    total = cap = trainer.cfg.steps
    start_step = trainer.step
    t0 = time.monotonic()
    window = BlockStats()
    window_tokens = 0
    window_t = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    log_file = (out / TRAIN_LOG).open("a", encoding="utf-8")
    stopped = None
    eval_every = opts.eval_every or opts.save_every
    try:
        while trainer.step < total:
            idx = trainer.batch_indices(trainer.step)
            stats = trainer.train_step()
            window.merge(stats)
            window_tokens += sum(len(trainer.examples[i].tokens) for i in idx)
            step = trainer.step
            if step % opts.log_every == 0 or step == total:
                now = time.monotonic()
                row = _log_row(step, total, window, lr_at(step - 1, total, trainer.cfg.lr, trainer.cfg.warmup),
                               now - window_t, window_tokens)
                done = step - start_step
                eta = (now - t0) / done * (total - step) if done else None
                trainer.history.append(row)
                log_file.write(json.dumps(row) + "\n")
                log_file.flush()
                if not opts.quiet:
                    say(_fmt_row(row, eta))
                window, window_tokens, window_t = BlockStats(), 0, now
            if opts.time_budget is not None and step - start_step >= 3:
                total = fit_steps(step, step - start_step, time.monotonic() - t0, opts.time_budget, cap)
                trainer.cfg.steps = total
            limit = opts.time_limit is not None and time.monotonic() - t0 >= opts.time_limit
            limit |= opts.stop_after is not None and step - start_step >= opts.stop_after
            limit |= opts.deadline is not None and time.monotonic() >= opts.deadline
            if step % opts.save_every == 0 or step == total or limit:
                trainer.save(out)
                if opts.eval_prompts and (step % eval_every == 0 or step == total):
                    _evaluate(trainer, opts, step, "chain")
            if limit and step < total:
                stopped = step
                break
    finally:
        log_file.close()
    if stopped is not None:
        say(f"train-drafter: stopped at step {stopped}/{total} (run limit); continue with --resume")
    elif opts.eval_prompts and opts.eval_ddtree_budget:
        _evaluate(trainer, opts, trainer.step, f"ddtree{opts.eval_ddtree_budget}")
    trainer.save(out)
    return {"step": trainer.step, "total": total, "finished": stopped is None,
            "seconds": time.monotonic() - t0, "last": trainer.history[-1] if trainer.history else None}


def fit_steps(step: int, done: int, elapsed: float, budget: float, total: int) -> int:
    """The step count that ends near `budget` seconds at the pace so far (never more than `total`); `step`
    itself once the budget is spent, so the run ends (checkpoint, evaluations) at this step.

    The pace includes evaluations and checkpoints, so it errs on the short side."""
    left = max(0.0, budget - elapsed)
    return max(step, min(total, step + int(left / (elapsed / done))))


def _evaluate(trainer: Trainer, opts: RunOptions, step: int, mode: str) -> dict[str, Any]:
    ddtree = mode.startswith("ddtree")
    acc = measure_acceptance(trainer.loaded, opts.out, opts.eval_prompts, opts.eval_tokens, ddtree=ddtree,
                             budget=opts.eval_ddtree_budget or 22)
    row = {"step": step, "mode": mode, "tau": acc.tau, "steps": acc.steps, "committed": acc.committed,
           "prompts": len(opts.eval_prompts), "seconds": acc.seconds}
    trainer.evals.append(row)
    if not opts.quiet:
        say(f"eval step {step}: tau {acc.tau:.2f} ({mode}, real decode loop, {len(opts.eval_prompts)} held-out "
             f"prompts, {acc.committed} tokens in {acc.steps} verify steps, {acc.seconds:.1f}s)")
    return row


def evaluate_fresh(loaded: LoadedModel, drafter: DFlashDrafter, opts: RunOptions, save_dtype: str) -> float:
    """tau of a drafter before training (a freshly initialised one: ~1), by the real decode loop."""
    folder = opts.out / ".fresh"
    save_drafter(copy.deepcopy(drafter).to(DTYPES[save_dtype]), folder)
    try:
        return measure_acceptance(loaded, folder, opts.eval_prompts, opts.eval_tokens).tau
    finally:
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()


def bench_trainer(trainer: Trainer, steps: int, out: Path) -> int:
    """`--bench-trainer N`: rows/s of the per-sequence and of the packed step, same data, one run
    (also in OUT/bench_trainer.json)."""
    res = trainer.bench(steps)
    res["device"] = str(trainer.device)
    res["batch"], res["anchors"], res["block"] = trainer.cfg.batch, trainer.cfg.anchors, trainer.drafter.cfg.block_size
    (out / BENCH).write_text(json.dumps(res, indent=2) + "\n")
    for mode in ("sequential", "packed"):
        r = res[mode]
        say(f"bench trainer: {mode:10s} {r['steps']} steps in {r['seconds']:.2f}s, {r['rows_s']:,.0f} rows/s")
    say(f"bench trainer: packed / per-sequence = {res['speedup']:.1f}x on {trainer.device} (batch {trainer.cfg.batch}, "
        f"<= {trainer.cfg.anchors} anchors, block {res['block']}); losses differ by at most "
        f"{res['max_loss_rel_diff']:.1e} (relative); {out / BENCH}")
    return 0


def main(args: argparse.Namespace) -> int:
    """`python -m lucebox train-drafter`: prompts → target responses → drafter training → tau."""
    started = time.monotonic()
    from lucebox.chat.prompt import PromptBuilder
    from lucebox.engine.weights.loader import load_model
    from lucebox.fetch import resolve_model
    from lucebox.train import data

    t_start = time.monotonic()
    out: Path = args.out
    if args.export:
        say(f"train-drafter: drafter in {export_drafter(out)} (from {out}/checkpoint)")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    ecfg = EngineConfig(device=args.device, dtype=args.dtype)
    device = ecfg.resolve_device()
    loaded = load_model(resolve_model(args.target), device=device, dtype=ecfg.resolve_dtype(device), quiet=args.quiet)
    builder = PromptBuilder.for_model(loaded)

    # Prompts: the training split, rendered, filtered by length, optionally subsampled (seeded).
    sources = [s for s in args.sources.split(",") if s]
    if not args.prompts and "file" in sources:
        sources.remove("file")
    prompts, counts = data.training_prompts(args.data_dir, sources=sources, files=args.prompts, seed=args.seed,
                                            swe_per_issue=args.swe_per_issue, math_count=args.math_prompts)
    if args.self_prompts > 0:  # user messages the target writes itself (cached like the responses)
        from lucebox.train.self_prompts import self_prompts

        written = self_prompts(loaded, builder, args.self_prompts, seed=args.seed, batch=args.gen_batch,
                               cache=out / SELF_PROMPTS, quiet=args.quiet)
        kept = data.drop_eval_overlap(written, args.data_dir)
        counts["self"] = len(kept)
        counts["dropped_eval_overlap"] += len(written) - len(kept)
        prompts += kept
    ids = [data.render(builder, p) for p in prompts]
    keep = [i for i, x in enumerate(ids) if len(x) <= args.max_prompt_tokens]
    if args.max_prompts is not None and len(keep) > args.max_prompts:
        gen = torch.Generator().manual_seed(args.seed)
        keep = sorted(keep[i] for i in torch.randperm(len(keep), generator=gen)[: args.max_prompts].tolist())
    train_ids = [ids[i] for i in keep]
    if not train_ids:
        raise LuceboxError("no training prompts left (check --sources, --max-prompt-tokens, --prompts)")
    say(f"train-drafter: {len(train_ids)} training prompts ({', '.join(f'{k} {v}' for k, v in counts.items())}; "
         f"{len(ids) - len(keep)} left out by --max-prompt-tokens/--max-prompts), target {loaded.config.name} "
         f"on {device} ({loaded.dtype})")
    eval_ids: list[list[int]] = []
    if args.eval_prompts > 0:
        eval_ids = [data.render(builder, p) for p in data.eval_prompts(args.data_dir)][: args.eval_prompts]

    # Responses from the target itself (cached).
    longest = max(len(x) for x in train_ids)
    engine = generation_engine(loaded, max(args.gen_batch, args.batch), longest, args.max_new_tokens)
    examples = []
    for r in range(args.responses):  # the first at --temperature, the others sampled, each with its own seeds
        cache = out / (EXAMPLES if r == 0 else f"examples-{r}.npz")
        temp = args.temperature if r == 0 else args.sample_temperature
        examples += generate_examples(loaded, train_ids, max_new_tokens=args.max_new_tokens, temperature=temp,
                                      seed=args.seed + r * 1_000_003, batch=args.gen_batch, cache=cache,
                                      engine=engine, quiet=args.quiet)
    n_resp = sum(e.response_len for e in examples)
    say(f"train-drafter: {len(examples)} examples, {n_resp} response tokens "
         f"(mean {n_resp / len(examples):.0f}), {sum(len(e.tokens) for e in examples)} tokens in all")

    opts = RunOptions(out=out, log_every=args.log_every, save_every=args.save_every, eval_every=args.eval_every,
                      eval_prompts=eval_ids, eval_tokens=args.eval_tokens, eval_ddtree_budget=args.eval_ddtree_budget,
                      time_limit=args.time_limit, time_budget=args.time_budget, stop_after=args.stop_after,
                      deadline=None if args.wall_limit is None else started + args.wall_limit, quiet=args.quiet)
    if args.resume:
        trainer = Trainer.resume(loaded, engine, examples, out, args.feature_cache, args.max_rows, args.quiet,
                                 args.attention)
        say(f"train-drafter: resuming at step {trainer.step}/{trainer.cfg.steps}")
    else:
        if args.init is not None:
            drafter = load_drafter(args.init, loaded.config, device, torch.float32)
        else:
            target_layers = [int(x) for x in args.target_layers.split(",")] if args.target_layers else None
            drafter = new_drafter(loaded, layers=args.layers, block_size=args.block_size, target_layers=target_layers,
                                  n_target_layers=args.n_target_layers, mask_token_id=args.mask_token_id,
                                  heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                                  intermediate=args.intermediate, seed=args.seed)
        n_usable = sum(1 for e in examples if e.response_len >= drafter.cfg.block_size)
        steps = args.steps or max(1, math.ceil(args.epochs * n_usable / args.batch))
        tcfg = TrainConfig(steps=steps, batch=args.batch, anchors=args.anchors, lr=args.lr, warmup=args.warmup,
                           weight_decay=args.weight_decay, grad_clip=args.grad_clip, gamma=args.gamma, seed=args.seed,
                           save_dtype=args.save_dtype)
        if (out / TRAIN_LOG).exists():
            (out / TRAIN_LOG).unlink()
        trainer = Trainer(loaded, engine, examples, drafter, tcfg, args.feature_cache, out, args.max_rows, args.quiet,
                          args.attention)
        d = drafter.cfg
        n_params = sum(p.numel() for p in trainer.drafter.parameters())
        say(f"train-drafter: drafter {d.num_layers} layers, block {d.block_size}, target layers "
             f"{d.target_layer_ids}, heads {d.num_heads}/{d.num_kv_heads}x{d.head_dim}, ffn {d.intermediate_size}, "
             f"mask token {d.mask_token_id}, {n_params / 1e6:.2f}M parameters "
             f"({n_params * DTYPES[args.save_dtype].itemsize / 1e6:.1f} MB as {args.save_dtype}); "
             f"{steps} steps x {args.batch} sequences x <= {args.anchors} blocks, gamma "
             f"{args.gamma or loss_gamma(d.block_size):.2f}; target features "
             f"{trainer.feature_bytes() / 2**30:.2f} GiB, " +
             (f"stored in {out / FEATURES}.bin" if trainer.store is not None else "recomputed every step"))
        if args.bench_trainer:
            return bench_trainer(trainer, args.bench_trainer, out)
        if eval_ids:
            tau0 = evaluate_fresh(loaded, trainer.drafter, opts, args.save_dtype)
            trainer.evals.append({"step": 0, "mode": "chain", "tau": tau0, "prompts": len(eval_ids)})
            say(f"eval step 0: tau {tau0:.2f} (chain, freshly initialised drafter, real decode loop)")
    result = run_training(trainer, opts)
    summary = {"target": str(loaded.path), "drafter": str(out), "device": str(device), "train_prompts": counts,
               "n_examples": len(examples), "response_tokens": n_resp, "eval_prompts": len(eval_ids),
               "eval_tokens": args.eval_tokens, "config": asdict(trainer.cfg),
               "drafter_config": trainer.drafter.cfg.to_json(), "evals": trainer.evals, "result": result,
               "wall_seconds": time.monotonic() - t_start}
    (out / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    chain = [e for e in trainer.evals if e["mode"] == "chain"]
    if len(chain) >= 1 and result["finished"]:
        tree = [e for e in trainer.evals if e["mode"].startswith("ddtree")]
        say(f"train-drafter: tau on {len(eval_ids)} held-out prompts: fresh {chain[0]['tau']:.2f} -> trained "
             f"{chain[-1]['tau']:.2f} (chain)" + (f", {tree[-1]['tau']:.2f} ({tree[-1]['mode']})" if tree else ""))
    say(f"train-drafter: drafter in {out} ({time.monotonic() - t_start:.0f}s)")
    return 0
