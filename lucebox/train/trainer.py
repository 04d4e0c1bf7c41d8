"""The optimisation of a DFlash drafter: Trainer owns the drafter being trained, its AdamW optimizer and the
step counter. One train_step takes `batch` examples in an order fixed by (seed, step), gets their target
features (cached across epochs when they fit), samples anchors and backpropagates the block loss; lr_at is
the schedule (linear warm-up, cosine decay), with gradient clipping, bf16 autocast on CUDA and fp32 on CPU.
save/resume write and read the checkpoint: the public drafter layout plus train_state.pt (fp32 weights,
optimizer, step). new_drafter makes a fresh drafter shaped for the target. The command driving it all is
lucebox.train.command."""

from __future__ import annotations

import copy
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

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
from lucebox.train.examples import Example
from lucebox.train.features import TargetFeatures
from lucebox.train.loss import block_loss, position_weights, sample_anchors

STATE = "train_state.pt"


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
    """Owns the drafter being trained, its optimizer and the step counter; see the module docstring
    (and lucebox.train.command's, step 3: what one training sequence contributes)."""

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
