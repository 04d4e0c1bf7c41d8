"""The Gated DeltaNet decode kernels (lucebox/engine/kernels/triton_deltanet.py) against the plain-torch decode of
models/qwen35.py, and the hybrid engine's kernel and CUDA graph paths against its eager torch path.

The kernel tests run on CUDA, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1; skipped otherwise):
head shapes off the kernels' power-of-two blocks (odd key dims, more value columns than one block, one key
head for three value heads), rows in slots out of order, a second step on reused slots, both write modes
(staged for the commit, and in place). fp32 throughout. The CUDA graph test runs on CUDA only.
"""

from __future__ import annotations

import os

import pytest
import torch

from lucebox.engine.kernels import triton_deltanet
from lucebox.engine.models.config import ModelConfig
from lucebox.engine.models.qwen35 import DeltaNetBlock
from lucebox.engine.runtime.recurrent_state import RecurrentStates, StateRows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(
    triton_deltanet.triton is None or (DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs triton on CUDA, or TRITON_INTERPRET=1 on the CPU")
# (tests that run the kernels on CPU tensors next to the CPU engine's torch path)
needs_interpreter = pytest.mark.skipif(triton_deltanet.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="needs triton's interpreter (TRITON_INTERPRET=1)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's numpy


def linear_config(k_heads: int, v_heads: int, k_dim: int, v_dim: int, kernel: int) -> ModelConfig:
    """One Gated DeltaNet layer of the given head shape (hidden 32)."""
    return ModelConfig(arch="qwen35", name="deltanet", vocab_size=64, hidden_size=32, intermediate_size=64,
                       num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6, max_position=256,
                       rope_theta=1e4, layer_types=["linear"], linear_k_heads=k_heads, linear_v_heads=v_heads,
                       linear_k_dim=k_dim, linear_v_dim=v_dim, linear_conv_kernel=kernel)


def random_block(cfg: ModelConfig, gen: torch.Generator) -> DeltaNetBlock:
    block = DeltaNetBlock(cfg, 0)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.4 if "conv" in name else 1.0))
        block.ssm_a.copy_(-torch.rand(block.v_heads, generator=gen).exp())  # -exp(A_log), A_log in [0, 1)
    return block.to(DEVICE)


def step(block: DeltaNetBlock, states: RecurrentStates, slots: list[int], inputs: tuple[torch.Tensor, ...],
         kernel: bool, in_place: bool, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """One decode step of `block` for rows in `slots` (the kernels or plain torch), committed; its outputs."""
    monkeypatch.setattr(triton_deltanet, "ON_CPU", kernel)
    monkeypatch.setattr(triton_deltanet, "ENABLED", kernel)
    rows = StateRows(states, len(slots), torch.tensor(slots, device=DEVICE), [], in_place=in_place)
    mixed, a, b = inputs
    assert triton_deltanet.use_kernel(mixed) == kernel
    out = torch.empty(len(slots), block.v_heads, block.v_dim, device=DEVICE)
    before = states.conv.clone(), states.ssm.clone()
    block.decode(mixed, a, b, rows, 0, out)
    if not in_place:  # staged: nothing is written before the commit (a step that raises leaves the states)
        assert torch.equal(states.conv, before[0]) and torch.equal(states.ssm, before[1])
    rows.commit()
    return out


# (k heads, v heads, k dim, v dim, conv kernel): the tiny test models' shape, one key head for three value
# heads with dims off the blocks, and more value columns than one block (40 > 32) with a 3-tap conv.
SHAPES = [(2, 4, 16, 16, 4), (1, 3, 8, 12, 4), (3, 3, 5, 40, 3)]


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("in_place", [False, True], ids=["staged", "in_place"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_decode_kernel_matches_torch(shape, in_place: bool, dtype: torch.dtype,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Two steps: rows in slots 3, 1, 4 of 5 (random states), then slots 4 and 3 again; outputs and every slot's
    states (the untouched ones too) equal the torch path's. Projections in `dtype` (a bf16 model's), math in
    fp32."""
    gen = torch.Generator().manual_seed(sum(shape))
    cfg = linear_config(*shape)
    block = random_block(cfg, gen)
    ref_states = RecurrentStates(cfg, 5, DEVICE)
    ref_states.conv.copy_(torch.randn(ref_states.conv.shape, generator=gen))
    ref_states.ssm.copy_(torch.randn(ref_states.ssm.shape, generator=gen) * 0.3)
    states = RecurrentStates(cfg, 5, DEVICE)
    states.conv.copy_(ref_states.conv)
    states.ssm.copy_(ref_states.ssm)
    for slots in ([3, 1, 4], [4, 3]):
        n = len(slots)
        inputs = tuple((torch.randn(n, m, generator=gen) * scale).to(DEVICE, dtype)
                       for m, scale in ((block.conv_dim, 1), (block.v_heads, 2), (block.v_heads, 2)))
        ref = step(block, ref_states, slots, inputs, False, False, monkeypatch)
        ours = step(block, states, slots, inputs, True, in_place, monkeypatch)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(states.conv, ref_states.conv, rtol=0, atol=0)  # a shift: exact
        torch.testing.assert_close(states.ssm, ref_states.ssm, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize(("heads", "k_dim", "v_dim"), [(3, 8, 20), (2, 16, 40)])
def test_chunk_scan_matches_torch(monkeypatch: pytest.MonkeyPatch, heads: int, k_dim: int, v_dim: int) -> None:
    """The chunked delta rule with its pass over the blocks in the kernel, from a non-zero state over 150 rows
    (2 x 64 + 22), dims off the kernel's blocks (8 < 16 keys; 20 and 40 value columns): the torch loop's outputs
    and final state."""
    from lucebox.engine.models.qwen35 import chunk_gated_delta

    gen = torch.Generator().manual_seed(heads + k_dim)
    T = 150
    q, k = (torch.nn.functional.normalize(torch.randn(T, heads, k_dim, generator=gen), dim=-1).to(DEVICE)
            for _ in range(2))
    v = torch.randn(T, heads, v_dim, generator=gen).to(DEVICE)
    g = (-torch.rand(T, heads, generator=gen) * 2).to(DEVICE)
    beta = torch.rand(T, heads, generator=gen).to(DEVICE)
    s0 = torch.randn(heads, k_dim, v_dim, generator=gen).to(DEVICE)
    monkeypatch.setattr(triton_deltanet, "ENABLED", False)
    ref, ref_state = chunk_gated_delta(q, k, v, g, beta, s0)
    monkeypatch.setattr(triton_deltanet, "ENABLED", True)
    monkeypatch.setattr(triton_deltanet, "ON_CPU", True)
    calls = []
    scan = triton_deltanet.chunk_scan
    monkeypatch.setattr(triton_deltanet, "chunk_scan", lambda *a: calls.append(1) or scan(*a))
    out, state = chunk_gated_delta(q, k, v, g, beta, s0)
    assert calls == [1]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, ref_state, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("parents", [[-1, 0, 1, 2, 3, 4], [-1, 0, 0, 1, 1, 2, 4, 6, -1, 8]], ids=["chain", "tree"])
def test_tree_step_matches_torch(parents: list[int]) -> None:
    """A verification's rows in one launch (tree_step) against the torch recurrence row by row, each from its
    parent's state (or the slot's): every row's output and state. Off the kernel's blocks: 12 key dims (16), 40
    value columns (two blocks of 32); alpha and beta as strided views of wider tensors; a second root row."""
    from lucebox.engine.models.qwen35 import recurrent_gated_delta_step

    gen = torch.Generator().manual_seed(len(parents))
    n, H, DK, DV = len(parents), 3, 12, 40
    q, k = (torch.nn.functional.normalize(torch.randn(n, H, DK, generator=gen), dim=-1).to(DEVICE) for _ in range(2))
    v = torch.randn(n, H, DV, generator=gen).to(DEVICE)
    alpha, beta = (torch.randn(n, 2 * H, generator=gen).to(DEVICE)[:, :H] for _ in range(2))
    ssm_a, dt_bias = (-torch.rand(H, generator=gen).exp()).to(DEVICE), torch.randn(H, generator=gen).to(DEVICE)
    s0 = torch.randn(H, DK, DV, generator=gen).to(DEVICE)
    g = ssm_a * torch.nn.functional.softplus(alpha + dt_bias)
    ref_states, ref_out = [s0], []
    for r, p in enumerate(parents):
        o, st = recurrent_gated_delta_step(q[r:r + 1], k[r:r + 1], v[r:r + 1], g[r:r + 1], torch.sigmoid(beta[r:r + 1]),
                                           ref_states[p + 1][None])
        ref_out.append(o[0])
        ref_states.append(st[0])
    states = torch.empty(n + 1, H, DK, DV, device=DEVICE)
    states[0] = s0
    out = torch.empty(n, H, DV, device=DEVICE)
    pids = torch.tensor([p + 1 for p in parents], dtype=torch.int32, device=DEVICE)
    triton_deltanet.tree_step(q, k, v, alpha, beta, ssm_a, dt_bias, pids, states, out)
    torch.testing.assert_close(out, torch.stack(ref_out), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, torch.stack(ref_states), rtol=1e-5, atol=1e-5)
    assert torch.equal(states[0], s0)


def greedy_tokens(path, max_tokens: int, **config) -> list[list[int]]:
    """The tiny qwen35 at `path` (fp32, eager) decoding two prompts together, greedy: its tokens."""
    from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
    from lucebox.engine.runtime.sampler import SamplingParams

    prompts = [[(7 * i + 3) % 300 + 3 for i in range(11)], [(5 * i + 1) % 300 + 3 for i in range(6)]]
    engine_config = EngineConfig(device=DEVICE, dtype="float32", kv_tokens=512, cuda_graphs=False,
                                 **{"max_step_tokens": 32, **config})
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return LLMEngine.from_path(path, engine_config, quiet=True).generate(prompts, params)


@needs_kernel
@pytest.mark.parametrize("ddtree", [False, True], ids=["chain", "ddtree"])
def test_engine_verification_kernel_gives_plain_tokens(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                       ddtree: bool) -> None:
    """The tiny qwen35 (fp32) speculating with a random drafter, its verifications' delta rule in the kernel
    (one launch a linear layer a verification), gives plain decoding's greedy tokens."""
    pytest.importorskip("transformers")
    from lucebox.engine.spec.drafter import DFlashDrafter, drafter_config_for, save_drafter
    from lucebox.engine.weights.loader import read_model_config
    from tests.fixtures.tiny_models import write_tiny_qwen35_gguf

    path = write_tiny_qwen35_gguf(tmp_path / "tiny.gguf")
    cfg = read_model_config(path)
    dcfg = drafter_config_for(cfg, layers=1, block_size=5, mask_token_id=cfg.vocab_size - 1)
    save_drafter(DFlashDrafter.random(dcfg, seed=0, std=0.2), tmp_path / "drafter")
    monkeypatch.setattr(triton_deltanet, "ENABLED", False)
    plain = greedy_tokens(path, 8)
    calls = []
    kernel = triton_deltanet.tree_step
    monkeypatch.setattr(triton_deltanet, "tree_step", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    monkeypatch.setattr(triton_deltanet, "ENABLED", True)
    monkeypatch.setattr(triton_deltanet, "TREE_ENABLED", True)
    monkeypatch.setattr(triton_deltanet, "ON_CPU", True)
    spec = dict(draft=str(tmp_path / "drafter"), ddtree=ddtree, ddtree_budget=6, spec_adaptive=False)
    assert greedy_tokens(path, 8, **spec) == plain
    assert len(calls) >= 4 * 2  # 4 linear layers x at least 2 verifications


@needs_kernel
def test_engine_kernel_path_gives_torch_tokens(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny qwen35 (fp32) decoding two prompts together through the kernels gives the torch path's greedy
    tokens; the kernels ran for every linear layer of every decode step."""
    pytest.importorskip("transformers")
    from tests.fixtures.tiny_models import write_tiny_qwen35_gguf

    path = write_tiny_qwen35_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setattr(triton_deltanet, "ENABLED", False)
    eager = greedy_tokens(path, 6, max_step_tokens=16)  # the prompts' prefill cut across steps
    calls = []
    kernel = triton_deltanet.decode_step
    monkeypatch.setattr(triton_deltanet, "decode_step", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    monkeypatch.setattr(triton_deltanet, "ENABLED", True)
    monkeypatch.setattr(triton_deltanet, "ON_CPU", True)
    assert greedy_tokens(path, 6, max_step_tokens=16) == eager
    assert len(calls) >= 4 * 5  # 4 linear layers x at least 5 decode steps


@needs_kernel
def test_in_place_step_equals_staged_step(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step of the tiny qwen35 as a CUDA graph runs it (every linear layer's kernels writing the slots in
    place) gives the eager step's logits and new states (staged, then committed), bit for bit."""
    pytest.importorskip("transformers")
    from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
    from lucebox.engine.runtime.model_runner import is_decode
    from lucebox.engine.runtime.sampler import SamplingParams
    from tests.fixtures.tiny_models import write_tiny_qwen35_gguf

    monkeypatch.setattr(triton_deltanet, "ON_CPU", True)
    monkeypatch.setattr(triton_deltanet, "ENABLED", True)
    config = EngineConfig(device=DEVICE, dtype="float32", kv_tokens=512, max_step_tokens=16, cuda_graphs=False)
    e = LLMEngine.from_path(write_tiny_qwen35_gguf(tmp_path / "tiny.gguf"), config, quiet=True)
    for n in (5, 9):
        e.add([(3 * i + 7) % 300 + 3 for i in range(n)], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    while e.scheduler.waiting or any(s.num_pending > 1 for s in e.scheduler.running):
        e.step()
    chunks = e.scheduler.schedule()
    assert len(chunks) == 2 and all(is_decode(c) for c in chunks)
    states = e.kv.states
    before = states.conv.clone(), states.ssm.clone()
    results = []
    for in_place in (False, True):
        states.conv.copy_(before[0])
        states.ssm.copy_(before[1])
        inputs = e.runner.prepare(chunks)
        inputs.state.in_place = in_place
        results.append((e.runner.forward(inputs).logits, states.conv.clone(), states.ssm.clone()))
    for staged, in_place in zip(*results):
        assert torch.equal(staged, in_place)
    assert not torch.equal(results[0][2], before[1])  # the step moved the states on


def staggered_tokens_on_cuda(path, **config):
    """The tiny qwen35 at `path` on CUDA (fp32) decoding 3 prompts of different lengths to different lengths
    (they start and end at different steps, so graph buckets change and padding rows run): (tokens, engine)."""
    from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
    from lucebox.engine.runtime.sampler import SamplingParams

    prompts = [[(7 * i + 3) % 300 + 3 for i in range(n)] for n in (40, 9, 23)]
    engine_config = EngineConfig(device="cuda", dtype="float32", kv_tokens=1024, max_step_tokens=16, max_num_seqs=4,
                                 **config)
    e = LLMEngine.from_path(path, engine_config, quiet=True)
    seqs = [e.add(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, [20, 12, 16])]
    while e.has_work():
        e.step()
    return [s.output_ids for s in seqs], e


@needs_cuda
@pytest.mark.parametrize("moe", [False, True], ids=["qwen35", "qwen35moe"])
def test_graph_decode_equals_eager(tmp_path, moe: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, decode steps replayed from CUDA graphs (the state slots among the graph's packed inputs, the
    kernels updating them in place) give the eager engine's greedy tokens, for batches of 1 to 3 sequences
    that start and end at different steps (graph buckets change, padding rows use the scratch slot).
    Both are on by default since this passed on the H200 (LUCEBOX_HYBRID_GRAPHS, LUCEBOX_DELTANET_KERNEL)."""
    pytest.importorskip("transformers")
    from lucebox.engine.runtime import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "HYBRID", True)
    monkeypatch.setattr(triton_deltanet, "ENABLED", True)
    from tests.fixtures.tiny_models import write_tiny_qwen35_gguf

    path = write_tiny_qwen35_gguf(tmp_path / "tiny.gguf", moe=moe)
    eager, _ = staggered_tokens_on_cuda(path, cuda_graphs=False)
    replayed, e = staggered_tokens_on_cuda(path, cuda_graphs=True)
    assert e.runner.graphs is not None and e.runner.graphs.graphs  # decode steps took graphs
    assert replayed == eager
    assert e.kv.states.num_free == e.kv.states.num_slots


@needs_cuda
@pytest.mark.parametrize("ddtree", [False, True], ids=["chain", "ddtree"])
def test_graph_speculation_equals_plain(tmp_path, ddtree: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, the hybrid's speculative steps replayed as CUDA graphs (spec/static.py: the drafter pass, the
    verification with `tree_step` keeping every row's states in fixed buffers, and the bookkeeping that writes
    the accepted row's state to the slot) give eager plain decoding's greedy tokens, for 3 sequences of
    different lengths that start and end at different steps; every slot is given back."""
    pytest.importorskip("transformers")
    from lucebox.engine.runtime import cuda_graphs
    from lucebox.engine.spec.drafter import DFlashDrafter, drafter_config_for, save_drafter
    from lucebox.engine.weights.loader import read_model_config
    from tests.fixtures.tiny_models import write_tiny_qwen35_gguf

    monkeypatch.setattr(cuda_graphs, "HYBRID", True)
    monkeypatch.setattr(triton_deltanet, "ENABLED", True)
    monkeypatch.setattr(triton_deltanet, "TREE_ENABLED", True)
    path = write_tiny_qwen35_gguf(tmp_path / "tiny.gguf")
    cfg = read_model_config(path)
    dcfg = drafter_config_for(cfg, layers=1, block_size=5, mask_token_id=cfg.vocab_size - 1)
    save_drafter(DFlashDrafter.random(dcfg, seed=0, std=0.2), tmp_path / "drafter")
    plain, _ = staggered_tokens_on_cuda(path, cuda_graphs=False)
    spec, e = staggered_tokens_on_cuda(path, cuda_graphs=True, draft=str(tmp_path / "drafter"), ddtree=ddtree,
                                       ddtree_budget=6, spec_adaptive=False)
    assert e.spec is not None and e.spec.static is not None
    # Greedy chain steps run the one-launch "chain" graph; a hybrid's DDTree verifies in three launches.
    want = "verify" if ddtree else "chain"
    assert any(kind == want for kind, _, _ in e.spec.static.graphs) and e.spec.stats.steps > 0
    assert spec == plain
    assert e.kv.states.num_free == e.kv.states.num_slots
