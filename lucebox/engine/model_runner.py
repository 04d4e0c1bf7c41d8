"""Turn a scheduled batch of chunks into one model forward pass.

The runner owns the model and the KV tensors. For each step it lays the rows
out flat (decode rows first as one batched attention group, then one group
per prefill chunk), builds the slot mapping, gather indices and masks once,
runs the model, and returns the logits of the rows that sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lucebox.engine.attention import AttentionMetadata, AttnGroup
from lucebox.engine.cuda_graphs import CudaGraphDecoder
from lucebox.engine.kv_cache import KVCache
from lucebox.engine.models import DecoderModel
from lucebox.engine.sequence import Chunk


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # rows (of the flat layout) whose logits are wanted
    order: list[Chunk]  # chunks in layout order


class ModelRunner:
    def __init__(self, model: DecoderModel, kv: KVCache) -> None:
        self.model = model
        self.cfg = model.cfg
        self.kv = kv
        self.device = kv.data.device
        self.graphs: CudaGraphDecoder | None = None

    def enable_cuda_graphs(self, max_batch: int, max_ctx: int) -> None:
        """Replay decode-only steps from captured CUDA graphs (CUDA devices only)."""
        if self.device.type == "cuda":
            self.graphs = CudaGraphDecoder(self, max_batch, max_ctx)

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.graphs is not None

    # ----- input preparation -------------------------------------------------

    def prepare(self, chunks: list[Chunk]) -> StepInputs:
        decodes = [c for c in chunks if c.n == 1 and c.start > 0]
        prefills = [c for c in chunks if not (c.n == 1 and c.start > 0)]
        order = decodes + prefills
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        for c in order:
            ids.extend(c.seq.token_ids[c.start:c.start + c.n])
            pos.extend(range(c.start, c.start + c.n))
            slots.extend(self.kv.slots(c.seq.block_table, c.start, c.start + c.n))
            if c.wants_logits:
                logit_rows.append(len(ids) - 1)
        meta = AttentionMetadata(slot_mapping=self._tensor(slots))
        row = 0
        if decodes:
            meta.groups.append(self._batched_group(row, decodes, q_len=1))
            row += len(decodes)
        for c in prefills:
            meta.groups.append(self._prefill_group(row, c))
            row += c.n
        return StepInputs(self._tensor(ids), self._tensor(pos), meta, self._tensor(logit_rows), order)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

    def _batched_group(self, row_start: int, chunks: list[Chunk], q_len: int) -> AttnGroup:
        """Sequences that each add `q_len` rows after a cached context."""
        ctx = [c.start + c.n for c in chunks]
        max_ctx = max(ctx)
        gather = self.gather_index([c.seq.block_table for c in chunks], max_ctx)
        ctx_t = torch.tensor(ctx, dtype=torch.long)
        q_pos = torch.stack([torch.arange(c.start, c.start + q_len) for c in chunks])  # [G, q_len]
        mask, mask_sliding = self.causal_masks(q_pos, ctx_t, max_ctx)
        return AttnGroup(row_start, len(chunks), q_len, self._dev(gather), self._dev(mask), self._dev(mask_sliding))

    def _prefill_group(self, row_start: int, c: Chunk) -> AttnGroup:
        q_pos = torch.arange(c.start, c.start + c.n)[None]
        window = self.cfg.sliding_window if self.cfg.has_sliding_layers else None
        if c.start == 0:
            # Fresh prompt: attend to own rows; causal via is_causal, window via a mask.
            sliding = None
            if window is not None and c.n > window:
                sliding = self.causal_masks(q_pos, torch.tensor([c.n]), c.n)[1]
            return AttnGroup(row_start, 1, c.n, None, None, self._dev(sliding))
        ctx = c.start + c.n
        gather = self.gather_index([c.seq.block_table], ctx)
        mask, mask_sliding = self.causal_masks(q_pos, torch.tensor([ctx]), ctx)
        return AttnGroup(row_start, 1, c.n, self._dev(gather), self._dev(mask), self._dev(mask_sliding))

    def gather_index(self, tables: list[list[int]], ctx: int) -> torch.Tensor:
        """[G, ctx] slot of each key position (block 0, scratch, past a table's end), on the CPU."""
        bs = self.kv.block_size
        n_blocks = -(-ctx // bs)
        bt = torch.zeros(len(tables), n_blocks, dtype=torch.long)
        for i, t in enumerate(tables):
            t = t[:n_blocks]
            bt[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        pos = torch.arange(ctx)
        return bt[:, pos // bs] * bs + pos % bs

    def causal_masks(
        self, q_pos: torch.Tensor, ctx: torch.Tensor, max_ctx: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[G, 1, q, max_ctx] masks on the CPU: full-attention layers, and sliding layers if any."""
        k_pos = torch.arange(max_ctx)[None, None, :]
        q = q_pos[:, :, None]
        allowed = (k_pos <= q) & (k_pos < ctx[:, None, None])
        sliding = None
        if self.cfg.has_sliding_layers:
            sliding = (allowed & (q - k_pos < self.cfg.sliding_window))[:, None]
        return allowed[:, None], sliding

    def _dev(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(self.device, non_blocking=True)

    # ----- execution ---------------------------------------------------------

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [n_logit_rows, vocab] in fp32."""
        hidden, _ = self.model(inputs.input_ids, inputs.positions, self.kv.data, inputs.meta)
        return self.model.logits(hidden[inputs.logit_rows]).float()

    def run(self, chunks: list[Chunk]) -> tuple[list[Chunk], torch.Tensor, torch.Tensor | None]:
        """Forward the chunks; returns the chunks that sample (in logits order), their logits,
        and their argmax tokens when a CUDA graph already computed them."""
        if self.graphs is not None:
            decodes = [c for c in chunks if c.n == 1 and c.start > 0]
            if decodes and len(decodes) == len(chunks):
                out = self.graphs.run(decodes)
                if out is not None:
                    return decodes, out[0], out[1]
            elif decodes:
                mixed = self._run_overlapped(decodes, [c for c in chunks if not (c.n == 1 and c.start > 0)])
                if mixed is not None:
                    return mixed
        inputs = self.prepare(chunks)
        logits = self.forward(inputs)
        return [c for c in inputs.order if c.wants_logits], logits, None

    def _run_overlapped(
        self, decodes: list[Chunk], prefills: list[Chunk]
    ) -> tuple[list[Chunk], torch.Tensor, None] | None:
        """A step with both: prefill chunks run eagerly on a side stream while the
        decode batch replays its CUDA graph on the main stream."""
        assert self.graphs is not None
        if self.graphs.buckets_for(len(decodes), max(c.start + 1 for c in decodes)) is None:
            return None
        main = torch.cuda.current_stream(self.device)
        side = self._side_stream()
        side.wait_stream(main)  # only what came before this step
        out = self.graphs.run(decodes)  # captures first if needed, before the side stream gets work
        with torch.cuda.stream(side):
            inputs = self.prepare(prefills)
            prefill_logits = self.forward(inputs)
        main.wait_stream(side)
        prefill_logits.record_stream(main)
        assert out is not None
        sampled = decodes + [c for c in inputs.order if c.wants_logits]
        return sampled, torch.cat([out[0].float(), prefill_logits]), None

    def _side_stream(self) -> torch.cuda.Stream:
        if not hasattr(self, "_stream"):
            self._stream = torch.cuda.Stream(self.device)
        return self._stream
