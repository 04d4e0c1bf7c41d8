"""DFlash speculation on the Qwen3.5 hybrid: a verification keeps every row's recurrent state (every node's,
for a DDTree) and the accepted row's becomes the sequence's, so a rejected suffix rolls back exactly.

fp32 greedy on the CPU, against plain decoding of the same engine configuration: a random tiny drafter
(through the real drafter, chain and tree; it rarely agrees with the target, so nearly every draft is
rolled back), and a drafter that knows plain decoding's continuation but ranks a wrong token first at every
fourth position (chains then accept a few tokens and reject the rest; trees take the runner-up sibling),
so acceptance, partial rejection and tree branches all happen. Prefill chunks run in the same steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lucebox.engine.kernels import triton_deltanet
from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.engine.runtime.sequence import Chunk
from lucebox.engine.spec.dflash import SpecDecoder
from lucebox.engine.spec.drafter import DFlashDrafter, drafter_config_for, save_drafter
from lucebox.engine.spec.static import StaticSpec
from lucebox.engine.weights.loader import read_model_config
from tests.fixtures.tiny_models import write_tiny_qwen35_gguf
from tests.test_triton_deltanet import needs_interpreter

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

N = 14  # tokens generated per prompt


def prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in torch.randint(3, 380, (n,), generator=torch.Generator().manual_seed(seed))]


PROMPTS = [prompt(25, 9), prompt(40, 10)]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen35_spec")
    out = {"qwen35": write_tiny_qwen35_gguf(root / "dense.gguf"),
           "qwen35moe": write_tiny_qwen35_gguf(root / "moe.gguf", moe=True)}
    cfg = read_model_config(out["qwen35"])
    dcfg = drafter_config_for(cfg, layers=1, block_size=6, mask_token_id=cfg.vocab_size - 1)
    save_drafter(DFlashDrafter.random(dcfg, seed=0, std=0.2), root / "drafter")
    out["drafter"] = root / "drafter"
    return out


def engine(path: Path, **kw) -> LLMEngine:
    return LLMEngine.from_path(path, EngineConfig(device="cpu", dtype="float32", max_step_tokens=16, kv_tokens=2048,
                                                  **kw), quiet=True)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(files) -> dict[str, list[list[int]]]:
    return {arch: engine(files[arch]).generate(PROMPTS, greedy()) for arch in ("qwen35", "qwen35moe")}


class KnowingDrafter(SpecDecoder):
    """Drafts plain decoding's continuation (`answers`: prompt -> output) with certainty, except that at every
    fourth position a wrong token is ranked first and the right one a close second: a chain stops there, a
    tree takes that runner-up as its one branch and follows the continuation under it."""

    answers: dict[tuple[int, ...], list[int]]

    def draft_logprobs(self, chunks: list[Chunk]) -> torch.Tensor:
        vocab = self.drafter.cfg.vocab_size
        out = torch.full((len(chunks), self.block - 1, vocab), -30.0)
        for g, c in enumerate(chunks):
            seq = c.seq
            full = list(seq.prompt_ids) + self.answers[tuple(seq.prompt_ids)]
            for d in range(self.block - 1):
                pos = c.start + 1 + d
                right = full[pos] if pos < len(full) else 0
                wrong = (right + 7) % vocab
                out[g, d, right] = 0.0
                if pos % 4 == 3:
                    out[g, d, wrong], out[g, d, right] = 0.0, -0.2
        return out.log_softmax(-1).to(self.device)


class KnowingStatic(StaticSpec):
    """StaticSpec with its drafter pass replaced by a KnowingDrafter's drafts (the rest, verification and the
    accepted rows' bookkeeping with the hybrid's states, as served: a greedy chain in the one-launch step)."""

    def step(self, chunks, chooser, argmax=False):
        self.chunks = chunks
        return super().step(chunks, chooser, argmax)

    def _draft(self, b: int, c: int, ids, start, slots, rope):
        lp = torch.full((b, self.B - 1, self.drafter.cfg.vocab_size), -30.0)
        lp[:len(self.chunks)] = self.spec.draft_logprobs(self.chunks)
        return lp.argmax(-1) if self.K == 1 else tuple(lp.topk(self.K, dim=-1))


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("ddtree", [False, True], ids=["chain", "ddtree"])
@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_random_drafter_equals_plain(files, plain, arch: str, ddtree: bool, static: bool) -> None:
    """The real drafter path (drafter context from the hybrid's captured layers, proposals, verification
    beside prefill chunks): plain decoding's tokens, every state slot given back; also through the fixed-shape
    steps that CUDA graphs replay (spec/static.py, run eagerly here), the states kept in its buffers."""
    e = engine(files[arch], draft=str(files["drafter"]), ddtree=ddtree, ddtree_budget=9, spec_static=static)
    assert e.spec is not None and (e.spec.static is not None) == static
    assert e.generate(PROMPTS, greedy()) == plain[arch]
    assert e.spec.stats.steps > 0
    assert e.kv.states.num_free == e.kv.states.num_slots and not e.kv.states.verified


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=needs_interpreter)], ids=["torch", "kernels"])
@pytest.mark.parametrize("ddtree", [False, True], ids=["chain", "ddtree"])
def test_rollback_after_partial_acceptance(files, plain, ddtree: bool, kernels: bool, static: bool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts accepted in part: the state after the last accepted row (node) is kept, the rejected rows'
    dropped, so decoding goes on as plain decoding does; also with the DeltaNet kernels (on the CPU under
    Triton's interpreter), the verifications' rows in one launch a layer, and through the fixed-shape steps
    (the accepted row's state copied out of the kept buffers)."""
    if kernels:
        monkeypatch.setattr(triton_deltanet, "ENABLED", True)
        monkeypatch.setattr(triton_deltanet, "TREE_ENABLED", True)
        monkeypatch.setattr(triton_deltanet, "ON_CPU", True)
    e = engine(files["qwen35"], draft=str(files["drafter"]), ddtree=ddtree, ddtree_budget=9)
    knowing = KnowingDrafter(e.spec.drafter, e.loaded.model, e.kv, ddtree=ddtree, budget=9, dtype=e.loaded.dtype)
    knowing.answers = {tuple(p): out for p, out in zip(PROMPTS, plain["qwen35"])}
    e.set_speculation(knowing)
    if static:
        knowing.static = KnowingStatic(knowing, e.config.max_num_seqs, e.n_ctx)
    assert e.generate(PROMPTS, greedy()) == plain["qwen35"]
    stats = knowing.stats
    assert stats.acceptance_length > (4.0 if ddtree else 2.5), stats  # drafts accepted (in trees off the chain)
    assert stats.committed < stats.steps * e.spec.block, stats  # ... and rejected in part
    if static:  # greedy: a chain in the one-launch step, a tree in three
        assert {k[0] for k in knowing.static.graphs} == ({"draft", "verify", "extend"} if ddtree else {"chain"})


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_with_the_prefix_cache(files, plain, static: bool) -> None:
    """Speculation and the prefix cache together: a hit restores the target's KV and state and the drafter's
    context; decoding from it gives plain decoding's tokens (also through the fixed-shape steps)."""
    from lucebox.cache.manager import CacheConfig

    e = engine(files["qwen35"], draft=str(files["drafter"]), spec_static=static)
    e.enable_prefix_cache(CacheConfig(gpu=True, min_tokens=16))
    for _ in range(2):
        seqs = [e.new_sequence(p, greedy()) for p in PROMPTS]
        for s in seqs:
            s.cache_hint = e.cache.prepare(s.prompt_ids)
            e.scheduler.add(s)
        while e.has_work():
            e.step()
        e.cache.poll()
        assert [s.output_ids for s in seqs] == plain["qwen35"]
    assert [s.num_cached for s in seqs] == [len(p) - 1 for p in PROMPTS]


@pytest.mark.parametrize("ddtree", [False, True], ids=["chain", "ddtree"])
def test_verification_rows_capped(files, plain, ddtree: bool) -> None:
    """Where the memory plan caps a verification's rows (`max_rows`), a chain verifies a shorter block and a
    tree fewer nodes: fewer tokens per step, the same tokens."""
    e = engine(files["qwen35"], draft=str(files["drafter"]))
    knowing = KnowingDrafter(e.spec.drafter, e.loaded.model, e.kv, ddtree=ddtree, budget=9, dtype=e.loaded.dtype,
                             max_rows=3)
    knowing.answers = {tuple(p): out for p, out in zip(PROMPTS, plain["qwen35"])}
    e.set_speculation(knowing)
    assert knowing.rows_per_step == 3 and knowing.block > 3
    assert e.scheduler.decode_rows == knowing.block  # KV slots: the drafter's whole block writes its K/V there
    assert e.generate(PROMPTS, greedy()) == plain["qwen35"]
    assert 2.0 < knowing.stats.acceptance_length <= 3.0, knowing.stats


def test_state_budget_from_the_memory_plan() -> None:
    """The plan's rule on the Qwen3.5-27B's 149.6 MiB state: on a 24 GB card (~6 GB left after weights,
    activations and graphs) 20 slots rather than --max-num-seqs 64 (9.6 GB); a DDTree-22 verification's 23
    rows (and the state they start from) then fit one sequence only, capped to 18 rows; an H200's ~100 GB
    take all 64 plainly, and the sequences verifying 16-row chains that fit."""
    from lucebox.engine.runtime.memory_plan import state_slots

    slot, gb = int(149.6 * 2**20), 1 << 30
    assert state_slots(room=6 * gb, slot_bytes=slot, max_seqs=64) == (20, 0)
    assert state_slots(room=6 * gb, slot_bytes=slot, max_seqs=64, verify_rows=23) == (1, 18)
    assert state_slots(room=6 * gb, slot_bytes=slot, max_seqs=64, verify_rows=16) == (1, 16)
    assert state_slots(room=100 * gb, slot_bytes=slot, max_seqs=64) == (64, 0)
    assert state_slots(room=100 * gb, slot_bytes=slot, max_seqs=64, verify_rows=16) == (19, 16)
    assert state_slots(room=gb // 2, slot_bytes=slot, max_seqs=64, verify_rows=16) == (1, 0)  # no speculation


def test_live_server_two_tool_turns_with_a_disconnect(files) -> None:
    """Through the real server (tests/live_server.py) on the hybrid with its drafter and the prefix cache: a
    streamed turn that must call a tool (a constrained call, the drafts fitted to the grammar), the tool's
    result in a second streamed turn that hits the cache (KV and recurrent state restored), a stream dropped
    mid-way whose sequence is dropped with it, then a third request served; every state slot given back."""
    import json
    import socket
    import time

    from openai import OpenAI

    from tests.live_server import start_server

    server = start_server(files["qwen35"], draft=str(files["drafter"]), kv_tokens=4096, max_num_seqs=4)
    try:
        engine = server.ctx.engine.engine
        assert engine.spec is not None and engine.cache is not None
        client = OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                  "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                 "required": ["city"]}}}]
        msgs = [{"role": "system", "content": "You answer briefly. " * 40},
                {"role": "user", "content": "What is the weather in Paris?"}]
        calls: dict[int, dict] = {}
        for chunk in client.chat.completions.create(model="m", messages=msgs, tools=tools, tool_choice="required",
                                                    stream=True, max_tokens=48, temperature=0):
            for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                call = calls.setdefault(tc.index, {"id": tc.id, "name": "", "args": ""})
                call["name"] += tc.function.name or ""
                call["args"] += tc.function.arguments or ""
        call = calls[0]
        assert call["name"] == "get_weather" and isinstance(json.loads(call["args"]), dict)
        msgs += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": call["id"], "type": "function", "function": {"name": call["name"],
                                                                          "arguments": call["args"]}}]},
                 {"role": "tool", "tool_call_id": call["id"], "content": "18 C, sunny"}]
        usage, text = None, ""
        for chunk in client.chat.completions.create(model="m", messages=msgs, tools=tools, stream=True,
                                                    max_tokens=24, temperature=0,
                                                    stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            usage = chunk.usage or usage
        assert usage is not None and usage.completion_tokens > 0
        assert usage.prompt_tokens_details.cached_tokens > 0  # the first turn's prefix, KV and state
        # a stream the client drops after its first bytes
        host, port = server.url.removeprefix("http://").split(":")
        body = json.dumps({"model": "m", "stream": True, "max_tokens": 1500, "ignore_eos": True,
                           "messages": [{"role": "user", "content": "Count to one hundred."}]}).encode()
        served = server.ctx.engine
        before, steps = served.num_disconnects, served.steps
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            got = b""
            while got.count(b"data: ") < 3:  # the role chunk and two content chunks: generation is running
                got += s.recv(65536)
            assert got.startswith(b"HTTP/1.1 200")
        for _ in range(200):
            if served.num_disconnects > before:
                break
            time.sleep(0.05)
        assert served.num_disconnects == before + 1 and served.steps - steps < 1000  # dropped long before 1500
        reply = client.chat.completions.create(model="m", messages=msgs[:2], max_tokens=8, temperature=0)
        assert reply.choices[0].finish_reason in ("length", "stop")
        for _ in range(200):
            if not engine.has_work():
                break
            time.sleep(0.05)
        assert not engine.scheduler.running and engine.kv.states.num_free == engine.kv.states.num_slots
    finally:
        server.stop()
