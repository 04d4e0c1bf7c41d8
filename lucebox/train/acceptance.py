"""How well a drafter would be accepted, the number training is for: measure_acceptance gets tau from the
real decode loop (LLMEngine with the drafter, greedy); walk_chain, BlockStats and simulated_acceptance
compute it from the training forward's per-row correctness (what chain decoding would commit along a
sequence), the training metric that must equal the decode loop's tau on the same sequences."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lucebox.engine.models import DecoderModel
from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.engine.spec.drafter import DFlashDrafter
from lucebox.engine.weights.loader import LoadedModel
from lucebox.train.loss import block_loss


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
                                            spec_adaptive=False, max_num_seqs=n,
                                            kv_tokens=n * (longest + max_new_tokens + 2 * rows)))
    t = time.perf_counter()
    outputs = engine.generate(prompts, SamplingParams(max_tokens=max_new_tokens, ignore_eos=ignore_eos))
    seconds = time.perf_counter() - t
    st = engine.spec.stats
    return Acceptance(st.acceptance_length, st.steps, st.committed, outputs, seconds)
