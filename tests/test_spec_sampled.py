"""Sampled mode: DFlash speculative decoding (chain and DDTree) draws from the same distribution as plain sampling.

A statistical test on a tiny vocabulary. The tiny random llama has 384 tokens, so the vocabulary is made tiny by
the sampling chain: with top_k=3 every position has 3 possible tokens and the first NEW=3 new tokens of one fixed
prompt have at most 27 joint outcomes. The exact joint distribution comes from the target's own logits
(`engine.score` of every prefix, filtered by an independent re-implementation of the sampling chain). Each mode
draws N samples, one request per seed (disjoint seed ranges, so the samples are independent) and is compared

- to the exact distribution: chi-square goodness of fit, and
- to plain sampling: two-sample chi-square (homogeneity),

cells whose expected count is below 5 merged. A correct implementation fails with probability ALPHA per
comparison (the seeds are fixed, so a run is deterministic). The same statistic must reject two distributions
that are deliberately off: plain sampling at another temperature, and the spec path with the textbook lossy
acceptance bug (on a rejection, redraw the bonus from the full distribution instead of the residual), which
proves the test can fail.

The drafter is trained for a few seconds on the target's own samples from the prompt, so its drafts agree with
the target's choice often but not always: both the accept path and the reject (bonus) path run, and in DDTree
mode walks also leave the top-1 chain for a sibling branch. Everything runs on one thread (small ops on a shared
2-core machine are much slower with two OpenMP threads).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams, filter_logits
from lucebox.engine.spec import dflash
from lucebox.engine.spec.drafter import save_drafter
from lucebox.engine.weights.loader import load_model
from lucebox.train.examples import Example
from lucebox.train.trainer import TrainConfig, Trainer, new_drafter

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

PROMPT = list(range(5, 30))
NEW = 3  # new tokens per request: the joint outcome is the test's "symbol"
N = 3000  # samples per mode
ALPHA = 1e-3  # a correct implementation fails one comparison with this probability
BLOCK = 4
BUDGET = 8  # DDTree nodes (> BLOCK - 1: top-8 siblings per depth)
PARAMS = dict(temperature=1.0, top_k=3)  # the main case: 3 tokens per position


def engine(target: Path, n_seqs: int = N, **kw) -> LLMEngine:
    cfg = EngineConfig(device="cpu", dtype="float32", kv_tokens=n_seqs * (len(PROMPT) + 24), max_num_seqs=n_seqs,
                       max_step_tokens=8192, **kw)
    return LLMEngine.from_path(target, cfg, quiet=True)


def outcomes(eng: LLMEngine, seeds: Sequence[int | None], new: int = NEW, **params) -> list[tuple[int, ...]]:
    """The first `new` tokens of one request per seed (None: the global generator), all batched together."""
    plist = [SamplingParams(seed=s, max_tokens=new, ignore_eos=True, **params) for s in seeds]
    return [tuple(o) for o in eng.generate([PROMPT] * len(plist), plist)]


# ----- the reference distribution --------------------------------------------------------------------------------


def chain_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                min_p: float = 0.0) -> dict[int, float]:
    """The sampling chain (temperature -> top-k -> top-p -> min-p) in float64, written apart from the sampler."""
    probs = (logits.double() / temperature).softmax(-1)
    vals, ids = probs.sort(descending=True)
    if top_k > 0:
        vals, ids = vals[:top_k], ids[:top_k]
    vals = vals / vals.sum()
    if top_p < 1.0:
        before = vals.cumsum(0) - vals  # mass strictly above each token: keep while it is within top_p
        keep = before <= top_p
        vals, ids = vals[keep], ids[keep]
        vals = vals / vals.sum()
    if min_p > 0:
        keep = vals >= min_p * vals[0]
        vals, ids = vals[keep], ids[keep]
        vals = vals / vals.sum()
    return dict(zip(ids.tolist(), vals.tolist()))


def exact_joint(eng: LLMEngine, new: int = NEW, **params) -> dict[tuple[int, ...], float]:
    """P(first `new` tokens) = product of the filtered next-token distributions, prefix by prefix."""
    joint = {(): 1.0}
    for _ in range(new):
        nxt = {}
        for prefix, p in joint.items():
            for tok, q in chain_probs(eng.score(PROMPT + list(prefix))[-1], **params).items():
                nxt[prefix + (tok,)] = p * q
        joint = nxt
    assert abs(sum(joint.values()) - 1.0) < 1e-9
    return joint


# ----- chi-square --------------------------------------------------------------------------------------------------


def cells(probs: dict[tuple[int, ...], float], n: int) -> list[list[tuple[int, ...]]]:
    """Group the outcomes into cells of expected count >= 5 (the rare ones pooled), fixed before looking at data."""
    order = sorted(probs, key=probs.get, reverse=True)
    big = [[o] for o in order if n * probs[o] >= 5]
    rest = [o for o in order if n * probs[o] < 5]
    while rest and n * sum(probs[o] for o in rest) < 5 and big:
        rest += big.pop()  # pool the smallest big cell into the rare ones until they are worth a cell
    return big + ([rest] if rest else [])


def chi2_sf(stat: float, df: int) -> float:
    """P(chi-square with df degrees of freedom > stat): the regularized upper incomplete gamma Q(df/2, stat/2)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def goodness_of_fit(sample: list[tuple[int, ...]], probs: dict[tuple[int, ...], float]) -> tuple[float, int, float]:
    """Pearson's chi-square of a sample against the exact distribution: (statistic, df, p-value)."""
    counts, n = Counter(sample), len(sample)
    groups = cells(probs, n)
    stat = 0.0
    for g in groups:
        expected = n * sum(probs[o] for o in g)
        stat += (sum(counts[o] for o in g) - expected) ** 2 / expected
    df = len(groups) - 1
    return stat, df, chi2_sf(stat, df)


def two_sample(a: list[tuple[int, ...]], b: list[tuple[int, ...]],
               probs: dict[tuple[int, ...], float]) -> tuple[float, int, float]:
    """Chi-square test that two equal-size samples come from one distribution (cells from the exact one)."""
    assert len(a) == len(b)
    ca, cb = Counter(a), Counter(b)
    groups = cells(probs, len(a))
    stat = 0.0
    for g in groups:
        x, y = sum(ca[o] for o in g), sum(cb[o] for o in g)
        stat += (x - y) ** 2 / (x + y) if x + y else 0.0
    df = len(groups) - 1
    return stat, df, chi2_sf(stat, df)


def test_chi_square_tail_is_right():
    # Closed forms: df=2 -> exp(-x/2); df=1 -> erfc(sqrt(x/2)).
    for x in (0.5, 3.0, 13.8):
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-9)
        assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-9)
    assert chi2_sf(29.59, 10) == pytest.approx(0.001, rel=0.01)  # the table's 0.1% point


def test_reference_chain_matches_the_sampler():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.5, 0.0, -1.0])  # probabilities .605 .222 .082 .050 .030 .011
    assert list(chain_probs(logits, 1.0, top_k=3)) == [0, 1, 2]
    assert list(chain_probs(logits, 1.0, top_p=0.8)) == [0, 1]  # keep while the mass above is <= top_p
    assert list(chain_probs(logits, 1.0, top_p=0.85)) == [0, 1, 2]
    p = chain_probs(logits, 0.5, min_p=0.1)  # at T=0.5: 1, e^-2 = .135, e^-4 = .018 of the top one
    assert list(p) == [0, 1] and p[0] == pytest.approx(1 / (1 + math.exp(-2)))
    # The engine's filter gives the same distribution on random logits.
    g = torch.Generator().manual_seed(0)
    for kw in (PARAMS, dict(temperature=0.8, top_p=0.9, min_p=0.1), dict(temperature=1.3, top_k=5, top_p=0.7)):
        for _ in range(20):
            row = torch.randn(50, generator=g) * 2
            ours = chain_probs(row, **kw)
            engine_probs = filter_logits(row[None].clone(), [SamplingParams(**kw)]).softmax(-1)[0]
            assert set(engine_probs.nonzero().flatten().tolist()) == set(ours)
            assert all(abs(engine_probs[t].item() - q) < 1e-5 for t, q in ours.items())


# ----- the samples ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def drafted(tiny_gguf, tmp_path_factory):
    """The target, the exact distribution, and a drafter trained on the target's own samples from PROMPT."""
    target = tiny_gguf("llama", "F32")
    loaded = load_model(target, device="cpu", dtype=torch.float32, quiet=True)
    gen = LLMEngine(loaded, EngineConfig(device="cpu", dtype="float32", kv_tokens=64 * 48, max_num_seqs=64))
    responses = outcomes(gen, range(10**6, 10**6 + 64), new=16, **PARAMS)
    examples = [Example(len(PROMPT), PROMPT + list(r)) for r in responses]
    trainer = Trainer(loaded, gen, examples, new_drafter(loaded, layers=1, block_size=BLOCK, target_layers=[0, 1]),
                        TrainConfig(steps=200, batch=4, anchors=16, lr=5e-3, save_dtype="float32"))
    for _ in range(200):
        trainer.train_step()
    folder = tmp_path_factory.mktemp("sampled-drafter")
    save_drafter(trainer.drafter, folder)
    plain = engine(target)
    return SimpleNamespace(target=target, draft=folder, plain=plain, exact=exact_joint(plain, **PARAMS))


@pytest.fixture(scope="module")
def plain_samples(drafted):
    """Plain sampling with seeds 0..3N: [0, N) is the plain sample, the rest match the spec runs' seeds."""
    return outcomes(drafted.plain, range(3 * N), **PARAMS)


class WalkSpy:
    """Wraps the real acceptance walk and records what it did (the engine's code path is unchanged)."""

    def __init__(self) -> None:
        self.walks = 0
        self.accepted = 0  # draft tokens accepted
        self.rejected = 0  # walks that stopped on a mismatch (the bonus is not a draft token)
        self.off_chain = 0  # walks that took a node off the top-1 chain (DDTree siblings)

    def __call__(self, chunk, choose):
        path, tokens = REAL_WALK(chunk, choose)
        n = chunk.n
        parents = chunk.parents or list(range(-1, n - 1))
        self.walks += 1
        self.accepted += len(path) - 1
        self.rejected += any(parents[i] == path[-1] for i in range(n))  # the last node had children: none matched
        # a parent's top-1 child is its first (siblings come in rank order): any other child is off the chain
        first = {}
        for i, p in enumerate(parents):
            first.setdefault(p, i)
        self.off_chain += any(first[parents[node]] != node for node in path[1:])
        return path, tokens


REAL_WALK = dflash.walk


def spec_run(drafted, seeds: Sequence[int | None], *, ddtree: bool, walk=None,
             **params) -> tuple[list, LLMEngine, WalkSpy]:
    spy = WalkSpy()
    eng = engine(drafted.target, draft=str(drafted.draft), ddtree=ddtree, ddtree_budget=BUDGET)
    assert eng.spec is not None and eng.spec.static is None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dflash, "walk", walk or spy)
        out = outcomes(eng, seeds, **params)
    return out, eng, spy


def lossy_walk(chunk, choose):
    """The classic lossy rule: on a rejection, the bonus is redrawn from the full distribution (not the residual),
    so a draft token gets a second chance: P(d) becomes p + (1 - p) p. The redraw needs fresh noise: the
    sampler's noise is a function of (seed, position), so it is told one more accepted token (PARAMS has no
    penalties or grammar, which are all that read the accepted tokens besides the position)."""
    path, tokens = REAL_WALK(chunk, choose)
    parents = chunk.parents or list(range(-1, chunk.n - 1))
    if any(parents[i] == path[-1] for i in range(chunk.n)):  # stopped on a mismatch
        tokens[-1] = choose(path[-1], tokens[:-1] + [-1])
    return path, tokens


# ----- the tests ---------------------------------------------------------------------------------------------------


def test_plain_sampling_matches_the_exact_distribution(drafted, plain_samples):
    exact = drafted.exact
    assert len(exact) == PARAMS["top_k"] ** NEW and len(cells(exact, N)) >= 10  # a tiny vocabulary, many cells
    sample = plain_samples[:N]
    assert set(sample) <= set(exact), "plain sampling produced an outcome outside top-k"
    stat, df, p = goodness_of_fit(sample, exact)
    print(f"plain vs exact: chi2={stat:.1f} df={df} p={p:.3g}")
    assert p > ALPHA


@pytest.mark.parametrize("ddtree", [False, True], ids=["chain", "ddtree"])
def test_spec_sampling_distribution_equals_plain_sampling(drafted, plain_samples, ddtree):
    seeds = range(N, 2 * N) if not ddtree else range(2 * N, 3 * N)
    sample, eng, spy = spec_run(drafted, seeds, ddtree=ddtree, **PARAMS)
    assert set(sample) <= set(drafted.exact), "spec sampling produced an outcome outside top-k"
    stat, df, p = goodness_of_fit(sample, drafted.exact)
    stat2, df2, p2 = two_sample(sample, plain_samples[:N], drafted.exact)
    st = eng.spec.stats
    print(f"{'ddtree' if ddtree else 'chain'}: vs exact chi2={stat:.1f} df={df} p={p:.3g}; vs plain chi2={stat2:.1f} "
          f"df={df2} p={p2:.3g}; {spy.walks} walks, {spy.accepted} drafts accepted, {spy.rejected} rejections, "
          f"{spy.off_chain} off the chain; tau {st.acceptance_length:.2f}")
    assert p > ALPHA and p2 > ALPHA
    # Both paths of the acceptance rule ran, often: the test is about them.
    assert spy.walks == st.steps and st.committed - st.steps == spy.accepted
    assert spy.accepted > N // 4 and spy.rejected > N // 4
    if ddtree:
        assert spy.off_chain > N // 20  # the walk also followed sibling branches
    # Same seeds, same draws: the spec run reproduces plain sampling token for token.
    same = sum(a == b for a, b in zip(sample, plain_samples[seeds.start:seeds.stop]))
    assert same >= 0.99 * N, f"only {same}/{N} seeded requests equal plain sampling with the same seed"


def test_the_statistic_rejects_a_different_distribution(drafted, plain_samples):
    """Power: the same statistic, the same sample size, two distributions that are off must fail."""
    hotter = outcomes(drafted.plain, range(N), temperature=1.2, top_k=PARAMS["top_k"])
    _, _, p_exact = goodness_of_fit(hotter, drafted.exact)
    _, _, p_plain = two_sample(hotter, plain_samples[N: 2 * N], drafted.exact)
    lossy, _, _ = spec_run(drafted, range(N, 2 * N), ddtree=False, walk=lossy_walk, **PARAMS)
    _, _, q_exact = goodness_of_fit(lossy, drafted.exact)
    _, _, q_plain = two_sample(lossy, plain_samples[:N], drafted.exact)
    print(f"temperature 1.2: p={p_exact:.3g} (exact), {p_plain:.3g} (plain); "
          f"lossy acceptance: p={q_exact:.3g} (exact), {q_plain:.3g} (plain)")
    assert max(p_exact, p_plain, q_exact, q_plain) < ALPHA


def test_top_p_min_p_and_top_k_one_through_spec(drafted):
    """Other sampling chains: top-p with min-p (no top-k), the chain run unseeded (the global generator, drawn row by
    row); and top_k=1 sampling (greedy through the sampler)."""
    params = dict(temperature=0.8, top_p=0.9, min_p=0.1)
    exact = exact_joint(drafted.plain, **params)
    n = N // 2
    assert len(cells(exact, n)) >= 5
    plain = outcomes(drafted.plain, range(n), **params)
    torch.manual_seed(0)
    chain, _, spy = spec_run(drafted, [None] * n, ddtree=False, **params)
    tree, _, tspy = spec_run(drafted, range(2 * n, 3 * n), ddtree=True, **params)
    for name, s in (("plain", plain), ("chain", chain), ("ddtree", tree)):
        assert set(s) <= set(exact), f"{name} produced an outcome the chain filters out"
        stat, df, p = goodness_of_fit(s, exact)
        print(f"top_p/min_p {name}: chi2={stat:.1f} df={df} p={p:.3g}")
        assert p > ALPHA
    for name, s in (("chain", chain), ("ddtree", tree)):
        stat, df, p = two_sample(s, plain, exact)
        print(f"top_p/min_p {name} vs plain: chi2={stat:.1f} df={df} p={p:.3g}")
        assert p > ALPHA
    assert spy.accepted > 0 and spy.rejected > 0 and tspy.accepted > 0 and tspy.rejected > 0
    greedy = outcomes(drafted.plain, range(1))[0]
    for ddtree in (False, True):
        got, _, _ = spec_run(drafted, range(50), ddtree=ddtree, temperature=1.5, top_k=1)
        assert set(got) == {greedy}
