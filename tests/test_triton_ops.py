"""The fused Triton kernels (lucebox/engine/kernels/triton_ops.py) against their torch references, and the decoder's
fused path against its eager path on tiny models of every architecture.

Runs on CUDA, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1) when triton is importable; skips
otherwise. The interpreter runs every dtype, but rounds fp32 -> bf16 toward zero where GPUs round to nearest,
hence the 2-ulp bf16 tolerance. It runs one Python program per row, so there T = 300 is tested in fp32 only.
The CUDA graph test runs on CUDA only.
"""

from __future__ import annotations

import os

import pytest
import torch

ops = pytest.importorskip("lucebox.engine.kernels.triton_ops")
if ops.triton is None:
    pytest.skip("triton is not installed", allow_module_level=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETER = DEVICE == "cpu"
if INTERPRETER and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA; set TRITON_INTERPRET=1 to run the kernels on the CPU", allow_module_level=True)

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # interpreter's numpy

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROWS = [1, 3, 300]
# (q heads, kv heads, head_dim, q/k norm): SmolLM2-135M, Gemma 3 270M, Qwen3-8B.
HEADS = {"smollm2": (9, 3, 64, False), "gemma3": (4, 1, 256, True), "qwen3-8b": (32, 8, 128, True)}


def cases(extra: list, interpreted_t300: tuple = ()) -> list:
    """dtype x rows x extra parameters, less the slow interpreter cases: there T = 300 runs in fp32 only,
    and only for the `extra` values in `interpreted_t300` if that is given."""
    out = []
    for dtype in DTYPES:
        for t in ROWS:
            for e in extra:
                slow = INTERPRETER and t == 300 and (dtype != torch.float32 or e not in (interpreted_t300 or extra))
                mark = pytest.mark.skip(reason="interpreter: slow, T=300 covered by another case") if slow else ()
                out.append(pytest.param(dtype, t, e, marks=mark, id=f"{str(dtype)[6:]}-T{t}-{e}"))
    return out


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[ref.dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE).to(dtype)


def norm_weight(n: int) -> torch.Tensor:
    return torch.rand(n, device=DEVICE) + 0.5  # fp32, as DecoderModel.finalize keeps norm weights


@pytest.mark.parametrize("dtype,t,hidden", cases([576, 640, 4096]))
def test_rms_norm(dtype, t, hidden):
    torch.manual_seed(0)
    x, w = 3 * randn(t, hidden, dtype=dtype), norm_weight(hidden)
    assert_close(ops.rms_norm(x, w, 1e-5), ops.rms_norm_ref(x, w, 1e-5))


def test_rms_norm_keeps_leading_dims_and_reads_strided_rows():
    torch.manual_seed(0)
    x = randn(4, 3, 2 * 64, dtype=torch.float32)[..., 64:]  # rows not contiguous with each other
    w = norm_weight(64)
    assert_close(ops.rms_norm(x, w, 1e-6), ops.rms_norm_ref(x, w, 1e-6))


@pytest.mark.parametrize("dtype,t,post_norm", cases([False, True]))
def test_add_rms_norm(dtype, t, post_norm):
    torch.manual_seed(0)
    hidden = 576
    x, residual, w = randn(t, hidden, dtype=dtype), 4 * randn(t, hidden, dtype=dtype), norm_weight(hidden)
    xw = norm_weight(hidden) if post_norm else None
    normed, new_residual = ops.add_rms_norm(x, residual, w, 1e-6, x_weight=xw)
    normed_ref, new_residual_ref = ops.add_rms_norm_ref(x, residual, w, 1e-6, x_weight=xw)
    assert_close(new_residual, new_residual_ref)
    assert_close(normed, normed_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [96, 576, 5120])
def test_norms_write_their_outputs_int8_workspace(dtype, hidden):
    """`ws` makes rms_norm and add_rms_norm also write their output's int8 workspace (the int8-activation matmul
    kernels' input) in the same launch: the bytes quantize_x writes from the stored output (its per-block sums
    of x, reduced in another order on a GPU, within an ulp), and the normed rows unchanged. Hidden 96 and 5120:
    rows that fill part of the kernel's power-of-two block (Qwen3.5-27B's 5120 in 8192)."""
    from lucebox.engine.kernels import triton_qmm

    torch.manual_seed(0)
    t = 3
    x, residual, w = randn(t, hidden, dtype=dtype), 4 * randn(t, hidden, dtype=dtype), norm_weight(hidden)

    def check(ws: torch.Tensor, normed: torch.Tensor) -> None:
        ref = triton_qmm.quantize_x(normed)
        sums = slice(hidden // 4 + hidden // 32, hidden // 4 + hidden // 16)  # fp32 sums of x, one a block
        keep = torch.ones(ref.shape[1], dtype=torch.bool)
        keep[sums] = False
        assert torch.equal(ws[:, keep], ref[:, keep])
        torch.testing.assert_close(ws[:, sums].view(torch.float32), ref[:, sums].view(torch.float32), rtol=1e-6,
                                   atol=1e-6)

    ws = triton_qmm.workspace(t, hidden, DEVICE)
    normed = ops.rms_norm(x, w, 1e-6, ws=ws)
    assert torch.equal(normed, ops.rms_norm(x, w, 1e-6))
    check(ws, normed)
    ws = triton_qmm.workspace(t, hidden, DEVICE)
    normed, new_residual = ops.add_rms_norm(x, residual, w, 1e-6, x_weight=w, ws=ws)
    assert torch.equal(normed, ops.add_rms_norm(x, residual, w, 1e-6, x_weight=w)[0])
    check(ws, normed)
    with pytest.raises(ValueError, match="int8 workspace"):
        ops.rms_norm(x, w, 1e-6, ws=triton_qmm.workspace(t + 1, hidden, DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,heads,dim", [(1, 48, 128), (3, 4, 64), (2, 2, 256)])
def test_gated_rms_norm(dtype, t, heads, dim):
    """Gated DeltaNet's output norm times silu(z) in one kernel against the eager block's torch (two ulps in
    16-bit: silu's exp), and with `ws` its int8 rows as quantize_x makes them from the stored output."""
    from lucebox.engine.kernels import triton_qmm

    torch.manual_seed(0)
    out = 3 * torch.randn(t, heads, dim, device=DEVICE)
    z = 4 * randn(t, heads * dim, dtype=dtype)
    w = norm_weight(dim)
    y = ops.gated_rms_norm(out, z, w, 1e-6, dtype)
    ref = ops.gated_rms_norm_ref(out, z, w, 1e-6, dtype)
    if INTERPRETER and dtype == torch.bfloat16:  # four roundings toward zero (see the module docstring): 4 ulps
        torch.testing.assert_close(y.float(), ref.float(), rtol=3.2e-2, atol=3.2e-2)
    else:
        assert_close(y, ref)
    ws = triton_qmm.workspace(t, heads * dim, DEVICE)
    assert torch.equal(ops.gated_rms_norm(out, z, w, 1e-6, dtype, ws=ws), y)
    ref = triton_qmm.quantize_x(y)
    n = heads * dim
    sums = slice(n // 4 + n // 32, n // 4 + n // 16)
    keep = torch.ones(ref.shape[1], dtype=torch.bool)
    keep[sums] = False
    assert torch.equal(ws[:, keep], ref[:, keep])
    torch.testing.assert_close(ws[:, sums].view(torch.float32), ref[:, sums].view(torch.float32), rtol=1e-6,
                               atol=1e-6)
    with pytest.raises(ValueError, match="gated_rms_norm"):
        ops.gated_rms_norm(out.transpose(0, 1), z, w, 1e-6, dtype)


def rope_tables(positions: torch.Tensor, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10_000.0 ** (torch.arange(0, dim, 2, device=DEVICE).float() / dim))
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype,t,model", cases(list(HEADS), interpreted_t300=("smollm2",)))
def test_rope_qk_and_cache(dtype, t, model):
    torch.manual_seed(0)
    hq, hkv, dim, qk_norm = HEADS[model]
    n_slots = 512
    qkv = 2 * randn(t, (hq + 2 * hkv) * dim, dtype=dtype)
    cos, sin = rope_tables(torch.randint(0, 4000, (t,), device=DEVICE), dim, dtype)
    slots = torch.randperm(n_slots, device=DEVICE)[:t]
    qw, kw = (norm_weight(dim), norm_weight(dim)) if qk_norm else (None, None)
    # The caches are views into one [layers, 2, slots, kv_heads, head_dim] tensor, as the engine's are.
    kv = randn(2, 2, n_slots, hkv, dim, dtype=dtype)
    kv_ref = kv.clone()
    q, k, v = ops.rope_qk_and_cache(qkv, cos, sin, kv[1, 0], kv[1, 1], slots, hq, hkv, qw, kw, eps=1e-6)
    q_ref, k_ref, v_ref = ops.rope_qk_and_cache_ref(qkv, cos, sin, kv_ref[1, 0], kv_ref[1, 1], slots, hq, hkv,
                                                    qw, kw, eps=1e-6)
    assert_close(q, q_ref)
    assert_close(k, k_ref)
    assert torch.equal(v, v_ref)
    assert_close(kv, kv_ref)  # the new rows, and nothing else, changed
    assert torch.equal(kv[0], kv_ref[0]) and torch.equal(kv[1, 1], kv_ref[1, 1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq", [0, 9])
def test_rope_qk_without_caches_and_without_q_heads(dtype, hq):
    """The DFlash drafter's two uses: block rows rotated and normed with nothing written (no caches), and
    context rows' k/v alone (no q heads) written to the cache."""
    torch.manual_seed(1)
    t, hkv, dim = 16, 3, 64
    qkv = 2 * randn(t, (hq + 2 * hkv) * dim, dtype=dtype)
    cos, sin = rope_tables(torch.arange(100, 100 + t, device=DEVICE), dim, dtype)
    w = norm_weight(dim)
    q, k, v = ops.rope_qk_and_cache(qkv, cos, sin, None, None, None, hq, hkv, w, w)
    q_ref, k_ref, v_ref = ops.rope_qk_and_cache_ref(qkv, cos, sin, None, None, None, hq, hkv, w, w)
    assert q.shape == (t, hq, dim)
    assert_close(q, q_ref)
    assert_close(k, k_ref)
    assert torch.equal(v, v_ref)
    kv = randn(2, 64, hkv, dim, dtype=dtype)
    kv_ref = kv.clone()
    slots = torch.randperm(64, device=DEVICE)[:t]
    ops.rope_qk_and_cache(qkv, cos, sin, kv[0], kv[1], slots, hq, hkv, w, w)
    ops.rope_qk_and_cache_ref(qkv, cos, sin, kv_ref[0], kv_ref[1], slots, hq, hkv, w, w)
    assert_close(kv, kv_ref)


@pytest.mark.parametrize("dtype,t,act", cases(list(ops.ACTS)))
@pytest.mark.parametrize("ffn", [100, 1536])
def test_act_mul(dtype, t, act, ffn):
    if INTERPRETER and t == 300 and ffn > 100:
        pytest.skip("interpreter: slow, T=300 covered by ffn=100")
    torch.manual_seed(0)
    gate_up = 3 * randn(t, 2 * ffn, dtype=dtype)
    assert_close(ops.act_mul(gate_up, act), ops.act_mul_ref(gate_up, act))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(128, 2048), (1, 2048), (257, 96), (512, 1000)])
def test_small_linear(dtype, n, k):
    """One row against a small dense weight (a MoE router, a shared expert's gate) equals the fp32 product
    rounded once, odd sizes included; what it does not serve goes to F.linear."""
    torch.manual_seed(0)
    x, w = randn(1, k, dtype=dtype), randn(n, k, dtype=dtype)
    assert_close(ops.small_linear(x, w), (x.float() @ w.float().T).to(dtype))
    on = ops.use_kernels(x)
    assert ops.small_linear_ok(x, w) == on
    for other in (randn(2, k, dtype=dtype), x.float()):  # two rows; an fp32 weight below
        assert not ops.small_linear_ok(other, w)
    assert not ops.small_linear_ok(x, w.float()) and not ops.small_linear_ok(x, randn(513, k, dtype=dtype))
    assert not ops.small_linear_ok(x, w.clone().requires_grad_()), "no backward: a trainer's weights take F.linear"


def test_bad_shapes_are_refused():
    x = randn(2, 64, dtype=torch.float32)
    with pytest.raises(ValueError, match="weight shape"):
        ops.rms_norm(x, norm_weight(32), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        ops.add_rms_norm(x, x[:1], norm_weight(64), 1e-6)
    with pytest.raises(ValueError, match="unknown activation"):
        ops.act_mul(x, "relu")
    cache = randn(16, 1, 16, dtype=torch.float32)
    cos = randn(2, 16, dtype=torch.float32)
    slots = torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="qkv"):
        ops.rope_qk_and_cache(x, cos, cos, cache, cache, slots, 3, 1)
    with pytest.raises(ValueError, match="both"):
        ops.rope_qk_and_cache(x, cos, cos, cache, cache, slots, 2, 1, q_norm_w=norm_weight(16))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need CUDA")
def test_kernels_replay_in_a_cuda_graph():
    torch.manual_seed(0)
    hq, hkv, dim, _ = HEADS["smollm2"]
    t, hidden, dtype = 4, 576, torch.bfloat16
    x, residual = randn(t, hidden, dtype=dtype), randn(t, hidden, dtype=dtype)
    w = norm_weight(hidden)
    qkv = randn(t, (hq + 2 * hkv) * dim, dtype=dtype)
    cos, sin = rope_tables(torch.arange(t, device=DEVICE), dim, dtype)
    slots = torch.arange(t, device=DEVICE)
    gate_up = randn(t, 2 * 1536, dtype=dtype)
    k_cache, v_cache = torch.zeros(64, hkv, dim, dtype=dtype, device=DEVICE), torch.zeros(64, hkv, dim, dtype=dtype,
                                                                                         device=DEVICE)

    def step():
        return (*ops.add_rms_norm(x, residual, w, 1e-5), ops.rope_qk_and_cache(qkv, cos, sin, k_cache, v_cache,
                                                                                 slots, hq, hkv)[0],
                ops.act_mul(gate_up, "silu"))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for tensor in (x, residual, qkv, gate_up):  # new inputs in the captured buffers
        tensor.copy_(torch.randn_like(tensor))
    slots.copy_(torch.arange(10, 10 + t, device=DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    refs = (*ops.add_rms_norm_ref(x, residual, w, 1e-5),
            ops.rope_qk_and_cache_ref(qkv, cos, sin, k_ref, v_ref, slots, hq, hkv)[0], ops.act_mul_ref(gate_up, "silu"))
    for out, ref in zip(outs, refs):
        assert_close(out, ref)
    assert_close(k_cache[10:10 + t], k_ref[10:10 + t])
    assert torch.equal(v_cache[10:10 + t], v_ref[10:10 + t])


# ----------------------------------------------------------------------------------------------------------------
# The decoder: fused path == eager path


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """Let the decoder take the fused path on CPU tensors (under the interpreter)."""
    if INTERPRETER:
        monkeypatch.setattr(ops, "ON_CPU", True)


@torch.inference_mode()
def prefill(engine, ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """One prompt through the model as `LLMEngine.score` runs it: logits, the outputs of the first and last
    layers (DFlash's capture), and the first block called on its own (`DecoderBlock.forward`)."""
    from lucebox.engine.runtime.sampler import SamplingParams
    from lucebox.engine.runtime.sequence import Chunk, Sequence

    model = engine.loaded.model
    seq = Sequence(list(ids), SamplingParams())
    seq.block_table = engine.kv.pool.allocate(engine.kv.blocks_for(len(ids)))
    try:
        inputs = engine.runner.prepare([Chunk(seq, 0, len(ids))])
        hidden, captured = model(inputs.input_ids, inputs.positions, engine.kv.data, inputs.meta,
                                 capture=(0, len(model.blk) - 1))
        block = model.blk[0]
        rotary = model.rotary["sliding" if block.sliding and "sliding" in model.rotary else "full"]
        h = model.embed(inputs.input_ids)
        first = block(h, rotary(inputs.positions, h.dtype), engine.kv.data[0, 0], engine.kv.data[0, 1], inputs.meta)
        return model.logits(hidden).float(), captured, first
    finally:
        engine.kv.pool.decref(seq.block_table)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_fused_decoder_matches_eager(arch, tiny_gguf, monkeypatch, kernels_on_cpu):
    from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
    from lucebox.engine.runtime.sampler import SamplingParams

    path = tiny_gguf(arch)
    ids = [(7 * i + 3) % 200 + 3 for i in range(20)]  # > 16 tokens: crosses tiny Gemma 3's sliding window
    prompts = [ids[:12]] if INTERPRETER else [ids[:12], ids]  # decoding 6 tokens also crosses it
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    results = {}
    calls = []
    rope = ops.rope_qk_and_cache
    monkeypatch.setattr(ops, "rope_qk_and_cache", lambda *a, **kw: calls.append(1) or rope(*a, **kw))
    for fused in (False, True):
        monkeypatch.setattr(ops, "ENABLED", fused)
        # A fresh engine each time: CUDA graphs keep the path they were captured with.
        engine = LLMEngine.from_path(path, EngineConfig(device=DEVICE, dtype="float32", kv_tokens=1024), quiet=True)
        results[fused] = prefill(engine, ids), engine.generate(prompts, params)
        assert bool(calls) == fused, "the fused path must run exactly when enabled"
    ((logits, captured, first), tokens), ((f_logits, f_captured, f_first), f_tokens) = results[False], results[True]

    def assert_rel(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
        diff = (ours - ref).abs().max().item()
        assert diff <= 1e-4 * ref.abs().max().item(), f"{arch} {what}: max |diff| {diff:.2e}"

    assert_rel(f_logits, logits, "logits")
    assert_rel(f_first, first, "first block")
    assert len(f_captured) == len(captured) == 2
    for ours, ref in zip(f_captured, captured):
        assert_rel(ours, ref, "captured layer output")
    assert f_tokens == tokens


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_drafter_layer_matches_its_reference(dtype, window, monkeypatch, kernels_on_cpu):
    """A DFlash drafter layer over its paged cache, on the reference path and on the fused kernels (`ready` fuses
    its projections), gives the block rows of the drafter's defining math (DFLASH.md: block rows over the
    gathered context K/V and their own, the block not causal; written out here with SDPA), leaves the context
    it reads alone, and writes the reference's context K/V (SmolLM2's drafter shape, 2 sequences of a 16-row
    block, shuffled block tables; a sliding layer keeps the context within the window of the last position)."""
    from lucebox.engine.models.dense_attention import causal_mask, dense_attention
    from lucebox.engine.spec.drafter import DFlashDrafter, DrafterConfig, block_metadata, ready

    cfg = DrafterConfig(hidden_size=576, num_layers=1, num_heads=9, num_kv_heads=3, head_dim=64,
                        intermediate_size=1536, vocab_size=49152, block_size=16, target_layer_ids=[1, 20],
                        mask_token_id=0, num_target_layers=30, sliding_window=window,
                        layer_types=["sliding_attention" if window else "full_attention"])
    drafter = ready(DFlashDrafter.random(cfg, seed=3, std=0.05), DEVICE, dtype)
    layer = drafter.layers[0]
    torch.manual_seed(0)
    g, b, page = 2, cfg.block_size, 16
    starts = torch.tensor([40, 33], device=DEVICE)
    tables = torch.tensor([[5, 2, 7, 1], [3, 8, 4, 6]], device=DEVICE)  # block 0: scratch
    pos = (starts[:, None] + torch.arange(b, device=DEVICE)).flatten()
    rope = drafter.rotary(pos, dtype)
    h = randn(g, b, 576, dtype=dtype)
    context = randn(2, 9 * page, 3, 64, dtype=dtype)  # K and V of every slot
    c = int(starts.max())
    gather = tables[:, torch.arange(c, device=DEVICE) // page] * page + torch.arange(c, device=DEVICE) % page
    # The definition: block rows see the context before their start (within the window of start - 1) and the
    # whole block.
    ctx_ok = causal_mask((starts - 1)[:, None], torch.arange(c, device=DEVICE), window)[:, 0]
    mask = torch.cat([ctx_ok, torch.ones(g, b, dtype=torch.bool, device=DEVICE)], 1)[:, None, :].expand(g, b, c + b)
    with torch.inference_mode():
        q, k, v = layer.block_qkv(h.view(g * b, -1), *rope)
        keys = torch.cat([context[0][gather], k.view(g, b, 3, 64)], 1)
        vals = torch.cat([context[1][gather], v.view(g, b, 3, 64)], 1)
        want = layer.after_attention(h, dense_attention(q.view(g, b, 9, 64), keys, vals, mask=mask).reshape(g, b, -1))
    x, slots = randn(g * b, 576, dtype=dtype), torch.randperm(64, device=DEVICE)[: g * b]
    meta = block_metadata(tables, starts, b, page, c + b, window)
    read = torch.zeros(9 * page, dtype=torch.bool, device=DEVICE)  # the context slots
    for i, start in enumerate(starts.tolist()):
        read[gather[i, :start]] = True
    out = {}
    for fused in (False, True):
        monkeypatch.setattr(ops, "ENABLED", fused)
        cache = context.clone()
        with torch.inference_mode():
            assert layer._fused(h) == fused
            out[fused] = layer(h, rope, cache[0], cache[1], meta)
            assert torch.equal(cache[:, read], context[:, read]), "the block overwrote the context it reads"
            layer.write_context(x, *rope, cache[0], cache[1], slots)
        out[fused] = out[fused], cache[:, slots]
    # A drafter whose weights were converted after `ready` (its fused copies stale) takes the reference.
    moved = ready(DFlashDrafter.random(cfg, seed=3, std=0.05), DEVICE, dtype).to(torch.float64).to(dtype)
    with torch.inference_mode():
        assert not moved.layers[0]._fused(h)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the fused kernels round their sums once, not per op
    for ours, ref in [(out[False][0], want), (out[True][0], want), (out[True][1], out[False][1])]:
        diff = (ours.float() - ref.float()).abs().max().item()
        assert diff <= tol * ref.float().abs().max().item(), diff


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, vocab", [(1, 49152), (3, 5000), (16, 4099)])
def test_masked_argmax(dtype, rows, vocab):
    """The greedy token under a grammar's bitmask equals the unpack-mask-argmax reference, ties included (the first
    of equal logits wins, as torch.argmax breaks them: bf16 logits tie often), for vocabularies not a multiple of
    32 or of the block."""
    logits = (torch.randn(rows, vocab, device=DEVICE) * 3).round().to(dtype)  # few distinct values: many ties
    words = (vocab + 31) // 32
    bitmasks = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, device=DEVICE)
    bitmasks[0] = 0
    bit = 1 << ((vocab - 1) % 32)
    bitmasks[0, -1] = bit - (1 << 32) if bit >= 1 << 31 else bit  # only the last token allowed (int32 bits)
    if rows > 2:
        bitmasks[1] = -1  # every token: the plain argmax
        bitmasks[2, : words // 2] = 0  # the first half refused
    out = ops.masked_argmax(logits, bitmasks)
    ref = ops.masked_argmax_ref(logits, bitmasks)
    assert out.tolist() == ref.tolist()
    assert out[0] == vocab - 1
    if rows > 2:
        assert out[1] == logits[1].float().argmax()
    with pytest.raises(ValueError, match="do not cover"):
        ops.masked_argmax(logits, bitmasks[:, :-1])
