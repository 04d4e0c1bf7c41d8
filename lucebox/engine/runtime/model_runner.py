"""Turn a scheduled batch of chunks into one model forward pass.

The runner owns the model and the KV tensors. For each step it lays the rows
out flat — decode rows first (one batched attention group), then the
speculative verification rows (one batched group, q_len = block or tree
size, tree masks), then one group per prefill chunk — packs the ids,
positions, slot mapping and the compact attention metadata (block tables,
context lengths, tree bitmasks) on the host into one array sent to the device
in one transfer, runs the model, and returns the logits of the rows that
sample (and, for DFlash, the chosen layers' outputs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lucebox.engine.kernels import triton_attention
from lucebox.engine.kernels.attention import AttentionMetadata, AttnGroup, pad_tables, tree_bits
from lucebox.engine.models import DecoderModel
from lucebox.engine.runtime.cuda_graphs import CudaGraphDecoder
from lucebox.engine.runtime.kv_cache import KVCache
from lucebox.engine.runtime.prefill_graphs import PrefillGraphs
from lucebox.engine.runtime.recurrent_state import StateRows
from lucebox.engine.runtime.sequence import Chunk


@dataclass
class RowLayout:
    """Where each chunk of a step sits in the step's flat rows and in its logits."""

    order: list[Chunk]  # chunks in layout order
    row_starts: list[int]  # first flat row of each chunk in `order`
    logit_starts: list[int]  # first logits row of each chunk in `order` (-1: none)


@dataclass(kw_only=True)
class StepInputs(RowLayout):
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # rows (of the flat layout) whose logits are wanted
    state: StateRows | None = None  # hybrid models: the recurrent state slot of each chunk


@dataclass
class StepResult:
    """One forward pass (eager, or a prefill graph's replay): logits of the sampling rows, and captured layer
    outputs when asked."""

    inputs: RowLayout
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
    def __init__(self, model: DecoderModel, kv: KVCache, dtype: torch.dtype) -> None:
        self.model = model
        self.cfg = model.cfg
        self.kv = kv
        self.device = kv.data.device
        self.graphs: CudaGraphDecoder | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        # Spark's graph-resident decode (spark/engine.py Spark.guarded): runs a decode-only step (the graph's
        # replay; without graphs the same sync-free step eagerly) and returns None when it must be run again
        # eagerly. Mixed steps then run eagerly too (no decode replay beside a prefill).
        self.guard: Callable[[Callable[[], Any]], Any] | None = None
        self._staging = _Staging(self.device)
        # A step's prefill chunks share one ragged attention group where the Triton kernels run (one launch
        # per layer however many prompts a step admits); elsewhere one group each, for the SDPA reference.
        # (Models whose layers have different query head counts keep a group per chunk: one tile list per step.)
        self._ragged = (triton_attention.available(self.device) and triton_attention.supports(self.cfg.head_dim)
                        and not self.cfg.heads_per_layer)
        group = self.cfg.num_heads // self.cfg.num_kv_heads
        self._tile_rows = (triton_attention.ragged_config(self.cfg.head_dim, dtype, group)[0] // group
                           if self._ragged else 0)

    def enable_cuda_graphs(self, max_batch: int, max_ctx: int, max_rows: int = 0) -> None:
        """Replay decode steps from captured CUDA graphs, and prefill chunks of up to `max_rows` rows a step
        too (runtime/prefill_graphs.py) where their attention is one ragged group and nothing in the forward
        reads the device from the host (a mixture of experts routes on the host; a hybrid's prefill splits
        its delta rule on the host's plan). CUDA devices only."""
        if self.device.type == "cuda":
            self.graphs = CudaGraphDecoder(self, max_batch, max_ctx)
            if max_rows and self._ragged and self.cfg.n_experts == 0 and self.kv.states is None:
                self.prefill_graphs = PrefillGraphs(self, max_rows, max_batch, max_ctx)

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.graphs is not None

    # ----- input preparation -------------------------------------------------

    def prepare(self, chunks: list[Chunk]) -> StepInputs:
        """The step's inputs and compact attention metadata, packed on the host (numpy, per chunk)
        into one int64 array and sent to the device in one transfer."""
        decodes = [c for c in chunks if is_decode(c)]
        verifies = [c for c in chunks if c.verify]
        prefills = [c for c in chunks if not is_decode(c) and not c.verify]
        if len({c.n for c in verifies}) > 1:
            raise ValueError("verification chunks of one step must have the same size")
        order = decodes + verifies + prefills
        bs = self.kv.block_size
        tables = [np.asarray(c.seq.block_table, dtype=np.int64) for c in order]
        ids: list[np.ndarray] = []
        pos: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        logit_rows: list[int] = []
        row_starts: list[int] = []
        logit_starts: list[int] = []
        row = 0
        for c, table in zip(order, tables):
            row_starts.append(row)
            ids.append(np.asarray(c.input_ids(), dtype=np.int64))
            pos.append(c.start + (np.arange(c.n) if c.parents is None else np.asarray(c.depths())))
            k = np.arange(c.start, c.start + c.n)
            slots.append(table[k // bs] * bs + k % bs)
            row += c.n
            if c.verify:
                logit_starts.append(len(logit_rows))
                logit_rows.extend(range(row - c.n, row))
            elif c.wants_logits:
                logit_starts.append(len(logit_rows))
                logit_rows.append(row - 1)
            else:
                logit_starts.append(-1)
        parts = [*ids, *pos, *slots, np.asarray(logit_rows, dtype=np.int64)]
        states = self.kv.states
        if states is not None:  # every chunk's state slot (the decodes' for one batched gather)
            parts.append(np.asarray([c.seq.state_slot for c in order], dtype=np.int64))
        # Attention groups: (first row, indices into `order`, has a draft tree); each adds its block
        # tables [n_seqs, blocks], context lengths [n_seqs], for trees ancestor bits [rows], and for the ragged
        # group of prefill chunks (where the kernels run) the rows of each chunk and their offsets.
        groups: list[tuple[int, list[int], bool]] = []
        i = 0
        if decodes:
            groups.append((0, list(range(len(decodes))), False))
            i = len(decodes)
        if verifies:
            idx = list(range(i, i + len(verifies)))
            groups.append((row_starts[i], idx, any(order[j].parents is not None for j in idx)))
            i += len(verifies)
        ragged = self._ragged and len(order) - i > 1
        if ragged:
            groups.append((row_starts[i], list(range(i, len(order))), False))
        else:
            groups.extend((row_starts[j], [j], False) for j in range(i, len(order)))
        for first, idx, has_tree in groups:
            ctx = [order[j].start + order[j].n for j in idx]
            parts.append(pad_tables([tables[j] for j in idx], -(-max(ctx) // bs)).ravel())
            parts.append(np.asarray(ctx, dtype=np.int64))
            if has_tree:
                parts.extend(tree_bits(order[j].parents or list(range(-1, order[j].n - 1))) for j in idx)
            if ragged and idx[0] == i:
                q_lens = [order[j].n for j in idx]
                parts.append(np.asarray(q_lens, dtype=np.int64))
                parts.append(np.asarray([row_starts[j] - first for j in idx], dtype=np.int64))
                tiles = triton_attention.ragged_tiles(q_lens, self._tile_rows)
                parts.append(tiles)
        dev = self._staging.to_device(parts)
        take = _Taker(dev)
        input_ids, positions, slot_mapping, logits_t = take(row), take(row), take(row), take(len(logit_rows))
        state = None
        if states is not None:
            nd = len(decodes)
            state = StateRows(states, nd, take(len(order)),
                              [(row_starts[nd + j], c.n, c.start, c.seq.state_slot) for j, c in enumerate(order[nd:])],
                              trees=[(c.parents or list(range(-1, c.n - 1))) if c.verify else None for c in order[nd:]])
        meta = AttentionMetadata(slot_mapping, bs, window=self.cfg.sliding_window if self.cfg.has_sliding_layers
                                 else None)
        for first, idx, has_tree in groups:
            c0 = order[idx[0]]
            n_seqs, q_len = len(idx), c0.n
            max_ctx = max(order[j].start + order[j].n for j in idx)
            bt = take(n_seqs * -(-max_ctx // bs)).view(n_seqs, -1)
            ctx_lens = take(n_seqs)
            tree = take(n_seqs * q_len) if has_tree else None
            if ragged and idx[0] == i:
                n_rows = sum(order[j].n for j in idx)
                meta.groups.append(AttnGroup(first, n_seqs, max(order[j].n for j in idx), max_ctx, bt, ctx_lens,
                                             positions[first: first + n_rows], q_lens=take(n_seqs),
                                             q_starts=take(n_seqs), tiles=take(tiles.size), n_rows=n_rows))
                continue
            meta.groups.append(AttnGroup(first, n_seqs, q_len, max_ctx, bt, ctx_lens,
                                         positions[first: first + n_seqs * q_len], tree,
                                         fresh=c0.start == 0 and not c0.verify))
        return StepInputs(order=order, row_starts=row_starts, logit_starts=logit_starts, input_ids=input_ids,
                          positions=positions, meta=meta, logit_rows=logits_t, state=state)

    # ----- execution ---------------------------------------------------------

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, capture: tuple[int, ...] = ()) -> StepResult:
        extra = {} if inputs.state is None else {"state": inputs.state}
        hidden, features = self.model(inputs.input_ids, inputs.positions, self.kv.data, inputs.meta, capture=capture,
                                      **extra)
        logits = self.model.logits(hidden[inputs.logit_rows]).float()
        return StepResult(inputs, logits, features)

    def run(self, chunks: list[Chunk], capture: tuple[int, ...] = ()
            ) -> tuple[list[Chunk], torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
        """Forward the chunks; returns the chunks that sample (in logits order), their logits, their argmax
        tokens when a CUDA graph already computed them, and for decode-only steps with `capture` (a hybrid's
        plain rows beside speculation: the drafter layers, `CudaGraphDecoder.capture`) those layers' outputs,
        a row per chunk in order."""
        decodes = [c for c in chunks if is_decode(c)]
        decode_only = bool(decodes) and len(decodes) == len(chunks)
        if capture:
            assert decode_only, "layer outputs are kept for decode-only steps"
            graphs = self.graphs
            if graphs is not None and graphs.capture == capture and self.guard is None:
                out = graphs.run(decodes)
                if out is not None:
                    return decodes, out[0], out[1], graphs.features(len(decodes))
            result = self.forward(self.prepare(chunks), capture=capture)
            return result.inputs.order, result.logits, None, result.features
        if decode_only and self.guard is not None:  # Spark: None means run it again eagerly (below)
            # a hybrid's recurrent states move on in place: each run of the step after the first, and the eager
            # one below, starts from the states as they were before it
            restore = (self.kv.states.snapshot([c.seq.state_slot for c in decodes])
                       if self.kv.states is not None else None)
            runs = 0

            def step() -> tuple[torch.Tensor, torch.Tensor | None] | None:
                nonlocal runs
                if runs and restore is not None:
                    restore()
                runs += 1
                return self._decode(decodes)

            out = self.guard(step)
            if out is not None:
                return decodes, out[0], out[1], []
            if runs and restore is not None:
                restore()
        elif self.graphs is not None:
            if decode_only:
                out = self.graphs.run(decodes)
                if out is not None:
                    return decodes, out[0], out[1], []
            elif decodes and self.kv.states is None and self.guard is None:  # a hybrid's runs eagerly: if its
                # prefill raised after the replay moved the decodes' states on, running the step again would
                # move them twice
                mixed = self._run_overlapped(decodes, [c for c in chunks if not is_decode(c)])
                if mixed is not None:
                    return (*mixed, [])
            elif self.prefill_graphs is not None:
                prefilled = self.prefill_graphs.run(chunks)
                if prefilled is not None:
                    return prefilled[0], prefilled[1], None, []
        result = self.forward(self.prepare(chunks))
        return [c for c in result.inputs.order if c.wants_logits], result.logits, None, []

    def _decode(self, decodes: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A decode-only step's (logits, argmax or None): the graph's replay (None: no bucket), else eagerly."""
        if self.graphs is not None:
            return self.graphs.run(decodes)
        return self.forward(self.prepare(decodes)).logits, None

    def _run_overlapped(
        self, decodes: list[Chunk], prefills: list[Chunk]
    ) -> tuple[list[Chunk], torch.Tensor, None] | None:
        """A step with both: the prefill chunks run on a side stream (a prefill graph's replay where they fit
        one, else eagerly) while the decode batch replays its CUDA graph on the main stream."""
        assert self.graphs is not None
        if self.graphs.buckets_for(len(decodes), max(c.start + 1 for c in decodes)) is None:
            return None
        main = torch.cuda.current_stream(self.device)
        side = self._side_stream()
        side.wait_stream(main)  # only what came before this step
        out = self.graphs.run(decodes)  # captures first if needed, before the side stream gets work
        with torch.cuda.stream(side):
            prefilled = self.prefill_graphs.run(prefills) if self.prefill_graphs is not None else None
            if prefilled is None:
                result = self.forward(self.prepare(prefills))
                prefilled = [c for c in result.inputs.order if c.wants_logits], result.logits
        main.wait_stream(side)
        prefilled[1].record_stream(main)
        assert out is not None
        return decodes + prefilled[0], torch.cat([out[0].float(), prefilled[1]]), None

    def _side_stream(self) -> torch.cuda.Stream:
        if not hasattr(self, "_stream"):
            self._stream = torch.cuda.Stream(self.device)
        return self._stream



class _Taker:
    """Consecutive views of the step's one device array, in the order `prepare` packed them."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.at = 0

    def __call__(self, n: int) -> torch.Tensor:
        self.at += n
        return self.t[self.at - n: self.at]


class _Staging:
    """The step's one host->device copy, through pinned buffers that are reused once their copy is done."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.bufs: list[torch.Tensor | None] = [None, None]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.i = 0

    def to_device(self, parts: list[np.ndarray]) -> torch.Tensor:
        if self.device.type != "cuda":
            return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64)).to(self.device)
        size = sum(p.size for p in parts)
        self.i = i = 1 - self.i
        event, buf = self.events[i], self.bufs[i]
        if event is not None:
            event.synchronize()  # the copy that last read this buffer has finished
        if buf is None or buf.numel() < size:
            buf = self.bufs[i] = torch.empty(max(size, 2 * (0 if buf is None else buf.numel()), 4096),
                                             dtype=torch.long, pin_memory=True)
        np.concatenate(parts, out=buf.numpy()[:size])
        dev = buf[:size].to(self.device, non_blocking=True)
        event = self.events[i] = torch.cuda.Event()
        event.record()
        return dev
