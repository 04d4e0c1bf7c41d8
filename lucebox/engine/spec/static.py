"""Speculative decode steps with fixed shapes, replayed as CUDA graphs.

A DFlash step is three launches of many small kernels: the drafter pass, the
target's verification of the block (or tree), and the bookkeeping after the
walk (drafter context K/V for the accepted rows, and for trees the KV
compaction). Each runs here on static buffers padded to a batch bucket and a
context bucket, so on CUDA each is one graph replay; on the CPU the same code
runs eagerly (the tests check it equals the dynamic path in dflash.py).

Per step the host: fills the draft inputs → replay → reads the chain (argmax)
or the top-K for the tree → builds the verification rows → replay → reads
the target's choices → walks → fills the accepted rows → replay. A greedy
chain step (every sequence choosing by argmax) is one launch instead
(`_chain_fn`): the verification rows, the accepted length and the bookkeeping
are worked out on the device, and the host reads the result once. So is a
dense target's greedy DDTree step (`_tree_fn`): the tree is built by
kernels/triton_tree.py and walked with its ancestor bits.

A hybrid target (models/qwen35.py) verifies from each sequence's state slot,
its rows' conv windows and parent states filled in buffers like the rest (the
delta rule over all rows in one `tree_step` launch a layer on CUDA), every
row's states kept in fixed buffers (`StateRows.kept`, the memory plan's
verification rows), and the accepted row's state written to the slot by the
bookkeeping graph. Its batch buckets stop at the state slots.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lucebox.engine.kernels import graph_mode, triton_tree
from lucebox.engine.kernels.attention import AttentionMetadata, AttnGroup, pad_tables, tree_bits
from lucebox.engine.runtime.cuda_graphs import MIN_CTX, all_buckets, batch_buckets, pick_buckets
from lucebox.engine.runtime.recurrent_state import StateRows, conv_windows
from lucebox.engine.runtime.sequence import Chunk
from lucebox.engine.spec.dflash import SpecDecoder, build_tree, walk
from lucebox.engine.spec.drafter import block_metadata

log = logging.getLogger(__name__)

# A greedy DDTree step in one launch (`_tree_fn`, the tree built by kernels/triton_tree.py's kernel on CUDA). H100,
# SmolLM2, `bench spec-cost --budgets 22`: r 1.96 / 2.05 / 2.49 at batch 1 / 4 / 16 against three launches' 1.98 /
# 2.18 / 2.99, so on by default (its torch-only first form cost more at batch 1, r 2.34). LUCEBOX_TREE_ONE_LAUNCH=0
# keeps trees in three launches; `bench spec-cost` times both.
TREE_ONE_LAUNCH = os.environ.get("LUCEBOX_TREE_ONE_LAUNCH", "1") == "1"


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
        # A greedy step's one-launch graph: a chain (`_chain_fn`; a DDTree whose budget fits the block is one), or
        # a tree (`_tree_fn`, dense targets: a hybrid's tree states are laid out by the host) or none.
        self.fused = "chain" if self.K == 1 else ("tree" if self.states is None and TREE_ONE_LAUNCH else None)
        self.graphs: dict[tuple[str, int, int], _Graphed] = {}
        self.one_launch = True  # greedy steps in one launch (`fused`); off: three, as sampled ones (benchmarks)
        self.ready = False  # set by the engine's warm-up; a capture after it is counted
        self.captures_after_ready = 0
        self._outs: dict[tuple[str, int], Any] = {}  # (kind, batch) -> the outputs its graphs share
        self.pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        b, n, nb = self.batches[-1], self.N, self.max_ctx // self.page
        dev = self.device
        self.kpos = torch.arange(self.max_ctx + n, device=dev)
        # Each graph's per-sequence inputs, one packed buffer each (one host->device copy a replay).
        # draft: the last token then mask tokens, the drafter context length, the block tables (verify's too),
        # a DDTree's chain depth (SpecDecoder.seed_depth) and, for a step launched ahead, the row of the step
        # before whose last token and start it takes from `carried` (-1: the host's)
        self.draft_in = _Packed(b, {"ids": self.B, "start": 1, "tables": nb, "seed": 1, "carry": 1}, dev)
        self.carried = torch.zeros(b, 2, dtype=torch.long, device=dev)  # a one-launch step's (last token, start)
        # A one-launch step's result copied behind it ([tokens..., path length] a row), two buffers: a step
        # launched ahead is read after the next one is queued (`launch`).
        pinned = dev.type == "cuda"
        self._results = [torch.zeros(b, n + 1, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self._copied = [torch.cuda.Event() if pinned else None for _ in range(2)]
        # verification: ids, positions, cache slots, DDTree ancestor-or-self bits, and a hybrid's state slot,
        # conv windows [n, kernel] and parent states (StateRows.fixed)
        verify = {"ids": n, "pos": n, "slots": n, "tree": n}
        # accepted rows: drafter-context rows, positions and slots, the KV moves, and a hybrid's accepted row
        extend = {"rows": n, "pos": n, "dslots": n, "src": n, "dst": n}
        chain = list(range(-1, n - 1))
        self._chain_bits = tree_bits(chain)
        if self.states is not None:  # a hybrid's verification keeps every row's states in fixed buffers
            conv, ssm = self.states.shapes()  # [linear layers, C, K-1], [linear layers, Hv, Dk, Dv]
            self.kernel = conv[-1] + 1
            verify |= {"sslot": 1, "window": n * self.kernel, "parents": n}
            extend |= {"sslot": 1, "acc": 1}
            f32 = torch.float32
            self.kept = (torch.zeros(conv[0], b, n, *conv[1:], dtype=f32, device=dev),
                         torch.zeros(ssm[0], b, n + 1, *ssm[1:], dtype=f32, device=dev))
            self._trees: list[list[int]] = [chain] * b  # the host's parents (the CPU's torch recurrence reads them)
            self._chain_window = np.asarray(conv_windows(chain, self.kernel)).ravel()
        self.verify_in = _Packed(b, verify, dev)
        self.extend_in = _Packed(b, extend, dev)

    def buckets_for(self, n: int, ctx: int) -> tuple[int, int] | None:
        return pick_buckets(self.batches, self.max_ctx, n, ctx)

    def set_one_launch(self, on: bool) -> None:
        """Greedy steps in one launch, or in three as sampled ones run (benchmarks time both); on, a dense
        target's DDTree takes the one-launch tree step whatever TREE_ONE_LAUNCH says."""
        self.one_launch = on
        if on and self.K > 1 and self.states is None:
            self.fused = "tree"

    @property
    def kinds(self) -> tuple[str, ...]:
        """The graphs of a bucket, in capture order (extend reads verify's outputs), then the one-launch greedy
        step's."""
        return ("draft", "verify", "extend") + ((self.fused,) if self.fused else ())

    def graph_keys(self) -> list[tuple[str, int, int]]:
        """Every graph a step can reach, largest bucket first (the start-up capture order)."""
        return [(kind, b, c) for b, c in all_buckets(self.batches, self.max_ctx) for kind in self.kinds]

    @torch.inference_mode()
    def capture_all(self, advance: Callable[[int], None] | None = None) -> int:
        """Capture every graph not captured yet (start-up); returns how many were captured. The rehearsals run on
        zeroed inputs (scratch block 0, position 0): after serving, the last step's would rewrite its slots,
        maybe cached blocks, with its stale draft."""
        if any(key not in self.graphs for key in self.graph_keys()):
            for packed in (self.draft_in, self.verify_in, self.extend_in):
                packed.dev.zero_()
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
        @torch.inference_mode()
        def fn() -> Any:  # (three launches: never launched ahead, so the host's inputs, no `carried`)
            ids, start = self.draft_in.view("ids", b), self.draft_in.view("start", b)
            pos = start + self.kpos[: self.B][None, :]
            return self._draft(b, c, ids, start, self._slots(b, pos),
                               self.drafter.rotary(pos.flatten(), self.spec.kv.data.dtype))

        return fn

    def _inputs(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter block's ids [b, B] and starts [b, 1]: the host's, or for a row launched ahead (its
        `carry` column >= 0) the last token and start that row of the step before wrote to `carried`."""
        d = self.draft_in
        ids, start, src = d.view("ids", b), d.view("start", b), d.view("carry", b)
        took = src >= 0
        prev = self.carried[src.clamp(min=0).flatten()]
        return (torch.cat([torch.where(took, prev[:, :1], ids[:, :1]), ids[:, 1:]], 1),
                torch.where(took, prev[:, 1:], start))

    def _carry(self, b: int, last: torch.Tensor, start: torch.Tensor) -> None:
        """A one-launch step's last committed tokens [b] and next starts [b], for a step launched behind it."""
        self.carried[:b] = torch.stack([last, start], 1)

    def _slots(self, b: int, pos: torch.Tensor) -> torch.Tensor:
        """Cache slots [b, k] of positions [b, k] through the draft inputs' block tables (one table for the
        target and the drafter: their caches share the block layout)."""
        return self.draft_in.view("tables", b).gather(1, pos // self.page) * self.page + pos % self.page

    def _draft(self, b: int, c: int, ids: torch.Tensor, start: torch.Tensor, slots: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor]) -> Any:
        """The drafter's pass over [b, B] block rows `ids` from `start` [b, 1] at `slots` with `rope` (their
        cos/sin): the argmax of each drafted row, or the top-K (log-probabilities, tokens) for a tree."""
        d, B = self.drafter, self.B
        kv = self.spec.kv.data
        h = self.target.embed(ids).to(kv.dtype)
        meta = block_metadata(self.draft_in.view("tables", b), start[:, 0], B, self.page, c, d.cfg.sliding_window,
                              slots)
        for i, layer in enumerate(d.layers):
            h = layer(h, rope, kv[i, 0], kv[i, 1], meta)
        logits = self.spec._head(d.norm(h[:, 1:]))
        if self.K == 1:
            return logits.argmax(-1)
        top = logits.float().log_softmax(-1).topk(self.K, dim=-1)
        return top.values, top.indices

    def _verify_fn(self, b: int, c: int) -> Callable[[], Any]:
        @torch.inference_mode()
        def fn() -> Any:
            v = self.verify_in
            return self._verify(b, c, v.view("ids", b), self.draft_in.view("start", b), v.view("pos", b),
                                v.view("slots", b), v.view("tree", b).flatten() if self.spec.ddtree else None)

        return fn

    def _verify(self, b: int, c: int, ids: torch.Tensor, start: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                tree: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """The target's pass over [b, n] verification rows from `start` [b, 1]: (logits, their argmax, the
        captured features)."""
        n, cfg, v = self.N, self.target.cfg, self.verify_in
        window = cfg.sliding_window if cfg.has_sliding_layers else None
        pos = pos.flatten()
        group = AttnGroup(0, b, n, c, self.draft_in.view("tables", b), start[:, 0] + n, pos, tree)
        meta = AttentionMetadata(slots.flatten(), self.page, [group], window)
        extra = {}
        if self.states is not None:  # every chunk a verification of n rows from its slot's state
            fixed = (v.view("window", b).reshape(b, n, self.kernel), v.view("parents", b).to(torch.int32))
            extra["state"] = StateRows(self.states, 0, v.view("sslot", b)[:, 0],
                                       [(i * n, n, 1, -1) for i in range(b)], trees=list(self._trees[:b]),
                                       fixed=fixed, kept=self.kept)
        hidden, feats = self.target(ids.flatten(), pos, self.spec.target_kv.data, meta, capture=self.spec.capture,
                                    **extra)
        logits = self.target.logits(hidden)
        return logits, logits.argmax(-1), feats

    def _extend_fn(self, b: int, c: int) -> Callable[[], Any]:
        verify = self.graphs[("verify", b, c)]

        @torch.inference_mode()
        def fn() -> None:
            e = self.extend_in
            sslot = e.view("sslot", b)[:, 0] if self.states is not None else None
            acc = e.view("acc", b)[:, 0] if self.states is not None else None
            self._extend(b, verify.out[2], e.view("rows", b), e.view("pos", b), e.view("dslots", b),
                         (e.view("src", b).flatten(), e.view("dst", b).flatten()), sslot, acc)

        return fn

    def _extend(self, b: int, feats: list[torch.Tensor], rows: torch.Tensor, pos: torch.Tensor, dslots: torch.Tensor,
                moves: tuple[torch.Tensor, torch.Tensor] | None, sslot: torch.Tensor | None,
                acc: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """The accepted rows' bookkeeping: drafter context K/V of `rows` [b, n] (verification rows, the path's
        last repeated) at `pos`/`dslots` (`rope`: the drafter's cos/sin of `pos`, where the caller has them),
        the target KV `moves` (src -> dst slots; a tree's compaction) and a hybrid's state after row `acc` of
        each sequence written to its slot `sslot`."""
        n, d = self.N, self.drafter
        kv, tkv = self.spec.kv.data, self.spec.target_kv.data
        rows = (rows + self.kpos[:b][:, None] * n).flatten()
        x = d.fuse([torch.cat(feats, -1)[rows].to(kv.dtype)])  # one gather, not one per feature
        cos, sin = rope if rope is not None else d.rotary(pos.flatten(), x.dtype)
        slots = dslots.flatten()
        for i, layer in enumerate(d.layers):
            layer.write_context(x, cos, sin, kv[i, 0], kv[i, 1], slots)
        if moves is not None:
            src, dst = moves
            tkv[:, :, dst] = tkv[:, :, src]
        if self.states is not None:  # the state after each sequence's last accepted row becomes its slot's
            seqs = self.kpos[:b]
            self.states.conv.index_copy_(1, sslot, self.kept[0][:, seqs, acc])
            self.states.ssm.index_copy_(1, sslot, self.kept[1][:, seqs, acc + 1])

    def _chain_fn(self, b: int, c: int) -> Callable[[], Any]:
        """A greedy chain step in one launch: draft, verify, the accepted length on the device (the drafts up to
        the first that differs from the target's argmax) and the accepted rows' bookkeeping. Returns [b, n + 1]:
        the target's argmax at every row, then the rows on the accepted path (the host reads it once)."""
        n, dtype = self.N, self.spec.kv.data.dtype

        @torch.inference_mode()
        def fn() -> Any:
            # The block's positions, slots (padding rows: scratch block 0) and the drafter's cos/sin, once: the
            # verification's n rows and the accepted rows' are the block's first n.
            block, start = self._inputs(b)
            bpos = start + self.kpos[: self.B][None, :]
            bslots = self._slots(b, bpos)
            cos, sin = self.drafter.rotary(bpos.flatten(), dtype)
            drafts = self._draft(b, c, block, start, bslots, (cos, sin))
            ids = torch.cat([block[:, :1], drafts[:, : n - 1]], 1)  # [b, n]: the last token + drafts
            pos, slots = bpos[:, :n], bslots[:, :n]
            _, best, feats = self._verify(b, c, ids, start, pos, slots, None)
            best = best.view(b, n)
            agreed = (ids[:, 1:] == best[:, :-1]).long().cumprod(1).sum(1)  # drafts accepted
            rows = torch.minimum(self.kpos[:n][None, :], agreed[:, None])
            sslot = self.verify_in.view("sslot", b)[:, 0] if self.states is not None else None
            rope = tuple(t.view(b, self.B, -1)[:, :n].reshape(b * n, -1) for t in (cos, sin))  # (views if n == B)
            self._extend(b, feats, rows, pos, slots, None, sslot, agreed, rope)  # a chain's path is in place: no moves
            self._carry(b, best.gather(1, agreed[:, None])[:, 0], start[:, 0] + agreed + 1)
            return torch.cat([best, agreed[:, None] + 1], 1)

        return fn

    def _tree_fn(self, b: int, c: int) -> Callable[[], Any]:
        """A greedy DDTree step in one launch (a dense target): the tree built on the device
        (kernels/triton_tree.py), verified, walked (each node's token against its parent's argmax) and
        compacted. Returns [b, n + 1] as `_chain_fn` does: the target's argmax along the accepted path, then
        its length."""
        n, dtype = self.N, self.spec.kv.data.dtype
        rows = self.kpos[:n]
        trees = triton_tree.draft_trees if triton_tree.available(self.device) else _host_trees

        @torch.inference_mode()
        def fn() -> Any:
            block, start = self._inputs(b)
            bpos = start + self.kpos[: self.B][None, :]
            lp, tok = self._draft(b, c, block, start, self._slots(b, bpos), self.drafter.rotary(bpos.flatten(), dtype))
            nodes, parent, depth, bits = trees(lp, tok, n, self.draft_in.view("seed", b)[:, 0])
            ids = torch.cat([block[:, :1], nodes], 1)
            spos = start + rows[None, :]  # row r's K/V goes to position start + r's slot, then compaction
            slots = self._slots(b, spos)
            _, best, feats = self._verify(b, c, ids, start, start + depth, slots, bits.flatten())
            best = best.view(b, n)
            wrong = ((ids != best.gather(1, parent)) & (rows > 0)).long() << rows  # a node the target would not pick
            on_path = (bits & wrong.sum(1, keepdim=True)) == 0  # siblings differ: the accepted nodes form one path
            k = on_path.sum(1, keepdim=True)
            path = torch.where(on_path, rows, n + rows).sort(1).values  # parents precede children: depth order
            path = torch.where(rows < k, path, path.gather(1, k - 1))  # the last accepted row repeated
            src = torch.where(rows < k, slots.gather(1, path), slots)
            self._extend(b, feats, path, spos, slots, (src.flatten(), slots.flatten()), None, None)
            tokens = best.gather(1, path)
            self._carry(b, tokens.gather(1, k - 1)[:, 0], start[:, 0] + k[:, 0])
            return torch.cat([tokens, k], 1)

        return fn

    def _graph(self, kind: str, b: int, c: int) -> _Graphed:
        key = (kind, b, c)
        g = self.graphs.get(key)
        if g is None:
            if self.ready:
                self.captures_after_ready += 1
                log.warning("spec graph %s batch=%d ctx=%d captured while serving (the warm-up missed it)", *key)
            make = {"draft": self._draft_fn, "verify": self._verify_fn, "extend": self._extend_fn,
                    "chain": self._chain_fn, "tree": self._tree_fn}[kind]
            # The eager runs before a capture execute the body: the bookkeeping's (its moves of KV rows are not
            # idempotent, and a hybrid's state slots are written) then points at scratch slot 0 and block 0, and
            # its inputs are put back after.
            fused = [self.draft_in.dev, self.verify_in.dev, self.carried]
            inputs = {"extend": [self.extend_in.dev], "chain": fused, "tree": fused}.get(kind, [])
            inputs = inputs if self.device.type == "cuda" else []
            held = [t.clone() for t in inputs]
            for t in inputs:
                t.zero_()
            g = self.graphs[key] = _Graphed(make(b, c), self.device, self.pool, self._outs.get((kind, b)))
            for t, h in zip(inputs, held):
                t.copy_(h)
            self._outs.setdefault((kind, b), g.out)
            log.debug("spec graph %s batch=%d ctx=%d", kind, b, c)
        return g

    # ----- one step -----------------------------------------------------------

    @torch.inference_mode()
    def step(self, chunks: list[Chunk],
             chooser: Callable[[Chunk, torch.Tensor, list[int]], Callable[[int, list[int]], int]],
             argmax: bool = False) -> list[list[int]] | None:
        """Draft, verify and accept for decode chunks; None if no bucket fits (caller falls back).

        `argmax`: every chunk's choice is the target's argmax (greedy, no penalties, logprobs, grammar or forced
        tokens), so a chain step runs as one launch (`_chain_fn`) and `chooser` is not asked.
        The sequences' computed lengths change only at the end, so a step that raises leaves them as
        they were (the engine then runs the chunks one by one)."""
        spec, n = self.spec, self.N
        ctx = max(ch.start + max(n, self.B) for ch in chunks)  # the verification's rows and the drafter block's
        buckets = self.buckets_for(len(chunks), ctx)
        if buckets is None:
            return None
        b, c = buckets
        g = len(chunks)
        # 1. draft
        if argmax and self.fused and self.one_launch:
            return self.finish(chunks, self.launch(chunks)())
        d = self.draft_in
        seeds = self._fill_draft(chunks, b)
        d.send(b)
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
            for ch, tv, ti, seed in zip(chunks, top_v, top_i, seeds):
                toks, parents = build_tree(tv, ti, spec.budget, seed)
                verify.append(Chunk(ch.seq, ch.start, n, tokens=[ch.seq.token_ids[ch.start]] + toks,
                                    parents=[-1] + parents))
        spec.stats.drafted += g * (n - 1)
        # 2. verify (padding rows: token 0 at position 0 in scratch slot 0, a chain)
        v = self.verify_in
        v.np[:b] = 0
        v.host("tree")[:b] = self._chain_bits
        for i, ch in enumerate(verify):
            v.host("ids")[i] = ch.tokens
            v.host("pos")[i] = ch.start + np.asarray(ch.depths())
            v.host("slots")[i] = spec.target_kv.slots(ch.seq.block_table, ch.start, ch.start + n)
            if ch.parents is not None:
                v.host("tree")[i] = tree_bits(ch.parents)
        if self.states is not None:
            self._fill_states(verify, b)
        v.send(b)
        logits, argmax, _ = self._graph("verify", b, c)()
        # 3. walk on the host, then the accepted rows' bookkeeping in one replay
        e = self.extend_in
        e.np[:b] = 0
        committed: list[list[int]] = []
        paths: list[int] = []
        best = argmax[: g * n].tolist()  # the one device->host read of the step's choices
        for i, ch in enumerate(verify):
            choose = chooser(ch, logits[i * n: (i + 1) * n], best[i * n: (i + 1) * n])
            path, tokens = walk(ch, choose)
            committed.append(tokens)
            e.host("rows")[i] = path + [path[-1]] * (n - len(path))
            e.host("pos")[i] = range(ch.start, ch.start + n)
            e.host("dslots")[i] = spec.kv.slots(ch.seq.block_table, ch.start, ch.start + n)
            # Compaction: row path[d] moves to position start + d; the rest stay where they are.
            tslots = v.host("slots")[i]
            src = e.host("src")[i]
            src[:] = tslots
            src[: len(path)] = tslots[path]
            paths.append(len(path))
            if self.states is not None:  # (forced tokens replace the verified ones: only row 0's state, the last
                e.host("acc")[i, 0] = 0 if ch.seq.forced_tokens else path[-1]  # known token's)
        e.host("dst")[:g] = v.host("slots")[:g]
        if self.states is not None:
            e.host("sslot")[:b] = v.host("sslot")[:b]
        e.send(b)
        self._graph("extend", b, c)()
        for ch, n_path in zip(chunks, paths):  # the sequences change only once every launch has run
            spec.record(ch.seq, ch.start, n_path)
            ch.seq.draft_len = ch.start + n_path
        return committed

    def _fill_draft(self, chunks: list[Chunk], b: int) -> list[int]:
        """Write the draft inputs of `chunks` in the host mirror (the other one than the last step's); returns a
        DDTree's seed depths. A chunk launched ahead (`carry` >= 0) has only a bound for its start: its tables
        cover that bound, and the graph takes its token and start from the step before."""
        d = self.draft_in
        d.flip()
        ids = d.host("ids")
        ids[:b] = self.drafter.cfg.mask_token_id
        ids[: len(chunks), 0] = [0 if ch.carry >= 0 else ch.seq.token_ids[ch.start] for ch in chunks]
        d.host("start")[:b, 0] = _pad([ch.start for ch in chunks], b)
        d.host("tables")[:b] = pad_tables([ch.seq.block_table for ch in chunks], self.max_ctx // self.page, b)
        seeds = [self.spec.seed_depth(ch.seq) for ch in chunks] if self.K > 1 else []
        d.host("seed")[:b, 0] = _pad(seeds, b) if seeds else 0
        d.host("carry")[:b, 0] = -1
        d.host("carry")[: len(chunks), 0] = [ch.carry for ch in chunks]
        return seeds

    def launches(self, chunks: list[Chunk]) -> bool:
        """Whether `launch` takes these greedy decode chunks: a one-launch step and a bucket for them (a
        hybrid's states are laid out by the host each step: never launched ahead)."""
        ctx = max(ch.start + max(self.N, self.B) for ch in chunks)
        return (self.fused is not None and self.one_launch and self.states is None
                and self.buckets_for(len(chunks), ctx) is not None)

    def launch(self, chunks: list[Chunk]) -> Callable[[], list[list[int]]]:
        """Queue a greedy one-launch step (chain or tree) and the copy of its result behind it; returns what
        waits for that copy and reads each chunk's row, [tokens..., path length] (then `finish`). Nothing on
        the host waits here, so the engine can queue the next step (runtime/ahead.py) before reading this
        one: its rows launched ahead read this one's last tokens and starts on the device."""
        g, n = len(chunks), self.N
        ctx = max(ch.start + max(n, self.B) for ch in chunks)
        buckets = self.buckets_for(g, ctx)
        assert buckets is not None, "the caller checked the bucket (launches)"
        b, c = buckets
        self._fill_draft(chunks, b)
        self.draft_in.send(b)
        if self.states is not None:
            v = self.verify_in
            v.np[:b] = 0
            self._fill_states([Chunk(ch.seq, ch.start, n) for ch in chunks], b)
            v.send(b)
        out = self._graph(self.fused, b, c)()
        turn = self.draft_in.turn
        result, copied = self._results[turn], self._copied[turn]
        result[:b].copy_(out, non_blocking=True)
        if copied is not None:
            copied.record()
        self.spec.stats.drafted += g * (n - 1)

        def read() -> list[list[int]]:  # before this buffer's next use: two launches later
            if copied is not None:
                copied.synchronize()
            return result[:g].tolist()
        return read

    def finish(self, chunks: list[Chunk], rows: list[list[int]]) -> list[list[int]]:
        """A one-launch step's bookkeeping from its rows (`launch`): each chunk's committed tokens."""
        committed = []
        for ch, row in zip(chunks, rows):
            k = row[-1]
            self.spec.record(ch.seq, ch.start, k)
            ch.seq.draft_len = ch.start + k
            committed.append(row[:k])
        return committed

    def _fill_states(self, verify: list[Chunk], b: int) -> None:
        """A hybrid's verification inputs: each chunk's state slot, conv windows and parent states (padding rows:
        a chain from scratch slot 0)."""
        v, n = self.verify_in, self.N
        v.host("window")[:b] = self._chain_window
        v.host("parents")[:b] = np.arange(n)  # a chain: row r's parent state is 1 + (r - 1)
        chain = list(range(-1, n - 1))
        self._trees = [ch.parents or chain for ch in verify] + [chain] * (len(self._trees) - len(verify))
        for i, ch in enumerate(verify):
            v.host("sslot")[i, 0] = ch.seq.state_slot
            if ch.parents is not None:
                v.host("window")[i] = np.asarray(conv_windows(ch.parents, self.kernel)).ravel()
                v.host("parents")[i] = np.asarray(ch.parents) + 1


def _host_trees(lp: torch.Tensor, tok: torch.Tensor, n: int, seed: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`triton_tree.draft_trees` from `build_tree` on the host, for the CPU's eager one-launch step."""
    nodes, parents, depths, bits = [], [], [], []
    for top_lp, top_ids, chain in zip(lp.tolist(), tok.tolist(), seed.tolist()):
        tokens, par = build_tree(top_lp, top_ids, n - 1, chain)
        depth = [0]
        for p in par:
            depth.append(depth[p] + 1)
        nodes.append(tokens)
        parents.append([0] + par)
        depths.append(depth)
        bits.append(tree_bits([-1] + par))
    as_long = {"dtype": torch.long, "device": lp.device}
    return (torch.tensor(nodes, **as_long), torch.tensor(parents, **as_long), torch.tensor(depths, **as_long),
            torch.from_numpy(np.stack(bits)).to(lp.device))


def _copy_into(dst: Any, src: Any) -> None:
    """Copy a graph body's outputs (a tensor, or tuples/lists of them, or None) into same-shaped buffers."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _copy_into(d, s)


def _pad(values: list[int], b: int) -> np.ndarray:
    out = np.zeros(b, dtype=np.int64)
    out[: len(values)] = values
    return out


class _Packed:
    """One graph's per-sequence int64 inputs: named column ranges of a [batch, width] device tensor, written on
    the host into a mirror (pinned on CUDA) and sent with one copy of the bucket's rows before a replay.
    A mirror is rewritten only after the step's next read-back, so its copy has run by then; the draft inputs
    alternate between two (`flip`), as a step launched ahead is read only after the next is queued."""

    def __init__(self, rows: int, fields: dict[str, int], device: torch.device) -> None:
        width = sum(fields.values())
        self.dev = torch.zeros(rows, width, dtype=torch.long, device=device)
        self.mirrors = [torch.zeros(rows, width, dtype=torch.long, pin_memory=device.type == "cuda")
                        for _ in range(2)]
        self.nps = [m.numpy() for m in self.mirrors]
        self.turn = 0
        self.pinned, self.np = self.mirrors[0], self.nps[0]
        self.cols: dict[str, slice] = {}
        at = 0
        for name, w in fields.items():
            self.cols[name] = slice(at, at + w)
            at += w

    def view(self, name: str, b: int) -> torch.Tensor:
        """Field `name` of the first `b` rows on the device, [b, width] (contiguous: a copy in the graph)."""
        return self.dev[:b, self.cols[name]].contiguous()

    def host(self, name: str) -> np.ndarray:
        """Field `name` of every row in the host mirror, [rows, width] (a view to write)."""
        return self.np[:, self.cols[name]]

    def send(self, b: int) -> None:
        self.dev[:b].copy_(self.pinned[:b], non_blocking=True)

    def flip(self) -> None:
        """Write the other mirror from now on: with a step launched ahead, the last one's copy may not have
        run yet when the next is filled (the one before it has: its result was read since)."""
        self.turn ^= 1
        self.pinned, self.np = self.mirrors[self.turn], self.nps[self.turn]
