"""Mixture-of-experts layers (models/moe.py) and the qwen3moe architecture against transformers 5.24 in fp32.

The tiny Qwen3-MoE (8 experts, top-2, tests/fixtures/tiny_models.py) is written by transformers itself as an
HF folder (its layer 1 dense through `mlp_only_layers`) and as a GGUF with llama.cpp's names (every layer MoE,
as llama.cpp's qwen3moe has it); transformers reads both back as the reference. The MoE module alone is also
checked against transformers' Qwen3.5-MoE block (softmax router, gated shared expert) and Laguna's (sigmoid
router with a selection bias, scaled weights, ungated shared expert). Tolerance: test_parity's RTOL. The Triton
kernel (kernels/triton_moe.py) is checked against the eager path on CUDA, or on the CPU under
TRITON_INTERPRET=1 (skipped otherwise).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from lucebox.engine.kernels import triton_moe, triton_ops
from lucebox.engine.models.config import ModelConfig
from lucebox.engine.models.layers import Linear
from lucebox.engine.models.moe import MoE
from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.engine.weights.loader import load_model
from tests.fixtures.tiny_models import transformers_gguf_kwargs

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

RTOL = 1e-4  # test_parity.py's
IDS = list(range(3, 40)) + list(range(100, 160))
DENSE_LAYER = {"mlp_only_layers": (1,)}


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    diff, scale = (ours - ref).abs().max().item(), ref.abs().max().item()
    assert diff <= RTOL * scale, f"{what}: max |diff| {diff:.2e} > {RTOL} x max |ref| {scale:.2f}"


def engine(path: Path, quantized: bool | None = None, **kw) -> LLMEngine:
    loaded = load_model(path, device="cpu", dtype=torch.float32, quiet=True,
                        weights={None: "auto", True: "quantized", False: "dense"}[quantized])
    return LLMEngine(loaded, EngineConfig(device="cpu", dtype="float32", kv_tokens=2048, **kw))


def with_tensors(folder: Path, dest: Path, sd: dict[str, torch.Tensor]) -> Path:
    """A copy of HF folder `folder` at `dest` whose model.safetensors holds `sd` instead."""
    from safetensors.torch import save_file

    dest.mkdir(exist_ok=True)
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (dest / f.name).write_bytes(f.read_bytes())
    save_file(sd, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_from_gguf(path: Path, qtype: str):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, **transformers_gguf_kwargs("qwen3moe", qtype)
    ).eval()


def test_hf_folder_matches_transformers(tiny_hf_folder) -> None:
    folder = tiny_hf_folder("qwen3moe", **DENSE_LAYER)
    ours = engine(folder)
    cfg = ours.loaded.config
    assert (cfg.arch, cfg.n_experts, cfg.n_experts_used, cfg.expert_ff) == ("qwen3moe", 8, 2, 32)
    assert cfg.moe_layers == [True, False, True] and cfg.norm_topk_prob
    blocks = ours.loaded.model.blk
    assert blocks[0].moe is not None and blocks[1].moe is None
    assert tuple(blocks[0].ffn_gate_exps.weight.shape) == (8 * 32, 64)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert_close(ours.score(IDS), hf_logits(hf, IDS), "tiny qwen3moe HF folder")


def test_fused_3d_expert_tensors_load_like_per_expert_ones(tiny_hf_folder, tmp_path) -> None:
    """transformers' in-memory layout (`mlp.experts.gate_up_proj` [E, 2ff, h], `down_proj` [E, h, ff]) in a
    folder gives the same model as the per-expert tensors save_pretrained writes."""
    from safetensors.torch import load_file

    folder = tiny_hf_folder("qwen3moe", **DENSE_LAYER)
    sd = load_file(str(folder / "model.safetensors"))
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in sd  # what save_pretrained writes
    for layer in (0, 2):
        p = f"model.layers.{layer}.mlp.experts."
        stack = {k: torch.stack([sd.pop(f"{p}{e}.{k}_proj.weight") for e in range(8)]) for k in ("gate", "up", "down")}
        sd[p + "gate_up_proj"] = torch.cat([stack["gate"], stack["up"]], dim=1)
        sd[p + "down_proj"] = stack["down"]
    assert torch.equal(engine(with_tensors(folder, tmp_path, sd)).score(IDS), engine(folder).score(IDS))


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_K"])
def test_gguf_matches_transformers(tiny_gguf, qtype) -> None:
    path = tiny_gguf("qwen3moe", qtype)
    ours = engine(path)
    assert ours.loaded.config.moe_layers == [True] * 3
    assert_close(ours.score(IDS), hf_logits(hf_from_gguf(path, qtype), IDS), f"tiny qwen3moe GGUF {qtype}")


def test_quantized_experts_stay_quantized_and_equal_the_dequantized_model(tiny_gguf) -> None:
    """Q8_0 experts kept in their blocks (one [E * rows, cols] QuantWeight per projection, each expert a slice
    of rows): the logits equal the dense (dequantized-at-load) model's bit for bit and transformers' within RTOL."""
    path = tiny_gguf("qwen3moe", "Q8_0")
    quant, dense = engine(path, quantized=True), engine(path, quantized=False)
    for block in quant.loaded.model.blk:
        for name, rows in (("ffn_gate_exps", 8 * 32), ("ffn_up_exps", 8 * 32), ("ffn_down_exps", 8 * 64)):
            lin = getattr(block, name)
            assert isinstance(lin, Linear) and lin.qtype == "Q8_0" and "weight" not in lin._parameters
            assert tuple(lin.quant.shape) == (rows, lin.cols)
    ours = quant.score(IDS)
    assert torch.equal(ours, dense.score(IDS))
    assert_close(ours, hf_logits(hf_from_gguf(path, "Q8_0"), IDS), "tiny qwen3moe Q8_0, quantized experts")


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_engine_greedy_matches_transformers_across_prefill_chunks_and_batching(tiny_hf_folder, tiny_gguf,
                                                                                source) -> None:
    """Prompts longer than one prefill chunk (max_step_tokens 32), 8 decoded tokens: equal to transformers'
    greedy continuation, batched (mixed lengths) as alone."""
    path = tiny_hf_folder("qwen3moe", **DENSE_LAYER) if source == "hf" else tiny_gguf("qwen3moe", "F32")
    hf = (transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
          if source == "hf" else hf_from_gguf(path, "F32"))
    hf.generation_config.eos_token_id = None
    ours = engine(path, max_step_tokens=32)
    prompts = [IDS, list(range(200, 260))]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    batched = ours.generate(prompts, params)
    for ids, out in zip(prompts, batched):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
        assert out == ref, f"{source}: greedy tokens differ for a {len(ids)}-token prompt"
        assert ours.generate([ids], params)[0] == out, "batched differs from alone"


# --------------------------------------------------------------------------------------------------------------
# The module alone, against transformers' MoE blocks of the other families


def moe_config(**kw) -> ModelConfig:
    base = dict(arch="test", name="moe", vocab_size=8, hidden_size=32, intermediate_size=64, num_layers=1,
                num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6, max_position=64, rope_theta=1e4,
                n_experts=8, n_experts_used=3, expert_ff=16)
    return ModelConfig(**{**base, **kw})


def load_into(moe: MoE, experts, router, shared, shared_gate=None, bias=None) -> None:
    """Copy a transformers MoE block's weights into ours (GGUF layout: experts stacked by rows)."""
    gate, up = experts.gate_up_proj.detach().chunk(2, dim=1)
    sd = {"ffn_gate_inp.weight": router.weight, "ffn_gate_exps.weight": gate.flatten(0, 1),
          "ffn_up_exps.weight": up.flatten(0, 1), "ffn_down_exps.weight": experts.down_proj.flatten(0, 1),
          "ffn_gate_shexp.weight": shared.gate_proj.weight, "ffn_up_shexp.weight": shared.up_proj.weight,
          "ffn_down_shexp.weight": shared.down_proj.weight}
    if shared_gate is not None:
        sd["ffn_gate_inp_shexp.weight"] = shared_gate.weight
    if bias is not None:
        sd["exp_probs_b.bias"] = bias
    moe.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=True)


def randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def test_softmax_router_with_gated_shared_expert_matches_qwen3_5_moe() -> None:
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q35

    hf_cfg = transformers.Qwen3_5MoeTextConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8,
                                               num_experts_per_tok=3, shared_expert_intermediate_size=24)
    ref = q35.Qwen3_5MoeSparseMoeBlock(hf_cfg).eval()
    randomize(ref, 0)
    moe = MoE(moe_config(shared_expert_ff=24), 0)
    load_into(moe, ref.experts, ref.gate, ref.shared_expert, shared_gate=ref.shared_expert_gate)
    x = torch.randn(1, 40, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(moe(x[0]), ref(x)[0], "Qwen3.5-MoE block")


def test_sigmoid_router_with_bias_and_scale_matches_laguna() -> None:
    from transformers.models.laguna import modeling_laguna as lg

    hf_cfg = transformers.LagunaConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3,
                                       shared_expert_intermediate_size=24, moe_routed_scaling_factor=2.5)
    ref = lg.LagunaSparseMoeBlock(hf_cfg).eval()
    randomize(ref, 2)
    with torch.no_grad():  # a bias big enough to change which experts win
        ref.gate.e_score_correction_bias.copy_(torch.linspace(-0.5, 0.5, 8))
    moe = MoE(moe_config(shared_expert_ff=24, shared_expert_gate=False, moe_router="sigmoid",
                         expert_weights_scale=2.5), 0)
    load_into(moe, ref.experts, ref.gate, ref.shared_experts, bias=ref.gate.e_score_correction_bias)
    x = torch.randn(1, 40, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert_close(moe(x[0]), ref(x)[0], "Laguna block")
        unbiased = torch.topk(torch.sigmoid(moe.ffn_gate_inp(x[0])), 3).indices
        assert not torch.equal(moe.route(x[0])[1], unbiased), "the bias should change some choices"


def test_hf_config_reads_both_expert_count_keys(tiny_hf_folder, tmp_path) -> None:
    """transformers 5 writes num_local_experts; hub checkpoints (Qwen3-30B-A3B) say num_experts."""
    from lucebox.engine.weights.hf_loader import hf_config

    folder = tiny_hf_folder("qwen3moe", **DENSE_LAYER)
    conf = json.loads((folder / "config.json").read_text())
    assert "num_local_experts" in conf
    conf["num_experts"] = conf.pop("num_local_experts")
    (tmp_path / "config.json").write_text(json.dumps(conf))
    assert hf_config(tmp_path).n_experts == hf_config(folder).n_experts == 8


# --------------------------------------------------------------------------------------------------------------
# The Triton kernel (kernels/triton_moe.py): CUDA, or the CPU under TRITON_INTERPRET=1

@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_grouped_gemm_path_equals_the_loop(device) -> None:
    """`experts_grouped_mm` (torch's grouped GEMM over the pairs sorted by expert, no host sync) gives the
    loop's result: 37 rows x top-3 of 8 experts, some experts unrouted; fp32 on the CPU, bf16 on CUDA; the same
    bits when run again, and a row alone gives its batched result."""
    from lucebox.engine.models import moe as moe_mod

    if moe_mod._grouped_mm is None:
        pytest.skip("this torch has no grouped GEMM")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    moe = MoE(moe_config(hidden_size=64, expert_ff=32), 0)
    randomize(moe, 6)
    moe = moe.to(device=device, dtype=dtype)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(9)).to(device=device, dtype=dtype)
    assert moe.grouped_mm_ok(x) and (device == "cpu" or not moe.grouped_mm_ok(x.float()))
    with torch.no_grad():
        weights, ids = moe.route(x)
        ids[:, 0] = torch.where(ids[:, 0] == 5, 6, ids[:, 0])  # expert 5 gets fewer rows, maybe none
        ours = moe.experts_grouped_mm(x, weights, ids)
        again = moe.experts_grouped_mm(x, weights, ids)
        alone = moe.experts_grouped_mm(x[5:6], weights[5:6], ids[5:6])
        ref = moe.experts(x, weights, ids) if device == "cpu" else moe.to(torch.float32).experts(
            x.float(), weights.float(), ids).to(dtype)
    assert torch.equal(ours, again)  # a fixed summation order: the same bits every run (no atomics)
    torch.testing.assert_close(alone, ours[5:6], rtol=1e-5 if device == "cpu" else 1e-2, atol=1e-5)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(ours, ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_grouped_gemm_path_dequantizes_quantized_experts(tiny_gguf, qtype) -> None:
    """Experts kept in their GGUF blocks: `experts_grouped_mm` dequantizes each projection whole and gives the
    loop's result (which runs each routed expert on its blocks); 40 rows, fp32 on the CPU."""
    from lucebox.engine.models import moe as moe_mod

    if moe_mod._grouped_mm is None:
        pytest.skip("this torch has no grouped GEMM")
    overrides = {"expert_ff": 256} if qtype == "Q4_K" else {}
    loaded = load_model(tiny_gguf("qwen3moe", qtype, **overrides), device="cpu", dtype=torch.float32,
                        quiet=True, weights="quantized")
    moe = loaded.model.blk[0].moe
    x = torch.randn(40, moe.hidden, generator=torch.Generator().manual_seed(11))
    assert moe.ffn_gate_exps.qtype == qtype and moe.grouped_mm_ok(x)
    with torch.no_grad():
        weights, ids = moe.route(x)
        ours = moe.experts_grouped_mm(x, weights, ids)
        ref = moe.experts(x, weights, ids)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())


KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(
    triton_moe.triton is None or (KERNEL_DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs triton on CUDA, or TRITON_INTERPRET=1 on the CPU")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_triton_experts_kernel_matches_the_grouped_path(monkeypatch, dtype, rows, act) -> None:
    """Sizes off the kernel's blocks (hidden 48, expert ff 24) so the masks are exercised; 7 rows x top-3 of 8
    experts repeat experts across rows."""
    moe = MoE(moe_config(hidden_size=48, expert_ff=24, hidden_act=act), 0)
    randomize(moe, 4)
    moe = moe.to(device=KERNEL_DEVICE, dtype=dtype)
    x = torch.randn(rows, 48, generator=torch.Generator().manual_seed(5)).to(device=KERNEL_DEVICE, dtype=dtype)
    with torch.no_grad():
        weights, ids = moe.route(x)
        ours = triton_moe.moe_experts(x, weights, ids, 8, moe.ffn_gate_exps.weight, moe.ffn_up_exps.weight,
                                      moe.ffn_down_exps.weight, act)
        monkeypatch.setattr(triton_moe, "ENABLED", False)
        ref = moe.experts(x, weights, ids)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(ours.float(), ref.float(), rtol=tol, atol=tol)


@needs_kernel
@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("experts,top_k,norm", [(8, 3, True), (128, 8, False), (24, 5, True)])
def test_triton_router_matches_the_torch_router(monkeypatch, router, experts, top_k, norm) -> None:
    """Softmax or sigmoid with a bias that changes choices, renormalised or not, scaled; expert counts off a
    power of two."""
    moe = MoE(moe_config(n_experts=experts, n_experts_used=top_k, moe_router=router, norm_topk_prob=norm,
                         expert_weights_scale=2.5), 0)
    randomize(moe, 8)
    moe = moe.to(KERNEL_DEVICE)
    x = torch.randn(11, 32, generator=torch.Generator().manual_seed(9)).to(KERNEL_DEVICE)
    with torch.no_grad():
        weights, ids = triton_moe.route(moe.ffn_gate_inp(x), top_k, router, norm, 2.5,
                                        moe.exp_probs_b.bias if router == "sigmoid" else None, x.dtype)
        monkeypatch.setattr(triton_moe, "ENABLED", False)
        ref_weights, ref_ids = moe.route(x)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)


Q4_K_M = {"expert_ff": 256, "layer_qtypes": (("ffn_down_exps", "Q6_K"),)}  # a Q4_K_M file's mix, down in Q6_K


@needs_kernel
@pytest.mark.parametrize("qtype,overrides,types", [
    ("Q8_0", {}, "Q8_0 Q8_0 Q8_0"), ("Q5_1", {}, "Q5_1 Q5_1 Q5_1"), ("Q6_K", {}, "Q6_K Q6_K Q8_0"),
    ("Q4_K", Q4_K_M, "Q4_K Q4_K Q6_K"), ("Q4_K", {"layer_qtypes": (("ffn_up_exps", "Q8_0"),)}, "Q4_K Q8_0 Q8_0"),
])
def test_triton_quantized_experts_kernel_matches_the_grouped_path(tiny_gguf, monkeypatch, qtype, overrides,
                                                                   types) -> None:
    """Experts in their GGUF blocks, gate, up and down of the `types` given (K-quant files: down, 32 columns
    wide, in Q8_0, or in Q6_K at expert width 256; gate and up of two types take separate launches)."""
    loaded = load_model(tiny_gguf("qwen3moe", qtype, **overrides), device=KERNEL_DEVICE, dtype=torch.float32,
                        quiet=True, weights="quantized")
    moe = loaded.model.blk[0].moe
    assert " ".join(p.qtype for p in (moe.ffn_gate_exps, moe.ffn_up_exps, moe.ffn_down_exps)) == types
    x = torch.randn(7, moe.hidden, generator=torch.Generator().manual_seed(7)).to(KERNEL_DEVICE)
    monkeypatch.setattr(triton_moe, "PAIR_ROWS", 0)  # the grouped kernel; the per-pair gemvs have their own test
    with torch.no_grad():
        weights, ids = moe.route(x)
        projections = (moe.ffn_gate_exps, moe.ffn_up_exps, moe.ffn_down_exps)
        ours = triton_moe.moe_experts(x, weights, ids, 8, *(p.quant for p in projections), moe.act)
        monkeypatch.setattr(triton_moe, "ENABLED", False)
        ref = moe.experts(x, weights, ids)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())


@needs_kernel
@pytest.mark.parametrize("qtype,overrides,types", [
    ("Q8_0", {}, "Q8_0 Q8_0 Q8_0"), ("Q4_K", Q4_K_M, "Q4_K Q4_K Q6_K"),
    ("Q4_K", {"layer_qtypes": (("ffn_up_exps", "Q8_0"),)}, "Q4_K Q8_0 Q8_0"), ("Q6_K", {}, "Q6_K Q6_K Q8_0"),
    ("Q4_K", {"layer_qtypes": (("ffn_down_exps", "Q5_1"),)}, "Q4_K Q4_K Q5_1"),
])
def test_one_row_takes_a_gemv_per_pair_within_int8_rounding(tiny_gguf, monkeypatch, qtype, overrides,
                                                             types) -> None:
    """A decode step of a few rows runs a gemv per (row, expert) pair on int8 activations (triton_qmm.pair_gemv):
    gate and up in one launch when of one type, else two; Q6_K down rows of one block (210 bytes) start 2 bytes
    into a word on every other row; a Q5_1 down takes the grouped kernel. Each row of 3 alone equals the same
    experts run one by one through the dense int8-activation gemv (the same rounding), and the exact grouped
    path within that rounding."""
    import torch.nn.functional as F

    from lucebox.engine.kernels import triton_qmm
    from lucebox.engine.weights.quant import QuantWeight

    loaded = load_model(tiny_gguf("qwen3moe", qtype, **overrides), device=KERNEL_DEVICE, dtype=torch.float32,
                        quiet=True, weights="quantized")
    moe = loaded.model.blk[0].moe
    projections = (moe.ffn_gate_exps, moe.ffn_up_exps, moe.ffn_down_exps)
    assert " ".join(p.qtype for p in projections) == types
    launches = []
    real = triton_moe.pair_gemv
    monkeypatch.setattr(triton_moe, "pair_gemv", lambda *a, **kw: (launches.append(a[1].qtype), real(*a, **kw)))
    x = torch.randn(3, moe.hidden, generator=torch.Generator().manual_seed(8)).to(KERNEL_DEVICE)
    with torch.no_grad():
        weights, ids = moe.route(x)
        ours = [triton_moe.moe_experts(x[i:i + 1], weights[i:i + 1], ids[i:i + 1], 8,
                                       *(p.quant for p in projections), moe.act) for i in range(3)]
        together = triton_moe.moe_experts(x, weights, ids, 8, *(p.quant for p in projections), moe.act)
        monkeypatch.setattr(triton_moe, "ENABLED", False)
        ref = moe.experts(x, weights, ids)
    gate, up, down = types.split()
    per_row = ([gate] if gate == up else [gate, up]) + ([down] if down != "Q5_1" else [])
    assert launches == per_row * 4, "3 rows alone, then together: the same launches"
    if down != "Q5_1":  # a row's result does not depend on the batch (the grouped down sums in another order)
        assert torch.equal(together, torch.cat(ours))

    def gemv(x: torch.Tensor, w: QuantWeight, e: int, rows: int) -> torch.Tensor:
        expert = QuantWeight(w.data[e * rows:(e + 1) * rows], w.qtype, w.cols, w.dtype)
        if w.qtype == "Q5_1":
            return x @ expert.dequantize().T
        out = torch.empty(1, rows, device=x.device, dtype=x.dtype)
        triton_qmm._launch_words(x, expert, None, out, triton_qmm.Q8X_CANDIDATES[w.qtype][0])
        return out

    gw, uw, dw = (p.quant for p in projections)
    ff = dw.cols
    for i in range(3):
        one = sum(weights[i, j] * gemv(F.silu(gemv(x[i:i + 1], gw, e, ff)) * gemv(x[i:i + 1], uw, e, ff),
                                        dw, e, moe.hidden) for j, e in enumerate(ids[i].tolist()))
        torch.testing.assert_close(ours[i], one, rtol=1e-4, atol=1e-5 * one.abs().max().item())
        assert ((ours[i][0] - ref[i]).norm() / ref[i].norm()).item() < 3e-2


@needs_kernel
@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_kernels_give_the_eager_engines_tokens(tiny_gguf, monkeypatch, qtype) -> None:
    """The engine as it runs on CUDA (fused block ops, CUDA graphs for decode, routed experts through the
    kernel for steps of at most 64 rows; Q8_0 experts kept quantized) gives the eager CPU engine's greedy
    tokens. On the CPU the interpreter runs the fused ops and the kernel."""
    path = tiny_gguf("qwen3moe", qtype)
    quantized = qtype != "F32"
    # The interpreter runs a Python program per kernel instance: one short prompt there. On CUDA the 97-token
    # prompt's prefill takes the eager path (the quantized matmul kernels on each expert's slice of blocks).
    prompts = [IDS[:12]] if KERNEL_DEVICE == "cpu" else [IDS, list(range(200, 230))]
    params = SamplingParams(max_tokens=6 if KERNEL_DEVICE == "cpu" else 12, ignore_eos=True)
    eager = engine(path, quantized=quantized).generate(prompts, params)
    if KERNEL_DEVICE == "cpu":
        monkeypatch.setattr(triton_moe, "ON_CPU", True)
        monkeypatch.setattr(triton_ops, "ON_CPU", True)
        ours = engine(path, quantized=quantized).generate(prompts, params)
    else:  # the grouped kernel: the per-pair gemvs' int8 activations are checked by their own test
        monkeypatch.setattr(triton_moe, "PAIR_ROWS", 0)
        loaded = load_model(path, device="cuda", dtype=torch.float32, quiet=True,
                            weights={None: "auto", True: "quantized", False: "dense"}[quantized])
        ours = LLMEngine(loaded, EngineConfig(device="cuda", dtype="float32", kv_tokens=2048)).generate(prompts, params)
    assert ours == eager


def test_every_expert_path_equals_the_grouped_path(tiny_gguf) -> None:
    """What a CUDA graph captures for quantized experts (no host sync) computes the grouped path's result."""
    moe = engine(tiny_gguf("qwen3moe", "Q8_0"), quantized=True).loaded.model.blk[0].moe
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        weights, ids = moe.route(x)
        torch.testing.assert_close(moe.experts_every(x, weights, ids), moe.experts(x, weights, ids),
                                   rtol=1e-5, atol=1e-6)


def test_bad_expert_files_are_model_file_errors(tiny_hf_folder, tmp_path) -> None:
    """A folder missing one expert's tensor, and a GGUF choosing more experts per token than it has, are
    refused with the name of what is wrong."""
    from safetensors.torch import load_file

    from lucebox.errors import ModelFileError
    from tests.fixtures.tiny_models import write_tiny_gguf

    folder = tiny_hf_folder("qwen3moe", **DENSE_LAYER)
    sd = load_file(str(folder / "model.safetensors"))
    del sd["model.layers.2.mlp.experts.5.down_proj.weight"]
    with pytest.raises(ModelFileError, match=r"experts\.5\.down_proj"):
        load_model(with_tensors(folder, tmp_path / "hf", sd), quiet=True)
    path = write_tiny_gguf(tmp_path / "bad.gguf", "qwen3moe", n_experts_used=9)
    with pytest.raises(ModelFileError, match="9 experts per token of 8"):
        load_model(path, quiet=True)


@pytest.mark.parametrize("ddtree", [False, True])
def test_speculative_decoding_equals_plain(tiny_gguf, tmp_path, ddtree) -> None:
    """A DFlash drafter (random, tiny) on the MoE target: verify steps route many rows at once, chain and
    tree; the tokens are plain decoding's, alone and batched."""
    from lucebox.engine.spec.drafter import DFlashDrafter, drafter_config_for, save_drafter
    from lucebox.engine.weights.loader import read_model_config

    target = tiny_gguf("qwen3moe", "F32")
    cfg = read_model_config(target)
    dcfg = drafter_config_for(cfg, layers=1, block_size=6, mask_token_id=cfg.vocab_size - 1)
    save_drafter(DFlashDrafter.random(dcfg, seed=0, std=0.2), tmp_path / "d")
    prompts = [list(range(5, 30)), list(range(200, 260))]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = engine(target).generate(prompts, params)
    spec = LLMEngine.from_path(target, EngineConfig(device="cpu", dtype="float32", kv_tokens=4096,
                                                    draft=str(tmp_path / "d"), ddtree=ddtree, ddtree_budget=9),
                               quiet=True)
    assert spec.generate(prompts[:1], params) == plain[:1]
    assert spec.generate(prompts, params) == plain
    assert spec.spec.stats.steps > 0


def fused_gate_up_copy(path: Path, dest: Path) -> Path:
    """The GGUF at `path` rewritten with each layer's ffn_gate_exps and ffn_up_exps as one ffn_gate_up_exps
    [n_expert, 2 ff, n_embd] (llama.cpp's optional fused form: per expert, the gate rows then the up rows)."""
    reader = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(dest, reader.fields["general.architecture"].contents())
    for name, f in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            w.add_key_value(name, f.contents(), f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if t.name.endswith("ffn_up_exps.weight"):
            continue
        data, qtype = np.asarray(t.data), t.tensor_type
        if t.name.endswith("ffn_gate_exps.weight"):
            up = np.asarray(tensors[t.name.replace("gate", "up")].data)
            data, name = np.concatenate([data, up], axis=1), t.name.replace("gate_exps", "gate_up_exps")
        else:
            name = t.name
        w.add_tensor(name, data, raw_dtype=None if qtype.name in ("F32", "F16") else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


def test_fused_gate_up_experts_in_a_gguf_load_like_separate_ones(tiny_gguf, tmp_path) -> None:
    """Split at load both kept in blocks and dequantized (which equals the blocks' result bit for bit)."""
    path = tiny_gguf("qwen3moe", "Q8_0")
    fused = fused_gate_up_copy(path, tmp_path / "fused.gguf")
    assert "blk.0.ffn_gate_up_exps.weight" in {t.name for t in gguf.GGUFReader(fused).tensors}
    ref = engine(path, quantized=True).score(IDS)
    assert torch.equal(engine(fused, quantized=True).score(IDS), ref)
    assert torch.equal(engine(fused, quantized=False).score(IDS), ref)


@needs_kernel
def test_bench_moe_times_both_paths_in_one_run(monkeypatch, tmp_path, capsys) -> None:
    """`bench moe` on the tiny shape (the kernels under the interpreter on the CPU, the graph timer stubbed: the
    grouped path 7 ms, the pair path 1 ms): a row per (down type, rows) with both paths, their ratio, the pair
    path's difference from the grouped one within int8 rounding, the JSON; PAIR_ROWS is put back."""
    import argparse

    import triton.testing

    from lucebox.bench import moe as bench_moe
    from lucebox.bench.spark import SHAPES

    monkeypatch.setattr(triton.testing, "do_bench_cudagraph",
                        lambda fn, **kw: (fn(), 1.0 if triton_moe.PAIR_ROWS else 7.0)[-1])
    before = triton_moe.PAIR_ROWS
    out = tmp_path / "moe.json"
    assert bench_moe.run(argparse.Namespace(shape="tiny-moe", json=out), SHAPES["tiny-moe"], ["Q6_K"], [1, 2, 80],
                         torch.device(KERNEL_DEVICE)) == 0
    assert triton_moe.PAIR_ROWS == before
    assert "pair vs grouped" in capsys.readouterr().out
    results = json.loads(out.read_text())["results"]
    assert [(r["down"], r["rows"]) for r in results] == [("Q6_K", 1), ("Q6_K", 2), ("Q6_K", 80)]
    for r in results[:2]:
        assert r["speedup"] == 7.0 and r["grouped_us"] == 7000.0 and 0 < r["routed_experts"] <= 2 * r["rows"]
        assert r["relative_difference"] < 3e-2
    prefill = results[2]  # a prefill chunk: the grouped kernel alone, its TFLOP/s from 6 x rows x k x hidden x ff
    shape = SHAPES["tiny-moe"]
    assert prefill["pair_us"] is None and prefill["speedup"] is None and prefill["relative_difference"] is None
    want = 6 * 80 * shape.top_k * shape.hidden * shape.expert_ff / 7e-3 / 1e12
    assert abs(prefill["best_tflop_s"] - want) < 1e-9 * want


def test_pair_rows_switch_reads_the_environment() -> None:
    """LUCEBOX_MOE_PAIR_ROWS=0 keeps every step on the grouped kernel (what the README's end-to-end comparison
    runs); a value that is not a whole number keeps the default, 16. LUCEBOX_MOE_MAX_ROWS: prefill steps of up to
    N rows take the grouped kernel (bench decode's comparison). The module reads them at import: one child
    process re-imports it under each setting."""
    import subprocess
    import sys

    cases = [("LUCEBOX_MOE_PAIR_ROWS", "0", "0 64"), ("LUCEBOX_MOE_PAIR_ROWS", "4", "4 64"),
             ("LUCEBOX_MOE_PAIR_ROWS", "lots", "16 64"), ("LUCEBOX_MOE_PAIR_ROWS", "-3", "16 64"),
             ("LUCEBOX_MOE_MAX_ROWS", "4096", "16 4096"), ("LUCEBOX_MOE_MAX_ROWS", "x", "16 64")]
    code = ("import importlib, os, sys\n"
            "from lucebox.engine.kernels import triton_moe as m\n"
            "for name, value in (line.split('=') for line in sys.argv[1:]):\n"
            "    os.environ.pop('LUCEBOX_MOE_PAIR_ROWS', None); os.environ.pop('LUCEBOX_MOE_MAX_ROWS', None)\n"
            "    os.environ[name] = value\n"
            "    m = importlib.reload(m)\n"
            "    print(m.PAIR_ROWS, m.MAX_ROWS)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LUCEBOX_MOE_")}
    out = subprocess.run([sys.executable, "-c", code, *(f"{n}={v}" for n, v, _ in cases)], env=env,
                         capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:len(cases)] == [want for _, _, want in cases], out.stderr[-500:]


def test_align_sorts_a_prefill_chunk_of_pairs_by_expert() -> None:
    """Above ALIGN_PAIRS (a prefill chunk under LUCEBOX_MOE_MAX_ROWS) `_align` sorts with torch: the pairs by
    expert, stable, and each expert's start, as the kernel gives them for a decode step."""
    ids = torch.randint(0, 16, (300, 8), generator=torch.Generator().manual_seed(3))
    ids[:, 1] = torch.where(ids[:, 1] == 7, 8, ids[:, 1])  # some expert counts differ
    assert ids.numel() > triton_moe.ALIGN_PAIRS
    order, starts = triton_moe._align(ids, 16)
    flat = ids.reshape(-1)
    assert order.dtype == starts.dtype == torch.int32 and starts.shape == (17,)
    assert torch.equal(order.long(), torch.sort(flat, stable=True).indices)
    assert torch.equal(starts[1:].long(), torch.cumsum(torch.bincount(flat, minlength=16), 0)) and starts[0] == 0


@needs_kernel
def test_align_kernel_and_sort_agree(monkeypatch) -> None:
    """The kernel `_align` runs up to ALIGN_PAIRS pairs and the torch sort above it give the same order and
    starts on one set of 2,400 pairs."""
    ids = torch.randint(0, 16, (300, 8), generator=torch.Generator().manual_seed(4)).to(KERNEL_DEVICE)
    by_sort = triton_moe._align(ids, 16)
    monkeypatch.setattr(triton_moe, "ALIGN_PAIRS", 1 << 20)
    by_kernel = triton_moe._align(ids, 16)
    assert torch.equal(by_sort[0], by_kernel[0]) and torch.equal(by_sort[1], by_kernel[1])
