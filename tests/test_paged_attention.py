"""Paged attention from compact metadata (block tables, context lengths, positions, tree bits).

- The reference path (dense slot index and mask built on the device) against the old semantics: the
  per-row CPU construction the runner used before (gather index, causal / sliding / tree masks).
- The Triton kernels against the reference on random, shuffled block tables: prefixes that are not
  multiples of the block, chunk boundaries, several sequences of different lengths, trees from random
  parent lists (up to 64 rows), sliding windows, GQA groups 1/4/8, head dims 64/128, blocks 16/256.
  They run on CUDA, or on the CPU under TRITON_INTERPRET=1 (small shapes); they skip otherwise.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lucebox.engine.kernels import triton_attention
from lucebox.engine.kernels.attention import (
    MAX_TREE_ROWS,
    AttentionMetadata,
    AttnGroup,
    attend_group,
    dense_mask,
    pad_tables,
    paged_attention,
    tree_bits,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(
    triton_attention.triton is None or (DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs triton on CUDA, or TRITON_INTERPRET=1 to run the kernels on the CPU",
)


# ----- building groups ---------------------------------------------------------------------------


def random_parents(n: int, rng: random.Random) -> list[int]:
    """Half the rows extend the previous one (deep branches, deeper than small windows), half branch anywhere."""
    return [-1] + [i - 1 if rng.random() < 0.5 else rng.randrange(i) for i in range(1, n)]


def depths(parents: list[int]) -> list[int]:
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


class Case:
    """A group of sequences with random shuffled block tables over a random cache."""

    def __init__(self, *, starts: list[int], q_len: int, page: int, hq: int, hkv: int, dim: int,
                 tree: bool = False, seed: int = 0, dtype: torch.dtype = torch.float32, fresh: bool = False,
                 bidirectional: bool = False):
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        self.page, self.q_len, self.starts = page, q_len, starts
        ctx = [s + q_len for s in starts]
        need = [-(-c // page) + rng.randrange(2) for c in ctx]  # some tables longer than needed
        blocks = list(range(1, sum(need) + 4))  # block 0 is scratch
        rng.shuffle(blocks)
        self.tables, at = [], 0
        for n in need:
            self.tables.append(blocks[at: at + n])
            at += n
        slots = (len(blocks) + 1) * page
        self.k_cache = torch.randn(slots, hkv, dim, generator=gen).to(DEVICE, dtype)
        self.v_cache = torch.randn(slots, hkv, dim, generator=gen).to(DEVICE, dtype)
        rows = len(starts) * q_len
        self.q = torch.randn(rows, hq, dim, generator=gen).to(DEVICE, dtype)
        self.parents = [random_parents(q_len, rng) if tree else None for _ in starts]
        pos = [s + (np.asarray(depths(p)) if p else np.arange(q_len)) for s, p in zip(starts, self.parents)]
        if bidirectional:  # a drafter's block: the window is measured from the last context position
            pos = [np.full(q_len, s - 1) for s in starts]
        self.q_pos = np.concatenate(pos)
        self.bidirectional = bidirectional
        new = torch.tensor([t[p // page] * page + p % page for s, t in zip(starts, self.tables)
                            for p in range(s, s + q_len)])
        self.k, self.v = self.k_cache[new.to(DEVICE)], self.v_cache[new.to(DEVICE)]  # this step's rows
        bits = np.concatenate([tree_bits(p) for p in self.parents]) if tree else None
        nb = -(-max(ctx) // page)
        self.group = AttnGroup(
            0, len(starts), q_len, max(ctx), torch.from_numpy(pad_tables(self.tables, nb)).to(DEVICE),
            torch.tensor(ctx, device=DEVICE), torch.from_numpy(self.q_pos).to(DEVICE),
            None if bits is None else torch.from_numpy(bits).to(DEVICE), fresh=fresh, bidirectional=bidirectional)

    def run(self, window: int | None, kernel: bool) -> torch.Tensor:
        return attend_group(self.q, self.k, self.v, self.k_cache, self.v_cache, self.group, self.page,
                            self.q.shape[-1] ** -0.5, window, kernel)


# ----- the old semantics: per-row masks on the CPU, as model_runner built them ------------------


def old_gather(tables: list[list[int]], ctx: int, page: int) -> torch.Tensor:
    n_blocks = -(-ctx // page)
    bt = torch.zeros(len(tables), n_blocks, dtype=torch.long)
    for i, t in enumerate(tables):
        t = t[:n_blocks]
        if t:
            bt[i, : len(t)] = torch.tensor(t)
    pos = torch.arange(ctx)
    return bt[:, pos // page] * page + pos % page


def old_ancestors(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    anc = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] |= anc[p]
    return anc


def old_masks(case: Case, window: int | None) -> torch.Tensor:
    """[G, 1, q, max_ctx]: `_batched_group` / `_prefill_group` causal masks, `_verify_group` tree masks."""
    n, max_ctx = case.q_len, case.group.max_ctx
    k_idx = torch.arange(max_ctx)
    out = []
    for s, parents in zip(case.starts, case.parents):
        if case.bidirectional:  # the drafter's old mask: the context up to s - 1 (its window), the whole block
            allowed = k_idx[None, :].expand(n, max_ctx) < s + n
            if window is not None:
                allowed = allowed & ((k_idx[None, :] >= s) | (s - 1 - k_idx[None, :] < window))
        elif parents is None:
            q_pos = torch.arange(s, s + n)[:, None]
            allowed = (k_idx[None, :] <= q_pos) & (k_idx[None, :] < s + n)
            if window is not None:
                allowed &= q_pos - k_idx[None, :] < window
        else:
            depth = torch.tensor(depths(parents))
            allowed = torch.zeros(n, max_ctx, dtype=torch.bool)
            allowed[:, :s] = True
            allowed[:, s: s + n] = old_ancestors(parents)
            if window is not None:
                q_pos = s + depth
                k_pos = torch.where(k_idx < s, k_idx, s + depth[(k_idx - s).clamp(0, n - 1)])
                allowed &= (q_pos[:, None] - k_pos[None, :]) < window
        out.append(allowed)
    return torch.stack(out)[:, None]


def old_attention(case: Case, window: int | None) -> torch.Tensor:
    gather = old_gather(case.tables, case.group.max_ctx, case.page).to(DEVICE)
    mask = old_masks(case, window).to(DEVICE)
    g, n = len(case.starts), case.q_len
    q = case.q.view(g, n, *case.q.shape[1:]).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, case.k_cache[gather].transpose(1, 2),
                                         case.v_cache[gather].transpose(1, 2), attn_mask=mask,
                                         scale=case.q.shape[-1] ** -0.5, enable_gqa=True)
    return out.transpose(1, 2).reshape(g * n, *case.q.shape[1:])


REFERENCE_CASES = {
    "prefix chunk": dict(starts=[37], q_len=29, page=16),
    "batched decode": dict(starts=[0, 5, 40, 133], q_len=1, page=16),
    "batched block": dict(starts=[3, 40, 133], q_len=7, page=16),
    "tree": dict(starts=[0, 21, 90], q_len=12, page=16, tree=True),
    "tree 64 rows": dict(starts=[17, 300], q_len=64, page=256, tree=True),
    "drafter blocks": dict(starts=[1, 21, 90], q_len=16, page=16, bidirectional=True),
}


@pytest.mark.parametrize("window", [None, 4, 9])
@pytest.mark.parametrize("name", list(REFERENCE_CASES))
def test_reference_matches_the_old_dense_masks(name, window):
    case = Case(**REFERENCE_CASES[name], hq=4, hkv=2, dim=16, seed=len(name))
    gather, mask = dense_mask(case.group, case.page, window)
    assert torch.equal(mask.cpu(), old_masks(case, window))
    assert torch.equal(gather.cpu(), old_gather(case.tables, case.group.max_ctx, case.page))
    ref = case.run(window, kernel=False)
    torch.testing.assert_close(ref, old_attention(case, window))


def test_dense_mask_is_built_once_per_group_and_window():
    case = Case(**REFERENCE_CASES["tree"], hq=2, hkv=1, dim=16)
    assert dense_mask(case.group, 16, None) is dense_mask(case.group, 16, None)
    assert dense_mask(case.group, 16, 5) is not dense_mask(case.group, 16, None)


def test_tree_bits():
    rng = random.Random(1)
    for n in (1, 2, 13, MAX_TREE_ROWS):
        parents = random_parents(n, rng)
        bits = tree_bits(parents)
        anc = old_ancestors(parents)
        got = torch.tensor([[(int(b) >> j) & 1 for j in range(n)] for b in bits.view(np.uint64)], dtype=torch.bool)
        assert torch.equal(got, anc)
    assert tree_bits(list(range(-1, 63)))[63] == -1  # a 64-row chain: every bit, the sign bit too
    with pytest.raises(ValueError, match="64 rows"):
        tree_bits(list(range(-1, 64)))
    with pytest.raises(ValueError, match="precede"):
        tree_bits([-1, 2, 0])


def test_paged_attention_writes_the_cache_then_attends():
    """The one entry point: new K/V land in their slots, then several groups come back in row order."""
    a = Case(starts=[20], q_len=6, page=16, hq=2, hkv=1, dim=16, seed=3)
    k_cache, v_cache = a.k_cache.clone(), a.v_cache.clone()
    slots = torch.tensor([a.tables[0][p // 16] * 16 + p % 16 for p in range(20, 26)], device=DEVICE)
    k_cache[slots] = 0
    v_cache[slots] = 0
    fresh = AttnGroup(6, 1, 4, 4, a.group.block_tables, torch.tensor([4], device=DEVICE), a.group.q_pos[:4] - 20,
                      fresh=True)  # a fresh 4-row prompt of its own after the first group
    meta = AttentionMetadata(torch.cat([slots, torch.zeros(4, dtype=torch.long, device=DEVICE)]), 16,
                             [a.group, fresh])
    q, k, v = torch.cat([a.q, a.q[:4]]), torch.cat([a.k, a.k[:4]]), torch.cat([a.v, a.v[:4]])
    out = paged_attention(q, k, v, k_cache, v_cache, meta, scale=0.25, sliding=False)
    assert torch.equal(k_cache[slots], a.k) and torch.equal(v_cache[slots], a.v)
    torch.testing.assert_close(out[:6], old_attention(a, None))
    own = F.scaled_dot_product_attention(a.q[:4].transpose(0, 1), a.k[:4].transpose(0, 1), a.v[:4].transpose(0, 1),
                                         is_causal=True, scale=0.25, enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(out[6:], own)


# ----- the kernels against the reference ---------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("splits", [1, 4])
def test_kernel_bidirectional_blocks_match_the_reference(splits, window):
    """A DFlash drafter's blocks (every row sees its whole block and the context, the window from the last
    context position) through the kernel, keys split or not, against the reference."""
    case = Case(starts=[1, 37, 300], q_len=16, page=16, hq=9, hkv=3, dim=64, seed=splits, bidirectional=True)
    g = case.group
    out = triton_attention.prefill_attention(
        case.q, case.k_cache, case.v_cache, g.block_tables, g.ctx_lens, g.q_pos, None, q_len=16,
        max_ctx=g.max_ctx, page=16, scale=64 ** -0.5, window=window, splits=splits, bidirectional=True)
    assert (out - case.run(window, kernel=False)).abs().max().item() < 2e-4
    check(case, window)  # the entry point every layer calls takes the same kernel


def check(case: Case, window: int | None) -> None:
    out = case.run(window, kernel=True)
    ref = case.run(window, kernel=False)
    tol = 2e-4 if case.q.dtype == torch.float32 else 3e-2
    assert (out.float() - ref.float()).abs().max().item() < tol


KERNEL_CASES = {
    # name: (starts, q_len, page, tree)
    "prefix 37 + chunk 29": ([37], 29, 16, False),
    "prefix 300 + chunk 40, block 256": ([300], 40, 256, False),
    "three sequences, block 5": ([0, 19, 150], 5, 16, False),
    "decode rows (the decode kernel)": ([0, 5, 40, 133], 1, 16, False),
    "random trees": ([9, 64, 200], 16, 16, True),
    "tree of 64 rows": ([33], 64, 16, True),
    "trees, block 256": ([0, 270], 23, 256, True),
}


@needs_kernel
@pytest.mark.parametrize("window", [None, 5, 24])
@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_kernel_matches_reference(name, window):
    starts, q_len, page, tree = KERNEL_CASES[name]
    check(Case(starts=starts, q_len=q_len, page=page, hq=8, hkv=2, dim=64, tree=tree, seed=len(name)), window)


@needs_kernel
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_kernel_gqa_and_head_dims(group, dim):
    check(Case(starts=[45, 3], q_len=20, page=16, hq=2 * group, hkv=2, dim=dim, seed=group), None)
    check(Case(starts=[70], q_len=10, page=16, hq=2 * group, hkv=2, dim=dim, tree=True, seed=dim), 4)


@needs_kernel
@pytest.mark.parametrize("config", [(128, 128, 8, 3), (64, 64, 4, 3), (16, 64, 4, 3)])
def test_kernel_tile_configs(config, monkeypatch):
    """The bf16/fp16 tile shapes, run here in fp32 (the interpreter's dtype): key tiles wider than a block,
    query tiles of 128, 64 and 16 rows (4 query rows of 4 heads)."""
    monkeypatch.setattr(triton_attention, "_prefill_config", lambda *a: config)
    check(Case(starts=[37, 300], q_len=40, page=16, hq=8, hkv=2, dim=64, seed=1), None)
    check(Case(starts=[20, 150], q_len=30, page=16, hq=8, hkv=2, dim=64, tree=True, seed=2), 6)


@needs_kernel
@pytest.mark.parametrize("window", [None, 30])
@pytest.mark.parametrize("splits", [2, 4])
def test_kernel_split_keys_merge_to_the_reference(splits, window):
    """Long contexts with few query tiles split the keys across programs; the merged result is the same
    (a short sequence next to a long one leaves whole splits empty)."""
    for tree, starts in ((False, [300, 7]), (True, [150, 0])):
        case = Case(starts=starts, q_len=12, page=16, hq=8, hkv=2, dim=64, tree=tree, seed=splits)
        g = case.group
        out = triton_attention.prefill_attention(
            case.q, case.k_cache, case.v_cache, g.block_tables, g.ctx_lens, g.q_pos, g.tree, q_len=12,
            max_ctx=g.max_ctx, page=16, scale=64 ** -0.5, window=window, splits=splits)
        assert (out - case.run(window, kernel=False)).abs().max().item() < 2e-4


@needs_kernel
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("splits", [None, 4])
def test_kernel_ragged_group_equals_each_chunk_alone(splits, window):
    """A step's prefill chunks in one ragged launch (fresh prompts, chunks after cached prefixes off the block
    grid, one row from a prompt's middle; different lengths, key splits) equal each chunk in a group of its
    own through the reference path."""
    chunks = [([0], 37, True), ([53], 9, False), ([0], 3, True), ([200], 64, False), ([17], 1, False)]
    cases = [Case(starts=s, q_len=n, page=16, hq=8, hkv=2, dim=64, fresh=f, seed=i)
             for i, (s, n, f) in enumerate(chunks)]
    # One cache for all: each case's blocks moved to its own range of the shared cache.
    k_cache, v_cache, tables, ctx = [], [], [], []
    for c in cases:
        base = sum(t.shape[0] for t in k_cache) // 16
        k_cache.append(c.k_cache)
        v_cache.append(c.v_cache)
        tables.append([b + base for b in c.tables[0]])
        ctx.append(c.starts[0] + c.q_len)
    k_all, v_all = torch.cat(k_cache), torch.cat(v_cache)
    lens = [c.q_len for c in cases]
    starts = np.cumsum([0] + lens[:-1]).tolist()
    bt = torch.from_numpy(pad_tables(tables, -(-max(ctx) // 16))).to(DEVICE)
    q = torch.cat([c.q for c in cases])
    q_pos = torch.cat([torch.from_numpy(c.q_pos) for c in cases]).to(DEVICE)
    tile_rows = triton_attention.ragged_config(64, q.dtype, 4)[0] // 4
    tiles = triton_attention.ragged_tiles(lens, tile_rows, pad_to=40)  # padded, as a CUDA graph holds it
    assert (tiles >= 0).sum() == sum(-(-n // tile_rows) for n in lens) and tiles[-1] == -1
    out = triton_attention.prefill_attention(
        q, k_all, v_all, bt, torch.tensor(ctx, device=DEVICE), q_pos, None, q_len=max(lens), max_ctx=max(ctx),
        page=16, scale=64 ** -0.5, window=window, splits=splits, q_lens=torch.tensor(lens, device=DEVICE),
        q_starts=torch.tensor(starts, device=DEVICE), tiles=torch.from_numpy(tiles).to(DEVICE))
    for c, a in zip(cases, starts):
        ref = c.run(window, kernel=False)
        assert (out[a: a + c.q_len] - ref).abs().max().item() < 2e-4


@needs_kernel
def test_kernel_chunked_prefill_equals_one_pass():
    """A prompt prefilled in chunks (boundaries off the block grid) equals the fresh one-pass prompt."""
    page, n, hq, hkv, dim = 16, 150, 4, 2, 64
    whole = Case(starts=[0], q_len=n, page=page, hq=hq, hkv=hkv, dim=dim, fresh=True, seed=5)
    ref = whole.run(None, kernel=False)  # SDPA is_causal over its own rows
    out = []
    for a, b in ((0, 37), (37, 64), (64, 65), (65, 150)):
        g = whole.group
        chunk = AttnGroup(0, 1, b - a, b, g.block_tables, torch.tensor([b], device=DEVICE), g.q_pos[a:b])
        out.append(attend_group(whole.q[a:b], whole.k[a:b], whole.v[a:b], whole.k_cache, whole.v_cache, chunk,
                                page, dim ** -0.5, None, True))
    torch.testing.assert_close(torch.cat(out), ref, atol=2e-4, rtol=1e-4)


@needs_kernel
def test_kernel_fresh_prompt_longer_than_the_window():
    """A fresh prompt on a sliding layer, longer than the window: the kernel reads it from the cache."""
    case = Case(starts=[0], q_len=90, page=16, hq=4, hkv=1, dim=64, fresh=True, seed=9)
    check(case, 32)


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16/fp16 kernels need CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_kernel_half_precision(dtype, dim):
    check(Case(starts=[1000, 77], q_len=300, page=16, hq=32, hkv=8, dim=dim, dtype=dtype), None)
    check(Case(starts=[513, 20, 4000], q_len=23, page=256, hq=16, hkv=4, dim=dim, tree=True, dtype=dtype), 200)


# ----- the runner: one step's metadata --------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(smollm2_path):
    from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine

    return LLMEngine.from_path(smollm2_path, EngineConfig(device="cpu", dtype="float32", kv_tokens=1024), quiet=True)


def test_runner_mixed_step_is_one_transfer_and_equals_each_chunk_alone(engine):
    """A step with a decode row, a draft tree, a chunk after a cached prefix and a fresh prompt: every
    input and all the attention metadata live in one array (one host->device copy), and each chunk's
    logits equal that chunk run on a step of its own."""
    from lucebox.engine.runtime.sampler import SamplingParams
    from lucebox.engine.runtime.sequence import Chunk, Sequence

    runner, kv, rng = engine.runner, engine.kv, random.Random(0)
    seqs = []
    for n in (41, 30, 35, 9):
        s = Sequence([rng.randrange(1000) for _ in range(n)], SamplingParams())
        s.block_table = kv.pool.allocate(kv.blocks_for(n + 8))
        seqs.append(s)
    a, b, c, d = seqs
    try:
        runner.forward(runner.prepare([Chunk(a, 0, 40), Chunk(b, 0, 30), Chunk(c, 0, 20)]))  # cached contexts
        draft = [b.token_ids[29]] + [rng.randrange(1000) for _ in range(5)]
        chunks = [Chunk(d, 0, 9), Chunk(c, 20, 15), Chunk(b, 29, 6, tokens=draft, parents=[-1, 0, 0, 1, 3, 2]),
                  Chunk(a, 40, 1)]
        inputs = runner.prepare(chunks)
        groups = inputs.meta.groups
        assert [(g.row_start, g.q_len, g.max_ctx, g.tree is not None, g.fresh) for g in groups] == [
            (0, 1, 41, False, False), (1, 6, 35, True, False), (7, 9, 9, False, True), (16, 15, 35, False, False)]
        one = inputs.input_ids.untyped_storage().data_ptr()
        views = [inputs.positions, inputs.meta.slot_mapping, inputs.logit_rows, groups[1].tree]
        views += [t for g in groups for t in (g.block_tables, g.ctx_lens, g.q_pos)]
        assert all(t.untyped_storage().data_ptr() == one for t in views)
        mixed = runner.forward(inputs)
        for i, ch in enumerate(mixed.inputs.order):
            alone = runner.forward(runner.prepare([ch]))
            torch.testing.assert_close(mixed.chunk_logits(i), alone.chunk_logits(0), atol=2e-4, rtol=1e-4)
    finally:
        for s in seqs:
            kv.pool.decref(s.block_table)


@pytest.mark.skipif(DEVICE != "cuda", reason="the ragged group is laid out where the CUDA kernels run")
def test_runner_lays_prefill_chunks_out_as_one_ragged_group_equal_to_each_alone(smollm2_path):
    """On CUDA a step's prefill chunks (fresh prompts and chunks after cached prefixes) are one attention
    group, beside the decode rows; each chunk's logits equal that chunk on a step of its own."""
    from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
    from lucebox.engine.runtime.sampler import SamplingParams
    from lucebox.engine.runtime.sequence import Chunk, Sequence

    eng = LLMEngine.from_path(smollm2_path, EngineConfig(device="cuda", dtype="float32", kv_tokens=2048,
                                                         cuda_graphs=False), quiet=True)
    runner, kv, rng = eng.runner, eng.kv, random.Random(1)
    seqs = []
    for n in (41, 30, 90, 9, 17):
        s = Sequence([rng.randrange(1000) for _ in range(n)], SamplingParams())
        s.block_table = kv.pool.allocate(kv.blocks_for(n + 8))
        seqs.append(s)
    a, b, c, d, e = seqs
    runner.forward(runner.prepare([Chunk(a, 0, 40), Chunk(b, 0, 20), Chunk(c, 0, 33)]))  # cached contexts
    chunks = [Chunk(d, 0, 9), Chunk(c, 33, 57), Chunk(a, 40, 1), Chunk(e, 0, 17), Chunk(b, 20, 10)]
    inputs = runner.prepare(chunks)
    groups = inputs.meta.groups
    assert [(g.row_start, g.n_seqs, g.q_len, g.n_rows) for g in groups] == [(0, 1, 1, 0), (1, 4, 57, 93)]
    assert groups[1].q_lens.tolist() == [9, 57, 17, 10] and groups[1].q_starts.tolist() == [0, 9, 66, 83]
    mixed = runner.forward(inputs)
    for i, ch in enumerate(mixed.inputs.order):
        alone = runner.forward(runner.prepare([ch]))
        torch.testing.assert_close(mixed.chunk_logits(i), alone.chunk_logits(0), atol=2e-4, rtol=1e-4)


@needs_kernel
def test_warm_up_launches_every_variant_and_leaves_the_cache_alone() -> None:
    """The start-up compile pass runs each (rows, split, window, tree) variant through the real entry point."""
    k = torch.randn(4 * 16, 2, 16, device=DEVICE)
    v = torch.randn(4 * 16, 2, 16, device=DEVICE)
    k0, v0 = k.clone(), v.clone()
    n = triton_attention.warm_up(k, v, num_heads=4, page=16, scale=0.25, max_rows=20, window=8, tree=True,
                                 context=40)
    # 3 tile configs (fp32, rows 2..20: 16, 32 and 64-row tiles) x 2 windows x 5 split counts x (causal,
    # tree bits), and the ragged config x 2 windows x 5 split counts
    assert n == 3 * 2 * 5 * 2 + 2 * 5
    # a drafter's blocks of 16 rows: one tile config x 2 windows x 5 split counts, nothing else
    assert triton_attention.warm_up(k, v, num_heads=4, page=16, scale=0.25, max_rows=16, window=8, tree=True,
                                    context=40, bidirectional=True) == 2 * 5
    assert torch.equal(k, k0) and torch.equal(v, v0)
