"""Where a decode step's time goes: the kernels of a few eager decode steps, by name (`bench decode --profile`).

A CUDA graph replays the kernels its eager step launched when it was captured, so the kernels of eager steps,
each launch visible to the profiler, are the account of a replayed step: their sum is the GPU's busy time a
step, and what a replayed step takes beyond it is the gaps between kernels. On the CPU the rows are the torch
ops' own (self) time.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from lucebox.engine.runtime.llm_engine import LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams

NAME = 100
"""Characters of a kernel's name kept (C++ template names run to thousands)."""


def profile_decode(engine: LLMEngine, prompts: list[list[int]], steps: int) -> dict[str, Any]:
    """Decode `prompts` together, then profile `steps` decode steps: per kernel (CUDA) or op (CPU) its calls
    and time per step, busiest first. `bench decode` runs it on an eager copy of its engine (no CUDA graphs, no
    step ahead), so that each row is a launch its Python issued; `recording` itself also counts the kernels of
    graph replays (`bench spec-cost --profile` profiles the served graphs)."""
    if steps < 1:
        raise ValueError("--profile takes a number of steps, at least 1")
    seqs = [engine.add(p, SamplingParams(max_tokens=steps + 4, ignore_eos=True)) for p in prompts]
    while any(s.num_output < 2 for s in seqs):  # prefilled, and one decode step run (lazy set-up done)
        engine.step()
    report: dict[str, Any] = {}
    with recording(engine.device, steps, report):
        for _ in range(steps):
            engine.step()
    while any(not s.is_finished for s in seqs):
        engine.step()
    return {"device": engine.device.type, "batch": len(prompts), "steps": steps, **report}


@contextlib.contextmanager
def recording(device: torch.device, steps: int, into: dict[str, Any]) -> Iterator[None]:
    """Profile the block, `steps` engine steps, and put their account into `into`: busy time and launches a
    step, and per kernel (CUDA) or op (CPU) its calls and time a step, busiest first. On CUDA the kernels of
    CUDA graph replays are counted too (CUPTI reports each kernel of a replay)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        yield
        if cuda:
            torch.cuda.synchronize(device)
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])  # name -> [µs, calls]
    if cuda:
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                totals[e.name[:NAME]][0] += e.device_time
                totals[e.name[:NAME]][1] += 1
    else:
        for avg in prof.key_averages():
            if avg.self_cpu_time_total > 0:
                totals[avg.key[:NAME]] = [avg.self_cpu_time_total, avg.count]
    busy = sum(us for us, _ in totals.values())
    rows = [{"name": name, "calls_per_step": n / steps, "us_per_step": us / steps, "share": us / busy if busy else 0.0,
             "us_per_call": us / n if n else 0.0}
            for name, (us, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])]
    into.update(busy_us_per_step=busy / steps, launches_per_step=sum(n for _, n in totals.values()) / steps,
                kernels=rows)


def table_rows(report: dict[str, Any], top: int = 25) -> list[list[Any]]:
    """The busiest `top` rows for bench.report.print_table (COLUMNS)."""
    return [[r["name"][:60], r["us_per_step"], 100 * r["share"], r["calls_per_step"], r["us_per_call"]]
            for r in report["kernels"][:top]]


COLUMNS = ["kernel (CUDA) / op (CPU)", "us a step", "% of busy", "calls a step", "us a call"]
