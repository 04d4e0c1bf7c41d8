"""Decide what each model step runs: decode rows plus prefill chunks under a token budget.

This is the synchronous core (no asyncio): the server's async loop calls
`schedule()` and `postprocess()` around each step it runs in the engine
thread. Policy:
- every running sequence decodes one row per step (first come, first served);
- the rest of the step's token budget goes to prefill chunks, oldest first,
  so a long prompt is cut into chunks that interleave with the decodes; while
  any sequence decodes, prefill may be capped at `prefill_cap` tokens a step
  (set by the engine's pacer from measured step times when `--prefill-pacing`
  is on, lucebox.engine.runtime.pacing) so a long prompt stalls them less;
- a waiting sequence is admitted when the pool has the KV blocks for its
  first chunk (and, for a hybrid model, a free recurrent state slot: it
  waits until one is given back) and the running set is below `max_num_seqs`;
- when a running sequence needs a block and none is free, the newest running
  sequence is preempted: its blocks are freed and it goes back to the front
  of the queue to be recomputed (prompt + what it generated so far);
- a sequence at its hold (`Sequence.hold_at`: the chat layer decides there,
  say, whether a thinking budget forces `</think>`) is not decoded: it keeps
  its blocks and waits, and is no work, until the hold is lifted (a recompute
  after a preemption prefills it up to its last token and no further).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from lucebox.engine.runtime.kv_cache import KVCache
from lucebox.engine.runtime.sampler import TokenLogprobs
from lucebox.engine.runtime.sequence import Chunk, SeqStatus, Sequence

if TYPE_CHECKING:
    from lucebox.cache.manager import PrefixCache


class Scheduler:
    def __init__(
        self,
        kv: KVCache,
        *,
        max_num_seqs: int,
        max_step_tokens: int,
        max_model_len: int,
        eos_ids: Iterable[int],
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_step_tokens = max_step_tokens
        self.max_model_len = max_model_len
        self.eos_ids = frozenset(eos_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.decode_rows = 1  # rows a decoding sequence brings to a step (speculative: block or tree size)
        self.cache: PrefixCache | None = None  # reuses and remembers prompt prefixes (lucebox.cache)
        self.on_release: Callable[[Sequence], None] | None = None  # frees per-sequence state elsewhere (drafter)
        # Where a decoding sequence's chunk starts (None: at num_computed). DFlash starts one that returns to
        # speculation at the end of its drafter context, so the chunk re-runs the positions it decoded plainly
        # (their drafter context) and samples at the last one as a decode would.
        self.decode_start: Callable[[Sequence], int] | None = None
        self.prefill_cap: int | None = None  # most prefill tokens in a step that also decodes (None: no cap)

    # ----- queue -------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        """Something to schedule: a waiting sequence, or a running one not held (Sequence.held)."""
        return bool(self.waiting) or any(not s.held for s in self.running)

    def abort(self, seq: Sequence, reason: str = "cancelled") -> None:
        """Drop a sequence now (client gone); its blocks are freed at once."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._finish(seq, reason)

    # ----- one step ----------------------------------------------------------

    def schedule(self) -> list[Chunk]:
        budget = self.max_step_tokens
        chunks: list[Chunk] = []
        decoding = [s for s in self.running if s.num_pending == 1 and not s.at_hold]
        prefilling = [s for s in self.running if s.num_pending > 1]
        for seq in decoding:
            if seq.is_finished or seq not in self.running:
                continue  # preempted to make room for an earlier one
            if not self._reserve(seq, seq.num_computed + self.decode_rows, chunks):
                continue
            start = self.decode_start(seq) if self.decode_start is not None else seq.num_computed
            if seq.num_computed - start + 1 > max(budget, 1):
                start = seq.num_computed  # no room this step: a one-row decode, the longer chunk later
            chunks.append(Chunk(seq, start, seq.num_computed - start + 1))
            budget -= chunks[-1].n
        if chunks and self.prefill_cap is not None:
            budget = min(budget, self.prefill_cap)
        for seq in prefilling:
            if budget <= 0 or seq not in self.running:
                break
            n = min(seq.num_pending - int(seq.at_hold), budget)  # held: its last token waits (runs as its decode)
            if not self._reserve(seq, seq.num_computed + n, chunks):
                break
            chunks.append(Chunk(seq, seq.num_computed, n))
            budget -= n
        states = self.kv.states
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if states is not None and not seq.state_slot:  # before the cache: a hit restores its state there
                if states.num_free == 0:
                    break
                seq.state_slot = states.allocate()
            if self.cache is not None and not seq.cache_attached:
                seq.cache_attached = True
                self.cache.attach(seq)  # may start it from cached blocks / a restored snapshot
            n = min(seq.num_pending - int(seq.at_hold), budget)  # held (a recompute): up to its last token
            # After a prefix-cache hit only the last prompt token may be left: that row runs as a decode,
            # which brings `decode_rows` rows (a speculative verification).
            rows = self.decode_rows if n == seq.num_pending == 1 and seq.num_computed > 0 else n
            need = self.kv.blocks_for(seq.num_computed + rows) - len(seq.block_table)
            if need > self.kv.pool.num_free and self.cache is not None:
                self.cache.evict(need - self.kv.pool.num_free)
            if need > self.kv.pool.num_free:
                break
            self.waiting.popleft()
            seq.block_table.extend(self.kv.pool.allocate(max(need, 0)))
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            if n > 0:  # (0: held with every token but its last one cached)
                chunks.append(Chunk(seq, seq.num_computed, n))
                budget -= n
        return chunks

    def _reserve(self, seq: Sequence, num_tokens: int, chunks: list[Chunk]) -> bool:
        """Grow the block table to hold `num_tokens`, preempting newer sequences if needed.

        A preempted sequence's chunk, if already scheduled this step, is dropped.
        """
        need = self.kv.blocks_for(num_tokens) - len(seq.block_table)
        if need > self.kv.pool.num_free and self.cache is not None:
            self.cache.evict(need - self.kv.pool.num_free)  # cached prefixes go before running sequences
        while need > self.kv.pool.num_free:
            victim = self.running[-1]
            self._preempt(victim)
            chunks[:] = [c for c in chunks if c.seq is not victim]
            if victim is seq:
                return False
        if need > 0:
            seq.block_table.extend(self.kv.pool.allocate(need))
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if self.cache is not None:
            self.cache.index_prefix(seq)  # its recompute will find these blocks if they survive
        self.kv.pool.decref(seq.block_table)
        seq.block_table = []
        self._free_state(seq)
        if self.on_release is not None:
            self.on_release(seq)
        seq.cache_attached = False
        seq.num_computed = 0
        seq.num_cached = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(
        self, chunks: list[Chunk], sampled: list[Chunk], tokens: list[int], logprobs: list[TokenLogprobs | None]
    ) -> list[Sequence]:
        """Advance the computed counts, append sampled tokens, finish what is done."""
        for c in chunks:
            c.seq.num_computed = c.start + c.n
        finished = []
        for c, tok, lp in zip(sampled, tokens, logprobs):
            seq = c.seq
            if seq.is_finished:
                continue
            if seq.forced_tokens:
                reason = self._force(seq)
                reason = reason or ("length" if seq.num_output >= seq.params.max_tokens else None)
            else:
                seq.token_ids.append(tok)
                if lp is not None:
                    seq.logprobs.append(lp)
                reason = self.stop_reason(seq, tok)
            if reason:
                self.running.remove(seq)
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def commit(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprobs | None] | None = None) -> bool:
        """Append several tokens (speculative step), stopping at EOS or the length limit; True if finished.

        Forced tokens, if any, replace them (as in `postprocess`); the caller has set the computed
        length to end at the last token it knew before these."""
        if seq.forced_tokens:
            reason = self._force(seq)
            if reason is None and (seq.num_output >= seq.params.max_tokens or len(seq.token_ids) >= self.max_model_len):
                reason = "length"
            if reason:
                self.running.remove(seq)
                self._finish(seq, reason)
                return True
            return False
        for i, tok in enumerate(tokens):
            seq.token_ids.append(tok)
            if logprobs and logprobs[i] is not None:
                seq.logprobs.append(logprobs[i])
            reason = self.stop_reason(seq, tok)
            if reason:
                self.running.remove(seq)
                self._finish(seq, reason)
                return True
        return False

    def stop_reason(self, seq: Sequence, tok: int) -> str | None:
        """Why `seq` ends after appending `tok` (None: it goes on). A grammar's sequence takes the token
        into its matcher here, and ends once the grammar is complete (or at an EOS it allowed, even with
        ignore_eos: its mask allows EOS only where the answer is complete)."""
        p = seq.params
        constrained = seq.constraint is not None
        if (not p.ignore_eos or constrained) and tok in self.eos_ids or tok in p.stop_token_ids:
            return "stop"
        if constrained and seq.constraint.advance(tok):
            return "stop"
        if seq.num_output >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def _force(seq: Sequence) -> str | None:
        """Append the forced tokens in place of the sampled one; "stop" if they end a grammar's answer."""
        forced, seq.forced_tokens = seq.forced_tokens, []
        seq.token_ids.extend(forced)
        if seq.constraint is not None and any(seq.constraint.advance(t) for t in forced):
            return "stop"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if self.cache is not None and seq.block_table and reason in ("stop", "length") and seq.num_output:
            self.cache.commit(seq)
        if seq.block_table:
            self.kv.pool.decref(seq.block_table)
            seq.block_table = []
        if seq.constraint is not None:  # its matcher seeds the next sequences of the same grammar
            seq.constraint.release()
        self._free_state(seq)
        if self.on_release is not None:
            self.on_release(seq)

    def _free_state(self, seq: Sequence) -> None:
        """Give back the sequence's recurrent state slot (hybrid models); its next start is at position 0."""
        if seq.state_slot:
            assert self.kv.states is not None
            self.kv.states.free(seq.state_slot)
            seq.state_slot = 0
