"""Decode steps replayed as CUDA graphs.

A small model's decode step is a few hundred tiny kernels; launched one by one
from Python they cost ~7 µs each, replayed from a graph ~1 µs. A graph fixes
every shape and address, so a decode-only step is padded to a captured batch
size and a captured context length (key positions gathered per sequence):
- batch buckets 1, 2, 4, 8, then multiples of 8 up to `max_batch`;
- context buckets: powers of two from 256 tokens up to the model's context.
Graphs are captured lazily the first time a (batch, context) bucket is used,
into one shared memory pool, and replayed with static input buffers refilled
each step. Padding rows write their K/V into scratch block 0 and are dropped.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from lucebox.engine.attention import AttentionMetadata, AttnGroup
from lucebox.engine.sequence import Chunk

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    small = [b for b in (1, 2, 4) if b < max_batch]
    return small + list(range(8, max_batch + 8, 8)) if max_batch > 4 else [b for b in (1, 2, 4) if b <= max_batch]


class _Graph:
    def __init__(self, graph: torch.cuda.CUDAGraph, logits: torch.Tensor) -> None:
        self.graph = graph
        self.logits = logits


class CudaGraphDecoder:
    """Captures and replays decode steps for one ModelRunner."""

    def __init__(self, runner: Any, max_batch: int, max_ctx: int) -> None:
        self.runner = runner
        self.model = runner.model
        self.kv = runner.kv
        self.device = runner.device
        self.batches = batch_buckets(max_batch)
        bs = self.kv.block_size
        self.max_ctx = -(-max_ctx // bs) * bs
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        sliding = self.model.cfg.has_sliding_layers
        b, c = self.batches[-1], self.max_ctx
        dev = self.device
        self.ids = torch.zeros(b, dtype=torch.long, device=dev)
        self.pos = torch.zeros(b, dtype=torch.long, device=dev)
        self.slots = torch.zeros(b, dtype=torch.long, device=dev)
        self.gather = torch.zeros(b, c, dtype=torch.long, device=dev)
        self.mask = torch.zeros(b, 1, 1, c, dtype=torch.bool, device=dev)
        self.mask_sliding = torch.zeros(b, 1, 1, c, dtype=torch.bool, device=dev) if sliding else None

    def buckets_for(self, n: int, ctx: int) -> tuple[int, int] | None:
        batch = next((b for b in self.batches if b >= n), None)
        if batch is None or ctx > self.max_ctx:
            return None
        c = 256
        while c < ctx:
            c *= 2
        return batch, min(c, self.max_ctx)

    def run(self, chunks: list[Chunk]) -> torch.Tensor | None:
        """Logits [len(chunks), vocab] for a decode-only step, or None if no bucket fits."""
        ctx = max(c.start + 1 for c in chunks)
        buckets = self.buckets_for(len(chunks), ctx)
        if buckets is None:
            return None
        batch, c = buckets
        self._fill(chunks, batch, c)
        g = self.graphs.get(buckets)
        if g is None:
            g = self._capture(batch, c)
            self.graphs[buckets] = g
            self._fill(chunks, batch, c)  # capture ran the graph on the same buffers; refill
        g.graph.replay()
        return g.logits[: len(chunks)]

    def _fill(self, chunks: list[Chunk], batch: int, c: int) -> None:
        n = len(chunks)
        r = self.runner
        ids = torch.zeros(batch, dtype=torch.long)
        pos = torch.zeros(batch, dtype=torch.long)
        slots = torch.zeros(batch, dtype=torch.long)
        ids[:n] = torch.tensor([ch.seq.token_ids[ch.start] for ch in chunks])
        pos[:n] = torch.tensor([ch.start for ch in chunks])
        slots[:n] = torch.tensor([self.kv.slot(ch.seq.block_table, ch.start) for ch in chunks])
        gather = torch.zeros(batch, c, dtype=torch.long)
        gather[:n] = r.gather_index([ch.seq.block_table for ch in chunks], c)
        mask, mask_sliding = r.causal_masks(pos[:, None], pos + 1, c)
        mask[n:, :, :, 0] = True  # padding rows attend to one (scratch) key: no NaN
        self.ids[:batch].copy_(ids, non_blocking=True)
        self.pos[:batch].copy_(pos, non_blocking=True)
        self.slots[:batch].copy_(slots, non_blocking=True)
        self.gather[:batch, :c].copy_(gather, non_blocking=True)
        self.mask[:batch, :, :, :c].copy_(mask, non_blocking=True)
        if self.mask_sliding is not None:
            mask_sliding[n:, :, :, 0] = True
            self.mask_sliding[:batch, :, :, :c].copy_(mask_sliding, non_blocking=True)

    def _meta(self, batch: int, c: int) -> AttentionMetadata:
        sliding = self.mask_sliding[:batch, :, :, :c] if self.mask_sliding is not None else None
        group = AttnGroup(0, batch, 1, self.gather[:batch, :c], self.mask[:batch, :, :, :c], sliding)
        return AttentionMetadata(self.slots[:batch], [group])

    @torch.inference_mode()
    def _forward(self, batch: int, c: int) -> torch.Tensor:
        hidden, _ = self.model(self.ids[:batch], self.pos[:batch], self.kv.data, self._meta(batch, c))
        return self.model.logits(hidden)

    @torch.inference_mode()
    def _capture(self, batch: int, c: int) -> _Graph:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph (cuBLAS handles, autotuning)
                self._forward(batch, c)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(batch, c)
        log.debug("captured decode graph batch=%d ctx=%d", batch, c)
        return _Graph(graph, logits)
