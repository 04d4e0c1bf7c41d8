"""Turn a scheduled batch of chunks into one model forward pass.

The runner owns the model and the KV tensors. For each step it lays the rows
out flat — decode rows first (one batched attention group), then the
speculative verification rows (one batched group, q_len = block or tree
size, tree masks), then one group per prefill chunk — builds the slot
mapping, gather indices and masks once, runs the model, and returns the
logits of the rows that sample (and, for DFlash, the chosen layers' outputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lucebox.engine.attention import AttentionMetadata, AttnGroup
from lucebox.engine.cuda_graphs import CudaGraphDecoder
from lucebox.engine.kv_cache import KVCache, gather_index
from lucebox.engine.models import DecoderModel
from lucebox.engine.sequence import Chunk


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # rows (of the flat layout) whose logits are wanted
    order: list[Chunk]  # chunks in layout order
    row_starts: list[int]  # first flat row of each chunk in `order`
    logit_starts: list[int]  # first logits row of each chunk in `order` (-1: none)


@dataclass
class StepResult:
    """One forward pass: logits of the sampling rows, and captured layer outputs when asked."""

    inputs: StepInputs
    logits: torch.Tensor  # [n_logit_rows, vocab]
    features: list[torch.Tensor]  # one [T, hidden] per captured layer (all rows), or []

    def chunk_logits(self, i: int) -> torch.Tensor:
        """Logits of chunk `i` (layout order): every row for a verification, else its last row."""
        c = self.inputs.order[i]
        start = self.inputs.logit_starts[i]
        return self.logits[start: start + (c.n if c.verify else 1)]

    def chunk_features(self, i: int) -> list[torch.Tensor]:
        start = self.inputs.row_starts[i]
        n = self.inputs.order[i].n
        return [f[start: start + n] for f in self.features]


def is_decode(c: Chunk) -> bool:
    """One row after a computed context that samples: the last known token (a decode, or the last prompt
    token after a prefix-cache hit). One row from the middle of a prompt (a step's leftover budget) is not."""
    return c.n == 1 and c.start > 0 and not c.verify and c.wants_logits


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
        decodes = [c for c in chunks if is_decode(c)]
        verifies = [c for c in chunks if c.verify]
        prefills = [c for c in chunks if not is_decode(c) and not c.verify]
        if len({c.n for c in verifies}) > 1:
            raise ValueError("verification chunks of one step must have the same size")
        order = decodes + verifies + prefills
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        row_starts: list[int] = []
        logit_starts: list[int] = []
        for c in order:
            row_starts.append(len(ids))
            ids.extend(c.input_ids())
            pos.extend(c.start + d for d in c.depths())
            slots.extend(self.kv.slots(c.seq.block_table, c.start, c.start + c.n))
            if c.verify:
                logit_starts.append(len(logit_rows))
                logit_rows.extend(range(len(ids) - c.n, len(ids)))
            elif c.wants_logits:
                logit_starts.append(len(logit_rows))
                logit_rows.append(len(ids) - 1)
            else:
                logit_starts.append(-1)
        meta = AttentionMetadata(slot_mapping=self._tensor(slots))
        row = 0
        if decodes:
            meta.groups.append(self._batched_group(row, decodes, q_len=1))
            row += len(decodes)
        if verifies:
            meta.groups.append(self._verify_group(row, verifies))
            row += sum(c.n for c in verifies)
        for c in prefills:
            meta.groups.append(self._prefill_group(row, c))
            row += c.n
        return StepInputs(self._tensor(ids), self._tensor(pos), meta, self._tensor(logit_rows), order,
                          row_starts, logit_starts)

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

    def _verify_group(self, row_start: int, chunks: list[Chunk]) -> AttnGroup:
        """Draft rows after a cached context: row i sees the context and its tree ancestors (and itself).

        Row i of sequence g sits in cache slot `start + i` but at RoPE position
        `start + depth(i)`; a chain is the tree whose ancestors are all earlier rows.
        """
        n = chunks[0].n
        max_ctx = max(c.start + n for c in chunks)
        gather = self.gather_index([c.seq.block_table for c in chunks], max_ctx)
        k_idx = torch.arange(max_ctx)
        masks, slides = [], []
        for c in chunks:
            depth = torch.tensor(c.depths())
            anc = ancestor_matrix(c.parents if c.parents is not None else list(range(-1, n - 1)))
            allowed = torch.zeros(n, max_ctx, dtype=torch.bool)
            allowed[:, : c.start] = True
            allowed[:, c.start: c.start + n] = anc
            masks.append(allowed)
            if self.cfg.has_sliding_layers:
                q_pos = c.start + depth
                k_pos = torch.where(k_idx < c.start, k_idx, c.start + depth[(k_idx - c.start).clamp(0, n - 1)])
                slides.append(allowed & ((q_pos[:, None] - k_pos[None, :]) < self.cfg.sliding_window))
        mask = torch.stack(masks)[:, None]
        sliding = torch.stack(slides)[:, None] if slides else None
        return AttnGroup(row_start, len(chunks), n, self._dev(gather), self._dev(mask), self._dev(sliding))

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
        return gather_index(tables, ctx, self.kv.block_size)

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
    def forward(self, inputs: StepInputs, capture: tuple[int, ...] = ()) -> StepResult:
        hidden, features = self.model(inputs.input_ids, inputs.positions, self.kv.data, inputs.meta, capture=capture)
        logits = self.model.logits(hidden[inputs.logit_rows]).float()
        return StepResult(inputs, logits, features)

    def run(self, chunks: list[Chunk]) -> tuple[list[Chunk], torch.Tensor, torch.Tensor | None]:
        """Forward the chunks; returns the chunks that sample (in logits order), their logits,
        and their argmax tokens when a CUDA graph already computed them."""
        if self.graphs is not None:
            decodes = [c for c in chunks if is_decode(c)]
            if decodes and len(decodes) == len(chunks):
                out = self.graphs.run(decodes)
                if out is not None:
                    return decodes, out[0], out[1]
            elif decodes:
                mixed = self._run_overlapped(decodes, [c for c in chunks if not is_decode(c)])
                if mixed is not None:
                    return mixed
        result = self.forward(self.prepare(chunks))
        return [c for c in result.inputs.order if c.wants_logits], result.logits, None

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
            result = self.forward(self.prepare(prefills))
        main.wait_stream(side)
        result.logits.record_stream(main)
        assert out is not None
        sampled = decodes + [c for c in result.inputs.order if c.wants_logits]
        return sampled, torch.cat([out[0].float(), result.logits]), None

    def _side_stream(self) -> torch.cuda.Stream:
        if not hasattr(self, "_stream"):
            self._stream = torch.cuda.Stream(self.device)
        return self._stream


def ancestor_matrix(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: entry (i, j) is True when row j is row i or one of its ancestors (parents precede children)."""
    n = len(parents)
    anc = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] |= anc[p]
    return anc
