"""One generation request as the engine sees it: tokens, KV blocks, progress."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from lucebox.engine.runtime.sampler import SamplingParams, TokenLogprobs

_ids = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet (no KV blocks)
    RUNNING = "running"  # admitted: prefilling or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    seq_id: int = field(default_factory=lambda: next(_ids))
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached: int = 0  # prompt tokens whose K/V came from a prefix cache
    block_table: list[int] = field(default_factory=list)
    state_slot: int = 0  # hybrid models: its slot in the recurrent state pool (0: none, scratch; KVCache.states)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None  # stop | length | cancelled | error
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Tokens to append instead of the next sampled one (e.g. a forced `</think>`
    # when a thinking budget runs out); the model then prefills them.
    forced_tokens: list[int] = field(default_factory=list)
    # An output-token count at which the engine stops decoding the sequence (None: no hold). A held sequence
    # stays running and keeps its blocks but gets no step until the async layer lifts the hold (forced tokens
    # lift it too): the thinking budget (chat/run.py) decides there, so its forced `</think>` lands at the
    # same position whatever the timing. A speculative commit may end a few tokens past it.
    hold_at: int | None = None
    # DFlash: how many positions of the drafter's KV (kept in the same blocks as the target's) are filled.
    draft_len: int = 0
    constraint: Any = None  # lucebox.engine.runtime.grammar.Constraint: the grammar its tokens must follow
    cache_hint: Any = None  # lucebox.cache.manager.CacheHint: the prompt's cache keys, computed off the engine
    cache_attached: bool = False  # the prefix cache has set this sequence's starting blocks
    spec_steps: int = 0  # verification passes this sequence took part in
    spec_committed: int = 0  # tokens they committed (acceptance length = committed / steps)
    spec_state: Any = None  # lucebox.engine.spec.adaptive.Acceptance: speculating or not, and its running tau

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def num_pending(self) -> int:
        """Tokens known but not yet run through the model (prompt left, or the last sample)."""
        return len(self.token_ids) - self.num_computed

    @property
    def at_hold(self) -> bool:
        """Its next token must wait: the output has reached `hold_at`."""
        return self.hold_at is not None and len(self.token_ids) - len(self.prompt_ids) >= self.hold_at

    @property
    def held(self) -> bool:
        """At its hold with nothing left to run (its last token is the one a decode would run): no step for it."""
        return self.at_hold and len(self.token_ids) - self.num_computed <= 1

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass
class Chunk:
    """The rows one sequence brings to one step: token_ids[start:start+n] (or `tokens`).

    Speculative verification brings rows that are not (yet) the sequence's
    tokens: `tokens` holds them (the last committed token, then the draft),
    `parents` the draft tree (row i's parent row; -1 for the root; a chain is
    parents [-1, 0, 1, ...]) and every row's logits are wanted.

    A decode launched one step ahead (runtime/ahead.py) does not know its input
    token yet: `carry` is the row of the previous step's device argmax that holds it.
    """

    seq: Sequence
    start: int
    n: int
    tokens: list[int] | None = None
    parents: list[int] | None = None
    carry: int = -1  # >= 0: the input token is the previous step's argmax at this row (on the device)

    @property
    def verify(self) -> bool:
        return self.tokens is not None

    @property
    def wants_logits(self) -> bool:
        """Only the step that reaches the end of the known tokens samples (verification: every row)."""
        return self.verify or self.carry >= 0 or self.start + self.n == len(self.seq.token_ids)

    def input_ids(self) -> list[int]:
        if self.carry >= 0:
            return [0]  # a placeholder: the device puts the carried token in its place
        return self.tokens if self.tokens is not None else self.seq.token_ids[self.start:self.start + self.n]

    def depths(self) -> list[int]:
        """Each row's distance from the first row (its RoPE offset from `start`)."""
        if self.parents is None:
            return list(range(self.n))
        depth: list[int] = []
        for p in self.parents:
            depth.append(0 if p < 0 else depth[p] + 1)
        return depth
