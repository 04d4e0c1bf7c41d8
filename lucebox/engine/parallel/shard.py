"""Split a loaded (finalized) model's weights for rank r of N, in place.

- Attention: the fused q|k|v rows of this rank's query heads and of the K/V heads they read (column-parallel;
  with fewer K/V heads than ranks each rank keeps the one its query heads read, replicated), Laguna's output
  gate by head, and the output projection's columns of those heads (row-parallel: each rank's partial sum,
  then one all-reduce). Each rank's KV cache holds only its K/V heads.
- Dense MLP: gate|up rows (column-parallel), down columns (row-parallel, all-reduce).
- Mixture of experts: split by expert (rank r holds experts [r E/N, (r+1) E/N)), the router replicated; the
  shared expert column/row split like the dense MLP; one all-reduce of routed + shared.
- Embedding and LM head: vocab-parallel (rows [r V/N, ...)): a lookup outside the rank's rows gives zeros and
  the all-reduce adds the one rank's row (exact); the head's logits are all-gathered.

A quantized weight is split in whole GGUF blocks: a row slice keeps its blocks as they are; a column slice
(the row-parallel inputs) must fall on block boundaries, else the model is refused with the reason.
Norms, rotary tables and q/k norms are per head or per hidden channel, hence replicated.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from lucebox.engine.models.config import ModelConfig
from lucebox.engine.models.decoder import DecoderBlock, DecoderModel
from lucebox.engine.models.layers import ConcatLinear, Embedding, Linear
from lucebox.engine.models.moe import MoE
from lucebox.engine.parallel.group import Comm
from lucebox.engine.weights.quant import FORMATS, QuantWeight
from lucebox.errors import LuceboxError


class RowParallelLinear(Linear):
    """A Linear over this rank's slice of the input features: its partial product, summed over the ranks."""

    comm: Comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(super().forward(x))


class VocabParallelEmbedding(Embedding):
    """This rank's rows [lo, lo + rows) of the embedding; `as_linear` (a tied head) gathers every rank's logits."""

    comm: Comm
    lo: int
    vocab: int  # the full vocabulary
    per_rank: int  # rows of the largest shard (the gather's width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.num_embeddings
        mine = (ids >= self.lo) & (ids < self.lo + rows)
        h = super().forward((ids - self.lo).clamp(0, rows - 1))
        return self.comm.all_reduce(h * mine[..., None].to(h.dtype))

    def as_linear(self, x: torch.Tensor) -> torch.Tensor:
        return gather_vocab(super().as_linear(x), self.comm, self.per_rank, self.vocab)


class VocabParallelHead(Linear):
    """This rank's rows of an untied LM head; the logits of every rank gathered."""

    comm: Comm
    vocab: int
    per_rank: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_vocab(super().forward(x), self.comm, self.per_rank, self.vocab)


def gather_vocab(local: torch.Tensor, comm: Comm, per_rank: int, vocab: int) -> torch.Tensor:
    """[T, V] logits from each rank's [T, its rows] (padded to one width for the gather, then cut)."""
    if local.shape[-1] < per_rank:
        local = F.pad(local, (0, per_rank - local.shape[-1]))
    return torch.cat(comm.all_gather(local), dim=-1)[..., :vocab]


def check_shardable(cfg: ModelConfig, world: int) -> None:
    """Refuse, with the reason, a model whose heads or widths do not divide over `world` ranks."""
    if cfg.is_hybrid:
        raise LuceboxError(f"--tensor-parallel is not supported for the hybrid architecture {cfg.arch} yet "
                           "(its Gated DeltaNet layers are not sharded)")
    hkv = cfg.num_kv_heads
    for layer in range(cfg.num_layers):
        hq = cfg.layer_heads(layer)
        if hq % world:
            raise LuceboxError(f"--tensor-parallel {world}: layer {layer} has {hq} query heads, not a multiple")
    if hkv % world and world % hkv:
        raise LuceboxError(f"--tensor-parallel {world}: {hkv} K/V heads neither divide over the ranks nor "
                           "replicate evenly")
    if cfg.n_experts and cfg.n_experts % world:
        raise LuceboxError(f"--tensor-parallel {world}: {cfg.n_experts} experts do not split evenly")
    has_dense = any(not cfg.is_moe(i) for i in range(cfg.num_layers))
    for what, width in (("intermediate size", cfg.intermediate_size if has_dense else 0),
                        ("shared expert width", cfg.shared_expert_ff)):
        if width % world:
            raise LuceboxError(f"--tensor-parallel {world}: the {what} {width} does not split evenly")


def shard_model(model: DecoderModel, comm: Comm) -> ModelConfig:
    """Keep rank `comm.rank`'s shard of every weight (see the module docstring); returns the rank's config
    (its query and K/V heads and MLP width: what its KV cache and kernels are sized by)."""
    cfg, world = model.cfg, comm.world
    check_shardable(cfg, world)
    for block in model.blk:
        _shard_block(block, cfg, comm)
    model.token_embd = _vocab_embedding(model.token_embd, cfg.vocab_size, comm)
    if not cfg.tie_word_embeddings:
        model.output = _vocab_head(model.output, cfg.vocab_size, comm)
    local = dataclasses.replace(
        cfg, num_heads=cfg.num_heads // world, num_kv_heads=max(cfg.num_kv_heads // world, 1),
        heads_per_layer=[h // world for h in cfg.heads_per_layer],
        intermediate_size=cfg.intermediate_size // world, shared_expert_ff=cfg.shared_expert_ff // world)
    model.cfg = local
    return local


def kv_heads_of(rank: int, world: int, kv_heads: int) -> range:
    """The K/V heads rank `rank` of `world` holds: its share, or with fewer heads than ranks the one its query
    heads read (replicated on world / kv_heads ranks)."""
    lo = rank * kv_heads // world
    return range(lo, (rank + 1) * kv_heads // world) if kv_heads >= world else range(lo, lo + 1)


def _shard_block(block: DecoderBlock, cfg: ModelConfig, comm: Comm) -> None:
    r, n, d = comm.rank, comm.world, block.head_dim
    hq, hkv = block.num_heads, block.num_kv_heads
    q_heads = range(r * hq // n, (r + 1) * hq // n)
    kv_heads = kv_heads_of(r, n, hkv)
    q_rows = _head_rows(q_heads, d)
    kv_rows = _head_rows(kv_heads, d)
    parts = [q_rows, kv_rows, kv_rows]
    block.attn_qkv = _take_parts(block.attn_qkv, parts, [hq * d, hkv * d, hkv * d])
    if hasattr(block, "attn_gate"):
        block.attn_gate = _rows(block.attn_gate, _head_rows(q_heads, block.attn_gate.out_features // hq))
    block.attn_output = _cols(block.attn_output, q_heads.start * d, q_heads.stop * d, comm)
    block.num_heads, block.num_kv_heads = len(q_heads), len(kv_heads)
    if block.moe is not None:
        _shard_moe(block, block.moe, comm)
    else:
        ff = block.ffn_down.in_features
        lo, hi = r * ff // n, (r + 1) * ff // n
        block.ffn_gate_up = _take_parts(block.ffn_gate_up, [torch.arange(lo, hi)] * 2, [ff, ff])
        block.ffn_down = _cols(block.ffn_down, lo, hi, comm)


def _shard_moe(block: DecoderBlock, moe: MoE, comm: Comm) -> None:
    """This rank's experts (whole row ranges of the stacked weights) and shared-expert slice; the block's
    attributes are the MoE's own modules (MoE.mount), so both are updated."""
    r, n, e = comm.rank, comm.world, moe.n_experts
    held = range(r * e // n, (r + 1) * e // n)
    for name, rows in (("ffn_gate_exps", moe.ff), ("ffn_up_exps", moe.ff), ("ffn_down_exps", moe.hidden)):
        _replace(block, moe, name, _rows(getattr(moe, name), torch.arange(held.start * rows, held.stop * rows)))
    moe.held = held
    if hasattr(moe, "ffn_down_shexp"):
        ff = moe.ffn_down_shexp.in_features
        lo, hi = r * ff // n, (r + 1) * ff // n
        for name in ("ffn_gate_shexp", "ffn_up_shexp"):
            _replace(block, moe, name, _rows(getattr(moe, name), torch.arange(lo, hi)))
        # summed with the routed experts' output, in the MoE's one all-reduce
        _replace(block, moe, "ffn_down_shexp", _cols(moe.ffn_down_shexp, lo, hi, comm, reduce=False))
    moe.reduce = comm.all_reduce


def _replace(block: nn.Module, moe: MoE, name: str, module: nn.Module) -> None:
    setattr(moe, name, module)
    setattr(block, name, module)


def _head_rows(heads: range, d: int) -> torch.Tensor:
    return torch.arange(heads.start * d, heads.stop * d)


def _take_parts(fused: nn.Module, rows: list[torch.Tensor], sizes: list[int]) -> nn.Module:
    """The rows `rows[i]` of each part of a fused projection (one Linear of the parts side by side, or a
    ConcatLinear of parts of different quant types)."""
    if isinstance(fused, ConcatLinear):
        fused.parts = nn.ModuleList(_rows(p, idx) for p, idx in zip(fused.parts, rows))
        fused.out_features = sum(p.out_features for p in fused.parts)
        return fused
    offsets = [0]
    for s in sizes[:-1]:
        offsets.append(offsets[-1] + s)
    assert isinstance(fused, Linear)
    return _rows(fused, torch.cat([idx + off for idx, off in zip(rows, offsets)]))


def _rows(lin: Linear, idx: torch.Tensor) -> Linear:
    """A Linear of rows `idx` of `lin` (quantized blocks copied as they are)."""
    out = _empty(lin.in_features, len(idx), lin.bias is not None, Linear)
    idx = idx.to(_where(lin).device)
    if lin.qtype is not None:
        out.set_quant(QuantWeight(lin.qdata.index_select(0, idx).contiguous(), lin.qtype, lin.cols, lin.dtype),
                      lin.dtype)
    else:
        out.weight = nn.Parameter(lin.weight.index_select(0, idx).contiguous(), requires_grad=False)
    if lin.bias is not None:
        out.bias = nn.Parameter(lin.bias.index_select(0, idx).contiguous(), requires_grad=False)
    return out


def _cols(lin: Linear, lo: int, hi: int, comm: Comm, reduce: bool = True) -> Linear:
    """A Linear of input features [lo, hi) of `lin` (a RowParallelLinear: its output summed over the ranks,
    unless the caller sums it); its bias is added once (rank 0's)."""
    out = _empty(hi - lo, lin.out_features, lin.bias is not None and comm.rank == 0,
                 RowParallelLinear if reduce else Linear)
    out.__dict__["comm"] = comm
    if lin.qtype is not None:
        block, size, _ = FORMATS[lin.qtype]
        if lo % block or hi % block:
            raise LuceboxError(f"--tensor-parallel {comm.world}: a {lin.qtype} weight of {lin.cols} columns "
                               f"would split at column {lo if lo % block else hi}, inside a {block}-value block "
                               "(use fewer ranks, or a dense or smaller-block file)")
        data = lin.qdata[:, lo // block * size: hi // block * size].contiguous()
        out.set_quant(QuantWeight(data, lin.qtype, hi - lo, lin.dtype), lin.dtype)
    else:
        out.weight = nn.Parameter(lin.weight[:, lo:hi].contiguous(), requires_grad=False)
    if out.bias is not None:
        out.bias = lin.bias
    return out


def _vocab_embedding(emb: Embedding, vocab: int, comm: Comm) -> VocabParallelEmbedding:
    per = -(-vocab // comm.world)
    lo, hi = comm.rank * per, min((comm.rank + 1) * per, vocab)
    with torch.device("meta"):
        out = VocabParallelEmbedding(hi - lo, emb.embedding_dim)
    idx = torch.arange(lo, hi, device=_where(emb).device)
    if emb.qtype is not None:
        out.set_quant(QuantWeight(emb.qdata.index_select(0, idx), emb.qtype, emb.cols, emb.dtype), emb.dtype)
    else:
        out.weight = nn.Parameter(emb.weight.index_select(0, idx), requires_grad=False)
    out.comm, out.lo, out.vocab, out.per_rank = comm, lo, vocab, per
    return out


def _vocab_head(head: Linear, vocab: int, comm: Comm) -> VocabParallelHead:
    per = -(-vocab // comm.world)
    lo, hi = comm.rank * per, min((comm.rank + 1) * per, vocab)
    rows = _rows(head, torch.arange(lo, hi))
    out = _empty(rows.in_features, rows.out_features, False, VocabParallelHead)
    if rows.qtype is not None:
        out.set_quant(rows.quant, rows.dtype)
    else:
        out.weight = rows.weight
    out.comm, out.vocab, out.per_rank = comm, vocab, per
    return out


def _empty(in_features: int, out_features: int, bias: bool, cls: type[Linear]) -> Linear:
    with torch.device("meta"):  # the weights are assigned next
        return cls(in_features, out_features, bias=bias)


def _where(m: nn.Module) -> torch.Tensor:
    """Any tensor of `m`'s weight (its device), without dequantizing a quantized one."""
    return m.qdata if m.__dict__.get("qtype") is not None else m.weight
