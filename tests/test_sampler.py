"""Sampler rules on hand-made logits, where the right answer can be computed independently."""

from __future__ import annotations

import math

import pytest
import torch

from lucebox.engine.runtime.sampler import (
    SampleRow,
    SamplingParams,
    apply_penalties,
    filter_logits,
    sample,
    seeded_uniform,
)

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def rows(params: SamplingParams, n: int = 1, seed: int | None = None, out: list[int] | None = None) -> list[SampleRow]:
    return [SampleRow(params, [0], list(out or []), seed) for _ in range(n)]


def frequencies(params: SamplingParams, draws: int = 20000, seed: int = 0) -> torch.Tensor:
    """Empirical token frequencies over `draws` rows sampled in one batch (shared generator)."""
    torch.manual_seed(seed)
    toks, _ = sample(LOGITS.repeat(draws, 1), [SampleRow(params, [0], [])] * draws)
    return torch.bincount(torch.tensor(toks), minlength=LOGITS.shape[1]).float() / draws


def test_greedy_is_argmax():
    toks, _ = sample(LOGITS.clone(), rows(SamplingParams()))
    assert toks == [0]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, top_p=1e-6),
    SamplingParams(temperature=1.0, min_p=1.0),
])
def test_filters_at_their_limit_reduce_to_greedy(params):
    toks, _ = sample(LOGITS.repeat(50, 1), rows(params, 50, seed=1))
    assert set(toks) == {0}


def test_temperature_sampling_matches_the_softmax():
    freq = frequencies(SamplingParams(temperature=0.7))
    expected = (LOGITS[0] / 0.7).softmax(-1)
    # 20000 draws: standard error of a frequency <= 0.0036; 5 sigma.
    assert (freq - expected).abs().max() < 0.018


def test_top_k_and_top_p_keep_exactly_the_right_tokens():
    probs = LOGITS[0].softmax(-1)  # [0.61, 0.22, 0.14, 0.08, 0.03, 0.004]
    f = frequencies(SamplingParams(temperature=1.0, top_k=2))
    assert set(torch.nonzero(f).flatten().tolist()) == {0, 1}
    # top_p=0.8: tokens are kept while the mass before them is <= 0.8 -> {0, 1} (0.61 + 0.22 > 0.8 stops after 1)
    mass_before = torch.cumsum(probs, 0) - probs
    keep = {i for i in range(6) if mass_before[i] <= 0.8}
    f = frequencies(SamplingParams(temperature=1.0, top_p=0.8))
    assert set(torch.nonzero(f).flatten().tolist()) == keep


def reference_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """The tokens top-k then top-p keep, by a full sort of the row (the rule as Hugging Face writes it)."""
    order = logits.argsort(descending=True)
    order = order[:top_k] if top_k else order
    probs = logits[order].softmax(-1)
    before = probs.cumsum(-1) - probs
    return {int(t) for t, b in zip(order, before) if b <= top_p or top_p == 1} | {int(order[0])}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_top_k_top_p_on_the_candidates_equals_the_full_sort(device):
    """The nucleus is cut from a row's largest logits, and from a full sort where they do not hold it: both give
    the tokens the full-sort rule keeps, whichever side of NUCLEUS_CANDIDATES the row falls."""
    g = torch.Generator().manual_seed(5)
    vocab, cases = 5000, [(0, 0.9), (0, 0.5), (40, 0.95), (0, 0.999), (2000, 1.0), (2000, 0.99), (7, 1.0), (0, 1e-4)]
    spread = [6.0, 3.0, 0.3]  # peaked rows (small nuclei), middling, nearly flat (nuclei past the candidates)
    logits = torch.cat([torch.randn(len(cases), vocab, generator=g) * s for s in spread])
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=p) for k, p in cases] * len(spread)
    out = filter_logits(logits.to(device), params).cpu()
    sizes = []
    for row, prm in enumerate(params):
        kept = set(torch.isfinite(out[row]).nonzero().flatten().tolist())
        assert kept == reference_top_k_top_p(logits[row], prm.top_k, prm.top_p), (row, prm)
        assert torch.equal(out[row][list(kept)], logits[row][list(kept)])  # kept logits are unchanged
        sizes.append(len(kept))
    assert min(sizes) == 1 and max(sizes) > 1024  # both paths ran


def test_min_p_drops_tokens_below_the_scaled_floor():
    probs = LOGITS[0].softmax(-1)
    keep = {i for i in range(6) if probs[i] >= 0.2 * probs.max()}
    f = frequencies(SamplingParams(temperature=1.0, min_p=0.2))
    assert set(torch.nonzero(f).flatten().tolist()) == keep


def test_repetition_penalty_follows_the_hf_rule():
    out = apply_penalties(LOGITS.clone(), [SampleRow(SamplingParams(repetition_penalty=2.0), [0], [4])])[0]
    assert out[0].item() == pytest.approx(1.0)  # positive logit divided
    assert out[4].item() == pytest.approx(-2.0)  # negative logit multiplied
    assert out[1].item() == pytest.approx(1.0)  # unseen untouched


def test_presence_and_frequency_penalties_follow_the_openai_rule():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(LOGITS.clone(), [SampleRow(params, [1], [2, 2, 3])])[0]
    assert out[2].item() == pytest.approx(0.5 - 0.5 - 2 * 0.25)
    assert out[3].item() == pytest.approx(0.0 - 0.5 - 0.25)
    assert out[1].item() == pytest.approx(1.0)  # prompt tokens are not penalised


def test_seeded_rows_are_reproducible_and_independent():
    p = SamplingParams(temperature=1.0)
    a, _ = sample(LOGITS.repeat(3, 1), [rows(p, seed=5)[0], rows(p, seed=6)[0], rows(p, seed=7)[0]])
    b, _ = sample(LOGITS.repeat(1, 1), rows(p, seed=6))
    assert a[1] == b[0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_a_seeded_draw_is_the_inverse_cdf_at_the_splitmix64_uniform(device):
    """Flat over 1000 tokens, the token is floor(1000 u), u from splitmix64 (reference written out on ints)."""
    mask = 2**64 - 1

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    p = SamplingParams(temperature=1.0)
    for seed, pos in ((0, 0), (1, 0), (0, 1), (2**64 - 1, 12345), (987654321, 7)):
        u = ((mix((mix(seed) + (pos + 1) * 0x9E3779B97F4A7C15) & mask) >> 11) + 0.5) / 2**53
        assert seeded_uniform(seed, pos) == u and 0 < u < 1
        assert sample(torch.zeros(1, 1000, device=device), [SampleRow(p, [0], [], seed, pos)])[0] == [int(u * 1000)]


def test_a_seeded_row_depends_on_its_seed_and_position_only():
    """Batch-invariant (the rows beside it change nothing) and fresh at each output position."""
    p = SamplingParams(temperature=1.0)
    flat = torch.zeros(1, 1000)  # uniform over 1000 tokens: a different noise almost surely picks differently
    alone = [sample(flat, [SampleRow(p, [0], [], 42, pos)])[0][0] for pos in range(20)]
    mixed = sample(flat.repeat(40, 1), [SampleRow(p, [0], [], 42 if i % 2 else i, i // 2) for i in range(40)])[0]
    assert mixed[1::2] == alone
    assert len(set(alone)) >= 15  # 20 positions, 1000 tokens: a repeat is rare, fifteen distinct almost certain
    other = [sample(flat, [SampleRow(p, [0], [], 43, pos)])[0][0] for pos in range(20)]
    assert sum(a == b for a, b in zip(alone, other)) <= 2  # another seed: another sequence


def test_seeded_draws_follow_the_distribution():
    """20000 seeded rows (consecutive seeds, one position): the same frequencies as the softmax."""
    p = SamplingParams(temperature=0.7)
    toks, _ = sample(LOGITS.repeat(20000, 1), [SampleRow(p, [0], [], s, 3) for s in range(20000)])
    freq = torch.bincount(torch.tensor(toks), minlength=LOGITS.shape[1]).float() / 20000
    assert (freq - (LOGITS[0] / 0.7).softmax(-1)).abs().max() < 0.018


def test_logprobs_report_the_raw_distribution():
    p = SamplingParams(temperature=0.5, logprobs=3)
    toks, lps = sample(LOGITS.clone(), rows(p, seed=0))
    raw = LOGITS[0].log_softmax(-1)
    assert lps[0].token_id == toks[0]
    assert lps[0].logprob == pytest.approx(raw[toks[0]].item())
    assert [t for t, _ in lps[0].top] == [0, 1, 2]
    assert math.isclose(lps[0].top[0][1], raw[0].item(), rel_tol=1e-6)


def test_filter_logits_never_empties_a_row():
    out = filter_logits(LOGITS.clone(), [SamplingParams(temperature=1.0, top_p=1e-9, top_k=1, min_p=1.0)])
    assert torch.isfinite(out).sum() == 1


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_k=-5), dict(max_tokens=0),
                                 dict(min_p=2), dict(logprobs=50)])
def test_validate_names_the_field(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad).validate()
