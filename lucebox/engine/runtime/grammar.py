"""Constrained decoding: a grammar (llguidance) that masks a sequence's logits before each token is chosen.

A request held to a grammar (a forced tool call, JSON mode, a JSON schema) carries a `Constraint` on its
Sequence. Each step, while the forward pass runs on the device, the engine thread computes the allowed-token
bitmask of every constrained row (`fill_masks`: llguidance releases the GIL and fills the rows in parallel);
the sampler applies the masks on the device after it takes the raw log-probabilities and before penalties,
temperature and the draw (`expand_masks`), so greedy, sampled and speculative rows all choose from the
constrained distribution. Every committed token advances the matcher (`Constraint.advance`); once the grammar
is complete the sequence ends with "stop", even with `ignore_eos` (the grammar says the answer is over).

A speculative verification walks its rows one by one: `Constraint.mask_after` gives the mask after the
tokens accepted so far (consumed, masked, rolled back), so the verify respects the grammar exactly and stays
lossless with respect to the constrained distribution.

The llguidance tokenizer (every token's bytes) is built once per tokenizer, lazily: ~0.3 s for a 49K
vocabulary, ~3 s for 262K.
"""

from __future__ import annotations

import collections
import functools
import threading
from typing import Any

import numpy as np
import torch

from lucebox.engine.kernels import triton_ops as ops

try:
    import llguidance
    from llguidance.numpy import fill_next_token_bitmask_par
except ImportError:  # a broken install: constrained requests are refused with a clear error
    llguidance = None


COMPILED_KEPT = 64
"""Grammars whose compiled matcher is kept for reuse (least recently used dropped first)."""


class GrammarError(ValueError):
    """The grammar (or the JSON schema it came from) cannot be compiled: the request is a 400."""


class TokenGrammar:
    """The grammar compiler for one tokenizer: checks grammars and makes per-sequence constraints."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        if llguidance is None:
            raise GrammarError("constrained decoding needs the llguidance package, which is not installed")
        self.vocab_size = vocab_size
        self.llt = llguidance.LLTokenizer(tokenizer.hf.to_str(), n_vocab=vocab_size,
                                          eos_token=sorted(tokenizer.eos_ids) or None)
        self.words = (vocab_size + 31) // 32
        # Compiled, never-advanced matchers of recent grammars: an agent sends the same tools every turn, and a
        # copy costs microseconds where compiling 20 tools' schemas costs ~10 ms.
        self._compiled: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def check(self, grammar: str) -> str:
        """The compile error of `grammar` for this tokenizer ("" when it compiles)."""
        return llguidance.LLMatcher.validate_grammar(grammar, self.llt)

    def constraint(self, grammar: str, reason: str, kind: str = "grammar") -> Constraint:
        """A fresh matcher for one sequence; GrammarError if the grammar does not compile. (The matcher compiles
        with the GIL released, so the engine thread keeps stepping meanwhile; `check` would hold it.)"""
        with self._lock:
            pristine = self._compiled.get(grammar)
            if pristine is not None:
                self._compiled.move_to_end(grammar)
                return Constraint(pristine.deep_copy(), reason, self.words, kind, (self, grammar))
        matcher = llguidance.LLMatcher(self.llt, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        with self._lock:
            self._compiled[grammar] = matcher.deep_copy()
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return Constraint(matcher, reason, self.words, kind, (self, grammar))

    def recycle(self, grammar: str, matcher: Any) -> None:
        """Keep a finished sequence's matcher, reset to the start, as the copy source of its grammar (while the
        grammar is still kept): the lexer states it built on the way are copied with it, and a fresh matcher
        builds each again per sequence (measured on SmolLM2, a bounded-string schema: 0.22 ms a token's mask
        from a fresh copy, 0.03 ms from a recycled one)."""
        if matcher.is_error() or not matcher.reset():
            return
        with self._lock:
            if grammar in self._compiled:
                self._compiled[grammar] = matcher


_compilers_lock = threading.Lock()


def compiler_for(tokenizer: Any, vocab_size: int) -> TokenGrammar:
    """The TokenGrammar of `tokenizer` (built on first use, then kept on the tokenizer, so it lives as long as the
    tokenizer does; any thread)."""
    with _compilers_lock:
        tg = tokenizer.grammar
        if tg is None or tg.vocab_size != vocab_size:
            tg = tokenizer.grammar = TokenGrammar(tokenizer, vocab_size)
        return tg


def grammar_from_lark(lark: str) -> str:
    """An llguidance grammar from Lark text (`%json {...}` inlines a JSON schema)."""
    if llguidance is None:
        raise GrammarError("constrained decoding needs the llguidance package, which is not installed")
    return llguidance.LLMatcher.grammar_from_lark(lark)


class Constraint:
    """One sequence's grammar state: what its next token may be, advanced by every committed token."""

    def __init__(self, matcher: Any, reason: str, words: int, kind: str = "grammar",
                 home: tuple[TokenGrammar, str] | None = None) -> None:
        self.matcher = matcher
        self.reason = reason  # why the request is constrained, in words (a debug log line)
        self.kind = kind  # a short label of why (the request log line, /metrics, /props)
        self.words = words
        self.consumed = 0  # tokens the matcher has taken
        self._home = home  # the compiler and grammar text it came from (`release`)

    def release(self) -> None:
        """The sequence is finished: its matcher goes back to its compiler (`TokenGrammar.recycle`); this
        constraint is unusable after."""
        if self._home is not None and self.matcher is not None:
            compiler, grammar = self._home
            compiler.recycle(grammar, self.matcher)
        self.matcher = None

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but the end of the answer may follow."""
        return self.matcher.is_stopped()

    def advance(self, token: int) -> bool:
        """Commit one token; True if the answer must end here (grammar complete, or a token it refused)."""
        if self.matcher.is_stopped():
            return True
        if not self.matcher.consume_token(token):
            return True
        self.consumed += 1
        return self.matcher.is_stopped()

    def fit_draft(self, draft: list[int]) -> list[int]:
        """A speculative chain checked against the grammar: its valid prefix, then the tokens the grammar forces
        from there (where it forces any), then the rest. A draft token the grammar refuses would be rejected
        anyway; a forced one is the likeliest choice. Lossless either way: the verify decides."""
        valid = self.matcher.validate_tokens(draft)
        if valid == len(draft):
            return draft
        taken = self.matcher.try_consume_tokens(draft[:valid]) if valid else 0
        forced = self.matcher.compute_ff_tokens()[: len(draft) - valid] if taken == valid else []
        if taken:
            self.matcher.rollback(taken)
        return draft[:valid] + forced + draft[valid + len(forced):]

    def mask_into(self, out: np.ndarray) -> None:
        """Fill one int32 bitmask row (bit i of word i // 32: token i allowed)."""
        self.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def mask_after(self, tokens: list[int]) -> np.ndarray:
        """The bitmask after `tokens` (a verification's accepted draft), leaving the state as it was."""
        out = np.zeros(self.words, dtype=np.int32)
        taken = self.matcher.try_consume_tokens(tokens) if tokens else 0
        if taken == len(tokens):
            self.mask_into(out)
        if taken:
            self.matcher.rollback(taken)
        return out


@functools.cache
def _executor() -> Any:
    return llguidance.LLExecutor()


def fill_masks(constraints: list[Constraint]) -> np.ndarray:
    """The bitmasks [n, words] int32 of these constraints' next tokens, computed in parallel (GIL released)."""
    out = np.zeros((len(constraints), constraints[0].words), dtype=np.int32)
    if len(constraints) == 1:
        constraints[0].mask_into(out[0])
    else:
        fill_next_token_bitmask_par(_executor(), [(c.matcher, i) for i, c in enumerate(constraints)], out)
    return out


def expand_masks(bitmasks: np.ndarray, vocab: int, device: torch.device) -> torch.Tensor:
    """Bitmasks [n, words] -> bool [n, vocab] (True: allowed) on `device`, unpacked there."""
    return ops.unpack_bitmask(torch.from_numpy(bitmasks).to(device, non_blocking=True), vocab)


def greedy_tokens(logits: torch.Tensor, bitmasks: np.ndarray) -> list[int]:
    """The greedy token of each row of `logits` among those its bitmask allows (all bits set: a free row); on
    CUDA one kernel, which a constrained batch-1 step needs to cost little more than a free one."""
    words = torch.from_numpy(bitmasks).to(logits.device, non_blocking=True)
    pick = ops.masked_argmax if ops.use_kernels(logits) else ops.masked_argmax_ref
    return pick(logits, words).tolist()
