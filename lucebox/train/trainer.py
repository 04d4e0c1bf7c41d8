"""The optimisation of a DFlash drafter: Trainer owns the drafter being trained, its AdamW optimizer and the
step counter. The target's features of every example are captured once, before the first step, into a
FeatureStore (a memory-mapped file in the output folder, reused by every epoch and by resumed runs; or
recomputed each step when they do not fit). One train_step takes `batch` examples in an order fixed by
(seed, step), samples their anchors and backpropagates the block loss of all of them in one packed drafter
forward (lucebox.train.packed; several when they exceed `max_rows` block rows), with one host sync per step;
`packed=False` is the per-sequence step it replaces (loss.block_loss, one forward each), kept as the
reference that `bench` times and the tests compare with. lr_at is the schedule (linear warm-up, cosine
decay), with gradient clipping, bf16 autocast on CUDA and fp32 on CPU. save/resume write and read the
checkpoint: the public drafter layout plus OUT/checkpoint/ (fp32 weights, optimizer, step, history) in
shards of at most 16 MB (lucebox.train.checkpoint). new_drafter makes a fresh drafter shaped for the target.
The command driving it all is lucebox.train.command."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lucebox.engine.runtime.llm_engine import DTYPES, LLMEngine
from lucebox.engine.spec.drafter import (
    DFlashDrafter,
    DrafterConfig,
    default_target_layers,
    drafter_config_for,
    save_drafter,
)
from lucebox.engine.weights.loader import LoadedModel
from lucebox.errors import LuceboxError
from lucebox.train.acceptance import BlockStats
from lucebox.train.checkpoint import read_checkpoint, write_checkpoint
from lucebox.train.examples import Example
from lucebox.train.features import FeatureStore, TargetFeatures
from lucebox.train.log import hms, say
from lucebox.train.loss import block_loss, position_weights, sample_anchors
from lucebox.train.packed import Masks, Packed, attention_masks, pack, packed_loss

CHECKPOINT = "checkpoint"  # OUT/checkpoint/: the training state in shards (what --resume reads)
FEATURES = "features"  # OUT/features.bin + OUT/features.json: the target features of every example


@dataclass
class TrainConfig:
    """Hyper-parameters (saved in the checkpoint; a resumed run keeps them)."""

    steps: int
    batch: int = 8  # sequences per optimizer step
    anchors: int = 512  # blocks per sequence (at most)
    lr: float = 6e-4
    warmup: float = 0.04  # fraction of the steps
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float | None = None  # None: from the block size (7 for B=16)
    seed: int = 0
    save_dtype: str = "bfloat16"


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


@dataclass
class _Batch:
    step: int
    idx: list[int]  # example indices
    anchors: list[torch.Tensor]  # per example (sorted, host)
    total_w: float  # the step's total loss weight: the loss is the weighted mean over its blocks


@dataclass
class _Prepared:
    """A packed step's inputs on the device: per group of sequences, (layout, masks, context features)."""

    batch: _Batch
    inputs: list[tuple[Packed, Masks, torch.Tensor]]


class Trainer:
    """Owns the drafter being trained, its optimizer and the step counter; see the module docstring
    (and lucebox.train.command's, step 3: what one training sequence contributes)."""

    def __init__(self, loaded: LoadedModel, engine: LLMEngine, examples: list[Example], drafter: DFlashDrafter,
                 config: TrainConfig, feature_cache: str = "auto", feature_dir: Path | None = None,
                 max_rows: int | None = None, quiet: bool = True, attention: str = "auto") -> None:
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
        if attention not in ("auto", "flex", "dense"):
            raise LuceboxError(f"--attention {attention!r}: choose auto, flex or dense")
        if attention == "flex" and self.device.type != "cuda":
            raise LuceboxError("--attention flex needs CUDA (flex_attention has no backward on the CPU)")
        # flex_attention's block masks on CUDA; dense masks (the same rule) on the CPU, or by choice
        self.flex = attention == "flex" or (attention == "auto" and self.device.type == "cuda")
        # Block rows per forward. The CPU's dense masks cost rows x (context + rows) across the packed
        # sequences, so it packs fewer; the GPU's block masks cost only what each row sees.
        self.max_rows = max_rows or (65536 if self.flex else 4096)
        self.features = TargetFeatures(engine, drafter.cfg.target_layer_ids)
        self.store = self._open_store(feature_cache, feature_dir, quiet)
        decay = [p for n, p in self.drafter.named_parameters() if not n.endswith("norm.weight")]
        no_decay = [p for n, p in self.drafter.named_parameters() if n.endswith("norm.weight")]
        fused = {"fused": True} if self.device.type == "cuda" else {}
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=config.lr, betas=(0.9, 0.95),
                                     **fused)
        pos_w = position_weights(drafter.cfg.block_size, config.gamma)
        self.pos_w, self.pos_w_sum = pos_w.to(self.device), float(pos_w.sum())  # the sum on the host: no sync
        self.step = 0
        self.history: list[dict[str, Any]] = []  # one row per log line
        self.evals: list[dict[str, Any]] = []
        self._perms: dict[int, list[int]] = {}
        self._prefetched: dict[int, _Prepared] = {}  # the next packed step's inputs, by step

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

    # -- the target's features

    @property
    def feature_width(self) -> int:
        return len(self.drafter.cfg.target_layer_ids) * self.drafter.cfg.hidden_size

    def feature_bytes(self) -> int:
        """Memory all examples' features take (what the feature store holds)."""
        return FeatureStore.nbytes([len(e.tokens) for e in self.examples], self.feature_width, self.loaded.dtype)

    def _fingerprint(self) -> str:
        h = hashlib.sha256()
        st = self.loaded.path.stat()
        h.update(json.dumps([self.loaded.path.name, st.st_size, self.loaded.config.name, str(self.loaded.dtype),
                             self.drafter.cfg.target_layer_ids]).encode())
        for e in self.examples:
            h.update(np.asarray(e.tokens, dtype=np.int32).tobytes() + b"|")
        return h.hexdigest()

    def _open_store(self, mode: str, folder: Path | None, quiet: bool) -> FeatureStore | None:
        """The feature store (`on`, or `auto` when it fits on disk, or in 4 GiB of RAM without a folder), else
        None: the target runs in every step (`off`)."""
        if mode not in ("auto", "on", "off"):
            raise LuceboxError(f"--feature-cache {mode!r}: choose auto, on or off")
        if mode == "off":
            return None
        path = folder / FEATURES if folder is not None else None
        need = self.feature_bytes()
        if mode == "auto":
            if path is None:
                room = 4 << 30
            else:
                folder.mkdir(parents=True, exist_ok=True)
                have = path.with_suffix(".bin")
                room = 0.9 * (shutil.disk_usage(folder).free + (have.stat().st_size if have.exists() else 0))
            if need > room:
                if not quiet:
                    say(f"train-drafter: target features ({need / 2**30:.1f} GiB) do not fit; recomputed every step")
                return None
        t0 = last = time.monotonic()

        def progress(done: int, total: int) -> None:
            nonlocal last
            now = time.monotonic()
            if not quiet and (now - last >= 10 or done == total):
                last = now
                eta = (now - t0) / done * (total - done)
                say(f"features: {done}/{total} examples captured, eta {hms(eta)}")

        return FeatureStore.build(self.features, [e.tokens for e in self.examples], self.feature_width,
                                  self.loaded.dtype, self.device, path, self._fingerprint(), progress=progress)

    def _live(self, idx: list[int]) -> list[torch.Tensor]:
        """Without a store: the features of examples idx from one batched target forward, [T, width] each."""
        return [torch.cat(f, dim=-1) for f in self.features([self.examples[i].tokens for i in idx])]

    def context_rows(self, idx: list[int], lengths: list[int]) -> torch.Tensor:
        """The features of positions 0..lengths[j]-1 of example idx[j], concatenated: [sum lengths, width]."""
        if self.store is not None:
            return self.store.gather(idx, lengths)
        return torch.cat([f[:n] for f, n in zip(self._live(idx), lengths)])

    # -- the step

    def _batch(self, step: int) -> _Batch:
        """Step `step`'s examples and anchors: a function of (seed, step) only."""
        idx = self.batch_indices(step)
        b = self.drafter.cfg.block_size
        anchors = []
        for j, i in enumerate(idx):
            ex = self.examples[i]
            gen = torch.Generator().manual_seed((self.cfg.seed * 1_000_003 + step) * 131 + j)
            anchors.append(sample_anchors(ex.prompt_len, len(ex.tokens), b, self.cfg.anchors, gen))
        return _Batch(step, idx, anchors, float(sum(len(a) for a in anchors)) * self.pos_w_sum)

    def train_step(self, packed: bool = True) -> BlockStats:
        """One optimizer step over `batch` sequences; returns its block statistics.

        Packed, the next step's inputs (layout, block masks, features) are prepared before the step's one
        host sync (its statistics): on CUDA, while the GPU still runs this step."""
        step = self.step
        lr = lr_at(step, self.cfg.steps, self.cfg.lr, self.cfg.warmup)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        if packed:
            prep = self._prefetched.pop(step, None) or self._prepare(self._batch(step))
            pending = self._packed_backward(prep)
        else:
            batch = self._batch(step)
            stats = self._sequential_step(batch.idx, batch.anchors, batch.total_w)
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.step += 1
        if packed:
            if self.step < self.cfg.steps:
                self._prefetched = {self.step: self._prepare(self._batch(self.step))}
            stats = self._packed_stats(prep.batch, *pending)
        return stats

    def _every(self, ex: Example, anc: torch.Tensor) -> bool:
        """Whether every response position with a full block is an anchor (then the chain walk is exact)."""
        return len(anc) == len(ex.tokens) - self.drafter.cfg.block_size - ex.prompt_len + 1

    def _prepare(self, batch: _Batch) -> _Prepared:
        """The packed forwards' inputs on the device: the sequences with anchors in groups of at most max_rows
        block rows (usually one group), each with its layout, masks and context features."""
        b = self.drafter.cfg.block_size
        keep = [j for j, a in enumerate(batch.anchors) if len(a)]
        groups: list[list[int]] = []
        rows = 0
        for j in keep:
            n = len(batch.anchors[j]) * b
            if not groups or rows + n > self.max_rows:
                groups.append([])
                rows = 0
            groups[-1].append(j)
            rows += n
        inputs = []
        for g in groups:
            ids = [batch.idx[j] for j in g]
            px = pack([self.examples[i].tokens for i in ids], [batch.anchors[j] for j in g], b,
                      self.drafter.cfg.mask_token_id)
            dev_px = px.to(self.device)
            inputs.append((dev_px, attention_masks(self.drafter, px, dev_px, self.flex),
                           self.context_rows(ids, px.ctx_lens)))
        return _Prepared(batch, inputs)

    def _packed_backward(self, prep: _Prepared) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Accumulate the gradients of the step's loss, one packed forward per group; no host sync."""
        losses, corrects = [], []
        cuda = self.device.type == "cuda"
        for dev_px, masks, ctx in prep.inputs:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                loss, correct = packed_loss(self.drafter, self.target, ctx, dev_px, masks, self.pos_w,
                                            1.0 / prep.batch.total_w)
            loss.backward()
            losses.append(loss.detach())
            corrects.append(correct)
        return losses, corrects

    def _packed_stats(self, batch: _Batch, losses: list[torch.Tensor], corrects: list[torch.Tensor]) -> BlockStats:
        """The step's block statistics: its one host sync."""
        stats = BlockStats()
        if not losses:
            return stats
        loss_sum = float(torch.stack(losses).sum())
        correct = torch.cat(corrects).cpu()
        keep = [j for j, a in enumerate(batch.anchors) if len(a)]
        for j, part in zip(keep, correct.split([len(batch.anchors[j]) for j in keep])):
            stats.add(0.0, len(batch.anchors[j]) * self.pos_w_sum, part,
                      self._every(self.examples[batch.idx[j]], batch.anchors[j]))
        stats.loss = loss_sum * batch.total_w
        return stats

    def _sequential_step(self, idx: list[int], anchors: list[torch.Tensor], total_w: float) -> BlockStats:
        """The gradients of the step's loss, one sequence at a time (the reference for the packed step)."""
        stats = BlockStats()
        cuda = self.device.type == "cuda"
        live = self._live(idx) if self.store is None else None
        for j, (i, anc) in enumerate(zip(idx, anchors)):
            if len(anc) == 0:
                continue
            ex = self.examples[i]
            f = self.store.example(i) if live is None else live[j]
            tokens = torch.tensor(ex.tokens, dtype=torch.long, device=self.device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                loss, correct = block_loss(self.drafter, self.target, [f], tokens, anc.to(self.device), self.pos_w,
                                           scale=1.0 / total_w)
            loss.backward()
            stats.add(float(loss.detach()) * total_w, len(anc) * float(self.pos_w.sum()), correct,
                      self._every(ex, anc))
        return stats

    def bench(self, steps: int, warmup: int = 3) -> dict[str, Any]:
        """Rows/s of the per-sequence and the packed step, on the same data from the same starting point
        (`warmup` untimed steps first: torch.compile specializes flex_attention on the first shapes it sees
        and recompiles twice before its lengths become dynamic), then the drafter and optimizer as they were."""
        start = copy.deepcopy({"model": self.drafter.state_dict(), "opt": self.opt.state_dict()})
        step0 = self.step
        out: dict[str, Any] = {}
        for mode in ("sequential", "packed"):
            for n in (warmup, steps):
                self.drafter.load_state_dict(start["model"])
                self.opt.load_state_dict(start["opt"])
                self.step = step0
                self._sync()
                t = time.perf_counter()
                stats, losses = BlockStats(), []
                for _ in range(n):
                    s = self.train_step(packed=mode == "packed")
                    stats.merge(s)
                    losses.append(s.mean_loss)
                self._sync()
                seconds = time.perf_counter() - t
            rows = stats.blocks * self.drafter.cfg.block_size
            out[mode] = {"steps": steps, "seconds": seconds, "rows": rows, "rows_s": rows / max(seconds, 1e-9),
                         "losses": losses}
        self.drafter.load_state_dict(start["model"])
        self.opt.load_state_dict(start["opt"])
        self.step, self._prefetched = step0, {}
        seq, pk = out["sequential"], out["packed"]
        out["speedup"] = pk["rows_s"] / max(seq["rows_s"], 1e-9)
        out["max_loss_rel_diff"] = max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(pk["losses"], seq["losses"])),
                                       default=0.0)
        return out

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- checkpoints

    def save(self, out: Path) -> None:
        """The public-layout drafter (in `save_dtype`) and the training state in shards, each written atomically."""
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / ".drafter.tmp"
        snapshot = copy.deepcopy(self.drafter).to(DTYPES[self.cfg.save_dtype])
        save_drafter(snapshot, tmp)
        for name in ("config.json", "model.safetensors"):
            os.replace(tmp / name, out / name)
        tmp.rmdir()
        write_checkpoint(out / CHECKPOINT, {
            "step": self.step, "config": asdict(self.cfg), "drafter_config": self.drafter.cfg.to_json(),
            "model": self.drafter.state_dict(), "optimizer": self.opt.state_dict(), "history": self.history,
            "evals": self.evals, "n_examples": len(self.examples)})

    @classmethod
    def resume(cls, loaded: LoadedModel, engine: LLMEngine, examples: list[Example], out: Path,
               feature_cache: str = "auto", max_rows: int | None = None, quiet: bool = True,
               attention: str = "auto") -> Trainer:
        """The trainer as OUT/checkpoint left it (its features come from OUT's store when it is there)."""
        if not (out / CHECKPOINT).is_dir():
            raise LuceboxError(f"--resume: no {out / CHECKPOINT} (nothing to resume; run without --resume first)")
        state = read_checkpoint(out / CHECKPOINT)
        drafter = checkpoint_drafter(state, str(out / CHECKPOINT))
        trainer = cls(loaded, engine, examples, drafter, TrainConfig(**state["config"]), feature_cache, out,
                      max_rows, quiet, attention)
        if len(trainer.examples) != state["n_examples"]:
            raise LuceboxError(f"--resume: {len(trainer.examples)} training examples now, {state['n_examples']} "
                               "when the checkpoint was written (other prompts or settings?)")
        trainer.opt.load_state_dict(state["optimizer"])
        trainer.step = int(state["step"])
        trainer.history = list(state["history"])
        trainer.evals = list(state["evals"])
        return trainer


def checkpoint_drafter(state: dict[str, Any], where: str) -> DFlashDrafter:
    """The drafter (fp32) of a checkpoint's state."""
    drafter = DFlashDrafter(DrafterConfig.from_json(state["drafter_config"], where))
    drafter.load_state_dict(state["model"])
    return drafter


def export_drafter(out: Path) -> Path:
    """Write OUT's public drafter layout (config.json, model.safetensors in the run's save dtype) from
    OUT/checkpoint alone: what a checkpoint carried off the training machine in shards becomes a drafter."""
    state = read_checkpoint(out / CHECKPOINT)
    drafter = checkpoint_drafter(state, str(out / CHECKPOINT)).to(DTYPES[state["config"]["save_dtype"]])
    save_drafter(drafter, out)
    return out
