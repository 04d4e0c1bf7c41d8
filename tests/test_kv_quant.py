"""q8_0 KV cache (`--kv-dtype q8_0`): int8 K/V with one fp16 scale per (slot, KV head), packed in one tensor.

- quantize/dequantize: the error of every value is at most absmax(row) / 254 (half a step), zero rows stay 0;
- paged_attention writes the new rows quantized and every path reads the quantized cache: the SDPA
  reference equals attention over the dequantized cache (1e-5), and is within 0.05 (max abs, unit-normal
  q/k/v) of the fp32 cache; the Triton kernels (CUDA, or TRITON_INTERPRET=1 on the CPU) match the q8_0
  reference to the same 2e-4 as the float kernels do;
- the real SmolLM2 engine on the CPU: greedy tokens with q8_0 KV equal the fp32-KV tokens for the first 12
  (measured: four prompts agree for 13, 16, 48 and 48 tokens; 12 leaves a margin), and a prefix-cache hit
  (tier 0 blocks, RAM snapshots) gives the same tokens as a cold q8_0 run; snapshots keep the int8 form and
  the disk layout id names the KV dtype; DFlash over a q8_0 target keeps its drafter KV float;
- bytes per token: q8_0 holds 1.94x the tokens of bf16 (head_dim 64);
- `--kv-dtype` reaches the engine; a bad value is one line and exit 2.
"""

from __future__ import annotations

import os

import pytest
import torch

from lucebox import cli
from lucebox.cache.manager import CacheConfig
from lucebox.cache.snapshots import gather_kv, scatter_kv, snapshot_shape
from lucebox.chat.template import resolve_chat_template
from lucebox.engine.kernels import kv_quant, triton_attention
from lucebox.engine.kernels.attention import AttentionMetadata, attend_group, paged_attention
from lucebox.engine.models.config import ModelConfig
from lucebox.engine.runtime.kv_cache import KVCache, resolve_kv_dtype
from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.errors import LuceboxError
from tests.test_cache_async import TURN1, TURN2, render, run
from tests.test_paged_attention import DEVICE, KERNEL_CASES, Case

needs_kernel = pytest.mark.skipif(
    triton_attention.triton is None or (DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs triton on CUDA, or TRITON_INTERPRET=1 to run the kernels on the CPU",
)


# ----- quantize / dequantize -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_is_half_a_step(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 4, 64, generator=gen) * torch.logspace(-4, 3, 50)[:, None, None]
    x[3, 1] = 0.0  # a zero row
    x[7, 2, 5] = 1e4  # an outlier channel: its row's step is large
    x = x.to(dtype)
    packed = kv_quant.quantize(x)
    assert packed.dtype == torch.int8 and packed.shape == (50, 4, 66)
    assert packed[..., :64].abs().max() <= 127
    y = kv_quant.dequantize(packed, torch.float32)
    xf = x.float()
    # half a step, the scale rounded to fp16 (relative 2^-11; below fp16's normal range, 2^-25 absolute)
    bound = xf.abs().amax(-1, keepdim=True) / 254 * (1 + 2**-10) + 127 * 2**-25
    assert ((y - xf).abs() <= bound).all()
    big = xf.abs().amax(-1) > 1  # normal-range scales: the half-step bound alone
    assert ((y - xf).abs()[big] <= (xf.abs().amax(-1, keepdim=True) / 254 * (1 + 2**-10)).expand_as(xf)[big]).all()
    assert torch.equal(y[3, 1], torch.zeros(64))
    scale = kv_quant.scales(packed)
    torch.testing.assert_close(scale.float(), (xf.abs().amax(-1) / 127).half().float())
    # the fp16 view the kernels read: element head_dim // 2 of each row
    assert torch.equal(kv_quant.scale_view(packed)[..., 32], scale)


# ----- paged attention: write path and readers --------------------------------------------------------


def quantized_case(starts, q_len, page, tree, seed, hq=8, hkv=2, dim=64):
    """A random Case, its caches quantized (k8, v8) and dequantized again (kd, vd: the same values in fp32)."""
    case = Case(starts=starts, q_len=q_len, page=page, hq=hq, hkv=hkv, dim=dim, tree=tree, seed=seed)
    k8, v8 = kv_quant.quantize(case.k_cache), kv_quant.quantize(case.v_cache)
    return case, k8, v8, kv_quant.dequantize(k8, torch.float32), kv_quant.dequantize(v8, torch.float32)


@pytest.mark.parametrize("name", ["prefix 37 + chunk 29", "decode rows (the decode kernel)", "random trees"])
@pytest.mark.parametrize("window", [None, 24])
def test_paged_attention_writes_quantized_rows_and_reads_them(name, window):
    starts, q_len, page, tree = KERNEL_CASES[name]
    case, k8, v8, kd, vd = quantized_case(starts, q_len, page, tree, seed=len(name))
    new = torch.tensor([t[p // page] * page + p % page for s, t in zip(starts, case.tables)
                        for p in range(s, s + q_len)], device=DEVICE)
    k_cache, v_cache = k8.clone(), v8.clone()
    k_cache[new] = 0
    v_cache[new] = 0
    meta = AttentionMetadata(slot_mapping=new, page=page, groups=[case.group], window=window)
    out = paged_attention(case.q, case.k, case.v, k_cache, v_cache, meta, scale=64 ** -0.5,
                          sliding=window is not None)
    assert torch.equal(k_cache, k8) and torch.equal(v_cache, v8), "the new rows are written quantized"
    ref = attend_group(case.q, case.k, case.v, kd, vd, case.group, page, 64 ** -0.5, window, False)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    exact = case.run(window, kernel=False)  # the fp32 cache
    assert (out - exact).abs().max().item() < 0.05


def test_a_fresh_prompt_reads_the_quantized_cache():
    """No SDPA-over-new-rows shortcut for q8_0: a prompt attends to the same (quantized) K/V that a later chunk
    or a cache hit reads, so cached and uncached runs see one set of values."""
    case = Case(starts=[0], q_len=40, page=16, hq=4, hkv=2, dim=64, fresh=True, seed=4)
    k8, v8 = kv_quant.quantize(case.k_cache), kv_quant.quantize(case.v_cache)
    kd, vd = kv_quant.dequantize(k8, torch.float32), kv_quant.dequantize(v8, torch.float32)
    out = attend_group(case.q, case.k, case.v, k8, v8, case.group, 16, 0.125, None, False)
    case.group.fresh = False
    ref = attend_group(case.q, case.k, case.v, kd, vd, case.group, 16, 0.125, None, False)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("name", ["prefix 37 + chunk 29", "prefix 300 + chunk 40, block 256",
                                  "decode rows (the decode kernel)", "random trees"])
def test_kernels_read_q8_like_the_reference(name, window):
    starts, q_len, page, tree = KERNEL_CASES[name]
    case, k8, v8, kd, vd = quantized_case(starts, q_len, page, tree, seed=len(name))
    out = attend_group(case.q, case.k, case.v, k8, v8, case.group, page, 64 ** -0.5, window, True)
    ref = attend_group(case.q, case.k, case.v, kd, vd, case.group, page, 64 ** -0.5, window, False)
    assert (out - ref).abs().max().item() < 2e-4


@needs_kernel
def test_prefill_kernel_split_keys_and_gqa_on_q8():
    case, k8, v8, kd, vd = quantized_case([300, 7], 12, 16, False, seed=2, hq=8, hkv=1, dim=128)
    g = case.group
    ref = attend_group(case.q, case.k, case.v, kd, vd, g, 16, 128 ** -0.5, None, False)
    out = triton_attention.prefill_attention(case.q, k8, v8, g.block_tables, g.ctx_lens, g.q_pos, None, q_len=12,
                                             max_ctx=g.max_ctx, page=16, scale=128 ** -0.5, splits=2)
    assert (out - ref).abs().max().item() < 2e-4


@needs_kernel
def test_fused_rope_leaves_a_q8_cache_to_paged_attention():
    from lucebox.engine.kernels import triton_ops

    t, hq, hkv, dim = 5, 4, 2, 64
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(t, (hq + 2 * hkv) * dim, generator=gen).to(DEVICE)
    cos, sin = torch.rand(t, dim, generator=gen).to(DEVICE), torch.rand(t, dim, generator=gen).to(DEVICE)
    slots = torch.arange(3, 3 + t, device=DEVICE)
    k8 = torch.zeros(16, hkv, dim + 2, dtype=torch.int8, device=DEVICE)
    v8 = k8.clone()
    q, k, v = triton_ops.rope_qk_and_cache(qkv, cos, sin, k8, v8, slots, hq, hkv)
    kc, vc = torch.zeros(16, hkv, dim, device=DEVICE), torch.zeros(16, hkv, dim, device=DEVICE)
    q_ref, k_ref, v_ref = triton_ops.rope_qk_and_cache_ref(qkv, cos, sin, kc, vc, slots, hq, hkv)
    assert not k8.any() and not v8.any()
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(k, k_ref)
    torch.testing.assert_close(v, v_ref)


# ----- sizes -----------------------------------------------------------------------------------------


def test_bytes_per_token_counts_int8_and_scales():
    cfg = ModelConfig(arch="llama", name="t", vocab_size=10, hidden_size=576, intermediate_size=64, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, max_position=2048,
                      rope_theta=1e4)
    bf16 = KVCache.bytes_per_token(cfg, torch.bfloat16)
    q8 = KVCache.bytes_per_token(cfg, torch.bfloat16, "q8_0")
    assert q8 == 30 * 2 * 3 * (64 + 2)
    assert bf16 / q8 > 1.9
    kv = KVCache.create(cfg, 4, 16, torch.bfloat16, "cpu", kv_dtype="q8_0")
    assert kv.quantized and kv.kv_dtype == "q8_0" and kv.data.dtype == torch.int8
    assert kv.data.nbytes == q8 * 4 * 16
    assert resolve_kv_dtype("auto", torch.float32) == "float32"
    with pytest.raises(ValueError, match="bf16 model"):
        resolve_kv_dtype("bf16", torch.float32)
    with pytest.raises(ValueError, match="unknown KV dtype"):
        resolve_kv_dtype("q4", torch.float32)


# ----- the real engine ---------------------------------------------------------------------------------

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "List three colors: red,")
N_MATCH = 12


@pytest.fixture(scope="module")
def q8_engine(smollm2_path) -> LLMEngine:
    return LLMEngine.from_path(smollm2_path, EngineConfig(device="cpu", kv_tokens=2048, block_size=16,
                                                          cuda_graphs=False, kv_dtype="q8_0"), quiet=True)


@pytest.fixture(scope="module")
def template(q8_engine):
    tok = q8_engine.tokenizer
    return resolve_chat_template(gguf_template=q8_engine.loaded.chat_template, bos_token=tok.bos_token,
                                 eos_token=tok.eos_token)


def test_greedy_tokens_match_fp32_kv(smollm2_path, q8_engine):
    assert q8_engine.kv.data.dtype == torch.int8 and q8_engine.kv.data.shape[-1] == 66
    fp32 = LLMEngine.from_path(smollm2_path, EngineConfig(device="cpu", kv_tokens=512, cuda_graphs=False),
                               quiet=True)
    assert fp32.kv.data.dtype == torch.float32
    prompts = [fp32.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=N_MATCH, ignore_eos=True)
    want = fp32.generate(prompts, params)
    del fp32
    got = q8_engine.generate(prompts, params)
    assert got == want


def test_speculation_on_a_q8_target_keeps_the_drafter_kv_in_the_model_dtype(smollm2_path, q8_engine):
    """DFlash over a q8_0 target: the drafter's context KV (same blocks, its own tensor) stays float, and the
    greedy tokens equal plain q8_0 decoding."""
    from pathlib import Path

    draft = Path(__file__).resolve().parents[1] / "model_cards" / "drafters" / "smollm2-135m-instruct-dflash"
    assert (draft / "model.safetensors").exists(), "the shipped drafter is part of the repository"
    spec = LLMEngine.from_path(smollm2_path, EngineConfig(device="cpu", kv_tokens=512, cuda_graphs=False,
                                                          kv_dtype="q8_0", draft=str(draft)), quiet=True)
    assert spec.kv.data.dtype == torch.int8 and spec.spec.kv.data.dtype == torch.float32
    ids = [spec.tokenizer.encode(PROMPTS[0])]
    params = SamplingParams(max_tokens=N_MATCH, ignore_eos=True)
    assert spec.generate(ids, params) == q8_engine.generate(ids, params)
    assert spec.spec.stats.steps < N_MATCH, "drafts were accepted"


def test_a_prefix_cache_hit_with_q8_kv_changes_nothing(q8_engine, template, tmp_path):
    eng = q8_engine
    p1, p2 = render(eng, template, TURN1), render(eng, template, TURN2)
    cold1, cold2 = run(eng, p1).output_ids, run(eng, p2).output_ids  # no cache
    eng.enable_prefix_cache(CacheConfig(gpu=True, min_tokens=16), template)
    cache = eng.cache
    try:
        assert run(eng, p1).output_ids == cold1
        assert cache.poll() == 0
        warm = run(eng, p1)  # tier 0: the finished sequence's blocks
        assert warm.num_cached > 0 and warm.output_ids == cold1
        cache.index.clear()
        nxt = run(eng, p2)  # tier 1: the turn-boundary RAM snapshot of turn 1 (int8 + scales) scattered back
        assert nxt.num_cached >= 16 and cache.counters["prefix"].hits >= 1
        assert nxt.output_ids == cold2
    finally:
        cache.clear()
        cache.poll()
        eng.cache = eng.scheduler.cache = None
    # snapshots are the device form; a float snapshot does not fit a q8_0 cache
    seq_table = eng.kv.pool.allocate(2)
    try:
        snap = gather_kv(eng.kv, seq_table, 20)
        assert snap.dtype == torch.int8 and tuple(snap.shape) == snapshot_shape(eng.kv, 20)
        with pytest.raises(ValueError, match="does not fit"):
            scatter_kv(eng.kv, seq_table, snap[..., :64].float())
    finally:
        eng.kv.pool.decref(seq_table)


def test_the_disk_layout_names_the_kv_dtype(smollm2_path, q8_engine, template, tmp_path):
    """A disk file written with q8_0 KV is never loaded into an engine with another KV dtype: the layout id
    (the folder and every header) includes it."""
    from lucebox.cache.layout import layout_id

    q8_engine.enable_prefix_cache(CacheConfig(min_tokens=16, disk_dir=tmp_path), template)
    try:
        q8_layout = q8_engine.cache.disk.layout_id
    finally:
        q8_engine.cache.clear()
        q8_engine.cache.poll()
        q8_engine.cache.disk.close()
        q8_engine.cache = q8_engine.scheduler.cache = None
    mc = q8_engine.model_config
    args = dict(model_path=smollm2_path, block_size=16, n_ctx=q8_engine.n_ctx, template_sha1=template.sha1,
                num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, extra={})
    assert q8_layout == layout_id(kv_dtype="q8_0", **args)
    assert q8_layout != layout_id(kv_dtype=torch.float32, **args)
    assert q8_layout != layout_id(kv_dtype=torch.int8, **args)


# ----- the command line -----------------------------------------------------------------------------------


def test_the_flag_reaches_the_engine(smollm2_path, monkeypatch):
    """generate/serve (ServerConfig -> load_into) and the benches (engine_from_args) pass --kv-dtype on."""
    from lucebox import serve

    seen = {}

    def from_path(path, cfg, quiet=False):
        seen["cfg"] = cfg
        raise LuceboxError("stop here")

    monkeypatch.setattr(LLMEngine, "from_path", staticmethod(from_path))
    model = ["--model", str(smollm2_path)]
    args = cli.build_parser().parse_args(["bench", "decode", *model, "--kv-dtype", "q8_0"])
    with pytest.raises(LuceboxError):
        cli.engine_from_args(args)
    assert seen["cfg"].kv_dtype == "q8_0"
    args = cli.build_parser().parse_args(["bench", "decode", *model])
    with pytest.raises(LuceboxError):
        cli.engine_from_args(args)
    assert seen["cfg"].kv_dtype == "auto"
    args = cli.build_parser().parse_args(["serve", *model, "--kv-dtype", "q8_0"])
    cfg = serve.ServerConfig.from_args(args)
    assert cfg.kv_dtype == "q8_0"
    monkeypatch.setenv("LUCEBOX_KV_DTYPE", "q8_0")
    assert serve.ServerConfig.from_args(cli.build_parser().parse_args(["serve", *model])).kv_dtype == "q8_0"
    monkeypatch.delenv("LUCEBOX_KV_DTYPE")
    seen.clear()
    with pytest.raises(LuceboxError, match="stop here"):
        cli.cmd_generate(cli.build_parser().parse_args(["generate", *model, "--kv-dtype", "q8_0", "--prompt", "hi"]))
    assert seen["cfg"].kv_dtype == "q8_0"


def test_a_bad_kv_dtype_is_one_line_and_exit_2(smollm2_path, capsys):
    assert cli.main(["generate", "--model", str(smollm2_path), "--device", "cpu", "--kv-dtype", "q4",
                     "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["lucebox: error: --kv-dtype is 'q4'; choose from auto, bf16, q8_0"]
