"""Split a loaded (finalized) model's weights for rank r of N, in place.

- Attention: the fused q|k|v rows of this rank's query heads and of the K/V heads they read (column-parallel;
  with fewer K/V heads than ranks each rank keeps the one its query heads read, replicated), Laguna's output
  gate by head, and the output projection's columns of those heads (row-parallel: each rank's partial sum,
  then one all-reduce). Each rank's KV cache holds only its K/V heads.
- Hybrid (qwen35, qwen35moe): a Gated DeltaNet layer by q/k head: rank r keeps q/k heads [r K/N, (r+1) K/N)
  and the value heads that read them (`linear_heads_of`), with every per-head tensor (attn_qkv and conv rows
  of those q|k|v channels, the gate, beta and alpha rows, decay rates and dt bias; ssm_out's columns
  row-parallel); its recurrent states hold only those channels and heads. A gated attention layer as above,
  its attn_q rows per head being [query | gate].
- Dense MLP: gate|up rows (column-parallel), down columns (row-parallel, all-reduce).
- Mixture of experts: split by expert (rank r holds experts [r E/N, (r+1) E/N)), the router replicated; the
  shared expert column/row split like the dense MLP; one all-reduce of routed + shared.
- Embedding and LM head: vocab-parallel (rows [r V/N, ...)): a lookup outside the rank's rows gives zeros and
  the all-reduce adds the one rank's row (exact); the head's logits are all-gathered.

A quantized weight is split in whole GGUF blocks: a row slice keeps its blocks as they are; a column slice
(the row-parallel inputs) must fall on block boundaries, else the model is refused with the reason.
Norms, rotary tables, q/k norms and the DeltaNet output norm are per head or per channel, hence replicated.
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
from lucebox.engine.models.qwen35 import DeltaNetBlock, GatedAttentionBlock
from lucebox.engine.parallel.group import Comm
from lucebox.engine.weights.quant import FORMATS, QuantWeight
from lucebox.errors import LuceboxError


class RowParallelLinear(Linear):
    """A Linear over this rank's slice of the input features: its partial product, summed over the ranks."""

    comm: Comm

    def forward(self, x: torch.Tensor, ws: torch.Tensor | None = None) -> torch.Tensor:
        return self.comm.all_reduce(super().forward(x, ws))


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

    def as_linear(self, x: torch.Tensor, ws: torch.Tensor | None = None) -> torch.Tensor:
        return gather_vocab(super().as_linear(x, ws), self.comm, self.per_rank, self.vocab)


class VocabParallelHead(Linear):
    """This rank's rows of an untied LM head; the logits of every rank gathered."""

    comm: Comm
    vocab: int
    per_rank: int

    def forward(self, x: torch.Tensor, ws: torch.Tensor | None = None) -> torch.Tensor:
        return gather_vocab(super().forward(x, ws), self.comm, self.per_rank, self.vocab)


def gather_vocab(local: torch.Tensor, comm: Comm, per_rank: int, vocab: int) -> torch.Tensor:
    """[T, V] logits from each rank's [T, its rows] (padded to one width for the gather, then cut)."""
    if local.shape[-1] < per_rank:
        local = F.pad(local, (0, per_rank - local.shape[-1]))
    return torch.cat(comm.all_gather(local), dim=-1)[..., :vocab]


def check_shardable(cfg: ModelConfig, world: int) -> None:
    """Refuse, with the reason, a model whose heads or widths do not divide over `world` ranks."""
    hkv = cfg.num_kv_heads
    for layer in range(cfg.num_layers):
        hq = cfg.layer_heads(layer)
        if hq % world:
            raise LuceboxError(f"--tensor-parallel {world}: layer {layer} has {hq} query heads, not a multiple")
    if hkv % world and world % hkv:
        raise LuceboxError(f"--tensor-parallel {world}: {hkv} K/V heads neither divide over the ranks nor "
                           "replicate evenly")
    if cfg.is_hybrid and (cfg.linear_k_heads % world or cfg.linear_v_heads % cfg.linear_k_heads):
        raise LuceboxError(f"--tensor-parallel {world}: the linear-attention layers' {cfg.linear_k_heads} key heads "
                           f"(with {cfg.linear_v_heads} value heads) do not split evenly")
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
        if isinstance(block, DeltaNetBlock):
            _shard_deltanet(block, cfg, comm)
        elif isinstance(block, GatedAttentionBlock):
            _shard_gated_attention(block, comm)
        else:
            _shard_block(block, comm)
        _shard_ffn(block, comm)
    model.token_embd = _vocab_embedding(model.token_embd, cfg.vocab_size, comm)
    if not cfg.tie_word_embeddings:
        model.output = _vocab_head(model.output, cfg.vocab_size, comm)
    local = dataclasses.replace(
        cfg, num_heads=cfg.num_heads // world, num_kv_heads=max(cfg.num_kv_heads // world, 1),
        heads_per_layer=[h // world for h in cfg.heads_per_layer],
        intermediate_size=cfg.intermediate_size // world, shared_expert_ff=cfg.shared_expert_ff // world,
        linear_k_heads=cfg.linear_k_heads // world, linear_v_heads=cfg.linear_v_heads // world)
    model.cfg = local
    return local


def kv_heads_of(rank: int, world: int, kv_heads: int) -> range:
    """The K/V heads rank `rank` of `world` holds: its share, or with fewer heads than ranks the one its query
    heads read (replicated on world / kv_heads ranks)."""
    lo = rank * kv_heads // world
    return range(lo, (rank + 1) * kv_heads // world) if kv_heads >= world else range(lo, lo + 1)


def linear_heads_of(rank: int, world: int, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """A Gated DeltaNet layer's share of rank `rank` of `world`, as indices into the whole layer's: (its conv
    channels over [q | k | v], which are also its attn_qkv rows and its conv state's channels; its value heads,
    also its ssm state's heads). q/k heads [r K/N, (r+1) K/N) and the value heads that read them: value head h
    reads q/k head h % K (tiled order), so they are taken m-major (h = j + m K for each m < V/K, then j over
    the rank's q/k heads), and local value head i reads local q/k head i % (K/N): the same rule, locally."""
    k, dk, dv = cfg.linear_k_heads, cfg.linear_k_dim, cfg.linear_v_dim
    keys = range(rank * k // world, (rank + 1) * k // world)
    values = torch.tensor([j + m * k for m in range(cfg.linear_v_heads // k) for j in keys])
    key_rows = _head_rows(keys, dk)
    return torch.cat([key_rows, k * dk + key_rows, 2 * k * dk + _head_rows(values, dv)]), values


def _shard_block(block: DecoderBlock, comm: Comm) -> None:
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
    block.attn_output = _cols(block.attn_output, [range(q_heads.start * d, q_heads.stop * d)], comm)
    block.num_heads, block.num_kv_heads = len(q_heads), len(kv_heads)


def _shard_gated_attention(block: GatedAttentionBlock, comm: Comm) -> None:
    """A hybrid's full-attention layer: attn_q's [query | gate] rows of this rank's heads, attn_k / attn_v of
    the K/V heads they read, attn_output's columns of those heads."""
    r, n, d = comm.rank, comm.world, block.head_dim
    q_heads = range(r * block.num_heads // n, (r + 1) * block.num_heads // n)
    kv_heads = kv_heads_of(r, n, block.num_kv_heads)
    kv_rows = _head_rows(kv_heads, d)
    block.attn_q = _rows(block.attn_q, _head_rows(q_heads, 2 * d))
    block.attn_k, block.attn_v = _rows(block.attn_k, kv_rows), _rows(block.attn_v, kv_rows)
    block.attn_output = _cols(block.attn_output, [range(q_heads.start * d, q_heads.stop * d)], comm)
    block.num_heads, block.num_kv_heads = len(q_heads), len(kv_heads)


def _shard_deltanet(block: DeltaNetBlock, cfg: ModelConfig, comm: Comm) -> None:
    """A Gated DeltaNet layer's share of this rank (`linear_heads_of`); ssm_out row-parallel over the columns of
    its value heads, one span of K/N heads for each m."""
    channels, values = linear_heads_of(comm.rank, comm.world, cfg)
    k, dv = cfg.linear_k_heads, cfg.linear_v_dim
    mine = k // comm.world
    first = comm.rank * mine
    block.attn_qkv = _rows(block.attn_qkv, channels)
    block.attn_gate = _rows(block.attn_gate, _head_rows(values, dv))
    v = cfg.linear_v_heads  # beta|alpha fused at load (DeltaNetBlock.fuse)
    block.ssm_beta_alpha = _take_parts(block.ssm_beta_alpha, [values, values], [v, v])
    block.ssm_a = _param_rows(block.ssm_a, values)
    block.ssm_dt.bias = _param_rows(block.ssm_dt.bias, values)
    block.ssm_conv1d.weight = _param_rows(block.ssm_conv1d.weight, channels)
    block.ssm_out = _cols(block.ssm_out, [range((m * k + first) * dv, (m * k + first + mine) * dv)
                                          for m in range(len(values) // mine)], comm)
    block.k_heads, block.v_heads, block.conv_dim = mine, len(values), len(channels)


def _shard_ffn(block: nn.Module, comm: Comm) -> None:
    """The block's FFN: its experts (and shared expert), or the dense MLP's gate|up rows and down columns."""
    if block.moe is not None:
        _shard_moe(block, block.moe, comm)
        return
    r, n = comm.rank, comm.world
    ff = block.ffn_down.in_features
    lo, hi = r * ff // n, (r + 1) * ff // n
    # gate|up fused at load (DecoderModel.finalize, Qwen35Model.finalize)
    block.ffn_gate_up = _take_parts(block.ffn_gate_up, [torch.arange(lo, hi)] * 2, [ff, ff])
    block.ffn_down = _cols(block.ffn_down, [range(lo, hi)], comm)


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
        _replace(block, moe, "ffn_down_shexp", _cols(moe.ffn_down_shexp, [range(lo, hi)], comm, reduce=False))
    moe.reduce = comm.all_reduce


def _replace(block: nn.Module, moe: MoE, name: str, module: nn.Module) -> None:
    setattr(moe, name, module)
    setattr(block, name, module)


def _head_rows(heads: range | torch.Tensor, d: int) -> torch.Tensor:
    """The rows of heads `heads` (in that order) of a projection with `d` rows a head."""
    return (torch.as_tensor(heads)[:, None] * d + torch.arange(d)).flatten()


def _param_rows(p: torch.Tensor, idx: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(p.index_select(0, idx.to(p.device)).contiguous(), requires_grad=False)


def _take_parts(fused: nn.Module, rows: list[torch.Tensor], sizes: list[int]) -> nn.Module:
    """The rows `rows[i]` of each part i (of `sizes[i]` rows) of a fused projection: one Linear of the parts
    side by side, or a ConcatLinear whose own parts are runs of them (fuse_linears), each keeping the chosen
    rows that fall in it."""
    offsets = [0]
    for s in sizes[:-1]:
        offsets.append(offsets[-1] + s)
    idx = torch.cat([i + off for i, off in zip(rows, offsets)])
    if isinstance(fused, ConcatLinear):
        start, kept = 0, []
        for p in fused.parts:
            inside = (idx >= start) & (idx < start + p.out_features)
            kept.append(_rows(p, idx[inside] - start))
            start += p.out_features
        fused.parts = nn.ModuleList(kept)
        fused.out_features = sum(p.out_features for p in fused.parts)
        return fused
    assert isinstance(fused, Linear)
    return _rows(fused, idx)


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


def _cols(lin: Linear, spans: list[range], comm: Comm, reduce: bool = True) -> Linear:
    """A Linear of the input features in `spans` of `lin`, side by side (a RowParallelLinear: its output summed
    over the ranks, unless the caller sums it); its bias is added once (rank 0's)."""
    width = sum(len(s) for s in spans)
    out = _empty(width, lin.out_features, lin.bias is not None and comm.rank == 0,
                 RowParallelLinear if reduce else Linear)
    out.__dict__["comm"] = comm
    if lin.qtype is not None:
        block, size, _ = FORMATS[lin.qtype]
        split = next((c for s in spans for c in (s.start, s.stop) if c % block), None)
        if split is not None:
            raise LuceboxError(f"--tensor-parallel {comm.world}: a {lin.qtype} weight of {lin.cols} columns "
                               f"would split at column {split}, inside a {block}-value block "
                               "(use fewer ranks, or a dense or smaller-block file)")
        data = torch.cat([lin.qdata[:, s.start // block * size: s.stop // block * size] for s in spans], 1)
        out.set_quant(QuantWeight(data.contiguous(), lin.qtype, width, lin.dtype), lin.dtype)
    else:
        out.weight = nn.Parameter(torch.cat([lin.weight[:, s.start:s.stop] for s in spans], 1).contiguous(),
                                  requires_grad=False)
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
