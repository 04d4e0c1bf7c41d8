"""Models whose GGUF weights stay quantized (engine/weights/quant), on the CPU path: the loader keeps the blocks, and
the logits equal the dense path's bit for bit (fp32 dequantization is exact) and transformers' on the same
file within test_parity's tolerance.

`weights="quantized"` asks for the quantized path on the CPU (its default there is dense: the per-call dequantize
costs about 3x a dense fp32 matmul on the default model, see gguf_loader.iter_gguf_tensors); on CUDA it is
the default.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from lucebox.engine.models.layers import ConcatLinear, Linear
from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.engine.weights.loader import load_model
from lucebox.engine.weights.quant import QuantWeight
from tests.fixtures.tiny_models import gguf_qtype_counts, transformers_gguf_kwargs

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

RTOL = 1e-4
Q4_K_M = (("attn_v", "Q6_K"), ("ffn_down", "Q6_K"))  # the mix of a llama.cpp Q4_K_M file's layers


def engine(path: Path, quantized: bool) -> LLMEngine:
    loaded = load_model(path, device="cpu", dtype=torch.float32, quiet=True,
                        weights="quantized" if quantized else "dense")
    return LLMEngine(loaded, EngineConfig(device="cpu", dtype="float32", kv_tokens=2048))


def weight_bytes(e: LLMEngine) -> tuple[int, int]:
    """(bytes in quantized blocks, bytes in dense weight matrices) of the engine's model."""
    quant = dense = 0
    for m in e.loaded.model.modules():
        if getattr(m, "qtype", None) is not None:
            quant += m.qdata.numel()
        elif isinstance(m, Linear):
            dense += m.weight.numel() * m.weight.element_size()
    return quant, dense


@pytest.mark.parametrize(("arch", "qtype", "overrides"), [
    ("llama", "Q4_0", {}), ("llama", "Q4_1", {}), ("llama", "Q5_0", {}), ("llama", "Q5_1", {}),
    ("llama", "Q8_0", {}), ("llama", "Q4_K", {}), ("llama", "Q5_K", {}), ("llama", "Q6_K", {}),
    ("qwen2", "Q8_0", {}), ("qwen3", "Q4_K", {"layer_qtypes": Q4_K_M}), ("gemma3", "Q6_K", {}),
    ("gemma3", "Q5_0", {"tied": False, "output_qtype": "Q8_0"}),
])
def test_quantized_cpu_path_equals_dense_and_matches_transformers(tiny_gguf, arch, qtype, overrides) -> None:
    path = tiny_gguf(arch, qtype, **overrides)
    quant, dense = engine(path, True), engine(path, False)
    q_bytes, d_bytes = weight_bytes(quant)
    assert q_bytes > 0 and d_bytes == 0, "every linear weight should stay quantized"
    ids = list(range(3, 40)) + list(range(100, 140))
    ours = quant.score(ids)
    assert torch.equal(ours, dense.score(ids))
    kwargs = transformers_gguf_kwargs(arch, qtype, **overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                           **kwargs)
    with torch.no_grad():
        ref = hf.eval()(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max().item() <= RTOL * ref.abs().max().item()


def test_mixed_types_in_one_projection_run_side_by_side(tiny_gguf) -> None:
    path = tiny_gguf("qwen3", "Q4_K", layer_qtypes=Q4_K_M)
    assert gguf_qtype_counts(path).get("Q6_K", 0) >= 4
    blk = engine(path, True).loaded.model.blk[0]
    assert isinstance(blk.attn_qkv, ConcatLinear)
    # q and k (both Q4_K) fuse into one weight beside v's: two kernels, not three
    assert [(p.qtype, p.out_features) for p in blk.attn_qkv.parts] == [("Q4_K", 4 * 128 + 2 * 128), ("Q6_K", 2 * 128)]
    assert blk.ffn_gate_up.qtype == "Q4_K" and blk.ffn_down.qtype == "Q6_K"


def test_weights_take_the_files_tensor_bytes(smollm2_path) -> None:
    """Quantized weights hold exactly the file's block bytes (plus the small F32 norms)."""
    from lucebox.engine.weights.gguf_file import GGUFFile

    e = engine(smollm2_path, True)
    file_bytes = sum(t.n_bytes for t in GGUFFile(smollm2_path).tensors)
    model_bytes = sum(b.numel() * b.element_size() for b in e.loaded.model.buffers() if b.dtype == torch.uint8)
    model_bytes += sum(p.numel() * p.element_size() for p in e.loaded.model.parameters())
    assert abs(model_bytes - file_bytes) <= 0.05 * file_bytes
    assert e.loaded.model.token_embd.qtype is not None


def test_real_model_quantized_equals_dense(smollm2_path) -> None:
    quant, dense = engine(smollm2_path, True), engine(smollm2_path, False)
    ids = quant.tokenizer.encode("<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
                                 add_special=True)
    assert torch.equal(quant.score(ids), dense.score(ids))
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    assert quant.generate([ids], params) == dense.generate([ids], params)


def test_types_without_kernels_are_dequantized_at_load_with_a_log_line(tiny_gguf, caplog) -> None:
    path = tiny_gguf("llama", "Q3_K")
    with caplog.at_level(logging.INFO, logger="lucebox.engine.weights.gguf_loader"):
        e = engine(path, True)
    assert any("Q3_K" in r.getMessage() and "dequantizing" in r.getMessage() for r in caplog.records)
    assert weight_bytes(e)[1] > 0  # held dense


def test_auto_weights_policy_weighs_the_dense_copy_against_the_gpu_memory_cap():
    """`--weights auto` on CUDA keeps blocks quantized when dense weights take over half the room, and for
    quantized experts: under a --gpu-memory cap the room is the cap, not the device's free memory (a 16 GB dense
    copy fits an H200 but not a 24 GB budget). It never picks "both" yet (not run on a GPU; opt-in)."""
    from lucebox.engine.weights.gguf_loader import weights_policy

    gb = 1 << 30
    assert weights_policy(16 * gb, free_bytes=139 * gb) == "dense"
    assert weights_policy(16 * gb, free_bytes=139 * gb, cap_bytes=24 * gb) == "quantized"
    assert weights_policy(16 * gb, free_bytes=20 * gb, cap_bytes=64 * gb) == "quantized"  # the smaller of the two
    assert weights_policy(4 * gb, free_bytes=139 * gb, cap_bytes=24 * gb) == "dense"
    assert weights_policy(57 * gb, free_bytes=139 * gb, moe=True) == "quantized"  # quantized experts decode faster
    assert weights_policy(4 * gb, free_bytes=139 * gb, moe=True) == "quantized"


def test_weights_both_keeps_a_dense_copy_in_step_with_the_blocks(tiny_gguf, monkeypatch) -> None:
    """`--weights both` on the CPU: every kept tensor carries its dense copy (the blocks dequantized), fused
    projections (q|k|v, gate|up) stack the copies as they stack the blocks, llama's q/k un-permute moves the copy's
    rows with the blocks', and the model's logits equal the blocks-only model's (off CUDA both compute from the
    blocks' values: the CPU reads the copy instead of dequantizing per call; on CUDA
    `test_weights_both_runs_few_rows_on_the_blocks_and_many_on_the_dense_copy` checks which rows each serves)."""
    path = tiny_gguf("llama", "Q4_K", layer_qtypes=Q4_K_M)
    both = load_model(path, device="cpu", dtype=torch.float32, quiet=True, weights="both")
    held = [m for m in both.model.modules() if getattr(m, "qtype", None) is not None]
    assert held and all("qdense" in m._buffers for m in held)
    for m in held:
        assert torch.equal(m.qdense, m.quant.dequantize(torch.float32)), m
        assert m.quant.dense is m.qdense and m.quant.dense_as(torch.float32) is m.qdense
    quant = LLMEngine(load_model(path, device="cpu", dtype=torch.float32, quiet=True, weights="quantized"),
                      EngineConfig(device="cpu", dtype="float32", kv_tokens=2048))
    ids = list(range(3, 40))
    want = quant.score(ids)
    both_engine = LLMEngine(both, EngineConfig(device="cpu", dtype="float32", kv_tokens=2048))

    def no_dequantize(*args, **kwargs):
        raise AssertionError("a weight held both ways was dequantized per call")

    monkeypatch.setattr(QuantWeight, "dequantize", no_dequantize)
    assert torch.equal(both_engine.score(ids), want)


@pytest.mark.parametrize("arch,qtype,experts", [("qwen3moe", "Q8_0", True), ("qwen3moe", "F32", False),
                                                ("qwen3", "Q8_0", False)])
def test_auto_weights_policy_finds_quantized_experts(tiny_gguf, arch, qtype, experts) -> None:
    """What `--weights auto` reads to keep a mixture of experts quantized: stacked expert tensors
    (`blk.N.ffn_*_exps.weight`) in a kept quant type; a dense model's Q8_0 linears or an F32 MoE do not count."""
    from lucebox.engine.weights.gguf_loader import open_gguf, quantized_experts

    assert quantized_experts(open_gguf(tiny_gguf(arch, qtype))) is experts


def test_the_tuners_choice_is_summarized_for_the_log() -> None:
    """The start-up log line and `bench decode` say how many tuned shapes run the int8-activation kernels."""
    from lucebox.engine.weights.quant import linear

    tuned = {("gemv", "Q4_K", 4096, 4096): (64, 2, 4, 4, "q8x"), ("gemv", "Q6_K", 1024, 4096): (8, 2, 4, 4),
             ("small", "Q4_K", 4096, 4096): (128, 1, 4, 4, "q8x")}
    assert linear.summary(tuned) == "3 (path, type, shape) cases, 2 of them on the int8-activation kernels"
    assert linear.summary({}) == "0 (path, type, shape) cases, 0 of them on the int8-activation kernels"
