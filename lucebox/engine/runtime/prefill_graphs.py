"""Prefill chunks replayed as CUDA graphs: a step that admits prompts without the eager path's launch cost.

Launched one by one from Python, a small model's forward costs far more on the host than on the GPU (on
SmolLM2, ~16 ms of Python and Triton launches against ~1 ms of kernels), so a step that admits a few
prompts next to running streams stalled them for tens of milliseconds. Here every prefill chunk of a step
is one ragged attention group (triton_attention: each chunk's rows, offsets and query tiles listed by the
host), so the whole forward has fixed shapes once its rows are padded to a bucket:
- row buckets: 16, 32, 64, then steps of ~1.5x up to 512 rows and of 128 rows above, up to the step's token
  budget; a bucket whose replay is slower than the eager forward of the smallest step it serves (a large
  model's big step is the GPU's time, which padding only adds to) is dropped at start-up, and its steps run
  eagerly;
- up to `max_seqs` chunks (padding chunks own no rows and no tiles);
- contexts up to `max_ctx` (MAX_CTX at most: a chunk over a longer context costs the GPU enough that the
  launches hide behind it, and runs eagerly).
Every bucket is captured at start-up into a pool of its own (a prefill graph replays on the side stream
while a decode graph replays on the main one). Padding rows write their K/V into scratch block 0.

With a drafter the graphs also keep the outputs of its target layers (`set_capture`), so a speculative
engine's prompt chunks, and the chunk that catches a sequence's drafter context up after the adaptive rule had
it decoding plainly, replay too (`run_step`): eagerly, the catch-up chunk cost ~16 plain steps (H100, SmolLM2).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lucebox.engine.kernels import graph_mode, triton_attention
from lucebox.engine.kernels.attention import AttentionMetadata, AttnGroup, pad_tables
from lucebox.engine.runtime.sequence import Chunk

if TYPE_CHECKING:
    from lucebox.engine.runtime.model_runner import StepResult

log = logging.getLogger(__name__)

MAX_CTX = 4096


def row_buckets(max_rows: int) -> list[int]:
    """16, 32, 64, 96, 144, 224, 336, 512 (each ~1.5x the last), then every 128 rows, up to `max_rows`: a step
    pays for at most a third more rows while it is small (its time is the host's), at most 127 rows once it is
    large (its time is the GPU's)."""
    out, r = [], 16
    while r < max_rows:
        out.append(r)
        r = r * 2 if r < 64 else (r * 3 // 2 + 15) // 16 * 16 if r < 512 else r + 128
    return out + [max_rows]


def worth_keeping(buckets: list[int], replay_s: dict[int, float], eager_s: dict[int, float]) -> set[int]:
    """The buckets whose replay (`replay_s[b]`, padded to b rows) beats running eagerly the smallest step the
    bucket serves (`eager_s[b]`: the previous bucket's rows + 1): a large model's big step is the GPU's time,
    which padding only adds to, so there the eager path is kept and the default is never slower than it."""
    return {b for b in buckets if replay_s[b] <= eager_s[b]}


class _Graph:
    def __init__(self, graph: torch.cuda.CUDAGraph, rows: int) -> None:
        self.graph = graph
        self.rows = rows


class PrefillGraphs:
    """Captures and replays one ModelRunner's prefill steps (ragged chunks), by row bucket."""

    def __init__(self, runner: Any, max_rows: int, max_seqs: int, max_ctx: int) -> None:
        self.runner = runner
        self.model = runner.model
        self.cfg = runner.model.cfg
        self.kv = runner.kv
        self.device = runner.device
        self.page = self.kv.block_size
        self.buckets = row_buckets(max_rows)
        self.dropped: set[int] = set()  # buckets whose steps run eagerly (capture_all timed them slower)
        self.seqs = max_seqs
        self.max_ctx = -(-min(max_ctx, MAX_CTX) // self.page) * self.page
        self.nb = self.max_ctx // self.page
        self.tile_rows = runner._tile_rows
        r, p = self.buckets[-1], max_seqs
        self.max_tiles = -(-r // self.tile_rows) + p
        # One packed int64 buffer: ids[r] | positions[r] | slots[r] | logit rows[p] | ctx[p] | q_lens[p] |
        # q_starts[p] | tiles[max_tiles] | block tables[p, nb].
        self.offsets = np.cumsum([0, r, r, r, p, p, p, p, self.max_tiles, p * self.nb])
        self.host = torch.zeros(int(self.offsets[-1]), dtype=torch.long, pin_memory=True)
        self.host_np = self.host.numpy()
        self.dev = torch.zeros(int(self.offsets[-1]), dtype=torch.long, device=self.device)
        self.graphs: dict[int, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        # Captured on a stream of their own: cuBLAS keys its workspace by stream, and a prefill graph replays
        # at the same time as a decode graph (captured on torch's default capture stream).
        self.capture_stream = torch.cuda.Stream(self.device)
        self.out_logits: torch.Tensor | None = None  # [seqs, vocab], made at the first capture
        self.capture: tuple[int, ...] = ()  # target layers whose outputs the graphs keep (a drafter's)
        self.out_features: list[torch.Tensor] = []  # one [max rows, hidden] per captured layer
        self.ready = False  # set by the engine's warm-up; a capture after it is counted
        self.captures_after_ready = 0
        self.replays = 0

    def _part(self, t: torch.Tensor | np.ndarray, i: int) -> Any:
        return t[int(self.offsets[i]): int(self.offsets[i + 1])]

    def bucket_for(self, chunks: list[Chunk]) -> int | None:
        """The row bucket of a step of these chunks, or None where they do not fit a graph."""
        if len(chunks) > self.seqs or any(c.verify or c.start + c.n > self.max_ctx for c in chunks):
            return None
        rows = sum(c.n for c in chunks)
        bucket = next((b for b in self.buckets if b >= rows), None)
        return None if bucket in self.dropped else bucket

    def set_capture(self, layers: tuple[int, ...]) -> None:
        """Keep the outputs of these target layers in every replay (a drafter's; () for none). Graphs captured
        for other layers are dropped, to be captured again by the next warm-up."""
        if tuple(layers) != self.capture:
            self.capture = tuple(layers)
            self.graphs.clear()
            self.dropped.clear()
            self.out_features = []
            self.pool = torch.cuda.graph_pool_handle()  # the freed graphs' pool cannot take new captures

    def capture_all(self, advance: Callable[[int], None] | None = None) -> int:
        """Capture every bucket not captured yet (start-up, largest first), then keep those whose replay is
        faster than the eager forward of the smallest step they serve (`worth_keeping`; both timed here, on
        the same inputs); returns how many were kept."""
        for rows in reversed(self.buckets):
            if rows not in self.graphs:
                self.graphs[rows] = self._capture(rows)
            if advance is not None:
                advance(1)
        # Timed on the capture's inputs, not on those a step left (an engine warmed up again after serving: a
        # real step's logit row indexes past a small bucket's rows, and its slots are some sequence's K/V).
        self._neutral_inputs()
        replay, eager = {}, {}
        for i, rows in enumerate(self.buckets):
            replay[rows] = self._time(self.graphs[rows].graph.replay)
            smallest = self.buckets[i - 1] + 1 if i else 1
            eager[rows] = self._time(lambda n=smallest: self._forward(n))
        keep = worth_keeping(self.buckets, replay, eager)
        self.dropped = set(self.buckets) - keep
        for rows in self.dropped:
            del self.graphs[rows]
        log.info("prefill graphs: %d of %d row buckets replay faster than the eager step%s", len(keep),
                 len(self.buckets), f" (eager: {', '.join(map(str, sorted(self.dropped)))} rows)" if self.dropped
                 else "")
        return len(keep)

    def _neutral_inputs(self) -> None:
        """Inputs that touch nothing: row 0 everywhere (a stale logit row of a larger bucket would index past a
        smaller one's rows), no tiles (they attend nothing), scratch slot 0."""
        self.host_np[:] = 0
        self._part(self.host_np, 7)[:] = -1
        self.dev.copy_(self.host)

    def _time(self, fn: Callable[[], Any], reps: int = 3) -> float:
        """Seconds one call of `fn` takes on the device (after a first call), on `_neutral_inputs`."""
        fn()
        torch.cuda.synchronize(self.device)
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize(self.device)
        return (time.perf_counter() - t) / reps

    def run(self, chunks: list[Chunk]) -> tuple[list[Chunk], torch.Tensor] | None:
        """(the chunks that sample, their logits [n, vocab]) replayed on the current stream, or None if the
        chunks fit no graph."""
        out = self._replay(chunks)
        if out is None:
            return None
        order, _ = out
        n = sum(c.wants_logits for c in order)
        assert self.out_logits is not None
        return order[:n], self.out_logits[:n].float()

    def run_step(self, chunks: list[Chunk]) -> StepResult | None:
        """The step as `ModelRunner.forward` gives it, the captured layers' outputs included (valid until the next
        replay), or None if the chunks fit no graph."""
        from lucebox.engine.runtime.model_runner import RowLayout, StepResult  # (which imports this module)

        out = self._replay(chunks)
        if out is None:
            return None
        order, rows = out
        n = sum(c.wants_logits for c in order)
        starts = np.cumsum([0] + [c.n for c in order])[:-1].tolist()
        layout = RowLayout(order, starts, [i if i < n else -1 for i in range(len(order))])
        assert self.out_logits is not None
        return StepResult(layout, self.out_logits[:n].float(), [f[:rows] for f in self.out_features])

    def _replay(self, chunks: list[Chunk]) -> tuple[list[Chunk], int] | None:
        """Replay the step's bucket with these chunks (those that sample first); (that order, the bucket)."""
        rows = self.bucket_for(chunks)
        if rows is None:
            return None
        g = self.graphs.get(rows)
        if g is None:  # before the inputs are filled: a capture's own forwards write the input buffers
            if self.ready:
                self.captures_after_ready += 1
                log.warning("prefill graph rows=%d captured while serving (the warm-up missed it)", rows)
            g = self.graphs[rows] = self._capture(rows)
        order = [c for c in chunks if c.wants_logits] + [c for c in chunks if not c.wants_logits]
        self._fill(order, rows)
        g.graph.replay()
        self.replays += 1
        return order, rows

    def _fill(self, order: list[Chunk], rows: int) -> None:
        h, p, bs = self.host_np, self.seqs, self.page
        ids, pos, slots, logit_rows, ctx, q_lens, q_starts, tiles, tables = (self._part(h, i) for i in range(9))
        ids[:rows] = pos[:rows] = slots[:rows] = 0  # padding rows: token 0 at position 0, into scratch slot 0
        logit_rows[:] = ctx[:] = q_lens[:] = q_starts[:] = 0
        at = 0
        for i, c in enumerate(order):
            table = np.asarray(c.seq.block_table, dtype=np.int64)
            k = np.arange(c.start, c.start + c.n)
            ids[at: at + c.n] = c.input_ids()
            pos[at: at + c.n] = k
            slots[at: at + c.n] = table[k // bs] * bs + k % bs
            q_starts[i], q_lens[i], ctx[i] = at, c.n, c.start + c.n
            at += c.n
            logit_rows[i] = at - 1
        tiles[:] = triton_attention.ragged_tiles(q_lens[: len(order)].tolist(), self.tile_rows, self.max_tiles)
        tables.reshape(p, self.nb)[: len(order)] = pad_tables([c.seq.block_table for c in order], self.nb)
        end = int(self.offsets[8]) + len(order) * self.nb  # the tables of padding chunks are never read
        self.dev[:end].copy_(self.host[:end], non_blocking=True)

    @torch.inference_mode()
    def _forward(self, rows: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        ids, pos, slots, logit_rows, ctx, q_lens, q_starts, tiles, tables = (self._part(self.dev, i)
                                                                             for i in range(9))
        ids, pos, slots = ids[:rows], pos[:rows], slots[:rows]
        tiles = tiles[: -(-rows // self.tile_rows) + self.seqs]
        group = AttnGroup(0, self.seqs, rows, self.max_ctx, tables.view(self.seqs, self.nb), ctx, pos,
                          q_lens=q_lens, q_starts=q_starts, tiles=tiles, n_rows=rows)
        window = self.cfg.sliding_window if self.cfg.has_sliding_layers else None
        hidden, features = self.model(ids, pos, self.kv.data, AttentionMetadata(slots, self.page, [group], window),
                                      capture=self.capture)
        return self.model.logits(hidden[logit_rows]), features

    @torch.inference_mode()
    def _capture(self, rows: int) -> _Graph:
        self._neutral_inputs()  # for the capture's forwards; the step's own inputs come after
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), graph_mode.rehearsal():
            for _ in range(2):  # warm-up outside the graph (kernel compilation, cuBLAS handles) on its path
                logits, features = self._forward(rows)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self.out_logits is None:
            self.out_logits = torch.zeros(self.seqs, logits.shape[-1], dtype=logits.dtype, device=self.device)
        if len(self.out_features) != len(features):
            self.out_features = [torch.zeros(self.buckets[-1], f.shape[-1], dtype=f.dtype, device=self.device)
                                 for f in features]
        del logits, features
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream, capture_error_mode="thread_local"):
            logits, features = self._forward(rows)
            self.out_logits.copy_(logits)
            for out, f in zip(self.out_features, features):
                out[:rows].copy_(f)
        log.debug("captured prefill graph rows=%d (chunks <= %d, context <= %d)", rows, self.seqs, self.max_ctx)
        return _Graph(graph, rows)
