"""The Triton quantized matmul (engine/kernels/triton_qmm.py) against the exact torch dequantizer, on odd shapes.

Runs on CUDA (bf16 activations, as the engine runs), or on the CPU under Triton's interpreter
(TRITON_INTERPRET=1, fp32 activations) when triton is importable; skips otherwise. The CUDA-graph and
whole-model tests run on CUDA only.
"""

from __future__ import annotations

import os

import pytest
import torch

from lucebox.engine.weights.quant import QUANT_TYPES, QuantWeight, linear
from tests.test_quant_formats import random_weight

if linear.triton_qmm is None:
    pytest.skip("triton is not installed", allow_module_level=True)
qmm = linear.triton_qmm
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA; set TRITON_INTERPRET=1 to run the kernels on the CPU", allow_module_level=True)
DTYPE = torch.bfloat16 if CUDA else torch.float32
# bf16 operands (the weight rounded to bf16 in the tile, as a dense bf16 weight is): ~3e-3 relative.
TOL = 1.5e-2 if CUDA else 1e-5
ROWS = [1, 3, 16, 17, 100] if CUDA else [1, 5, 17]
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def block(qtype: str) -> int:
    return 256 if qtype.endswith("_K") else 32


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def reference(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.double() @ w.dequantize().double().T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("qtype", QUANT_TYPES)
@pytest.mark.parametrize("m", ROWS)
def test_qmatmul_matches_dequantized_reference(qtype: str, m: int, monkeypatch) -> None:
    """Every type through the gemv (m = 1) and the fused tile kernel (m > 1, forced below the slice path)."""
    monkeypatch.setattr(qmm, "PREFILL_ROWS", 1 << 30)
    n, k = 72, block(qtype) * 5  # N not a multiple of any tile; an odd number of chunks per step
    w = random_weight(qtype, n, k, seed=m).to(DEVICE)
    x = torch.randn(m, k, device=DEVICE).to(DTYPE)
    y = qmm.qmatmul(x, w)
    assert y.shape == (m, n) and y.dtype == DTYPE
    assert rel_err(y, reference(x, w)) < TOL


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "Q6_K", "Q8_0"])
def test_bias_and_writing_into_a_column_slice(qtype: str) -> None:
    n, k, m = 40, block(qtype) * 2, 4
    w = random_weight(qtype, n, k, seed=7).to(DEVICE)
    x = torch.randn(m, k, device=DEVICE).to(DTYPE)
    bias = torch.randn(n, device=DEVICE).to(DTYPE)
    out = torch.full((m, n + 24), float("nan"), device=DEVICE, dtype=DTYPE)
    qmm.qmatmul(x, w, bias, out=out[:, 8:8 + n])
    assert out[:, :8].isnan().all() and out[:, 8 + n:].isnan().all()
    assert rel_err(out[:, 8:8 + n], reference(x, w, bias)) < TOL


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0"])
def test_zero_rows_launch_nothing(qtype: str) -> None:
    """A step whose batch has no logit rows calls the LM head on [0, K]: an empty result, no kernel (on the
    H200 the int8 small-batch kernels read row M - 1 = -1: an illegal memory access that killed the warm-up)."""
    w = random_weight(qtype, 48, block(qtype) * 2, seed=1).to(DEVICE)
    qmm.TUNED["small", qtype, 48, w.cols] = qmm.SMALL_Q8X_CANDIDATES[qtype][0]  # the int8 kernel serves
    try:
        y = qmm.qmatmul(torch.zeros(0, w.cols, device=DEVICE, dtype=DTYPE), w)
        assert y.shape == (0, 48)
        if CUDA:
            torch.cuda.synchronize()
    finally:
        del qmm.TUNED["small", qtype, 48, w.cols]


def test_rows_must_match() -> None:
    w = random_weight("Q8_0", 16, 64).to(DEVICE)
    with pytest.raises(ValueError, match="columns"):
        qmm.qmatmul(torch.zeros(1, 96, device=DEVICE, dtype=DTYPE), w)


@needs_cuda
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("fused_rows", [2, 64])
def test_real_shapes_every_path(qtype: str, fused_rows: int, monkeypatch) -> None:
    """A Qwen3-8B-sized projection at decode and prefill sizes, with the fused tile kernel serving up to 1 or
    up to 63 rows (the gemv, tile and slice paths all run)."""
    monkeypatch.setattr(qmm, "PREFILL_ROWS", fused_rows)
    w = random_weight(qtype, 1024, 4096, seed=2).to("cuda")
    for m in (1, 16, 512):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        assert rel_err(qmm.qmatmul(x, w), reference(x, w)) < TOL


@needs_cuda
def test_cuda_graph_replay_equals_eager() -> None:
    w = random_weight("Q4_K", 256, 512, seed=3).to("cuda")
    x = torch.randn(2, 512, device="cuda", dtype=torch.bfloat16)
    eager = qmm.qmatmul(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = qmm.qmatmul(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(y, qmm.qmatmul(x, w))
    assert not torch.equal(y, eager)


@needs_cuda
@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_embedding_row_gather_captures_in_a_cuda_graph(qtype: str) -> None:
    """The quantized embedding dequantizes its rows with torch ops inside the decode graph: none of them may
    copy from the host."""
    w = random_weight(qtype, 64, block(qtype) * 2, seed=13).to("cuda")
    ids = torch.tensor([5, 0, 63], device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rows = w.rows(ids, torch.bfloat16)
    ids.copy_(torch.tensor([1, 2, 3]))
    graph.replay()
    assert torch.equal(rows, w.dequantize(torch.bfloat16)[1:4])


@needs_cuda
def test_quantized_model_on_cuda_matches_dense_and_graphs_match_eager(tiny_gguf) -> None:
    """A tiny Q4_K_M-style model (Q4_K with Q6_K attn_v / ffn_down) held quantized vs dequantized at load, and
    its CUDA-graph decode vs eager decode."""
    from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
    from lucebox.engine.runtime.sampler import SamplingParams
    from lucebox.engine.weights.loader import load_model

    path = tiny_gguf("qwen3", "Q4_K", layer_qtypes=(("attn_v", "Q6_K"), ("ffn_down", "Q6_K")), embed_qtype="Q4_K")
    ids = list(range(3, 60))

    def engine(quantized: bool, graphs: bool) -> LLMEngine:
        loaded = load_model(path, device="cuda", dtype=torch.bfloat16, quiet=True,
                            weights="quantized" if quantized else "dense")
        return LLMEngine(loaded, EngineConfig(device="cuda", dtype="bfloat16", kv_tokens=2048, cuda_graphs=graphs))

    quant = engine(True, True)
    assert quant.loaded.model.blk[0].ffn_down.qtype == "Q6_K"
    dense = engine(False, True)
    a, b = quant.score(ids), dense.score(ids)
    assert rel_err(a, b.double()) < 2e-2
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    assert quant.generate([ids], params) == engine(True, False).generate([ids], params)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_a_dense_copy_serves_the_rows_the_blocks_do_not(qtype: str, monkeypatch) -> None:
    """qmatmul of a weight held both ways (--weights both): rows up to SMALL_BM on a tuned shape run the int8
    kernels on the blocks (the blocks-only result, bit for bit), more rows (or an untuned shape) run cuBLAS on the
    dense copy (x @ dense.T, bit for bit), into a column slice and with a bias too; int8_x follows."""
    w = random_weight(qtype, 64, 512).to(DEVICE)
    both = w.with_dense()
    assert torch.equal(both.dense, w.dequantize(DTYPE))
    monkeypatch.setattr(linear, "ON_CPU", True)
    monkeypatch.setattr(qmm, "TUNED", {("gemv", qtype, 64, 512): (4, 16, 1, 2, "q8x"),
                                       ("small", qtype, 64, 512): (32, 1, 4, 2, "q8x")})
    bias = torch.randn(64, device=DEVICE, dtype=DTYPE)
    for m in (1, 3, qmm.SMALL_BM, qmm.SMALL_BM + 1, 40):
        x = torch.randn(m, 512, device=DEVICE, dtype=DTYPE)
        y = linear.qlinear(x, both)
        dense = m > qmm.SMALL_BM
        assert qmm.dense_serves(m, both) is dense and qmm.int8_x(m, both) is not dense
        assert torch.equal(y, x @ both.dense.T if dense else linear.qlinear(x, w)), m
        out = torch.zeros(m, 100, device=DEVICE, dtype=DTYPE)
        linear.qlinear(x, both, out=out[:, 10:74])
        assert torch.equal(out[:, 10:74], y)
        if dense:
            assert torch.equal(linear.qlinear(x, both, bias), torch.addmm(bias, x, both.dense.T))
    monkeypatch.setattr(qmm, "TUNED", {})  # an untuned shape: the copy at every row count
    assert qmm.dense_serves(1, both) and not qmm.dense_serves(1, w)


@needs_cuda
def test_weights_both_runs_few_rows_on_the_blocks_and_many_on_the_dense_copy(tiny_gguf, monkeypatch) -> None:
    """`--weights both` (the blocks and a dense copy; opt-in until this test has passed on a GPU): decode rows
    (up to SMALL_BM, tuned shapes) run the int8 kernels on the blocks, giving the blocks-only engine's tokens and
    logits exactly;
    prefill and bigger batches run cuBLAS on the dense copy (no int8 launch and no dequantize into scratch at more
    than SMALL_BM rows), within bf16 tolerance of the dense engine."""
    from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
    from lucebox.engine.runtime.sampler import SamplingParams
    from lucebox.engine.weights.loader import load_model

    path = tiny_gguf("qwen3", "Q4_K", hidden_size=512, layer_qtypes=(("attn_v", "Q6_K"), ("ffn_down", "Q6_K")))
    tuned = {}

    def engine(weights: str) -> LLMEngine:
        loaded = load_model(path, device="cuda", dtype=torch.bfloat16, quiet=True, weights=weights)
        for m in loaded.model.modules():  # every weight on the int8 kernels at 1 and up to SMALL_BM rows
            if getattr(m, "qtype", None) in qmm.WORD_TYPES:
                tuned[("gemv", m.qtype, *m.quant.shape)] = (4, 1, 1, 2, "q8x")
                tuned[("small", m.qtype, *m.quant.shape)] = (32, 1, 4, 2, "q8x")
        monkeypatch.setattr(qmm, "TUNED", tuned)
        return LLMEngine(loaded, EngineConfig(device="cuda", dtype="bfloat16", kv_tokens=2048))

    quant, dense, both = engine("quantized"), engine("dense"), engine("both")
    w = both.loaded.model.blk[0].ffn_down.quant
    assert w.dense is not None and w.qtype == "Q6_K"
    assert [qmm.dense_serves(m, w) for m in (1, 2, qmm.SMALL_BM, qmm.SMALL_BM + 1, 64)] == [False] * 3 + [True] * 2
    assert not qmm.int8_x(qmm.SMALL_BM + 1, w) and qmm.int8_x(1, w)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [[5], [77]]  # one-token prompts: every step of both engines runs the blocks
    assert both.generate(prompts[:1], params) == quant.generate(prompts[:1], params)
    assert both.generate(prompts, params) == quant.generate(prompts, params)  # two rows: the int8 tiles
    long = list(range(3, 60))
    rows: list[int] = []
    launch = qmm._launch_words

    def counted(x, *args, **kwargs):
        rows.append(x.shape[0])
        return launch(x, *args, **kwargs)

    monkeypatch.setattr(qmm, "_launch_words", counted)
    monkeypatch.setattr(qmm, "dequantize_rows", None)  # the blocks-only prefill path: never taken here
    a, b = both.score(long), dense.score(long)
    assert all(m <= qmm.SMALL_BM for m in rows)  # the 57 rows went to the dense copy
    assert rel_err(a, b.double()) < 1e-2


@needs_cuda
def test_programmatic_dependent_launch_changes_no_token(tiny_gguf, monkeypatch) -> None:
    """Decode steps whose kernels overlap (engine/kernels/pdl.py: at one row the norms, RoPE, attention and int8
    gemvs launch early, the gemvs prefetching their weights before they wait) give the tokens and logits of the
    same engine with PDL off, in CUDA graphs and eagerly; two rows launch as before."""
    from lucebox.engine.kernels import pdl
    from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
    from lucebox.engine.runtime.sampler import SamplingParams
    from lucebox.engine.weights.loader import load_model

    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("no programmatic dependent launch on this GPU")
    x = torch.zeros(1, device="cuda")
    assert pdl.launch(x, 1) == {"PDL": True, "launch_pdl": True} and pdl.launch(x, 2) == {}
    monkeypatch.setenv("LUCEBOX_PDL", "0")
    assert pdl.launch(x, 1) == {}
    path = tiny_gguf("qwen3", "Q4_K", hidden_size=512, layer_qtypes=(("attn_v", "Q6_K"), ("ffn_down", "Q6_K")))
    tuned = {}

    def engine(on: bool, graphs: bool) -> LLMEngine:
        monkeypatch.setenv("LUCEBOX_PDL", "1" if on else "0")
        loaded = load_model(path, device="cuda", dtype=torch.bfloat16, quiet=True, weights="quantized")
        for m in loaded.model.modules():  # every weight on the int8 kernels (the ones that prefetch), split in two
            if getattr(m, "qtype", None) in qmm.WORD_TYPES:
                tuned[("gemv", m.qtype, *m.quant.shape)] = (4, 1, 1, 2, "q8x")
                tuned[("small", m.qtype, *m.quant.shape)] = (32, 1, 4, 2, "q8x")
        monkeypatch.setattr(qmm, "TUNED", tuned)
        return LLMEngine(loaded, EngineConfig(device="cuda", dtype="bfloat16", kv_tokens=2048, cuda_graphs=graphs))

    params = SamplingParams(max_tokens=32, ignore_eos=True)
    prompts = [list(range(3, 40)), list(range(50, 61))]
    off = engine(False, True)
    want = [off.generate([p], params)[0] for p in prompts]
    batched = off.generate(prompts, params)  # two rows: the int8 tiles
    for graphs in (True, False):
        on = engine(True, graphs)
        assert [on.generate([p], params)[0] for p in prompts] == want
        assert on.generate(prompts, params) == batched
        assert torch.equal(on.score(prompts[1] + want[1]), off.score(prompts[1] + want[1]))


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_dequantize_rows_kernel_matches_torch(qtype: str) -> None:
    w = random_weight(qtype, 40, block(qtype) * 5, seed=11).to(DEVICE)
    got = qmm.dequantize_rows(w, 3, 37, torch.float32)
    ref = w.dequantize()[3:37]
    assert torch.allclose(got, ref, rtol=1e-6, atol=0)  # exact but for fused multiply-adds


@needs_cuda
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q4_1"])
def test_prefill_path_in_bounded_slices(qtype: str, monkeypatch) -> None:
    monkeypatch.setattr(qmm, "SCRATCH_ELEMS", 300 * 512)  # force several slices
    w = random_weight(qtype, 1000, 512, seed=12).to("cuda")
    x = torch.randn(qmm.PREFILL_ROWS + 7, 512, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(1000, device="cuda", dtype=torch.bfloat16)
    assert rel_err(qmm.qmatmul(x, w, bias), reference(x, w, bias)) < TOL


WORD_CONFIGS = [(1, 1, 1, 1), (4, 2, 4, 1), (16, 1, 4, 4), (8, 2, 2, 2)]


@pytest.mark.skipif(CUDA, reason="on the H200 (triton 3.6) some configs miscompile (cfg3 Q6_K m=5 fails): serving only "
                    "uses configs the start-up warm-up checked against the reference (test_warm_up_never_keeps_...)")
@pytest.mark.parametrize("qtype", list(qmm.WORD_TYPES))
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("cfg", WORD_CONFIGS)
def test_word_kernels_every_config_and_split(qtype: str, m: int, cfg, monkeypatch) -> None:
    """The word-wise gemv / small-batch kernels (Q4_K, Q6_K, Q8_0) in every launch config, split-K included
    (fp32 partials summed by a second kernel), with a bias: Q6_K / Q8_0 rows of an even number of blocks, so
    every other block starts 2 bytes into a word and is funnel-shifted."""
    n, k = 40, block(qtype) * 4
    w = random_weight(qtype, n, k, seed=m).to(DEVICE)
    if cfg is not None and m > 1:
        cfg = (16 * cfg[0], *cfg[1:])
    x = torch.randn(m, k, device=DEVICE).to(DTYPE)
    bias = torch.randn(n, device=DEVICE).to(DTYPE)
    out = torch.full((m, n), float("nan"), device=DEVICE, dtype=DTYPE)
    qmm._launch_words(x, w, bias, out, cfg)
    assert rel_err(out, reference(x, w, bias)) < TOL


@pytest.mark.parametrize("qtype", list(qmm.WORD_TYPES))
def test_word_gemv_reads_bf16_activations_as_word_pairs(qtype: str) -> None:
    """bf16 x is loaded 4 columns per 8-byte word and widened by shifts; the result matches x's exact product
    (rounded once, to the bf16 output)."""
    n, k = 24, block(qtype) * 2
    w = random_weight(qtype, n, k, seed=4).to(DEVICE)
    x = torch.randn(1, k, device=DEVICE).to(torch.bfloat16)
    y = qmm.qmatmul(x, w)
    assert y.dtype == torch.bfloat16
    assert rel_err(y, reference(x, w)) < 1.5e-2


@needs_cuda
def test_warm_up_tunes_checked_configs_and_qmatmul_uses_them() -> None:
    shapes = [("Q4_K", 512, 1024), ("Q6_K", 256, 2048), ("Q2_K", 256, 256)]
    tuned = qmm.warm_up(shapes)
    assert set(tuned) == {(kind, q, n, k) for q, n, k in shapes[:2] for kind in ("gemv", "small", "wide")}
    assert all(qmm.TUNED[key] == cfg for key, cfg in tuned.items())
    for q, n, k in shapes[:2]:
        assert tuned["wide", q, n, k] == tuned["small", q, n, k]  # the 16-row config, checked at 32 rows
        w = random_weight(q, n, k, seed=5).to("cuda")
        for m in (1, 16, 23, 32):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            assert rel_err(qmm.qmatmul(x, w), reference(x, w)) < TOL


def test_word_kernels_serve_only_shapes_warm_up_checked_on_cuda(monkeypatch) -> None:
    """On the CPU (interpreter) the word-wise kernels always serve; on CUDA only a shape warm_up checked
    against the exact reference does (some configs compiled to wrong results there), others keep the older
    kernels."""
    w = random_weight("Q4_K", 32, 512, seed=6).to(DEVICE)
    x = torch.randn(1, 512, device=DEVICE).to(DTYPE)
    out = torch.empty(1, 32, device=DEVICE, dtype=DTYPE)
    monkeypatch.setattr(qmm, "TUNED", {})
    assert qmm._word_ok(x, w, out) is (not CUDA)
    qmm.TUNED["gemv", "Q4_K", 32, 512] = qmm.GEMV_DEFAULT["Q4_K"]
    assert qmm._word_ok(x, w, out)
    assert not qmm._word_ok(torch.randn(2, 512, device=DEVICE).to(DTYPE), w, torch.empty(2, 32, device=DEVICE,
                                                                                       dtype=DTYPE)) or not CUDA


def test_warm_up_never_keeps_a_config_that_computes_wrong(monkeypatch) -> None:
    """warm_up checks every candidate against the exact reference before timing it: a config whose result is
    wrong (as some compiled to on the H200) is dropped even when it is the fastest. Runs on the CPU too (the
    interpreter, with the timer stubbed: triton's do_bench_cudagraph needs CUDA)."""
    import triton.testing

    good, bad = (4, 1, 1, 1), (1, 1, 1, 1)
    real = qmm._launch_words

    def launch(x, w, bias, out, cfg=None):
        real(x, w, bias, out, cfg)
        if cfg == bad:
            out[:, 1::2] = 0  # the failure seen on the GPU: every other row lost

    times = {good: 2.0, bad: 1.0}
    monkeypatch.setattr(qmm, "_launch_words", launch)
    monkeypatch.setattr(qmm, "GEMV_CANDIDATES", [bad, good])
    monkeypatch.setattr(qmm, "Q8X_CANDIDATES", {})
    monkeypatch.setattr(qmm, "SMALL_CANDIDATES", [bad])
    monkeypatch.setattr(qmm, "SMALL_Q8X_CANDIDATES", {})
    monkeypatch.setattr(qmm, "TUNED", {})
    calls = []
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, **kw: (calls.append(1), fn(), times[
        next(c for c in (good, bad) if fn.__defaults__[0] == c)])[-1])
    tuned = qmm.warm_up([("Q6_K", 24, 512)], device=DEVICE, dtype=DTYPE)
    assert tuned == {("gemv", "Q6_K", 24, 512): good}  # the only small candidate was wrong: none kept
    assert qmm.TUNED == tuned and len(calls) == 1


def quantize_like_the_kernel(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x's 32-column blocks as quantize_x makes them, in its fp32 arithmetic (a double product can round a value
    near a half the other way): (absmax [k/32, 1], int8 values [k/32, 32]), both as float64."""
    xs = x.float().cpu().view(k // 32, 32)
    amax = xs.abs().amax(-1, keepdim=True)
    v = xs * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return amax.double(), torch.where(v >= 0, v + 0.5, v - 0.5).trunc().double()


def i8_reference(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """The int8-activation Q4_K gemv's arithmetic in torch: x quantized per 32 columns (absmax / 127, rounded
    half away from zero), integer dots with the nibbles, the block scales, the dmin term on the exact x."""
    from lucebox.engine.weights.quant.dequant import FORMATS

    blocks = w.data.cpu().view(-1, FORMATS["Q4_K"][1]).numpy()
    n, k = w.shape
    d = torch.from_numpy(blocks[:, 0:2].copy().view("<f2").astype("float64")).view(n, k // 256, 1)
    dmin = torch.from_numpy(blocks[:, 2:4].copy().view("<f2").astype("float64")).view(n, k // 256, 1)
    sc_raw = torch.from_numpy(blocks[:, 4:16].astype("int64")).view(n, k // 256, 12)
    qs = torch.from_numpy(blocks[:, 16:].astype("int64")).view(n, k // 256, 4, 32)
    sc = torch.zeros(n, k // 256, 8, dtype=torch.int64)
    mn = torch.zeros_like(sc)
    for j in range(8):  # ggml's get_scale_min_k4
        if j < 4:
            sc[..., j], mn[..., j] = sc_raw[..., j] & 63, sc_raw[..., j + 4] & 63
        else:
            sc[..., j] = (sc_raw[..., j + 4] & 0xF) | ((sc_raw[..., j - 4] >> 6) << 4)
            mn[..., j] = (sc_raw[..., j + 4] >> 4) | ((sc_raw[..., j] >> 6) << 4)
    q = torch.stack([qs & 15, qs >> 4], dim=3).reshape(n, k // 256, 8, 32)  # sub-block 2c + s
    xs = x.double().cpu().view(k // 256, 8, 32)
    amax, xq = quantize_like_the_kernel(x, k)
    amax, xq = amax.view(k // 256, 8, 1), xq.view(k // 256, 8, 32)
    dots = (q.double() * xq).sum(-1)  # [n, blocks, 8]
    y = (d * sc * dots * (amax[..., 0] / 127.0) - dmin * mn * xs.sum(-1)).sum((1, 2))
    return y[None]


def i8_reference_q6k(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """The int8-activation Q6_K gemv's arithmetic: every weight is d * scale * (q - 32), exact in the dequantized
    weight, so the kernel's sum is sum over 32-column blocks of dx * sum_j w_j * xq_j."""
    n, k = w.shape
    amax, xq = quantize_like_the_kernel(x, k)
    dense = w.dequantize().double().cpu().view(n, k // 32, 32)
    return ((dense * xq).sum(-1) * (amax[:, 0] / 127.0)).sum(-1)[None]


@pytest.mark.parametrize("qtype,cfg", [(q, c) for q in ("Q4_K", "Q6_K") for c in [
    (4, 2, 1, 1, "q8x"), (8, 4, 4, 2, "q8x"), (16, 1, 2, 4, "q8x"), (1, 8, 1, 1, "q8x"), (2, 4, 2, 4, "q8x")]] + [
    ("Q8_0", (4, 1, 1, 1, "q8x")), ("Q8_0", (8, 2, 4, 2, "q8x"))])
def test_int8_activation_gemv(qtype: str, cfg) -> None:
    """The Q4_K / Q6_K / Q8_0 gemvs with int8 activations (dp4a on CUDA, the same sum by shifts under the
    interpreter) equal their own arithmetic done in torch, and stay within bf16-like error of the exact product;
    split-K and bias; rows not a multiple of the rows a program takes; Q6_K / Q8_0 rows of an even number of
    blocks (every other block 2 bytes into a word) and of an odd number (every other row 2 bytes into a word)."""
    n = 40
    for k in (256 * 4, 256 * 3):
        w = random_weight(qtype, n, k, seed=11).to(DEVICE)
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).to(DEVICE, DTYPE)  # fixed: no ties
        x[0, 64:96] = 0.0  # an all-zero sub-block: scale 0, no division by zero
        out = torch.full((1, n), float("nan"), device=DEVICE, dtype=DTYPE)
        qmm._launch_words(x, w, None, out, cfg)
        own = i8_reference(x, w) if qtype == "Q4_K" else i8_reference_q6k(x, w)  # Q6_K's form holds for Q8_0
        assert rel_err(out, own.to(out.device)) < (1e-2 if CUDA else 1e-6)
        assert rel_err(out, reference(x, w)) < 1.5e-2
        bias = torch.randn(n, device=DEVICE).to(DTYPE)
        qmm._launch_words(x, w, bias, out, cfg)
        assert rel_err(out, reference(x, w, bias)) < 1.5e-2


def test_warm_up_keeps_the_int8_gemv_where_it_is_faster(monkeypatch) -> None:
    """For Q4_K at one row the tuner times the int8-activation gemv beside the float ones and keeps the faster
    (timer stubbed on the CPU); qmatmul then runs it."""
    import triton.testing

    flt, i8 = (4, 1, 1, 1), (4, 2, 1, 1, "q8x")
    monkeypatch.setattr(qmm, "GEMV_CANDIDATES", [flt])
    monkeypatch.setattr(qmm, "Q8X_CANDIDATES", {"Q4_K": [i8]})
    monkeypatch.setattr(qmm, "SMALL_CANDIDATES", [])
    monkeypatch.setattr(qmm, "SMALL_Q8X_CANDIDATES", {})
    monkeypatch.setattr(qmm, "TUNED", {})
    times = {flt: 2.0, i8: 1.0}
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, **kw: (fn(), times[fn.__defaults__[0]])[-1])
    assert qmm.warm_up([("Q4_K", 24, 512)], device=DEVICE, dtype=DTYPE) == {("gemv", "Q4_K", 24, 512): i8}
    w = random_weight("Q4_K", 24, 512, seed=12).to(DEVICE)
    x = torch.randn(1, 512, device=DEVICE).to(DTYPE)
    assert rel_err(qmm.qmatmul(x, w), i8_reference(x, w).to(DEVICE)) < (1e-2 if CUDA else 1e-6)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("m", [2, 5, 16, 23, 32])
@pytest.mark.parametrize("cfg", [(16, 1, 4, 1, "q8x"), (32, 1, 4, 2, "q8x"), (16, 2, 4, 2, "q8x")])
def test_int8_small_batch(qtype: str, m: int, cfg) -> None:
    """The Q4_K / Q6_K / Q8_0 small-batch kernels with int8 activations (int8 tensor-core dots) equal, row by row, the
    int8-activation arithmetic in torch, and stay within bf16-like error of the exact product; split-K, bias,
    rows not a multiple of the program's, two super-blocks a loop step (NB 2), and past 16 rows one 32-row tile
    (a DDTree's 23 verified rows)."""
    n, k = 40, 256 * 4
    w = random_weight(qtype, n, k, seed=13).to(DEVICE)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE, DTYPE)  # fixed: not the global RNG
    x[0, 64:96] = 0.0
    out = torch.full((m, n), float("nan"), device=DEVICE, dtype=DTYPE)
    qmm._launch_words(x, w, None, out, cfg)
    own = torch.cat([(i8_reference if qtype == "Q4_K" else i8_reference_q6k)(x[i], w) for i in range(m)])
    assert rel_err(out, own.to(out.device)) < (1e-2 if CUDA else 1e-6)
    assert rel_err(out, reference(x, w)) < 1.5e-2
    bias = torch.randn(n, device=DEVICE).to(DTYPE)
    qmm._launch_words(x, w, bias, out, cfg)
    assert rel_err(out, reference(x, w, bias)) < 1.5e-2


@pytest.mark.parametrize("sweep", [False, True])
def test_bench_qmm_measures_every_matrix_type_and_row_count(monkeypatch, tmp_path, sweep) -> None:
    """`bench qmm`'s loop on a tiny shape (the kernels under the interpreter on the CPU, the graph timer stubbed:
    float kernels 2 ms, int8 ones 1 ms, cuBLAS 3 ms): a row per (matrix, type, rows) with both families timed,
    the int8 kernel's bandwidth, and the JSON; `--sweep` adds the wider grid's best at one row."""
    import argparse
    import json

    import triton.testing

    from lucebox.bench import qmm as bench_qmm

    monkeypatch.setattr(qmm, "GEMV_CANDIDATES", [(4, 1, 1, 1)])
    monkeypatch.setattr(qmm, "Q8X_CANDIDATES", {"Q4_K": [(4, 2, 1, 1, "q8x")], "Q6_K": [(4, 2, 1, 1, "q8x")],
                                                "Q8_0": [(4, 1, 1, 1, "q8x")]})
    monkeypatch.setattr(qmm, "SMALL_CANDIDATES", [(16, 1, 4, 1)])
    monkeypatch.setattr(qmm, "SMALL_Q8X_CANDIDATES", {"Q4_K": [(16, 1, 4, 1, "q8x")], "Q6_K": [(16, 1, 4, 1, "q8x")]})
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, **kw: (fn(), {4: 2.0, 5: 1.0}.get(
        len(fn.__defaults__[0]) if fn.__defaults__ and isinstance(fn.__defaults__[0], tuple) else 0, 3.0))[-1])
    mats = [m for m in bench_qmm.matrices("tiny", 512) if m[0] == "attn_q"]
    torch.manual_seed(0)  # random_weight's blocks: one 256-column Q4_K row can cancel to > 2% int8 error (1 in ~20)
    out = tmp_path / "qmm.json"
    monkeypatch.setattr(bench_qmm, "sweep_configs", lambda qtype: [(4, 2, 1, 1, "q8x"), (8, 1, 1, 1, "q8x")])
    args = argparse.Namespace(shape="tiny", json=out, sweep=sweep)
    assert bench_qmm.run(args, ["Q4_K", "Q6_K", "Q8_0"], [1, 2], mats, torch.device(DEVICE)) == 0
    results = json.loads(out.read_text())["results"]
    assert len(results) == 3 * 2
    for r in results:
        assert r["cublas_bf16_us"] == 3000.0
        assert r["float_us"] == 2000.0
        assert r["int8_us"] == (None if r["qtype"] == "Q8_0" and r["rows"] == 2 else 1000.0)
        if not sweep:
            assert "sweep" not in r
        elif r["rows"] == 1:  # the grid's config the tuner did not try (Q8_0's (4, 2, ...) is new to it as well)
            assert r["sweep"]["us"] == 1000.0 and tuple(r["sweep"]["config"][:4]) in {(8, 1, 1, 1), (4, 2, 1, 1)}
        else:
            assert r["sweep"] is None
    assert bench_qmm.MAX_ROWS == qmm.SMALL_MAX  # --rows takes every row count a small-batch kernel serves


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_quantize_x_with_act_equals_act_mul_then_quantize(act) -> None:
    """`quantize_x(gate_up, act)` (the MoE down's input in one launch) is `quantize_x(act_mul(gate_up, act))`
    bit for bit: the same rounding to the activation dtype before the int8 blocks, 3 rows of a 96-wide row."""
    from lucebox.engine.kernels import triton_ops

    gate_up = (torch.randn(3, 192, generator=torch.Generator().manual_seed(4)) * 3).to(DEVICE, DTYPE)
    ours = qmm.quantize_x(gate_up, act)
    ref = qmm.quantize_x(triton_ops.act_mul(gate_up, act).contiguous())
    assert ours.shape == ref.shape == (3, 96 // 4 + 96 // 8)
    assert torch.equal(ours, ref)
    assert not torch.equal(ours, qmm.quantize_x(gate_up[:, :96].contiguous()))  # the act was applied


@pytest.mark.parametrize("m", [1, 5])
def test_one_int8_workspace_serves_concat_parts_and_the_ffn_down(monkeypatch, m: int) -> None:
    """Where the tuner chose the int8-activation kernels, ConcatLinear quantizes its input once for all its parts
    (q, k and v of different types) and a dense FFN's down projection takes quantize_x(gate_up, act)'s workspace
    (int8_workspace): the same outputs, bit for bit, as one workspace per call from the activated rows. Where a
    weight's kernel reads x (a float config) no workspace is made for it alone, a module offered one reads x, and
    qmatmul refuses one."""
    from lucebox.engine.kernels import triton_ops
    from lucebox.engine.models.layers import ConcatLinear, Linear, down_of_gate_up, int8_input

    monkeypatch.setattr(linear, "ON_CPU", not CUDA)
    monkeypatch.setattr(triton_ops, "ON_CPU", not CUDA)
    k = 1024

    def quantized(qtype: str, n: int, seed: int) -> Linear:
        lin = Linear(k, n)
        lin.set_quant(random_weight(qtype, n, k, seed=seed).to(DEVICE), DTYPE)
        return lin

    parts = [quantized("Q4_K", 48, 21), quantized("Q6_K", 16, 22)]
    down = quantized("Q4_K", 40, 23)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(DEVICE, DTYPE)
    gate_up = torch.randn(m, 2 * k, generator=gen).to(DEVICE, DTYPE)
    assert linear.int8_workspace(x, [p.quant for p in parts]) is None  # nothing tuned: the kernels read x
    assert down_of_gate_up(down, gate_up, "silu") is None
    for w in [p.quant for p in parts] + [down.quant]:
        monkeypatch.setitem(qmm.TUNED, (qmm._kind(m), w.qtype, *w.shape), (16, 1, 4, 1, "q8x"))
    ours = ConcatLinear(parts)(x)
    assert torch.equal(ours, torch.cat([qmm.qmatmul(x, p.quant) for p in parts], dim=1))
    # One part on a kernel that reads x (the tuner's choice for its shape): the workspace is still made for the
    # other and offered to both; the x reader ignores it.
    monkeypatch.setitem(qmm.TUNED, (qmm._kind(m), "Q6_K", 16, k), (4, 1, 1, 1) if m == 1 else (16, 1, 4, 1))
    ws = int8_input(x, [ConcatLinear(parts)])
    assert ws is not None and torch.equal(parts[1](x, ws=ws), qmm.qmatmul(x, parts[1].quant))
    assert torch.equal(ConcatLinear(parts)(x), torch.cat([qmm.qmatmul(x, p.quant) for p in parts], dim=1))
    assert int8_input(x, [parts[1]]) is None  # its only reader reads x
    activated = triton_ops.act_mul(gate_up, "silu").contiguous()
    assert torch.equal(down_of_gate_up(down, gate_up, "silu"), qmm.qmatmul(activated, down.quant))
    own = torch.cat([i8_reference(activated[i], down.quant) for i in range(m)])  # the int8 arithmetic in torch
    assert rel_err(down_of_gate_up(down, gate_up, "silu"), own.to(DEVICE)) < (1e-2 if CUDA else 1e-6)
    # A tensor-parallel shard of down (RowParallelLinear) still sums its partial product over the ranks: the
    # fused path goes through the module. The ranks stand in as a sum that doubles (two equal shards).
    from lucebox.engine.parallel.shard import RowParallelLinear

    class TwoRanks:
        def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
            return t * 2

    shard = RowParallelLinear(k, 40)
    shard.__dict__["comm"] = TwoRanks()
    shard.set_quant(down.quant, DTYPE)
    assert torch.equal(down_of_gate_up(shard, gate_up, "silu"), 2 * qmm.qmatmul(activated, down.quant))
    monkeypatch.setitem(qmm.TUNED, (qmm._kind(m), "Q4_K", 40, k), (16, 1, 4, 1))  # a float config: reads x
    assert down_of_gate_up(down, gate_up, "silu") is None
    with pytest.raises(ValueError, match="int8 workspace"):
        qmm.qmatmul(x, down.quant, ws=qmm.quantize_x(x))


@pytest.mark.parametrize("arch", ["qwen3", "qwen35", "qwen3moe", "qwen35moe"])
def test_norms_write_the_int8_input_of_the_projections_that_read_it(tiny_gguf, tmp_path, monkeypatch,
                                                                   arch: str) -> None:
    """With the int8-activation kernels chosen for every weight (as the GPU's tuner chooses them), a norm's kernel
    also writes its output's int8 workspace for the projections that read it (layers.int8_input): a Qwen3 Q4_K_M
    layer's q|k|v (q|k one Q4_K weight beside a Q6_K v: two kernels) and gate|up, a Qwen3.5 Gated DeltaNet
    layer's qkv, z gate, beta|alpha and (its gated output norm's) ssm_out, its attention layer's q, k and v; a
    mixture of experts' routed experts (per-pair gemvs) and shared expert's gate and up. The logits equal, bit
    for bit, those of the same kernels quantizing x themselves, with fewer quantize_x launches."""
    from lucebox.engine.kernels import triton_moe, triton_ops
    from lucebox.engine.models import decoder, moe, qwen35
    from lucebox.engine.models.layers import ConcatLinear
    from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
    from lucebox.engine.weights.loader import load_model
    from tests.fixtures.tiny_models import write_tiny_qwen35_gguf

    if arch == "qwen3":
        # hidden 512: a Q6_K row of 2 blocks is 420 bytes, a whole number of words (the int8 kernels' rows)
        path = tiny_gguf("qwen3", "Q4_K", hidden_size=512, layer_qtypes=(("attn_v", "Q6_K"), ("ffn_down", "Q6_K")))
    elif arch == "qwen3moe":  # the routed experts' per-pair gemvs read the pre-FFN norm's int8 rows
        path = tiny_gguf("qwen3moe", "Q8_0")
    else:
        pytest.importorskip("transformers.models.qwen3_5")
        # value heads of 32: the gated output norm writes whole int8 blocks a head (ssm_out's input); the MoE
        # model's shared expert is offered the norm's rows for its gate and up
        path = write_tiny_qwen35_gguf(tmp_path / "hybrid.gguf", qtype="Q8_0", linear_value_head_dim=32,
                                      moe=arch == "qwen35moe")
    for module in (linear, triton_ops, triton_moe):
        monkeypatch.setattr(module, "ON_CPU", not CUDA)
    loaded = load_model(path, device=DEVICE, dtype=DTYPE, quiet=True, weights="quantized")
    model = loaded.model
    if arch == "qwen3":
        assert [(p.qtype, p.out_features) for p in model.blk[0].attn_qkv.parts] == [("Q4_K", 4 * 128 + 2 * 128),
                                                                                     ("Q6_K", 2 * 128)]
        assert isinstance(model.blk[0].attn_qkv, ConcatLinear)
    tuned = {}
    for m in model.modules():
        if getattr(m, "qtype", None) in qmm.WORD_TYPES:
            shape = (m.qtype, *m.quant.shape)
            tuned[("gemv", *shape)] = qmm.Q8X_CANDIDATES[m.qtype][0]
            tuned[("small", *shape)] = qmm.SMALL_Q8X_CANDIDATES[m.qtype][0]
    monkeypatch.setattr(qmm, "TUNED", tuned)
    calls = []
    real = qmm.quantize_x
    for module in (qmm, triton_moe):
        monkeypatch.setattr(module, "quantize_x", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    e = LLMEngine(loaded, EngineConfig(device=DEVICE, dtype="float32" if not CUDA else "bfloat16", kv_tokens=512))
    ids = list(range(3, 8))
    with torch.no_grad():
        ours = e.score(ids)
        fused_calls = len(calls)
        for module in (decoder, qwen35, moe):
            monkeypatch.setattr(module, "int8_input", lambda *a, **kw: None)
        calls.clear()
        theirs = e.score(ids)
    assert torch.equal(ours, theirs)
    # left: the attention output's (a prefill's attention quantizes its output after; a decode step's merge kernel
    # writes it; a DeltaNet layer's output norm writes ssm_out's), the FFN down's (its activation fused in; routed
    # experts on the per-pair gemvs only) and a shared expert's down
    def left(b: torch.nn.Module) -> int:
        experts = b.moe and [p.quant if p.qtype else p.weight for p in (b.moe.ffn_gate_exps, b.moe.ffn_up_exps)]
        down = b.moe is None or triton_moe.pairs_read_int8(len(ids), *experts)
        shared = b.moe is not None and hasattr(b.moe, "ffn_down_shexp")
        return (not isinstance(b, qwen35.DeltaNetBlock)) + down + shared

    assert fused_calls == sum(left(b) for b in model.blk) < len(calls)
