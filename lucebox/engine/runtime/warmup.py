"""Start-up warm-up: every CUDA graph captured and every Triton kernel compiled before the first request.

A capture or a JIT compile on the serving path makes the request that reaches it wait (a 10 s first TTFT on
an 8B). So at start-up the engine (`LLMEngine.warm_up`):
1. captures every decode graph bucket (batch buckets x context buckets up to the context; cuda_graphs.py)
   and, with a drafter, every speculative graph (spec/static.py);
2. runs every eager shape class once through the real `step()`: Triton specialises an integer argument on
   whether it is 1 or a multiple of 16, so prefill chunks of each class, fresh and over a cached context,
   the largest chunk the scheduler makes, mixed decode + prefill steps, and sampled (non-greedy, penalised,
   logprob) rows next to greedy ones.
Afterwards a graph capture or a Triton compile is counted (`captures_after_ready`, `compiles_after_ready`)
and logged as a warning: it is a bug the warm-up should have covered. On the CPU there are no graphs and no
JIT, so the warm-up is one short request (a prefill and a decode), to keep the CPU server and tests quick.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import torch

from lucebox.engine.runtime.sampler import SamplingParams

if TYPE_CHECKING:
    from lucebox.engine.runtime.llm_engine import LLMEngine

log = logging.getLogger(__name__)


class KernelCompiles:
    """Counts Triton JIT compiles in this process (a `triton.knobs` post-compile hook, installed once).

    Once `armed` (an engine finished its warm-up), every compile is logged as a warning with its kernel name."""

    def __init__(self) -> None:
        self.count = 0
        self.armed = False
        self.late: list[str] = []  # kernels compiled while armed
        self.in_capture: list[str] = []  # kernels compiled inside a CUDA graph capture (its rehearsal missed them)
        self.installed = False
        self._lock = threading.Lock()

    def install(self) -> bool:
        """Hook Triton's compiler; False where this Triton has no such hook (then nothing is counted)."""
        with self._lock:
            if self.installed:
                return True
            try:
                from triton import knobs
            except ImportError:
                return False
            runtime = getattr(knobs, "runtime", None)
            if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
                return False
            previous = runtime.jit_post_compile_hook

            def hook(*args: Any, **kwargs: Any) -> Any:
                self._compiled(kwargs.get("fn"), _specialisation(kwargs.get("compile")) or kwargs.get("repr"))
                return previous(*args, **kwargs) if previous is not None else None

            runtime.jit_post_compile_hook = hook
            self.installed = True
            return True

    def _compiled(self, fn: Any, signature: Any = None) -> None:
        """`signature`: Triton's repr of the specialisation (argument types, divisibility, constants), logged
        with a late compile so the log says which shape the warm-up missed."""
        name = str(getattr(fn, "name", None) or fn)
        self.count += 1
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            self.in_capture.append(name)
            log.warning("Triton kernel %s compiled inside a CUDA graph capture (graph_mode.rehearsal missed it)", name)
        if self.armed:
            self.late.append(name)
            log.warning("Triton kernel %s compiled while serving (the warm-up missed this shape): %s", name,
                        signature or "?")


COMPILES = KernelCompiles()


def _specialisation(compile_args: Any) -> str | None:
    """The parts of a Triton compile that tell one specialisation from another (argument types, constant and
    divisibility attributes), in one line; None where this Triton does not pass them."""
    if not isinstance(compile_args, dict) or "signature" not in compile_args:
        return None
    sig = compile_args.get("signature") or {}
    types = ",".join(f"{k}:{v}" for k, v in sig.items() if v != "constexpr") if isinstance(sig, dict) else str(sig)
    consts = compile_args.get("constants") or {}
    consts = ",".join(f"{k}={v}" for k, v in consts.items()) if isinstance(consts, dict) else str(consts)
    return f"types({types}) constants({consts}) attrs({compile_args.get('configs')})"


def shape_lengths(chunk: int, limit: int) -> list[int]:
    """Prompt lengths whose prefill chunks cover every shape class a step can have, given the scheduler's
    largest chunk `chunk` and the longest prompt that fits `limit`: one row past a full chunk, small odd and
    multiple-of-16 chunks, a one-row prefill (an eager forward of one row, next to graph-replayed decodes),
    the largest chunk, and odd and multiple-of-16 chunks over a cached context."""
    wanted = [chunk + 17, 3, 32, 1, chunk - 1, chunk + 32, chunk]
    out: list[int] = []
    for n in wanted:
        n = max(1, min(n, limit))
        if n not in out:
            out.append(n)
    return out


def warm_requests(engine: LLMEngine, lengths: list[int], advance: Any = None) -> int:
    """Run one request per length through `engine.step()`, each added while the earlier ones decode (mixed
    steps), alternating greedy and sampled rows; returns the steps run. The prefix cache is detached meanwhile,
    so nothing of the warm-up is cached, and the counters it moved (preemptions, speculative stats) are put
    back; the engine must be idle."""
    assert not engine.has_work(), "warm up an idle engine"
    vocab = engine.model_config.vocab_size
    greedy = SamplingParams(max_tokens=2, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
                             presence_penalty=0.1, seed=0, logprobs=2, max_tokens=3, ignore_eos=True)
    sched = engine.scheduler
    cache, sched.cache, engine.cache = sched.cache, None, None
    preemptions = sched.num_preemptions
    steps = 0
    seqs = []
    try:
        for i, n in enumerate(lengths):
            ids = [(7 * j + 11) % vocab for j in range(n)]
            seqs.append(engine.add(ids, sampled if i % 2 else greedy))
            engine.step()
            steps += 1
            if advance is not None:
                advance(1)
        while engine.has_work():
            engine.step()
            steps += 1
    finally:
        for s in seqs:
            engine.abort(s)
        sched.cache = engine.cache = cache
        sched.num_preemptions = preemptions
        if engine.spec is not None:
            stats = engine.spec.stats
            stats.steps = stats.committed = stats.drafted = 0
        if engine.adaptive is not None:
            engine.adaptive.forget()
    failed = [s.seq_id for s in seqs if s.finish_reason not in ("length", "stop")]
    if failed:
        log.warning("warm-up: %d of %d requests ended with an error (see above)", len(failed), len(seqs))
    return steps
