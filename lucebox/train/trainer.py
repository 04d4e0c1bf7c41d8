"""Train a DFlash drafter for a target by self-distillation (docs/spec/DFLASH.md, "Training a drafter").

`python -m lucebox train-drafter --target MODEL --out DIR`:

1. Prompts: the training split of lucebox.train.data (the suites `bench spec`
   measures are never used), rendered with the target's chat template.
2. Responses: the target generates them (greedy by default), batched through
   LLMEngine. The token ids are cached in OUT/examples.npz: a second run, or a
   resumed one, does not regenerate (an interrupted generation resumes too).
3. Training step, per sequence `tok` (prompt + response, length T):
   - the frozen target runs one full forward capturing `target_layer_ids`; the
     feature at position j is those layers' outputs at j (after token j);
   - up to `anchors` positions a are drawn among the response positions with
     a <= T-B; anchor a makes the block [tok[a], MASK x (B-1)] at positions
     a..a+B-1, which attends to the context features of positions < a only
     (strictly), to its own B rows both ways, and to no other block. This is
     exactly what SpecDecoder.draft_logprobs sees when it drafts after tok[0..a]
     are committed (context = features 0..a-1, first block token = tok[a]);
   - row k (1..B-1) predicts tok[a+k]; cross-entropy weighted w_k = exp(-(k-1)/gamma);
     the logits are the target's LM head (the tensor the target itself uses:
     tied embedding or `output`) applied to drafter.norm(h), as at inference.
   AdamW, linear warm-up then cosine decay, gradient clipping; bf16 autocast on CUDA,
   fp32 on CPU.
4. Checkpoints: OUT/config.json + OUT/model.safetensors (the public layout, via
   save_drafter) and OUT/train_state.pt (fp32 weights, optimizer, step) for
   `--resume`. The acceptance length tau, measured by the real decode loop
   (LLMEngine with the drafter, greedy) on held-out prompts, is printed at the
   start (fresh drafter), at checkpoints and at the end.

Training metrics, per log line: the weighted loss, `acc@k` (row k's accuracy),
`tau(walk)` = what chain decoding would get along the trained sequences (computed
from the blocks when every response position was an anchor: the metric that must
equal the decode loop's tau on those sequences; a trainer with an off-by-one shows
high accuracy and a real tau ~ 1) and `tau(blocks)` = 1 + the mean accepted rows of
a block (uniform over positions, so optimistic when misses cluster where a decode
loop's blocks start, right after a rejection).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lucebox.engine.models import DecoderModel
from lucebox.engine.models.dense_attention import causal_mask, dense_attention
from lucebox.engine.runtime.llm_engine import DTYPES, EngineConfig, LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.engine.runtime.sequence import Chunk, Sequence
from lucebox.engine.spec.drafter import (
    DFlashDrafter,
    DrafterConfig,
    default_target_layers,
    drafter_config_for,
    load_drafter,
    save_drafter,
)
from lucebox.engine.weights.loader import LoadedModel
from lucebox.errors import LuceboxError

EXAMPLES = "examples.npz"
STATE = "train_state.pt"
TRAIN_LOG = "train_log.jsonl"
SUMMARY = "summary.json"
# gamma of the position weights for the block sizes DFLASH.md names; linear in between and beyond.
GAMMA_POINTS = ((8, 4.0), (10, 5.0), (16, 7.0))


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----- loss weights ------------------------------------------------------------------------------


def loss_gamma(block_size: int) -> float:
    """gamma of w_k = exp(-(k-1)/gamma): 4 for B=8, 5 for B=10, 7 for B=16, piecewise linear otherwise."""
    pts = GAMMA_POINTS
    if block_size <= pts[0][0]:
        return pts[0][1] * block_size / pts[0][0]
    for (b0, g0), (b1, g1) in zip(pts, pts[1:]):
        if block_size <= b1:
            return g0 + (g1 - g0) * (block_size - b0) / (b1 - b0)
    (b0, g0), (b1, g1) = pts[-2], pts[-1]
    return g1 + (g1 - g0) / (b1 - b0) * (block_size - b1)


def position_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """[B-1] weights of rows k = 1..B-1."""
    g = gamma or loss_gamma(block_size)
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / g)


# ----- examples: the target's own responses -----------------------------------------------------


@dataclass
class Example:
    prompt_len: int
    tokens: list[int]  # prompt + response

    @property
    def response_len(self) -> int:
        return len(self.tokens) - self.prompt_len


def _fingerprint(loaded: LoadedModel, prompts: list[list[int]], params: dict[str, Any]) -> str:
    h = hashlib.sha256()
    st = loaded.path.stat()
    h.update(json.dumps([loaded.path.name, st.st_size, loaded.config.name, loaded.config.vocab_size,
                         params], sort_keys=True).encode())
    for p in prompts:
        h.update(np.asarray(p, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()


def _save_examples(path: Path, fingerprint: str, done: dict[int, list[int]], prompts: list[list[int]]) -> None:
    idx = sorted(done)
    resp = [done[i] for i in idx]
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(
        tmp, meta=np.array(json.dumps({"fingerprint": fingerprint, "n_prompts": len(prompts)})),
        index=np.asarray(idx, dtype=np.int64),
        prompt_offsets=np.cumsum([0] + [len(prompts[i]) for i in idx]).astype(np.int64),
        prompt_tokens=np.asarray([t for i in idx for t in prompts[i]], dtype=np.int32),
        offsets=np.cumsum([0] + [len(r) for r in resp]).astype(np.int64),
        tokens=np.asarray([t for r in resp for t in r], dtype=np.int32))
    os.replace(tmp, path)


def _load_examples(path: Path, fingerprint: str) -> dict[int, list[int]] | None:
    """The cached responses by prompt index, or None when the cache is for other prompts/settings."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if meta.get("fingerprint") != fingerprint:
                return None
            idx, off, tok = z["index"].tolist(), z["offsets"], z["tokens"]
            return {i: tok[off[j]: off[j + 1]].tolist() for j, i in enumerate(idx)}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError) as exc:
        _say(f"train-drafter: ignoring unreadable {path} ({exc})")
        return None


def load_examples_file(path: Path) -> list[Example]:
    """Every (prompt, response) of an examples.npz, whatever it was made for (inspection, tests)."""
    with np.load(path, allow_pickle=False) as z:
        po, pt, off, tok = z["prompt_offsets"], z["prompt_tokens"], z["offsets"], z["tokens"]
        return [Example(int(po[j + 1] - po[j]), pt[po[j]: po[j + 1]].tolist() + tok[off[j]: off[j + 1]].tolist())
                for j in range(len(off) - 1)]


def generate_examples(loaded: LoadedModel, prompts: list[list[int]], *, max_new_tokens: int,
                      temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, batch: int = 64,
                      cache: Path | None = None, engine: LLMEngine | None = None,
                      quiet: bool = False) -> list[Example]:
    """The target's responses to `prompts` (self-distillation data), batched, with progress.

    Greedy unless `temperature` > 0 (then prompt i samples with seed `seed + i`).
    With `cache`, finished responses are saved there as they come (every minute)
    and reused by the next call with the same target, prompts and settings.
    """
    settings = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed}
    fingerprint = _fingerprint(loaded, prompts, settings)
    done: dict[int, list[int]] = {}
    if cache is not None:
        done = _load_examples(cache, fingerprint) or {}
        if done:
            _say(f"train-drafter: {len(done)}/{len(prompts)} responses from {cache}")
    todo = [i for i in range(len(prompts)) if i not in done]
    if todo:
        if engine is None:
            engine = generation_engine(loaded, batch, max(len(prompts[i]) for i in todo), max_new_tokens)
        _run_generation(engine, prompts, todo, done, settings, cache, fingerprint, quiet)
    return [Example(len(prompts[i]), list(prompts[i]) + done[i]) for i in range(len(prompts))]


def generation_engine(loaded: LoadedModel, batch: int, max_prompt: int, max_new: int) -> LLMEngine:
    """An engine sized for `batch` sequences of up to max_prompt + max_new tokens."""
    cuda = loaded.device.type == "cuda"
    per_seq = max_prompt + max_new + 64
    return LLMEngine(loaded, EngineConfig(max_num_seqs=batch, kv_tokens=batch * per_seq,
                                          max_step_tokens=8192 if cuda else 2048, cuda_graphs=cuda))


def _run_generation(engine: LLMEngine, prompts: list[list[int]], todo: list[int], done: dict[int, list[int]],
                    settings: dict[str, Any], cache: Path | None, fingerprint: str, quiet: bool) -> None:
    cap = engine.config.max_num_seqs * 2  # keep the scheduler's queue short: admission order stays ours
    queue = list(todo)
    live: dict[int, int] = {}  # seq id -> prompt index
    seqs: dict[int, Sequence] = {}
    start = last_report = last_flush = time.monotonic()
    tokens = 0
    n_total = len(todo)
    while queue or live:
        while queue and len(live) < cap:
            i = queue.pop(0)
            temp = settings["temperature"]
            params = SamplingParams(max_tokens=settings["max_new_tokens"], temperature=temp, top_p=settings["top_p"],
                                    seed=settings["seed"] + i if temp > 0 else None)
            seq = engine.add(prompts[i], params)
            live[seq.seq_id] = i
            seqs[seq.seq_id] = seq
        for out in engine.step():
            tokens += len(out.new_tokens)
            if out.finished:
                sid = out.seq.seq_id
                done[live.pop(sid)] = list(seqs.pop(sid).output_ids)
        now = time.monotonic()
        if not quiet and (now - last_report >= 10 or not (queue or live)):
            last_report = now
            finished = n_total - len(queue) - len(live)
            rate = tokens / max(now - start, 1e-6)
            eta = (n_total - finished) * (tokens / max(finished, 1)) / max(rate, 1e-6)
            _say(f"generate: {finished}/{n_total} responses, {tokens} tokens, {rate:,.0f} tok/s, "
                 f"eta {_hms(eta) if finished else '?'}")
        if cache is not None and (now - last_flush >= 60 or not (queue or live)):
            last_flush = now
            _save_examples(cache, fingerprint, done, prompts)


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


# ----- features from the frozen target ------------------------------------------------------------


class TargetFeatures:
    """The target layers' outputs at every position of whole sequences, one forward each.

    Runs the target exactly as the decode loop does when it captures features
    (DecoderModel.forward with `capture`), over the engine's KV pool. Features
    come back in the order the decode loop gets them (layer order).
    """

    def __init__(self, engine: LLMEngine, layer_ids: list[int], max_tokens: int = 16384) -> None:
        self.engine = engine
        self.capture = tuple(layer_ids)
        self.max_tokens = max_tokens

    @torch.no_grad()
    def __call__(self, sequences: list[list[int]]) -> list[list[torch.Tensor]]:
        kv, runner, model = self.engine.kv, self.engine.runner, self.engine.loaded.model
        out: list[list[torch.Tensor]] = []
        i = 0
        while i < len(sequences):
            group: list[Sequence] = []
            n_tok = 0
            while i < len(sequences):
                ids = sequences[i]
                need = kv.blocks_for(len(ids))
                if group and (need > kv.pool.num_free or n_tok + len(ids) > self.max_tokens):
                    break
                if need > kv.pool.num_free:
                    raise LuceboxError(f"a {len(ids)}-token training sequence does not fit the KV cache")
                seq = Sequence(list(ids), SamplingParams())
                seq.block_table = kv.pool.allocate(need)
                group.append(seq)
                n_tok += len(ids)
                i += 1
            try:
                inputs = runner.prepare([Chunk(s, 0, len(s.token_ids)) for s in group])
                _, feats = model(inputs.input_ids, inputs.positions, kv.data, inputs.meta, capture=self.capture)
                by_seq = {c.seq.seq_id: start for c, start in zip(inputs.order, inputs.row_starts)}
                for s in group:
                    a = by_seq[s.seq_id]
                    out.append([f[a: a + len(s.token_ids)].clone() for f in feats])
            finally:
                for s in group:
                    kv.pool.decref(s.block_table)
        return out


# ----- the drafter's training forward -------------------------------------------------------------


def head_weight(target: DecoderModel) -> torch.Tensor:
    """The LM head the drafter shares: the tensor the target's own logits use (tied embedding or `output`)."""
    return target.token_embd.weight if target.cfg.tie_word_embeddings else target.output.weight


def block_mask(anchors: torch.Tensor, ctx_len: int, block: int, window: int | None = None,
               pad_to: int = 1) -> torch.Tensor:
    """[N*B, ctx_len + N*B (padded)] bool: block row of anchor a sees context positions < a (and, with a
    window, >= a - window) and the B rows of its own block; never another block, never padding.

    The context part is the causal rule of a query at position a - 1, the last committed token's (the
    drafter's context ends there), so sliding drafter layers see what SpecDecoder gives them."""
    n = anchors.shape[0]
    dev = anchors.device
    ctx = causal_mask(anchors.repeat_interleave(block) - 1, torch.arange(ctx_len, device=dev), window)
    blk_id = torch.arange(n * block, device=dev) // block
    own = blk_id[:, None] == blk_id[None, :]
    total = ctx_len + n * block
    pad = (-total) % pad_to
    parts = [ctx, own] + ([torch.zeros(n * block, pad, dtype=torch.bool, device=dev)] if pad else [])
    return torch.cat(parts, dim=1)


def drafter_hidden(drafter: DFlashDrafter, target: DecoderModel, features: list[torch.Tensor],
                   tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """drafter.norm(h) of rows 1..B-1 of every anchor's block: [N, B-1, H].

    The same computation as SpecDecoder (extend_context + draft_logprobs) for a
    sequence whose committed tokens are tokens[0..a]: context rows = fused
    features of positions 0..a-1, block = [tokens[a], MASK...] at a..a+B-1.
    It runs the drafter's own layer methods; only the layout differs: every
    anchor's block in one attention call over the shared context, kept apart
    by `block_mask`.
    """
    cfg = drafter.cfg
    b, n = cfg.block_size, anchors.shape[0]
    dev = tokens.device
    ctx_len = int(anchors.max())  # positions >= max anchor are never context
    x = drafter.fuse([f[:ctx_len] for f in features])
    block_ids = torch.full((n, b), cfg.mask_token_id, dtype=torch.long, device=dev)
    block_ids[:, 0] = tokens[anchors]
    with torch.no_grad():
        h = target.embed(block_ids).float().reshape(n * b, -1)  # residual stream kept in fp32
    dtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else h.dtype
    cos_c, sin_c = drafter.rotary(torch.arange(ctx_len, device=dev), dtype)
    cos_b, sin_b = drafter.rotary((anchors[:, None] + torch.arange(b, device=dev)).flatten(), dtype)
    masks = {False: block_mask(anchors, ctx_len, b, pad_to=8)}
    if cfg.sliding_window and any(layer.sliding for layer in drafter.layers):
        masks[True] = block_mask(anchors, ctx_len, b, cfg.sliding_window, pad_to=8)
    pad = masks[False].shape[1] - ctx_len - n * b
    for layer in drafter.layers:
        kc, vc = layer.context_kv(x, cos_c, sin_c)
        q, kb, vb = layer.block_qkv(h, cos_b, sin_b)
        keys, vals = torch.cat([kc, kb.to(kc.dtype)]), torch.cat([vc, vb.to(vc.dtype)])
        if pad:
            keys = torch.cat([keys, keys.new_zeros(pad, *keys.shape[1:])])
            vals = torch.cat([vals, vals.new_zeros(pad, *vals.shape[1:])])
        att = dense_attention(q.to(keys.dtype), keys, vals, mask=masks[layer.sliding])
        h = layer.after_attention(h, att.reshape(n * b, -1))
    return drafter.norm(h).view(n, b, -1)[:, 1:]


class _HeadCrossEntropy(torch.autograd.Function):
    """sum(row_w * CE(h @ W^T, labels)) for a frozen head W, in row chunks, never holding all logits.

    The gradient w.r.t. h is computed in the forward pass (chunk by chunk), so the
    [rows, vocab] logits are neither stored nor recomputed. Also returns the argmax.
    """

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, row_w: torch.Tensor,
                chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = h.shape[0]
        grad = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        preds = torch.empty(rows, dtype=torch.long, device=h.device)
        for s in range(0, rows, chunk):
            e = min(s + chunk, rows)
            logits = (h[s:e].to(weight.dtype) @ weight.t()).float()
            lab = labels[s:e]
            lse = torch.logsumexp(logits, dim=-1)
            loss += ((lse - logits.gather(1, lab[:, None])[:, 0]) * row_w[s:e]).sum()
            preds[s:e] = logits.argmax(-1)
            if grad is not None:
                p = logits.sub_(lse[:, None]).exp_()  # softmax, in place
                p[torch.arange(e - s, device=h.device), lab] -= 1.0
                p.mul_(row_w[s:e, None])
                grad[s:e] = (p.to(weight.dtype) @ weight).to(h.dtype)
        ctx.grad = grad  # an intermediate, not an input or output: kept as an attribute
        ctx.mark_non_differentiable(preds)
        return loss, preds

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, _grad_preds: Any) -> tuple[Any, ...]:
        grad = ctx.grad
        return grad * grad_loss.to(grad.dtype), None, None, None, None


def head_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, row_w: torch.Tensor,
                       chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted CE sum, argmax ids) of rows h [R, H] through the frozen head `weight` [V, H]."""
    chunk = chunk or max(1, (1 << 26) // weight.shape[0])
    return _HeadCrossEntropy.apply(h, weight, labels, row_w, chunk)


def sample_anchors(prompt_len: int, total_len: int, block: int, max_anchors: int,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Sorted anchor positions among the response positions a with a <= T-B (all of them if few enough)."""
    lo, hi = prompt_len, total_len - block  # inclusive
    if hi < lo:
        return torch.empty(0, dtype=torch.long)
    n = hi - lo + 1
    if n <= max_anchors:
        return torch.arange(lo, hi + 1)
    pick = torch.randperm(n, generator=generator)[:max_anchors]
    return (pick + lo).sort().values


def walk_chain(lead: list[int]) -> tuple[int, int]:
    """(verify steps, committed tokens) of greedy chain decoding along a sequence.

    lead[i]: how many drafts the block at the i-th position would get accepted
    (leading correct rows). A step at position i commits lead[i] + 1 tokens (the
    accepted drafts and the target's bonus token) and the next block starts there.
    """
    steps = committed = i = 0
    while i < len(lead):
        steps += 1
        committed += lead[i] + 1
        i += lead[i] + 1
    return steps, committed


@dataclass
class BlockStats:
    """Sums over trained blocks: weighted loss, per-row correct counts, accepted lengths, chain walks."""

    loss: float = 0.0
    weight: float = 0.0
    blocks: int = 0
    correct: list[float] = field(default_factory=list)
    accepted: float = 0.0  # sum over blocks of the number of leading correct rows
    walk_steps: int = 0  # chain walks over sequences whose every position was an anchor
    walk_committed: int = 0

    def add(self, loss: float, weight: float, correct: torch.Tensor, every_position: bool = False) -> None:
        self.loss += loss
        self.weight += weight
        self.blocks += correct.shape[0]
        col = correct.float().sum(0).tolist()
        self.correct = [a + b for a, b in zip(self.correct, col)] if self.correct else col
        lead = correct.int().cumprod(dim=1).sum(1)
        self.accepted += float(lead.sum())
        if every_position:
            steps, committed = walk_chain(lead.tolist())
            self.walk_steps += steps
            self.walk_committed += committed

    def merge(self, other: BlockStats) -> None:
        self.loss += other.loss
        self.weight += other.weight
        self.blocks += other.blocks
        self.correct = ([a + b for a, b in zip(self.correct, other.correct)] if self.correct else
                        list(other.correct))
        self.accepted += other.accepted
        self.walk_steps += other.walk_steps
        self.walk_committed += other.walk_committed

    @property
    def mean_loss(self) -> float:
        return self.loss / self.weight if self.weight else float("nan")

    @property
    def accuracy(self) -> list[float]:
        return [c / self.blocks for c in self.correct] if self.blocks else []

    @property
    def tau_blocks(self) -> float:
        """1 + mean leading correct rows over the trained blocks (uniform over positions: optimistic
        when the misses cluster where a decode loop's blocks start, e.g. right after a rejection)."""
        return 1.0 + self.accepted / self.blocks if self.blocks else float("nan")

    @property
    def tau_walk(self) -> float:
        """What chain decoding would get along the trained sequences (those whose every position was an
        anchor): the training metric that should equal the decode loop's tau on the same sequences."""
        return self.walk_committed / self.walk_steps if self.walk_steps else float("nan")


def block_loss(drafter: DFlashDrafter, target: DecoderModel, features: list[torch.Tensor], tokens: torch.Tensor,
               anchors: torch.Tensor, pos_w: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale * sum of w_k * CE over the anchors' rows, correct [N, B-1]) for one sequence."""
    b = drafter.cfg.block_size
    h = drafter_hidden(drafter, target, features, tokens, anchors)  # [N, B-1, H]
    labels = tokens[anchors[:, None] + torch.arange(1, b, device=tokens.device)]  # row k predicts tok[a+k]
    row_w = (pos_w.to(tokens.device) * scale).expand(anchors.shape[0], b - 1).reshape(-1)
    loss, preds = head_cross_entropy(h.reshape(-1, h.shape[-1]), head_weight(target), labels.reshape(-1), row_w)
    return loss, preds.view(-1, b - 1) == labels


@torch.no_grad()
def simulated_acceptance(drafter: DFlashDrafter, target: DecoderModel, features: list[torch.Tensor],
                         tokens: torch.Tensor, prompt_len: int, n_out: int) -> tuple[int, int]:
    """(verify steps, committed tokens) that greedy chain decoding of `n_out` tokens would take, computed
    by the training code (block_loss's labels and correctness, walk_chain) along the target's greedy
    continuation `tokens` (at least n_out + B - 1 tokens after the prompt). It must equal the real
    decode loop's counts: the check that training measures what inference does."""
    # The prefill step samples the first output token; the block at output position i (anchor
    # prompt_len + i) runs while fewer than n_out tokens are out, i.e. for i < n_out - 1.
    anchors = torch.arange(prompt_len, prompt_len + n_out - 1, device=tokens.device)
    if len(anchors) == 0:
        return 0, 0
    ones = torch.ones(drafter.cfg.block_size - 1, device=tokens.device)
    _, correct = block_loss(drafter, target, features, tokens, anchors, ones)
    return walk_chain(correct.int().cumprod(dim=1).sum(1).tolist())


# ----- acceptance measured by the real decode loop ------------------------------------------------


@dataclass
class Acceptance:
    tau: float
    steps: int
    committed: int
    outputs: list[list[int]]
    seconds: float


def measure_acceptance(loaded: LoadedModel, draft: Path, prompts: list[list[int]], max_new_tokens: int, *,
                       ddtree: bool = False, budget: int = 22, ignore_eos: bool = False,
                       batch: int = 16) -> Acceptance:
    """tau of a drafter folder: greedy generation of `prompts` through LLMEngine with EngineConfig(draft=...)."""
    longest = max(len(p) for p in prompts)
    n = min(batch, len(prompts))
    rows = budget + 1 if ddtree else 64
    engine = LLMEngine(loaded, EngineConfig(draft=str(draft), ddtree=ddtree, ddtree_budget=budget, cuda_graphs=False,
                                            max_num_seqs=n, kv_tokens=n * (longest + max_new_tokens + 2 * rows)))
    t = time.perf_counter()
    outputs = engine.generate(prompts, SamplingParams(max_tokens=max_new_tokens, ignore_eos=ignore_eos))
    seconds = time.perf_counter() - t
    st = engine.spec.stats
    return Acceptance(st.acceptance_length, st.steps, st.committed, outputs, seconds)


# ----- training ------------------------------------------------------------------------------------


@dataclass
class TrainConfig:
    """Hyper-parameters (saved in train_state.pt; a resumed run keeps them)."""

    steps: int
    batch: int = 8  # sequences per optimizer step
    anchors: int = 512  # blocks per sequence (at most)
    lr: float = 6e-4
    warmup: float = 0.04  # fraction of the steps
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float | None = None  # None: from the block size
    seed: int = 0
    save_dtype: str = "bfloat16"


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
    quiet: bool = False


def lr_at(step: int, total: int, base: float, warmup: float) -> float:
    """Linear warm-up over `warmup` of the steps, then cosine decay to zero."""
    warm = max(1, round(warmup * total))
    if step < warm:
        return base * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return base * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def new_drafter(loaded: LoadedModel, *, layers: int = 2, block_size: int = 16, target_layers: list[int] | None = None,
                n_target_layers: int = 5, mask_token_id: int | None = None, heads: int | None = None,
                kv_heads: int | None = None, head_dim: int | None = None, intermediate: int | None = None,
                seed: int = 0) -> DFlashDrafter:
    """A freshly initialised drafter shaped for the target (hidden size and, by default, heads and FFN)."""
    cfg = loaded.config
    ids = sorted(target_layers) if target_layers else default_target_layers(cfg.num_layers, n_target_layers)
    if len(set(ids)) != len(ids) or not all(0 <= i < cfg.num_layers for i in ids):
        raise LuceboxError(f"--target-layers {ids}: need distinct layers of the {cfg.num_layers}-layer target")
    mask = default_mask_token(loaded) if mask_token_id is None else mask_token_id
    if not 0 <= mask < cfg.vocab_size:
        raise LuceboxError(f"--mask-token-id {mask} is outside the target's vocabulary ({cfg.vocab_size})")
    if block_size < 2:
        raise LuceboxError("--block-size must be at least 2")
    dcfg = drafter_config_for(cfg, layers=layers, block_size=block_size, mask_token_id=mask, target_layers=ids,
                              heads=heads, kv_heads=kv_heads, head_dim=head_dim, intermediate=intermediate)
    if dcfg.num_heads % dcfg.num_kv_heads:
        raise LuceboxError(f"{dcfg.num_heads} heads are not a multiple of {dcfg.num_kv_heads} KV heads")
    return DFlashDrafter.random(dcfg, seed=seed)


def default_mask_token(loaded: LoadedModel) -> int:
    """A special token the chat never uses (the highest unused one), else the last vocabulary id."""
    tok = loaded.tokenizer
    used = {tok.bos_id, tok.eos_id, tok.pad_id, *tok.eos_ids}
    text = loaded.chat_template or ""
    free = [i for i in sorted(tok.special_ids) if i not in used and (tok.id_to_token(i) or "") not in text]
    return free[-1] if free else loaded.config.vocab_size - 1


class Trainer:
    """Owns the drafter being trained, its optimizer and the step counter; see the module docstring."""

    def __init__(self, loaded: LoadedModel, engine: LLMEngine, examples: list[Example], drafter: DFlashDrafter,
                 config: TrainConfig, feature_cache: str = "auto") -> None:
        self.loaded, self.engine, self.cfg = loaded, engine, config
        self.device = loaded.device
        self.target = loaded.model
        self.examples = [e for e in examples if e.response_len >= drafter.cfg.block_size]
        if not self.examples:
            raise LuceboxError(f"no example has a response of at least {drafter.cfg.block_size} tokens "
                               "(block size): nothing to train on")
        self.drafter = drafter.to(self.device, torch.float32)
        self.drafter.init_rotary(self.device)
        self.drafter.train().requires_grad_(True)
        self.features = TargetFeatures(engine, drafter.cfg.target_layer_ids)
        self.cache_features = self._want_feature_cache(feature_cache)
        self._feature_cache: dict[int, list[torch.Tensor]] = {}
        decay = [p for n, p in self.drafter.named_parameters() if not n.endswith("norm.weight")]
        no_decay = [p for n, p in self.drafter.named_parameters() if n.endswith("norm.weight")]
        fused = {"fused": True} if self.device.type == "cuda" else {}
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=config.lr, betas=(0.9, 0.95),
                                     **fused)
        self.pos_w = position_weights(drafter.cfg.block_size, config.gamma).to(self.device)
        self.step = 0
        self.history: list[dict[str, Any]] = []  # one row per log line
        self.evals: list[dict[str, Any]] = []
        self._perms: dict[int, list[int]] = {}

    # -- data order: a function of (seed, step) only, so a resumed run sees what an uninterrupted one would

    def batch_indices(self, step: int) -> list[int]:
        n = len(self.examples)
        out = []
        for j in range(self.cfg.batch):
            g = step * self.cfg.batch + j
            epoch = g // n
            if epoch not in self._perms:
                gen = torch.Generator().manual_seed(self.cfg.seed * 7919 + epoch)
                self._perms = {epoch: torch.randperm(n, generator=gen).tolist()}
            out.append(self._perms[epoch][g % n])
        return out

    def feature_bytes(self) -> int:
        """Memory all examples' features take (what the feature cache would hold)."""
        n_tok = sum(len(e.tokens) for e in self.examples)
        return n_tok * len(self.drafter.cfg.target_layer_ids) * self.drafter.cfg.hidden_size * \
            self.loaded.dtype.itemsize

    def _want_feature_cache(self, mode: str) -> bool:
        if mode not in ("auto", "on", "off"):
            raise LuceboxError(f"--feature-cache {mode!r}: choose auto, on or off")
        if mode != "auto":
            return mode == "on"
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return self.feature_bytes() <= 0.3 * free
        return self.feature_bytes() <= 4 << 30

    def features_of(self, idx: list[int]) -> list[list[torch.Tensor]]:
        """The target features of examples `idx`: one target forward each, kept for later epochs when caching."""
        missing = [i for i in dict.fromkeys(idx) if i not in self._feature_cache]
        got = dict(zip(missing, self.features([self.examples[i].tokens for i in missing]))) if missing else {}
        if self.cache_features:
            self._feature_cache.update(got)
            return [self._feature_cache[i] for i in idx]
        return [got[i] for i in idx]

    def train_step(self) -> BlockStats:
        """One optimizer step over `batch` sequences; returns its block statistics."""
        step = self.step
        idx = self.batch_indices(step)
        seqs = [self.examples[i] for i in idx]
        b = self.drafter.cfg.block_size
        anchors = []
        for j, ex in enumerate(seqs):
            gen = torch.Generator().manual_seed((self.cfg.seed * 1_000_003 + step) * 131 + j)
            anchors.append(sample_anchors(ex.prompt_len, len(ex.tokens), b, self.cfg.anchors, gen))
        total_w = float(sum(len(a) for a in anchors)) * float(self.pos_w.sum())
        feats = self.features_of(idx)
        lr = lr_at(step, self.cfg.steps, self.cfg.lr, self.cfg.warmup)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        stats = BlockStats()
        cuda = self.device.type == "cuda"
        for ex, anc, f in zip(seqs, anchors, feats):
            if len(anc) == 0:
                continue
            tokens = torch.tensor(ex.tokens, dtype=torch.long, device=self.device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                loss, correct = block_loss(self.drafter, self.target, f, tokens, anc.to(self.device), self.pos_w,
                                           scale=1.0 / total_w)
            loss.backward()
            every = len(anc) == len(ex.tokens) - b - ex.prompt_len + 1
            stats.add(float(loss.detach()) * total_w, len(anc) * float(self.pos_w.sum()), correct, every)
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.step += 1
        return stats

    # -- checkpoints

    def save(self, out: Path) -> None:
        """The public-layout drafter (in `save_dtype`) and the training state, each written atomically."""
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / ".checkpoint.tmp"
        snapshot = copy.deepcopy(self.drafter).to(DTYPES[self.cfg.save_dtype])
        save_drafter(snapshot, tmp)
        state = {"step": self.step, "config": asdict(self.cfg), "drafter_config": self.drafter.cfg.to_json(),
                 "model": self.drafter.state_dict(), "optimizer": self.opt.state_dict(), "history": self.history,
                 "evals": self.evals, "n_examples": len(self.examples)}
        torch.save(state, tmp / STATE)
        for name in ("config.json", "model.safetensors", STATE):
            os.replace(tmp / name, out / name)
        tmp.rmdir()

    @classmethod
    def resume(cls, loaded: LoadedModel, engine: LLMEngine, examples: list[Example], out: Path,
               feature_cache: str = "auto") -> Trainer:
        path = out / STATE
        if not path.is_file():
            raise LuceboxError(f"--resume: no {path} (nothing to resume; run without --resume first)")
        state = torch.load(path, map_location="cpu", weights_only=True)
        dcfg = DrafterConfig.from_json(state["drafter_config"], str(path))
        drafter = DFlashDrafter(dcfg)
        drafter.load_state_dict(state["model"])
        trainer = cls(loaded, engine, examples, drafter, TrainConfig(**state["config"]), feature_cache)
        if len(trainer.examples) != state["n_examples"]:
            raise LuceboxError(f"--resume: {len(trainer.examples)} training examples now, {state['n_examples']} "
                               "when the checkpoint was written (other prompts or settings?)")
        trainer.opt.load_state_dict(state["optimizer"])
        trainer.step = int(state["step"])
        trainer.history = list(state["history"])
        trainer.evals = list(state["evals"])
        return trainer


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
            f"{r['tok_s']:,.0f} tok/s {r['rows_s']:,.0f} rows/s" + (f" eta {_hms(eta)}" if eta is not None else ""))


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
                    _say(_fmt_row(row, eta))
                window, window_tokens, window_t = BlockStats(), 0, now
            if opts.time_budget is not None and step - start_step >= 3:
                total = fit_steps(step, step - start_step, time.monotonic() - t0, opts.time_budget, cap)
                trainer.cfg.steps = total
            limit = opts.time_limit is not None and time.monotonic() - t0 >= opts.time_limit
            limit |= opts.stop_after is not None and step - start_step >= opts.stop_after
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
        _say(f"train-drafter: stopped at step {stopped}/{total} (run limit); continue with --resume")
    elif opts.eval_prompts and opts.eval_ddtree_budget:
        _evaluate(trainer, opts, trainer.step, f"ddtree{opts.eval_ddtree_budget}")
    trainer.save(out)
    return {"step": trainer.step, "total": total, "finished": stopped is None,
            "seconds": time.monotonic() - t0, "last": trainer.history[-1] if trainer.history else None}


def fit_steps(step: int, done: int, elapsed: float, budget: float, total: int) -> int:
    """The step count that ends near `budget` seconds at the pace so far (never more than `total`).

    The pace includes the first epoch's target forwards, so it errs on the short side."""
    left = max(0.0, budget - elapsed)
    return max(step + 1 if step < total else step, min(total, step + int(left / (elapsed / done))))


def _evaluate(trainer: Trainer, opts: RunOptions, step: int, mode: str) -> dict[str, Any]:
    ddtree = mode.startswith("ddtree")
    acc = measure_acceptance(trainer.loaded, opts.out, opts.eval_prompts, opts.eval_tokens, ddtree=ddtree,
                             budget=opts.eval_ddtree_budget or 22)
    row = {"step": step, "mode": mode, "tau": acc.tau, "steps": acc.steps, "committed": acc.committed,
           "prompts": len(opts.eval_prompts), "seconds": acc.seconds}
    trainer.evals.append(row)
    if not opts.quiet:
        _say(f"eval step {step}: tau {acc.tau:.2f} ({mode}, real decode loop, {len(opts.eval_prompts)} held-out "
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


# ----- command line ----------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    """`python -m lucebox train-drafter`: prompts → target responses → drafter training → tau."""
    from lucebox.chat.prompt import PromptBuilder
    from lucebox.engine.weights.loader import load_model
    from lucebox.fetch import resolve_model
    from lucebox.train import data

    t_start = time.monotonic()
    out: Path = args.out
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
    prompts, counts = data.training_prompts(args.data_dir, sources=sources, files=args.prompts, seed=args.seed)
    ids = [data.render(builder, p) for p in prompts]
    keep = [i for i, x in enumerate(ids) if len(x) <= args.max_prompt_tokens]
    if args.max_prompts is not None and len(keep) > args.max_prompts:
        gen = torch.Generator().manual_seed(args.seed)
        keep = sorted(keep[i] for i in torch.randperm(len(keep), generator=gen)[: args.max_prompts].tolist())
    train_ids = [ids[i] for i in keep]
    if not train_ids:
        raise LuceboxError("no training prompts left (check --sources, --max-prompt-tokens, --prompts)")
    _say(f"train-drafter: {len(train_ids)} training prompts ({', '.join(f'{k} {v}' for k, v in counts.items())}; "
         f"{len(ids) - len(keep)} left out by --max-prompt-tokens/--max-prompts), target {loaded.config.name} "
         f"on {device} ({loaded.dtype})")
    eval_ids: list[list[int]] = []
    if args.eval_prompts > 0:
        eval_ids = [data.render(builder, p) for p in data.eval_prompts(args.data_dir)][: args.eval_prompts]

    # Responses from the target itself (cached).
    longest = max(len(x) for x in train_ids)
    engine = generation_engine(loaded, max(args.gen_batch, args.batch), longest, args.max_new_tokens)
    examples = generate_examples(loaded, train_ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                 seed=args.seed, batch=args.gen_batch, cache=out / EXAMPLES, engine=engine,
                                 quiet=args.quiet)
    n_resp = sum(e.response_len for e in examples)
    _say(f"train-drafter: {len(examples)} examples, {n_resp} response tokens "
         f"(mean {n_resp / len(examples):.0f}), {sum(len(e.tokens) for e in examples)} tokens in all")

    opts = RunOptions(out=out, log_every=args.log_every, save_every=args.save_every, eval_every=args.eval_every,
                      eval_prompts=eval_ids, eval_tokens=args.eval_tokens, eval_ddtree_budget=args.eval_ddtree_budget,
                      time_limit=args.time_limit, time_budget=args.time_budget, stop_after=args.stop_after,
                      quiet=args.quiet)
    if args.resume:
        trainer = Trainer.resume(loaded, engine, examples, out, args.feature_cache)
        _say(f"train-drafter: resuming at step {trainer.step}/{trainer.cfg.steps}")
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
        trainer = Trainer(loaded, engine, examples, drafter, tcfg, args.feature_cache)
        d = drafter.cfg
        n_params = sum(p.numel() for p in trainer.drafter.parameters())
        _say(f"train-drafter: drafter {d.num_layers} layers, block {d.block_size}, target layers "
             f"{d.target_layer_ids}, heads {d.num_heads}/{d.num_kv_heads}x{d.head_dim}, ffn {d.intermediate_size}, "
             f"mask token {d.mask_token_id}, {n_params / 1e6:.2f}M parameters "
             f"({n_params * DTYPES[args.save_dtype].itemsize / 1e6:.1f} MB as {args.save_dtype}); "
             f"{steps} steps x {args.batch} sequences x <= {args.anchors} blocks, gamma "
             f"{args.gamma or loss_gamma(d.block_size):.2f}; target features "
             f"{trainer.feature_bytes() / 2**30:.2f} GiB, " + ("cached" if trainer.cache_features else "recomputed"))
        if eval_ids:
            tau0 = evaluate_fresh(loaded, trainer.drafter, opts, args.save_dtype)
            trainer.evals.append({"step": 0, "mode": "chain", "tau": tau0, "prompts": len(eval_ids)})
            _say(f"eval step 0: tau {tau0:.2f} (chain, freshly initialised drafter, real decode loop)")
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
        _say(f"train-drafter: tau on {len(eval_ids)} held-out prompts: fresh {chain[0]['tau']:.2f} -> trained "
             f"{chain[-1]['tau']:.2f} (chain)" + (f", {tree[-1]['tau']:.2f} ({tree[-1]['mode']})" if tree else ""))
    _say(f"train-drafter: drafter in {out} ({time.monotonic() - t_start:.0f}s)")
    return 0
