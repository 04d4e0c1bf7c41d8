"""Speculative decode steps with fixed shapes, replayed as CUDA graphs.

A DFlash step is three launches of many small kernels: the drafter pass, the
target's verification of the block (or tree), and the bookkeeping after the
walk (drafter context K/V for the accepted rows, and for trees the KV
compaction). Each runs here on static buffers padded to a batch bucket and a
context bucket, so on CUDA each is one graph replay; on the CPU the same code
runs eagerly (the tests check it equals the dynamic path in dflash.py).

Per step the host: fills the draft inputs → replay → reads the chain (argmax)
or the top-K for the tree → builds the verification rows → replay → reads
the target's choices → walks → fills the accepted rows → replay.

A hybrid target (models/qwen35.py) verifies from each sequence's state slot,
its rows' conv windows and parent states filled in buffers like the rest (the
delta rule over all rows in one `tree_step` launch a layer on CUDA), every
row's states kept in fixed buffers (`StateRows.kept`, the memory plan's
verification rows), and the accepted row's state written to the slot by the
bookkeeping graph. Its batch buckets stop at the state slots.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from lucebox.engine.kernels import graph_mode
from lucebox.engine.kernels.attention import AttentionMetadata, AttnGroup, pad_tables, tree_bits
from lucebox.engine.runtime.cuda_graphs import MIN_CTX, all_buckets, batch_buckets, pick_buckets
from lucebox.engine.runtime.recurrent_state import StateRows, conv_windows
from lucebox.engine.runtime.sequence import Chunk
from lucebox.engine.spec.dflash import SpecDecoder, build_tree, walk

log = logging.getLogger(__name__)


class _Graphed:
    """A function of static buffers, run eagerly or captured once and replayed.

    `like`: the outputs of a graph of the same kind and batch (same shapes) that this one writes its outputs
    into, so the graphs of every context bucket share one set of outputs in the pool instead of one each."""

    def __init__(self, fn: Callable[[], Any], device: torch.device, pool: Any, like: Any = None) -> None:
        self.fn = fn
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: Any = None
        if device.type == "cuda":
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream), graph_mode.rehearsal():
                for _ in range(2):  # kernel compilation, cuBLAS handles, on the capture's path
                    fn()
            torch.cuda.current_stream(device).wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
                out = fn()
                if like is not None:
                    _copy_into(like, out)
                    out = like
                self.out = out

    def __call__(self) -> Any:
        if self.graph is None:
            self.out = self.fn()
        else:
            self.graph.replay()
        return self.out


class StaticSpec:
    def __init__(self, spec: SpecDecoder, max_batch: int, max_ctx: int) -> None:
        self.spec = spec
        self.drafter = spec.drafter
        self.target = spec.target
        self.device = spec.device
        self.page = spec.target_kv.block_size
        self.states = spec.target_kv.states  # a hybrid's recurrent state slots, else None
        self.batches = batch_buckets(max_batch)
        if self.states is not None:  # a verifying sequence holds a slot: buckets up to the slots, the last exactly
            slots = self.states.num_slots  # (so every verification fits one, and the kept states the memory plan)
            self.batches = sorted({b for b in self.batches if b < slots} | {min(slots, max_batch)})
        self.max_ctx = max(MIN_CTX, -(-max_ctx // self.page) * self.page)
        self.B = spec.block
        self.N = spec.rows_per_step
        self.K = 8 if spec.ddtree and spec.budget > spec.block - 1 else 1
        self.graphs: dict[tuple[str, int, int], _Graphed] = {}
        self.ready = False  # set by the engine's warm-up; a capture after it is counted
        self.captures_after_ready = 0
        self._outs: dict[tuple[str, int], Any] = {}  # (kind, batch) -> the outputs its graphs share
        self.pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        b, n, nb = self.batches[-1], self.N, self.max_ctx // self.page
        dev, long = self.device, torch.long
        z = lambda *shape, dtype=long: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
        self.kpos = torch.arange(self.max_ctx + n, device=dev)
        # drafter inputs
        self.d_ids, self.d_start, self.d_tables = z(b, self.B), z(b), z(b, nb)
        # verification inputs
        self.v_ids, self.v_pos, self.v_slots = z(b, n), z(b, n), z(b, n)
        self.v_tables, self.v_start = z(b, nb), z(b)
        self.v_tree = z(b, n)  # DDTree: each row's ancestor-or-self bits within the draft
        # accepted-rows inputs
        self.e_rows, self.e_pos, self.e_dslots, self.e_src, self.e_dst = z(b, n), z(b, n), z(b, n), z(b, n), z(b, n)
        if self.states is not None:  # a hybrid's verification: state slots, conv windows, parents, kept states
            conv, ssm = self.states.shapes()  # [linear layers, C, K-1], [linear layers, Hv, Dk, Dv]
            self.kernel = conv[-1] + 1
            self.v_sslot, self.v_window = z(b), z(b, n, self.kernel)
            self.v_parents = z(b, n, dtype=torch.int32)
            f32 = torch.float32
            self.kept = (torch.zeros(conv[0], b, n, *conv[1:], dtype=f32, device=dev),
                         torch.zeros(ssm[0], b, n + 1, *ssm[1:], dtype=f32, device=dev))
            self.e_acc = z(b)  # each sequence's last accepted row: its state becomes the slot's
            chain = list(range(-1, n - 1))
            self._trees: list[list[int]] = [chain] * b  # the host's parents (the CPU's torch recurrence reads them)
            self._chain = (torch.tensor(conv_windows(chain, self.kernel)), torch.tensor(chain, dtype=torch.int32) + 1)

    def buckets_for(self, n: int, ctx: int) -> tuple[int, int] | None:
        return pick_buckets(self.batches, self.max_ctx, n, ctx)

    KINDS = ("draft", "verify", "extend")  # capture order within a bucket: extend reads verify's outputs

    def graph_keys(self) -> list[tuple[str, int, int]]:
        """Every graph a step can reach, largest bucket first (the start-up capture order)."""
        return [(kind, b, c) for b, c in all_buckets(self.batches, self.max_ctx) for kind in self.KINDS]

    @torch.inference_mode()
    def capture_all(self, advance: Callable[[int], None] | None = None) -> int:
        """Capture every graph not captured yet (start-up); returns how many were captured."""
        n = 0
        for kind, b, c in self.graph_keys():
            if (kind, b, c) not in self.graphs:
                self._graph(kind, b, c)
                n += 1
            if advance is not None:
                advance(1)
        return n

    # ----- the three graph bodies ---------------------------------------------

    def _draft_fn(self, b: int, c: int) -> Callable[[], Any]:
        d, bs, B = self.drafter, self.page, self.B
        kv = self.spec.kv.data

        @torch.inference_mode()
        def fn() -> Any:
            start = self.d_start[:b]
            h = self.target.embed(self.d_ids[:b]).to(kv.dtype)
            pos = (start[:, None] + self.kpos[:B][None, :]).flatten()
            rope = d.rotary(pos, h.dtype)
            kp = self.kpos[:c]
            tables = self.d_tables[:b]
            gather = tables[:, kp // bs] * bs + kp % bs
            ctx_ok = kp[None, :] < start[:, None]
            mask = torch.cat([ctx_ok, torch.ones(b, B, dtype=torch.bool, device=self.device)], 1)[:, None, None, :]
            mask = mask.expand(b, 1, B, c + B)
            for i, layer in enumerate(d.layers):
                h = layer(h, rope, kv[i, 0][gather], kv[i, 1][gather], mask)
            logits = self.spec._head(d.norm(h[:, 1:]))
            if self.K == 1:
                return logits.argmax(-1)
            top = logits.float().log_softmax(-1).topk(self.K, dim=-1)
            return top.values, top.indices

        return fn

    def _verify_fn(self, b: int, c: int) -> Callable[[], Any]:
        n, cfg = self.N, self.target.cfg
        window = cfg.sliding_window if cfg.has_sliding_layers else None

        @torch.inference_mode()
        def fn() -> Any:
            group = AttnGroup(0, b, n, c, self.v_tables[:b], self.v_start[:b] + n, self.v_pos[:b].flatten(),
                              self.v_tree[:b].flatten() if self.spec.ddtree else None)
            meta = AttentionMetadata(self.v_slots[:b].flatten(), self.page, [group], window)
            extra = {}
            if self.states is not None:  # every chunk a verification of n rows from its slot's state
                extra["state"] = StateRows(self.states, 0, self.v_sslot[:b], [(i * n, n, 1, -1) for i in range(b)],
                                           trees=list(self._trees[:b]), fixed=(self.v_window, self.v_parents),
                                           kept=self.kept)
            hidden, feats = self.target(self.v_ids[:b].flatten(), self.v_pos[:b].flatten(),
                                        self.spec.target_kv.data, meta, capture=self.spec.capture, **extra)
            logits = self.target.logits(hidden)
            return logits, logits.argmax(-1), feats

        return fn

    def _extend_fn(self, b: int, c: int) -> Callable[[], Any]:
        n, d = self.N, self.drafter
        verify = self.graphs[("verify", b, c)]
        kv, tkv = self.spec.kv.data, self.spec.target_kv.data

        @torch.inference_mode()
        def fn() -> None:
            _, _, feats = verify.out
            rows = (self.e_rows[:b] + self.kpos[:b][:, None] * n).flatten()
            x = d.fuse([f[rows].to(kv.dtype) for f in feats])
            cos, sin = d.rotary(self.e_pos[:b].flatten(), x.dtype)
            slots = self.e_dslots[:b].flatten()
            for i, layer in enumerate(d.layers):
                k, v = layer.context_kv(x, cos, sin)
                kv[i, 0].index_copy_(0, slots, k)
                kv[i, 1].index_copy_(0, slots, v)
            src, dst = self.e_src[:b].flatten(), self.e_dst[:b].flatten()
            tkv[:, :, dst] = tkv[:, :, src]
            if self.states is not None:  # the state after each sequence's last accepted row becomes its slot's
                seqs, acc, slots = self.kpos[:b], self.e_acc[:b], self.v_sslot[:b]
                self.states.conv.index_copy_(1, slots, self.kept[0][:, seqs, acc])
                self.states.ssm.index_copy_(1, slots, self.kept[1][:, seqs, acc + 1])

        return fn

    def _graph(self, kind: str, b: int, c: int) -> _Graphed:
        key = (kind, b, c)
        g = self.graphs.get(key)
        if g is None:
            if self.ready:
                self.captures_after_ready += 1
                log.warning("spec graph %s batch=%d ctx=%d captured while serving (the warm-up missed it)", *key)
            make = {"draft": self._draft_fn, "verify": self._verify_fn, "extend": self._extend_fn}[kind]
            # The eager runs before a capture execute the body: the bookkeeping's (its moves of KV rows are not
            # idempotent) then points at scratch slot 0 and block 0, and its inputs are put back after.
            inputs = self._extend_inputs() if kind == "extend" and self.device.type == "cuda" else []
            held = [t.clone() for t in inputs]
            for t in inputs:
                t.zero_()
            g = self.graphs[key] = _Graphed(make(b, c), self.device, self.pool, self._outs.get((kind, b)))
            for t, h in zip(inputs, held):
                t.copy_(h)
            self._outs.setdefault((kind, b), g.out)
            log.debug("spec graph %s batch=%d ctx=%d", kind, b, c)
        return g

    def _extend_inputs(self) -> list[torch.Tensor]:
        """The buffers the bookkeeping graph reads (besides the verification's outputs)."""
        hybrid = [self.e_acc, self.v_sslot] if self.states is not None else []
        return [self.e_rows, self.e_pos, self.e_dslots, self.e_src, self.e_dst, *hybrid]

    # ----- one step -----------------------------------------------------------

    @torch.inference_mode()
    def step(self, chunks: list[Chunk],
             chooser: Callable[[Chunk, torch.Tensor, list[int]], Callable[[int, list[int]], int]]
             ) -> list[list[int]] | None:
        """Draft, verify and accept for decode chunks; None if no bucket fits (caller falls back).

        The sequences' computed lengths change only at the end, so a step that raises leaves them as
        they were (the engine then runs the chunks one by one)."""
        spec, n = self.spec, self.N
        ctx = max(ch.start + n for ch in chunks)
        buckets = self.buckets_for(len(chunks), ctx)
        if buckets is None:
            return None
        b, c = buckets
        g = len(chunks)
        # 1. draft
        ids = torch.full((b, self.B), self.drafter.cfg.mask_token_id, dtype=torch.long)
        ids[:g, 0] = torch.tensor([ch.seq.token_ids[ch.start] for ch in chunks])
        self.d_ids[:b].copy_(ids)
        self.d_start[:b].copy_(_pad([ch.start for ch in chunks], b))
        self.d_tables[:b].copy_(self._tables([ch.seq.block_table for ch in chunks], b))
        out = self._graph("draft", b, c)()
        verify: list[Chunk] = []
        if self.K == 1:
            drafts = out[:g].tolist()
            for ch, dr in zip(chunks, drafts):
                dr = dr[: n - 1] if ch.seq.constraint is None else ch.seq.constraint.fit_draft(dr[: n - 1])
                toks = [ch.seq.token_ids[ch.start]] + dr
                parents = None if not spec.ddtree else list(range(-1, n - 1))
                verify.append(Chunk(ch.seq, ch.start, n, tokens=toks, parents=parents))
        else:
            top_v, top_i = out[0][:g].tolist(), out[1][:g].tolist()
            for ch, tv, ti in zip(chunks, top_v, top_i):
                toks, parents = build_tree(tv, ti, spec.budget)
                verify.append(Chunk(ch.seq, ch.start, n, tokens=[ch.seq.token_ids[ch.start]] + toks,
                                    parents=[-1] + parents))
        spec.stats.drafted += g * (n - 1)
        # 2. verify
        v_ids = torch.zeros(b, n, dtype=torch.long)
        v_pos = torch.zeros(b, n, dtype=torch.long)
        v_slots = torch.zeros(b, n, dtype=torch.long)
        v_tree = torch.from_numpy(tree_bits(list(range(-1, n - 1)))).expand(b, n).clone()  # padding: chains
        for i, ch in enumerate(verify):
            depth = ch.depths()
            v_ids[i] = torch.tensor(ch.tokens)
            v_pos[i] = ch.start + torch.tensor(depth)
            v_slots[i] = torch.tensor(spec.target_kv.slots(ch.seq.block_table, ch.start, ch.start + n))
            if ch.parents is not None:
                v_tree[i] = torch.from_numpy(tree_bits(ch.parents))
        for buf, val in ((self.v_ids, v_ids), (self.v_pos, v_pos), (self.v_slots, v_slots), (self.v_tree, v_tree)):
            buf[:b].copy_(val)
        self.v_start[:b].copy_(_pad([ch.start for ch in chunks], b))
        self.v_tables[:b].copy_(self._tables([ch.seq.block_table for ch in chunks], b))
        if self.states is not None:
            self._fill_states(verify, b)
        logits, argmax, _ = self._graph("verify", b, c)()
        # 3. walk on the host, then the accepted rows' bookkeeping in one replay
        committed: list[list[int]] = []
        paths: list[int] = []
        e_rows = torch.zeros(b, n, dtype=torch.long)
        e_pos = torch.zeros(b, n, dtype=torch.long)
        e_dslots = torch.zeros(b, n, dtype=torch.long)
        e_src = torch.zeros(b, n, dtype=torch.long)
        e_acc = torch.zeros(b, dtype=torch.long)
        best = argmax[: g * n].tolist()  # the one device->host read of the step's choices
        for i, ch in enumerate(verify):
            choose = chooser(ch, logits[i * n: (i + 1) * n], best[i * n: (i + 1) * n])
            path, tokens = walk(ch, choose)
            committed.append(tokens)
            rows = path + [path[-1]] * (n - len(path))
            e_rows[i] = torch.tensor(rows)
            e_pos[i] = ch.start + torch.arange(n)
            e_dslots[i] = torch.tensor(spec.kv.slots(ch.seq.block_table, ch.start, ch.start + n))
            tslots = spec.target_kv.slots(ch.seq.block_table, ch.start, ch.start + n)
            # Compaction: row path[d] moves to position start + d; the rest stay where they are.
            src = list(tslots)
            for d, r in enumerate(path):
                src[d] = tslots[r]
            e_src[i] = torch.tensor(src)
            paths.append(len(path))
            # (a hybrid's state: forced tokens replace the verified ones, so only row 0's, the last known token's)
            e_acc[i] = 0 if ch.seq.forced_tokens else path[-1]
        e_dst = torch.zeros(b, n, dtype=torch.long)
        e_dst[:g] = v_slots[:g]
        for buf, val in ((self.e_rows, e_rows), (self.e_pos, e_pos), (self.e_dslots, e_dslots),
                         (self.e_src, e_src), (self.e_dst, e_dst)):
            buf[:b].copy_(val)
        if self.states is not None:
            self.e_acc[:b].copy_(e_acc)
        self._graph("extend", b, c)()
        for ch, n_path in zip(chunks, paths):  # the sequences change only once every launch has run
            spec.record(ch.seq, ch.start, n_path)
            ch.seq.draft_len = ch.start + n_path
        return committed

    def _fill_states(self, verify: list[Chunk], b: int) -> None:
        """A hybrid's verification inputs: each chunk's state slot, conv windows and parent states (padding rows:
        a chain from scratch slot 0)."""
        g, n = len(verify), self.N
        slots = torch.zeros(b, dtype=torch.long)
        windows, parents = self._chain[0].repeat(b, 1, 1), self._chain[1].repeat(b, 1)
        chain = list(range(-1, n - 1))
        self._trees = [ch.parents or chain for ch in verify] + [chain] * (len(self._trees) - g)
        for i, ch in enumerate(verify):
            slots[i] = ch.seq.state_slot
            if ch.parents is not None:
                windows[i] = torch.tensor(conv_windows(ch.parents, self.kernel))
                parents[i] = torch.tensor(ch.parents, dtype=torch.int32) + 1
        self.v_sslot[:b].copy_(slots)
        self.v_window[:b].copy_(windows)
        self.v_parents[:b].copy_(parents)

    def _tables(self, tables: list[list[int]], b: int) -> torch.Tensor:
        return torch.from_numpy(pad_tables(tables, self.max_ctx // self.page, b))


def _copy_into(dst: Any, src: Any) -> None:
    """Copy a graph body's outputs (a tensor, or tuples/lists of them, or None) into same-shaped buffers."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _copy_into(d, s)


def _pad(values: list[int], b: int) -> torch.Tensor:
    out = torch.zeros(b, dtype=torch.long)
    out[: len(values)] = torch.tensor(values)
    return out
