"""Batched sampling with per-request parameters and per-request seeds.

Order of operations (as Hugging Face and vLLM apply them): penalties →
temperature → top-k → top-p → min-p → draw. Greedy rows skip straight to
argmax after penalties. Log-probabilities reported to clients are those of
the model's raw distribution (before penalties and temperature), as vLLM does.

The draw is the inverse CDF at one uniform per row, all rows in one batched search. A seeded row's
uniform is counter-based, a hash of (seed, output position) (splitmix64), not a generator's state: a
row's tokens do not depend on the rows beside it or on how many draws came before, and speculative
decoding, which chooses at a verified row what plain decoding would choose at that position, draws the
same token there. Unseeded rows take fresh uniforms from torch's global generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Bounds that keep the sampler's arithmetic finite in fp32, applied when a SamplingParams is made.
# Values past them sample the same as the bound (a top-k past the vocabulary is no top-k; a repetition
# penalty of 1e-300 or 1e4 already pushes the seen tokens' logits to the extremes), so clamping changes
# no result a caller could want, and keeps NaN out of softmax (1e-300 divides a logit into inf).
TOP_K_MAX = 2**31 - 1
REPETITION_PENALTY_RANGE = (1e-4, 1e4)
TEMPERATURE_MAX = 1e4
SEED_MODULUS = 2**64  # seeds are 64-bit (a negative seed wraps the same way)


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF style, over prompt and output
    presence_penalty: float = 0.0  # OpenAI style, over output only
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)  # besides the model's EOS set
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; N = chosen token plus top N alternatives

    def __post_init__(self) -> None:
        """Clamp values the sampler cannot represent to ones that sample the same (see the bounds above).

        NaN and out-of-range values are left as they are, for `validate` to name them."""
        if isinstance(self.top_k, int) and self.top_k > TOP_K_MAX:
            self.top_k = TOP_K_MAX
        lo, hi = REPETITION_PENALTY_RANGE
        if _number(self.repetition_penalty) and self.repetition_penalty > 0:  # NaN and <= 0: validate's
            self.repetition_penalty = min(max(self.repetition_penalty, lo), hi)
        if _number(self.temperature) and self.temperature > TEMPERATURE_MAX:  # inf too
            self.temperature = TEMPERATURE_MAX
        if isinstance(self.seed, int):
            self.seed %= SEED_MODULUS

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self) -> None:
        """Raise ValueError naming the first out-of-range field."""
        checks = [
            ("temperature", self.temperature >= 0),
            ("top_k", self.top_k >= 0 or self.top_k == -1),
            ("top_p", 0 < self.top_p <= 1),
            ("min_p", 0 <= self.min_p <= 1),
            ("repetition_penalty", self.repetition_penalty > 0),
            ("presence_penalty", -2 <= self.presence_penalty <= 2),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2),
            ("max_tokens", self.max_tokens >= 1),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} is out of range")


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class SamplingError(ValueError):
    """A row's parameters left it no distribution to draw from (raised before anything is drawn)."""


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class SampleRow:
    """What the sampler needs to know about one row besides its logits."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    seed: int | None = None  # None: a fresh uniform from torch's global generator
    position: int = 0  # the output index of the token being chosen (a seeded row's uniform depends on it)


_MASK = 2**64 - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment (the golden ratio)


def _mix(z: int) -> int:
    """splitmix64's finalizer (Steele, Lea & Flood 2014), mod 2**64."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """A seeded row's uniform in (0, 1) at one output position: 53 bits of a hash of (seed, position)."""
    z = _mix((_mix(seed % SEED_MODULUS) + (position + 1) * _GAMMA) & _MASK)
    return ((z >> 11) + 0.5) * 2.0**-53


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Repetition (HF), presence and frequency (OpenAI) penalties, in place."""
    for i, row in enumerate(rows):
        p = row.params
        if not p.has_penalties:
            continue
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), dtype=torch.long,
                                device=logits.device)
            if seen.numel():
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if row.output_ids and (p.presence_penalty or p.frequency_penalty):
            out = torch.tensor(row.output_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(out, minlength=logits.shape[1]).to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


NUCLEUS_CANDIDATES = 1024
"""Top-k and top-p look at a row's largest logits first, and sort the whole row only when its nucleus is not
among them (a top-k above this, or a top-p mass the candidates do not reach: with SmolLM2 on MT-Bench at
T=0.9, top-p 0.95, 0.5% of rows). A full-vocabulary sort per row was two thirds of a 256-row sampling step."""


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p over rows that sample (not greedy)."""
    dev = logits.device
    temps = torch.tensor([max(p.temperature, 1e-5) for p in params], device=dev, dtype=logits.dtype)
    logits = logits / temps[:, None]
    if any((p.top_k > 0) or p.top_p < 1.0 for p in params):
        vocab = logits.shape[-1]
        ks = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)
        ps = torch.tensor([p.top_p for p in params], device=dev, dtype=logits.dtype)
        logits = _top_k_top_p(logits, ks, ps, top_k=any(0 < p.top_k < vocab for p in params))
    min_ps = [p.min_p for p in params]
    if any(m > 0 for m in min_ps):
        probs = logits.softmax(-1)
        floor = torch.tensor(min_ps, device=dev, dtype=logits.dtype)[:, None] * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def _top_k_top_p(logits: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor, top_k: bool) -> torch.Tensor:
    """`logits` with every token outside each row's top-k, then outside its top-p nucleus, at -inf (`top_k`:
    some row has a top-k below the vocabulary; without one the top-k passes are skipped)."""
    vocab = logits.shape[-1]
    n = min(NUCLEUS_CANDIDATES, vocab)  # largest first (topk of a whole row is slower than its sort)
    vals, idx = logits.topk(n, dim=-1) if n < vocab else logits.sort(dim=-1, descending=True)
    total = logits.logsumexp(-1)
    keep, mass = _nucleus(vals, ks, ps, total, vocab, top_k)
    out = torch.full_like(logits, float("-inf")).scatter_(-1, idx, vals.masked_fill(~keep, float("-inf")))
    # Exact where the cut falls among the candidates: a top-k within them, or (no top-k) a mass past top-p,
    # after which the first token left out already has more than top-p before it.
    unsure = ~((ks <= vals.shape[-1]) | ((ks >= vocab) & (mass > ps)))
    if bool(unsure.any()):
        rows = unsure.nonzero().flatten()
        vals, idx = logits[rows].sort(dim=-1, descending=True)
        keep, _ = _nucleus(vals, ks[rows], ps[rows], total[rows], vocab, top_k)
        out[rows] = torch.full_like(vals, float("-inf")).scatter_(-1, idx, vals.masked_fill(~keep, float("-inf")))
    return out


def _nucleus(vals: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor, total: torch.Tensor, vocab: int,
             top_k: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(which of a row's largest logits `vals` [rows, n] (sorted) top-k and top-p keep, their probability mass).

    Probabilities are over the row's top-k, or without one over its whole vocabulary (`total`, the logsumexp
    of all of it: `vals` may be the first n only); a token is kept while the mass before it is at most top-p."""
    drop = torch.arange(vals.shape[-1], device=vals.device)[None, :] >= ks[:, None] if top_k else None
    if drop is not None:
        in_k = vals.masked_fill(drop, float("-inf")).logsumexp(-1)
        total = torch.where(ks >= vocab, total, in_k)
    probs = (vals - total[:, None]).exp()
    if drop is not None:
        probs.masked_fill_(drop, 0.0)
    cum = probs.cumsum(-1)
    cut = ((cum - probs) > ps[:, None]) & (ps[:, None] < 1)  # top-p 1 cuts nothing (cum can round past 1)
    drop = cut if drop is None else drop | cut
    drop[:, 0] = False
    return ~drop, cum[:, -1]


def draw(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """One token per row from softmax(logits): the inverse CDF at each row's uniform (module docstring).

    Rows whose probabilities are not a distribution (NaN, inf, all zero) raise SamplingError before any
    draw, and before the global generator moves, so the engine can drop the bad row and sample the
    others exactly as it would have."""
    probs = logits.softmax(-1)
    ok = torch.isfinite(probs).all(-1) & (probs.sum(-1) > 0)
    if not bool(ok.all()):
        bad = (~ok).nonzero().flatten().tolist()
        raise SamplingError(f"rows {bad} have no valid probability distribution (NaN or inf after the penalties "
                            "and temperature)")
    unseeded = [i for i, r in enumerate(rows) if r.seed is None]
    fresh = iter(torch.rand(len(unseeded), dtype=torch.float64).clamp_(2.0**-53, 1 - 2.0**-53).tolist())
    u = [next(fresh) if r.seed is None else seeded_uniform(r.seed, r.position) for r in rows]
    # float64: u * total < total exactly (u <= 1 - 2**-53), so the search never runs off the end; a token of
    # probability 0 repeats its left neighbour's cumulative sum, and `right=True` never lands on it.
    cdf = probs.double().cumsum(-1)
    target = torch.tensor(u, dtype=torch.float64, device=logits.device)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def sample(logits: torch.Tensor, rows: list[SampleRow],
           allowed: torch.Tensor | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Pick the next token of each row; logprobs where the row asked for them.

    `allowed` [rows, vocab] bool: the tokens each row may choose (a grammar's mask, engine/runtime/grammar.py),
    applied after the raw log-probabilities are taken and before everything else."""
    logits = logits.float()
    logprobs: list[TokenLogprobs | None] = [None] * len(rows)
    want_lp = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    raw_lp = logits[want_lp].log_softmax(-1) if want_lp else None
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    if any(r.params.has_penalties for r in rows):
        logits = apply_penalties(logits.clone(), rows)
    tokens = logits.argmax(-1)
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        filtered = filter_logits(logits[sampled], [rows[i].params for i in sampled])
        tokens[sampled] = draw(filtered, [rows[i] for i in sampled])
    token_list = tokens.tolist()
    if raw_lp is not None:
        for j, i in enumerate(want_lp):
            n = rows[i].params.logprobs or 0
            top_v, top_i = raw_lp[j].topk(n) if n else (raw_lp[j][:0], raw_lp[j][:0].long())
            logprobs[i] = TokenLogprobs(
                token_list[i], float(raw_lp[j, token_list[i]]), list(zip(top_i.tolist(), top_v.tolist()))
            )
    return token_list, logprobs
