"""Start-up: the warm-up captures every graph bucket and compiles every kernel before `/health` says ready,
and the memory plan sizes the KV cache from what the weights and a measured activation peak leave.

CPU tests run the real engine on the default model; the CUDA ones (captures and compiles after ready, the
--gpu-memory cap) skip without CUDA.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import multiprocessing
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from lucebox.api.common import ServerContext
from lucebox.cli import build_parser, generate_config, parse_argv
from lucebox.engine.runtime import warmup
from lucebox.engine.runtime.cuda_graphs import MIN_CTX, all_buckets, batch_buckets, ctx_buckets, pick_buckets
from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.memory_plan import GB, extrapolate_peak, plan_memory
from lucebox.errors import LuceboxError
from lucebox.http import HttpServer
from lucebox.serve import ServerConfig, http_options, make_app, start_engine
from tests.memory import release_memory

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA (run on the GPU machine)")


# ----- bucket enumeration ---------------------------------------------------------------------------------


def _graph_ctx(n_ctx: int, page: int = 16) -> int:
    """The context bound CudaGraphDecoder and StaticSpec use for a model context (rounded to a page)."""
    return max(MIN_CTX, -(-n_ctx // page) * page)


def _reachable(batches: list[int], max_ctx: int) -> set[tuple[int, int]]:
    """Every bucket pick_buckets returns for every batch size and every context up to max_ctx."""
    out = set()
    for n in range(1, batches[-1] + 1):
        for ctx in range(1, max_ctx + 1):
            b = pick_buckets(batches, max_ctx, n, ctx)
            assert b is not None
            out.add(b)
    return out


@pytest.mark.parametrize("max_batch,n_ctx", [(1, 100), (3, 256), (16, 8192), (20, 3000), (64, 4100)])
def test_every_reachable_bucket_is_enumerated_once(max_batch, n_ctx):
    batches = batch_buckets(max_batch)
    max_ctx = _graph_ctx(n_ctx)
    buckets = all_buckets(batches, max_ctx)
    assert len(buckets) == len(set(buckets))
    assert set(buckets) == _reachable(batches, max_ctx)
    # largest first: later captures reuse the memory the first ones freed in the shared pool
    assert buckets[0] == (batches[-1], max_ctx) and buckets[-1] == (batches[0], MIN_CTX)


def test_context_buckets_of_the_default_engine_config(smollm2_path):
    """The buckets the default model's server reaches (its context, --max-num-seqs 16) are all enumerated."""
    from lucebox.engine.weights.loader import read_model_config

    cfg = ServerConfig()
    max_ctx = _graph_ctx(read_model_config(smollm2_path).max_position, EngineConfig().block_size)
    assert ctx_buckets(max_ctx) == [256, 512, 1024, 2048, 4096, 8192]
    assert set(all_buckets(batch_buckets(cfg.max_num_seqs), max_ctx)) == _reachable(
        batch_buckets(cfg.max_num_seqs), max_ctx)


def test_spec_graph_keys_cover_every_bucket_and_kind(tiny_gguf, tmp_path):
    from tests.test_spec import random_drafter

    target = tiny_gguf("llama", "F32")
    draft = random_drafter(target, tmp_path / "d", layers=1, block=4)
    engine = LLMEngine.from_path(target, EngineConfig(device="cpu", dtype="float32", kv_tokens=1024, max_num_seqs=5,
                                                      draft=str(draft), spec_static=True), quiet=True)
    static = engine.spec.static
    keys = static.graph_keys()
    buckets = all_buckets(static.batches, static.max_ctx)
    assert static.kinds == ("draft", "verify", "extend", "chain")  # a chain drafter: also the one-launch step
    assert len(keys) == 4 * len(buckets) == len(set(keys))
    assert {(b, c) for _, b, c in keys} == _reachable(static.batches, static.max_ctx)
    # within a bucket verify comes before extend (extend reads verify's outputs)
    assert all(keys.index(("verify", b, c)) < keys.index(("extend", b, c)) for b, c in buckets)
    assert static.capture_all() == len(keys) and static.capture_all() == 0  # on the CPU: eager, nothing captured


# ----- the eager shape classes ----------------------------------------------------------------------------


def test_shape_lengths_cover_triton_specialisation_classes():
    """Triton specialises integer arguments on == 1 and % 16 == 0: the prompts give fresh chunks of both
    non-1 classes, the largest chunk, and chunks over a cached context of both classes."""
    chunk = 2048
    lengths = warmup.shape_lengths(chunk, 10_000)
    fresh = {min(n, chunk) for n in lengths}
    over_ctx = {n - chunk for n in lengths if n > chunk}
    assert chunk in fresh and any(n % 16 == 0 and n < chunk for n in fresh) and any(n % 16 for n in fresh)
    assert any(n % 16 == 0 for n in over_ctx) and any(n % 16 for n in over_ctx)
    assert all(1 <= n <= 100 for n in warmup.shape_lengths(2048, 100))  # a short context bounds them


def test_warm_requests_run_mixed_steps_and_leave_nothing_behind(tiny_gguf):
    """The CUDA warm-up's request pattern, run on the CPU with a small chunk: the steps include a fresh
    chunk, a chunk over a cached context, and a prefill next to decodes; afterwards the engine is idle,
    every block is free and nothing was cached."""
    from lucebox.cache.manager import CacheConfig

    engine = LLMEngine.from_path(tiny_gguf("llama", "F32"), EngineConfig(
        device="cpu", dtype="float32", kv_tokens=1024, max_step_tokens=16, max_num_seqs=4), quiet=True)
    engine.enable_prefix_cache(CacheConfig())
    steps: list[list[tuple[int, int, int]]] = []
    step = engine.step

    def recording_step():
        out = step()
        steps.append(list(engine.last_step))
        return out

    engine.step = recording_step
    ran = warmup.warm_requests(engine, [16 + 5, 3, 8])
    assert ran == len(steps) and ran >= 3
    rows = [r for s in steps for r in s]
    assert any(start == 0 and n == 16 for _, start, n in rows), "no full fresh chunk"
    assert any(start == 16 and n == 5 for _, start, n in rows), "no chunk over a cached context"
    assert any(any(n == 1 and start > 0 for _, start, n in s) and any(n > 1 for _, _, n in s) for s in steps), \
        "no mixed decode + prefill step"
    assert not engine.has_work() and engine.kv.pool.num_used == 0
    assert engine.cache is not None and engine.scheduler.cache is engine.cache
    assert engine.cache.stats()["gpu"]["hits"] == 0 and engine.cache.blocks_held == 0


def test_warm_requests_with_a_drafter_leave_no_stats(tiny_gguf, tmp_path):
    """With a drafter the warm-up's decodes are speculative steps; its stats and blocks are not left behind."""
    from tests.test_spec import random_drafter

    target = tiny_gguf("llama", "F32")
    draft = random_drafter(target, tmp_path / "d", layers=1, block=4)
    engine = LLMEngine.from_path(target, EngineConfig(device="cpu", dtype="float32", kv_tokens=1024, max_num_seqs=4,
                                                      max_step_tokens=16, draft=str(draft)), quiet=True)
    steps = []
    record = engine.spec.record

    def recording(*args):
        steps.append(args)
        return record(*args)

    engine.spec.record = recording  # counts the verifications (the stats are what is under test)
    warmup.warm_requests(engine, [21, 3, 8])
    assert steps, "no speculative step ran"
    s = engine.spec.stats
    assert (s.steps, s.committed, s.drafted) == (0, 0, 0)
    assert not engine.has_work() and engine.kv.pool.num_used == 0


# ----- /health before and after -------------------------------------------------------------------------


def _get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


class Server:
    """The server as `python -m lucebox serve` runs it (socket first, then load + warm-up in a thread),
    in a background thread; `polls` records /health from the moment the socket is bound until ready."""

    def __init__(self, cfg: ServerConfig, poll: bool = False) -> None:
        self.cfg, self.ctx = cfg, ServerContext(model_id="smollm2", n_ctx=0)
        self.port = 0
        self.polls: list[tuple[float, int, bytes]] = []  # (monotonic time the answer came, status, body)
        self._stop = False
        self._error: BaseException | None = None
        bound, done = threading.Event(), threading.Event()

        async def main() -> None:
            router = make_app(self.ctx)
            server = HttpServer(router, **http_options(self.ctx, cfg, router))
            await server.start()
            self.port = server.port
            bound.set()
            try:
                await start_engine(self.ctx, cfg)
            except BaseException as exc:  # noqa: BLE001 - raised in the test's thread
                self._error = exc
            done.set()
            while not self._stop:
                await asyncio.sleep(0.05)
            await server.shutdown(1.0)
            if self.ctx.engine is not None:
                await self.ctx.engine.stop()

        self._thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
        self._thread.start()
        assert bound.wait(60), "the socket was not bound"
        deadline = time.monotonic() + 300
        while not done.wait(0.02 if poll else 1.0):
            assert time.monotonic() < deadline, "the server did not start in 300 s"
            if poll:
                status, body = _get(self.port, "/health")
                self.polls.append((time.monotonic(), status, body))
        if self._error is not None:
            self.stop()
            raise self._error

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._stop = True
        self._thread.join(30)
        self.ctx = None  # type: ignore[assignment]
        release_memory()


def test_health_is_loading_until_the_warm_up_is_done(smollm2_path):
    """A real server: /health answers 503 `loading` while the model loads and warms up, 200 only once the
    warm-up has ended; /props reports the warm-up and /metrics the captures and compiles after it (none)."""
    server = Server(ServerConfig(model=str(smollm2_path), port=0, device="cpu", dtype="float32", kv_tokens=2048,
                                 max_num_seqs=2, prefill_compression="off"), poll=True)
    try:
        engine = server.ctx.engine.engine
        assert engine.warm_up_end is not None, "the server did not warm the engine up"
        assert server.polls, "no /health answer while loading"
        _, status, body = server.polls[0]
        assert status == 503 and json.loads(body) == {"status": "loading"}
        ready = [t for t, status, _ in server.polls if status != 503]
        assert all(t >= engine.warm_up_end for t in ready), "/health said ready before the warm-up ended"
        assert _get(server.port, "/health")[0] == 200
        status, body = _get(server.port, "/props")
        warm = json.loads(body)["warm_up"]
        assert status == 200 and warm["done"] and warm["seconds"] >= 0 and warm["captures_after_ready"] == 0
        metrics = _get(server.port, "/metrics")[1].decode()
        assert "lucebox_graph_captures_after_ready_total 0" in metrics
        assert "lucebox_kernel_compiles_after_ready_total 0" in metrics
    finally:
        server.stop()


# ----- flags ------------------------------------------------------------------------------------------------


def test_gpu_memory_flag_reaches_the_engine_config(monkeypatch):
    args = parse_argv(["serve", "--gpu-memory", "22.5"])
    assert ServerConfig.from_args(args).gpu_memory == 22.5
    monkeypatch.setenv("LUCEBOX_GPU_MEMORY", "20")
    assert ServerConfig.from_args(parse_argv(["serve"])).gpu_memory == 20.0
    for bad in ("0", "-3", "lots"):
        monkeypatch.setenv("LUCEBOX_GPU_MEMORY", bad)
        with pytest.raises(LuceboxError, match="gpu-memory"):
            ServerConfig.from_args(parse_argv(["serve"]))
    monkeypatch.delenv("LUCEBOX_GPU_MEMORY")
    bench = build_parser().parse_args(["bench", "decode", "--gpu-memory", "8"])
    assert bench.gpu_memory == 8.0


def test_generate_skips_the_warm_up_unless_asked():
    assert ServerConfig().warm_up is True  # serve always warms up
    assert generate_config(parse_argv(["generate", "-p", "hi"])).warm_up is False
    assert generate_config(parse_argv(["generate", "-p", "hi", "--warm-up"])).warm_up is True


def test_cpu_engine_ignores_gpu_memory_and_keeps_its_kv_size(tiny_gguf):
    """On the CPU the KV cache is sized as before (a few contexts within 1 GiB of RAM), cap or not."""
    from lucebox.engine.runtime.kv_cache import KVCache

    e = LLMEngine.from_path(tiny_gguf("llama", "F32"), EngineConfig(device="cpu", dtype="float32", gpu_memory=0.001),
                            quiet=True)
    tokens = min(4 * e.n_ctx, (1 << 30) // KVCache.bytes_per_token(e.model_config, torch.float32))
    assert e.kv.pool.num_blocks == -(-tokens // 16) + 1 and e.memory_plan is None


# ----- the memory plan arithmetic -----------------------------------------------------------------------------


def test_plan_gives_the_kv_cache_what_remains():
    plan = plan_memory(budget=24 * GB, capped=True, weights=16 * GB, activations=GB, graphs=GB // 2,
                       block_bytes=2 << 20, block_size=16, min_tokens=2048)
    assert plan.blocks == (24 * GB - 16 * GB - GB - GB // 2) // (2 << 20) == 3328
    assert plan.kv_tokens == (plan.blocks - 1) * 16
    assert plan.weights + plan.activations + plan.graphs + plan.kv_bytes <= plan.budget
    line = plan.line()
    assert "weights 16.00 GB" in line and "activation peak 1.00 GB" in line and f"= {plan.kv_tokens} tokens" in line
    uncapped = plan_memory(budget=80 * GB, capped=False, weights=GB, activations=GB, graphs=GB,
                           block_bytes=1 << 20, block_size=16, min_tokens=16, max_tokens=16 * 1000)
    assert uncapped.blocks == 1001  # 4 contexts at most without a cap (scratch block included)


def test_plan_refuses_weights_over_the_cap_and_no_room_for_kv():
    with pytest.raises(LuceboxError, match=r"weights take 25\.00 GB .*more than --gpu-memory 24\.00 GB"):
        plan_memory(budget=24 * GB, capped=True, weights=25 * GB, activations=0, graphs=0, block_bytes=1 << 20,
                    block_size=16, min_tokens=16)
    with pytest.raises(LuceboxError, match=r"KV cache needs at least .*\(2048 tokens\)"):
        plan_memory(budget=24 * GB, capped=True, weights=23 * GB, activations=GB, graphs=GB // 4,
                    block_bytes=1 << 20, block_size=16, min_tokens=2048)
    with pytest.raises(LuceboxError, match="free"):
        plan_memory(budget=2 * GB, capped=False, weights=3 * GB, activations=0, graphs=0, block_bytes=1 << 20,
                    block_size=16, min_tokens=16)


def test_activation_peak_extrapolates_a_context_dependent_attention():
    assert extrapolate_peak([(2048, 100), (4096, 100)], 32768) == 100  # paged attention: flat
    assert extrapolate_peak([(2048, 100), (4096, 200)], 8192) == 400  # a dense mask grows with the context
    assert extrapolate_peak([(2048, 300), (4096, 200)], 8192) == 300  # never below what was measured
    assert extrapolate_peak([(2048, 100)], 8192) == 100


# ----- CUDA ---------------------------------------------------------------------------------------------------


@needs_cuda
def test_no_capture_or_compile_while_serving_mixed_requests(smollm2_path):
    """After the warm-up, concurrent requests of different lengths (greedy and sampled, streamed and not)
    make no CUDA graph capture and no Triton compile."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.test_serving import post

    seen = len(warmup.COMPILES.in_capture)  # process-wide: only this test's captures count
    server = Server(ServerConfig(model=str(smollm2_path), port=0, device="cuda", max_num_seqs=8,
                                 prefill_compression="off"))
    try:
        engine = server.ctx.engine.engine
        assert engine.device.type == "cuda" and engine.warm_up_seconds is not None
        assert len(engine.runner.graphs.graphs) == len(engine.runner.graphs.buckets())
        words = "the quick brown fox jumps over the lazy dog " * 300

        def one(i: int) -> int:
            body = {"model": "x", "messages": [{"role": "user", "content": words[: 40 + 997 * i]}],
                    "max_tokens": 24 + 8 * i, "temperature": 0.7 if i % 2 else 0, "stream": i % 3 == 0}
            if i % 2:
                body.update(top_p=0.9, logprobs=True, top_logprobs=2, presence_penalty=0.3)
            status, _, _ = post(server.url, "/v1/chat/completions", body) if not body["stream"] else \
                (_stream(server.url, body), None, None)
            return status

        with ThreadPoolExecutor(6) as pool:
            assert list(pool.map(one, range(12))) == [200] * 12
        assert engine.captures_after_ready == 0
        assert engine.compiles_after_ready == 0, warmup.COMPILES.late
        assert warmup.COMPILES.in_capture[seen:] == []
    finally:
        server.stop()


def _stream(url: str, body: dict) -> int:
    import urllib.request

    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()
        return r.status


@needs_cuda
def test_spec_warm_up_captures_every_graph(smollm2_path, tmp_path):
    """A speculative engine warmed up after a plain one (`bench spec` builds several in one process): its own
    warm-up's compiles are not reported as late, and serving (the adaptive rule stopping the random drafter,
    probing it again after 32 plain tokens and catching its context up) compiles and captures nothing."""
    from lucebox.engine.runtime.sampler import SamplingParams
    from tests.test_spec import random_drafter

    draft = random_drafter(smollm2_path, tmp_path / "d", layers=1, block=8, target_layers=[2, 15, 27])
    seen, late = len(warmup.COMPILES.in_capture), len(warmup.COMPILES.late)
    LLMEngine.from_path(smollm2_path, EngineConfig(device="cuda", max_num_seqs=4), quiet=True).warm_up(False)
    engine = LLMEngine.from_path(smollm2_path, EngineConfig(device="cuda", max_num_seqs=4, draft=str(draft)),
                                 quiet=True)
    engine.warm_up(progress=False)
    assert warmup.COMPILES.late[late:] == []
    static = engine.spec.static
    assert set(static.graphs) == set(static.graph_keys())
    prompts = [engine.tokenizer.encode("x " * n) for n in (5, 300, 700)]
    engine.generate(prompts, SamplingParams(max_tokens=100, ignore_eos=True))
    assert engine.adaptive.stats.probes > 0
    assert engine.captures_after_ready == 0 and engine.compiles_after_ready == 0, warmup.COMPILES.late
    assert warmup.COMPILES.late[late:] == [] and warmup.COMPILES.in_capture[seen:] == []


@needs_cuda
def test_a_second_warm_up_after_serving_changes_nothing(smollm2_path):
    """`bench spec` warms the engine up once per configuration, after serving the one before: the prefill graphs'
    timing replays on neutral inputs, not on the last real prefill's (its logit row, past the smallest bucket's
    rows, was a device-side index assert that aborted the process; its slots some sequence's K/V)."""
    from lucebox.engine.runtime.sampler import SamplingParams

    engine = LLMEngine.from_path(smollm2_path, EngineConfig(device="cuda", max_num_seqs=1), quiet=True)
    engine.warm_up(progress=False)
    assert engine.runner.prefill_graphs is not None
    prompt = engine.tokenizer.encode("x " * 150)  # a prefill of ~150 rows through a prefill graph
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    first = engine.generate([prompt], params)
    replays = engine.runner.prefill_graphs.replays
    assert replays > 0
    engine.warm_up(progress=False)
    torch.cuda.synchronize()
    assert engine.generate([prompt], params) == first


@needs_cuda
def test_graphs_recaptured_after_serving_leave_cached_blocks_alone(smollm2_path, tmp_path):
    """A second warm-up that recaptures the decode graphs (a new feature capture, as a hybrid's drafter context
    asks for) rehearses on neutral inputs: the last real step's slots lie in blocks the GPU prefix tier keeps,
    and its stale tokens would overwrite their K/V (and the drafter context's)."""
    from lucebox.cache.manager import CacheConfig
    from lucebox.engine.runtime.sampler import SamplingParams
    from tests.test_spec import random_drafter

    draft = random_drafter(smollm2_path, tmp_path / "draft", layers=1, block=8)
    engine = LLMEngine.from_path(smollm2_path, EngineConfig(device="cuda", max_num_seqs=2, draft=str(draft),
                                                            spec_adaptive=False), quiet=True)  # every step drafts
    engine.enable_prefix_cache(CacheConfig(gpu=True, prefix_slots=0, exact_slots=0, min_tokens=16))
    engine.warm_up(progress=False)
    page = engine.kv.block_size
    prompt = engine.tokenizer.encode("The river runs north past the mill. " * 12)
    new = 3 * page - (len(prompt) - 1) % page  # positions 0 .. len - 2 fill whole blocks: the last step's are indexed
    engine.generate([prompt], SamplingParams(max_tokens=new, ignore_eos=True))
    blocks = sorted(engine.cache.index.blocks())
    assert len(blocks) >= len(prompt) // page, f"the finished sequence's blocks are indexed: {blocks}"
    slots = torch.tensor([b * page + i for b in blocks for i in range(page)], device="cuda")
    held = [kv.data[:, :, slots].clone() for kv in (engine.kv, engine.spec.kv)]
    engine.runner.graphs.keep_layers(engine.runner.graphs.capture + (0,))  # a new feature capture: all recaptured
    engine.warm_up(progress=False)
    torch.cuda.synchronize()
    assert sorted(engine.cache.index.blocks()) == blocks
    for name, kv, before in zip(("target", "drafter"), (engine.kv, engine.spec.kv), held):
        same = (kv.data[:, :, slots] == before).flatten(3).all(-1).all(0).all(0).view(len(blocks), page)
        changed = [(b, (~row).nonzero().flatten().tolist()) for b, row in zip(blocks, same) if not row.all()]
        assert not changed, f"{name} K/V rewritten in cached blocks (block, offsets): {changed}"


def _gpu_memory_cap_check(path: str) -> None:
    """The body of the cap test, in a fresh process: a per-process memory fraction and allocator peaks are
    process-wide, and engines of earlier tests in a full GPU run still hold memory in the test process."""
    from lucebox.engine.runtime.sampler import SamplingParams

    free = LLMEngine.from_path(Path(path), EngineConfig(device="cuda"), quiet=True)
    assert free.memory_plan is not None and not free.memory_plan.capped
    weights = free.memory_plan.weights
    del free
    release_memory()
    torch.cuda.empty_cache()
    cap = weights / GB + 1.5
    engine = LLMEngine.from_path(Path(path), EngineConfig(device="cuda", gpu_memory=cap), quiet=True)
    plan = engine.memory_plan
    assert plan.capped and plan.budget == int(cap * GB)
    assert plan.weights + plan.activations + plan.graphs + plan.kv_bytes <= plan.budget
    assert plan.activations > 0 and plan.kv_tokens > 2048
    engine.warm_up(progress=False)
    prompt = list(range(100, 100 + min(engine.n_ctx - 64, 4000)))
    engine.generate([prompt, prompt[:50]], SamplingParams(max_tokens=32, ignore_eos=True))
    assert torch.cuda.max_memory_reserved() <= int(cap * GB)
    try:
        LLMEngine.from_path(Path(path), EngineConfig(device="cuda", gpu_memory=0.01), quiet=True)
        raise AssertionError("a cap below the weights was accepted")
    except LuceboxError as e:
        assert "weights" in str(e), e


@needs_cuda
def test_gpu_memory_cap_sizes_the_kv_cache_and_holds(smollm2_path):
    ctx = multiprocessing.get_context("spawn")  # CUDA in a child needs spawn, not fork
    child = ctx.Process(target=_gpu_memory_cap_check, args=(str(smollm2_path),))
    child.start()
    child.join(timeout=600)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0, f"the cap check failed in its process (exit code {child.exitcode}; stderr above)"


@needs_cuda
def test_weights_over_the_cap_exit_2_with_one_line(smollm2_path):
    r = subprocess.run([sys.executable, "-m", "lucebox", "generate", "-m", str(smollm2_path), "--device", "cuda",
                        "--gpu-memory", "0.01", "-p", "hi", "-n", "2"], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("lucebox: error:")]
    assert len(errors) == 1 and "--gpu-memory" in errors[0] and "Traceback" not in r.stderr
