"""Stream pacing (AsyncEngine.stream, `--stream-pace-us`): with many streams, each writes an event at most every
`pace x active streams`, carrying every step in between, so the event loop's per-event work stops taking the GIL
from the engine. The tokens are the same; only how they are grouped into events changes."""

from __future__ import annotations

import asyncio
import os

import pytest

from lucebox import cli
from lucebox.engine.runtime.async_engine import AsyncEngine
from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams

PROMPTS = ["Count from one to twenty:", "The alphabet, letter by letter:"]


@pytest.fixture(scope="module")
def llm(smollm2_path) -> LLMEngine:
    return LLMEngine.from_path(smollm2_path, EngineConfig(device="cpu", dtype="float32", kv_tokens=4096), quiet=True)


def run(llm: LLMEngine, pace: float) -> list[list[tuple[float, list[int]]]]:
    """Both prompts at once, 20 greedy tokens each; per prompt, its stream's events as (loop time, token ids)."""
    async def main() -> list[list[tuple[float, list[int]]]]:
        engine = AsyncEngine(llm, stream_pace=pace)
        await engine.start()
        loop = asyncio.get_running_loop()
        try:
            params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
            gens = [engine.submit(llm.tokenizer.encode(p, add_special=False), params) for p in PROMPTS]

            async def events(gen) -> list[tuple[float, list[int]]]:
                return [(loop.time(), list(new)) async for new in engine.stream(gen)]

            return list(await asyncio.gather(*(events(g) for g in gens)))
        finally:
            await engine.stop()

    return asyncio.run(main())


def tokens(events: list[tuple[float, list[int]]]) -> list[int]:
    return [t for _, ids in events for t in ids]


def test_pacing_groups_steps_into_fewer_events_with_the_same_tokens(llm):
    plain = run(llm, 0.0)
    paced = run(llm, 0.25)  # 0.5 s between one stream's events while both run, 0.25 s once one is left
    for p, q in zip(plain, paced):
        assert tokens(p) == tokens(q) and len(tokens(q)) == 20
        assert len(q[0][1]) <= 2  # the first event does not wait
        gaps = [b[0] - a[0] for a, b in zip(q, q[1:])][:-1]  # the last event does not wait either
        assert all(g >= 0.24 for g in gaps), gaps  # however slow the steps, never closer than the pace
        assert len(q) < 20 and len(q) < len(p), (len(q), len(p))  # steps taken during a wait went out together


@pytest.mark.parametrize("value", ["-1", "nan", "20000"])
def test_a_bad_stream_pace_is_one_line_and_exit_2(capsys, value):
    assert cli.main(["serve", "--stream-pace-us", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--stream-pace-us must be between 0 and 10000" in err[0], err


def test_the_environment_sets_the_pace(monkeypatch):
    from lucebox.serve import ServerConfig

    args = cli.build_parser().parse_args(["serve"])
    assert ServerConfig.from_args(args).stream_pace_us == 200.0  # the default
    monkeypatch.setitem(os.environ, "LUCEBOX_STREAM_PACE_US", "0")
    assert ServerConfig.from_args(args).stream_pace_us == 0.0
    assert ServerConfig.from_args(cli.build_parser().parse_args(["serve", "--stream-pace-us", "250"])
                                  ).stream_pace_us == 250.0
