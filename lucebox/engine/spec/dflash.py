"""Speculative decoding with a DFlash drafter: propose a block (chain) or a draft tree (DDTree),
verify it with the target in one forward pass, accept the longest agreeing prefix.

Lossless: the target's choice at each verified row is exactly what plain
decoding would pick there (argmax, or a sample from the request's full
sampling chain drawn with the request's seed at that position), and a draft token is
kept only when it equals that choice (DFLASH.md: rejection sampling with a
point-mass proposal). The engine calls, per step:

    chunks = spec.propose(decode_chunks)         # verification chunks (drafter pass)
    result = runner.forward(prepare(chunks + prefills), capture=spec.capture)
    new_tokens = spec.accept(chunk, logits, features, choose)   # walk, compact KV, extend drafter context
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lucebox.engine.kernels.attention import MAX_TREE_ROWS, pad_tables
from lucebox.engine.models import DecoderModel
from lucebox.engine.models.config import ModelConfig
from lucebox.engine.runtime.kv_cache import KVCache
from lucebox.engine.runtime.sequence import Chunk, Sequence
from lucebox.engine.spec.drafter import DFlashDrafter, block_metadata


@dataclass
class SpecStats:
    steps: int = 0  # verification forward passes
    committed: int = 0  # tokens committed by them (accepted drafts + the bonus token)
    drafted: int = 0

    @property
    def acceptance_length(self) -> float:
        """τ: tokens per target forward pass."""
        return self.committed / self.steps if self.steps else 0.0


class SpecDecoder:
    def __init__(self, drafter: DFlashDrafter, target: DecoderModel, target_kv: KVCache, *, ddtree: bool = False,
                 budget: int = 22, dtype: torch.dtype | None = None, max_rows: int | None = None,
                 tree_chain: int | None = None) -> None:
        """`max_rows` caps the rows of one verification (a chain's block, a tree's nodes + 1): a hybrid
        target keeps a recurrent state per verified row, and the memory plan says how many fit.
        `tree_chain`: a DDTree's chain depth for every sequence (benchmarks); None: `seed_depth`'s rule."""
        self.drafter = drafter
        self.target = target
        self.target_kv = target_kv
        self.block = drafter.cfg.block_size
        self.chain = self.block if max_rows is None else min(self.block, max_rows)  # a chain verification's rows
        self.ddtree = ddtree
        self.tree_chain = tree_chain
        self.budget = budget if max_rows is None else min(budget, max_rows - 1)
        if ddtree and self.budget + 1 > MAX_TREE_ROWS:
            raise ValueError(f"DDTree budget {self.budget}: at most {MAX_TREE_ROWS - 1} (verification trees of up to "
                             f"{MAX_TREE_ROWS} rows)")
        self.capture = tuple(drafter.cfg.target_layer_ids)
        self.device = target_kv.data.device
        dc = drafter.cfg
        shape_cfg = ModelConfig(arch="dflash", name="drafter", vocab_size=dc.vocab_size, hidden_size=dc.hidden_size,
                                intermediate_size=dc.intermediate_size, num_layers=dc.num_layers,
                                num_heads=dc.num_heads, num_kv_heads=dc.num_kv_heads, head_dim=dc.head_dim,
                                rms_norm_eps=dc.rms_norm_eps, max_position=dc.max_position, rope_theta=dc.rope_theta)
        # The drafter's context K/V live in the target's blocks: position p of a sequence is in slot
        # `block_table[p // bs] * bs + p % bs` of both tensors. So a block shared from the prefix cache
        # brings the drafter context of its positions with it, and no second block table is kept.
        # The drafter's K/V stay in the model dtype when the target's cache is q8_0 (its blocks store them so).
        # `dtype`: the model's compute dtype (needed then; by default the target cache's dtype).
        dtype = dtype or target_kv.data.dtype
        if not dtype.is_floating_point:
            raise ValueError("a q8_0 target KV cache: give SpecDecoder the model dtype (dtype=...)")
        data = KVCache.create(shape_cfg, target_kv.pool.num_blocks, target_kv.block_size, dtype,
                              self.device).data
        self.kv = KVCache(data, target_kv.block_size, target_kv.pool)
        self.stats = SpecStats()
        self.static: Any = None  # StaticSpec (fixed-shape, CUDA-graph steps), set by the engine

    @property
    def rows_per_step(self) -> int:
        """Rows a sequence brings to one verification."""
        return self.budget + 1 if self.ddtree else self.chain

    def seed_depth(self, seq: Sequence) -> int:
        """How deep a DDTree keeps the drafter's top-1 chain before it grows best-first (build_tree): twice the
        tokens a step this sequence has committed so far (the engine's figure before its fourth step; the whole
        chain before any), at most block - 1. A weak drafter's tree then spends its nodes where the drafter
        rates them likely (SmolLM2's shipped drafter, tau ~3: +5-10% tau at budget 22 over the whole chain);
        a strong one's keeps the chain that its accepted steps reach."""
        if self.tree_chain is not None:
            return min(max(self.tree_chain, 0), self.block - 1)
        steps, committed = ((seq.spec_steps, seq.spec_committed) if seq.spec_steps >= 4
                            else (self.stats.steps, self.stats.committed))
        depth = self.block - 1
        return depth if not steps else min(depth, -(-2 * committed // steps))

    @property
    def reserve_rows(self) -> int:
        """KV slots a speculating sequence holds past its computed length: the verification's rows, and the
        drafter block's, whose K/V are written there (drafter.block_metadata)."""
        return max(self.rows_per_step, self.block)

    # ----- drafter context ----------------------------------------------------

    def release(self, seq: Sequence) -> None:
        """The sequence left the running set: its drafter context goes with its blocks."""
        seq.draft_len = 0

    @torch.inference_mode()
    def extend_context(self, seq: Sequence, start: int, features: list[torch.Tensor]) -> None:
        """Append the fused features of positions start.. to the sequence's drafter context."""
        n = features[0].shape[0]
        assert start == seq.draft_len, f"drafter context at {seq.draft_len}, extension starts at {start}"
        x = self.drafter.fuse([f.to(self.kv.data.dtype) for f in features])
        positions = torch.arange(start, start + n, device=self.device)
        cos, sin = self.drafter.rotary(positions, x.dtype)
        slots = torch.tensor(self.kv.slots(seq.block_table, start, start + n), device=self.device)
        for i, layer in enumerate(self.drafter.layers):
            layer.write_context(x, cos, sin, self.kv.data[i, 0], self.kv.data[i, 1], slots)
        seq.draft_len = start + n

    # ----- drafting -----------------------------------------------------------

    @torch.inference_mode()
    def draft_logprobs(self, chunks: list[Chunk]) -> torch.Tensor:
        """Drafter log-probabilities [G, B-1, vocab] for the block after each sequence's last token."""
        cfg = self.drafter.cfg
        b, g = self.block, len(chunks)
        starts = [c.start for c in chunks]
        for c in chunks:
            assert c.seq.draft_len == c.start, "drafter context out of step with the target"
        block_ids = torch.full((g, b), cfg.mask_token_id, dtype=torch.long)
        block_ids[:, 0] = torch.tensor([c.seq.token_ids[c.start] for c in chunks])
        h = self.target.embed(block_ids.to(self.device)).to(self.kv.data.dtype)  # [G, B, H]
        pos = (torch.tensor(starts)[:, None] + torch.arange(b)[None]).flatten().to(self.device)
        rope = self.drafter.rotary(pos, h.dtype)
        bs, end = self.kv.block_size, max(starts) + b
        assert all(len(c.seq.block_table) * bs >= c.start + b for c in chunks), \
            "the drafter block's slots are not reserved (SpecDecoder.reserve_rows)"
        tables = torch.from_numpy(pad_tables([c.seq.block_table for c in chunks], -(-end // bs))).to(self.device)
        meta = block_metadata(tables, torch.tensor(starts, device=self.device), b, bs, end, cfg.sliding_window)
        for i, layer in enumerate(self.drafter.layers):
            h = layer(h, rope, self.kv.data[i, 0], self.kv.data[i, 1], meta)
        out = self.drafter.norm(h[:, 1:])
        return self._head(out).float().log_softmax(-1)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """The target's own LM head (tied or not, dense or quantized: never a dense copy per call)."""
        return self.target.lm_head(h)

    def propose(self, chunks: list[Chunk]) -> list[Chunk]:
        """Verification chunks (last token + draft) for the decoding sequences."""
        logprobs = self.draft_logprobs(chunks)
        out = []
        if not self.ddtree:
            drafts = logprobs.argmax(-1).tolist()
            for c, d in zip(chunks, drafts):
                d = c.seq.constraint.fit_draft(d) if c.seq.constraint is not None else d
                out.append(Chunk(c.seq, c.start, self.chain, tokens=[c.seq.token_ids[c.start]] + d[:self.chain - 1]))
        else:
            k = 8 if self.budget > self.block - 1 else 1
            top_v, top_i = logprobs.topk(k, dim=-1)
            top_v, top_i = top_v.cpu().tolist(), top_i.cpu().tolist()
            for c, tv, ti in zip(chunks, top_v, top_i):
                tokens, parents = build_tree(tv, ti, self.budget, self.seed_depth(c.seq))
                out.append(Chunk(c.seq, c.start, len(tokens) + 1, tokens=[c.seq.token_ids[c.start]] + tokens,
                                 parents=[-1] + parents))
        self.stats.drafted += sum(c.n - 1 for c in out)
        return out

    # ----- acceptance ---------------------------------------------------------

    @torch.inference_mode()
    def accept(self, chunk: Chunk, logits: torch.Tensor, features: list[torch.Tensor],
               choose: Callable[[int, list[int]], int]) -> list[int]:
        """Walk the verified draft; returns the committed tokens (accepted drafts + the target's next token).

        `choose(row, accepted_so_far)` is the target's choice at a verified row (the
        engine's sampler). Compacts the accepted rows' KV to consecutive positions
        (a hybrid's recurrent state: the one after the last of them), sets the
        sequence's computed length, and appends their features to the drafter context.
        The caller appends the tokens and applies stop rules.
        """
        path, tokens = walk(chunk, choose)
        seq, p0 = chunk.seq, chunk.start
        # Move the accepted rows' KV to consecutive slots (a chain's path is already in place).
        moves = [(p0 + i, p0 + d) for d, i in enumerate(path) if i != d]
        if moves:
            kv = self.target_kv
            src = torch.tensor([kv.slot(seq.block_table, a) for a, _ in moves], device=self.device)
            dst = torch.tensor([kv.slot(seq.block_table, b) for _, b in moves], device=self.device)
            kv.data[:, :, dst] = kv.data[:, :, src]
        if self.target_kv.states is not None:  # a hybrid: the recurrent state after the last kept row
            # (forced tokens replace the verified ones: the caller keeps only the last known token, row 0)
            self.accept_state(seq, 0 if seq.forced_tokens else path[-1])
        rows = torch.tensor(path, device=self.device)
        self.extend_context(seq, p0, [f[rows] for f in features])
        self.record(seq, p0, len(path))
        return tokens

    def accept_state(self, seq: Sequence, row: int) -> None:
        """A hybrid target: the sequence's recurrent state becomes the one after verified row `row`."""
        self.target_kv.states.accept(seq.state_slot, row)

    def record(self, seq: Sequence, start: int, n_path: int) -> None:
        """Book-keeping after a verification: computed length and acceptance statistics."""
        seq.num_computed = start + n_path
        self.stats.steps += 1
        self.stats.committed += n_path
        seq.spec_steps += 1
        seq.spec_committed += n_path


def walk(chunk: Chunk, choose: Callable[[int, list[int]], int]) -> tuple[list[int], list[int]]:
    """Follow the target's choices through the draft: (rows on the accepted path, committed tokens).

    Row 0 is the last committed token; a row's children are the draft tokens
    after it. At each row the target chooses; if a child carries that token the
    walk moves there, else the choice is the bonus token and the walk ends.
    """
    tokens = chunk.tokens
    assert tokens is not None
    parents = chunk.parents or list(range(-1, chunk.n - 1))
    children: dict[int, dict[int, int]] = {}
    for i, p in enumerate(parents):
        if p >= 0:
            children.setdefault(p, {}).setdefault(tokens[i], i)
    path = [0]
    accepted: list[int] = []
    while True:
        y = choose(path[-1], accepted)
        nxt = children.get(path[-1], {}).get(y)
        if nxt is None:
            return path, accepted + [y]
        path.append(nxt)
        accepted.append(y)


def build_tree(top_lp: list[list[float]], top_ids: list[list[int]], budget: int,
               seed: int | None = None) -> tuple[list[int], list[int]]:
    """DDTree from one drafter pass: `top_*[d]` are the top-K log-probs/ids at depth d+1.

    The drafter's top-1 chain down to depth `seed` (None: the whole block), each chain node's
    rank-1 sibling and the last one's first child as candidates, then best-first by cumulative
    log-probability (a popped node pushes its next sibling and its first child) up to `budget`
    nodes. Best-first alone (seed 0) keeps the nodes the drafter's own probabilities rate most
    likely to be accepted; but those are per-position marginals, which underrate how often a
    strong drafter's chain goes on once its start was right, so the whole chain is seeded
    (DFLASH.md: ~4 -> ~9 tokens a step in the C++ server). SpecDecoder.seed_depth picks the depth
    from the acceptance seen so far. Returns the nodes' tokens and parents (node indices, -1 = the
    root); parents precede children.
    """
    depth_max = len(top_lp)
    k = len(top_lp[0])
    tokens: list[int] = []
    parents: list[int] = []
    cum: list[float] = []
    heap: list[tuple[float, int, int, int, int]] = []  # (-cum, tiebreak, depth, rank, parent)
    counter = 0

    def push(depth: int, rank: int, parent: int) -> None:
        nonlocal counter
        base = cum[parent] if parent >= 0 else 0.0
        heapq.heappush(heap, (-(base + top_lp[depth][rank]), counter, depth, rank, parent))
        counter += 1

    seed = min(depth_max if seed is None else max(seed, 0), depth_max, budget)
    for depth in range(seed):  # the chain: node `depth` under node `depth - 1` (-1: the root)
        tokens.append(top_ids[depth][0])
        parents.append(depth - 1)
        cum.append((cum[depth - 1] if depth else 0.0) + top_lp[depth][0])
        if k > 1:
            push(depth, 1, depth - 1)
    if seed < depth_max:
        push(seed, 0, seed - 1)
    while len(tokens) < budget and heap:
        _, _, depth, rank, par = heapq.heappop(heap)
        tokens.append(top_ids[depth][rank])
        parents.append(par)
        cum.append((cum[par] if par >= 0 else 0.0) + top_lp[depth][rank])
        node = len(tokens) - 1
        if rank + 1 < k:
            push(depth, rank + 1, par)
        if depth + 1 < depth_max:
            push(depth + 1, 0, node)
    # Parents are 0-based among nodes; shift by one so index 0 is the root row.
    return tokens, [p + 1 if p >= 0 else 0 for p in parents]
