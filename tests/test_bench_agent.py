"""`bench agent`: replayed agent sessions against a real server, and the statistics it reports.

The end-to-end tests run small replays (2 sessions x 3 turns, a ~256-token
prefix, max_tokens 1) against the shared `live_server` (SmolLM2 on CPU) through
`--url`, and once against a server the benchmark starts itself. Each test uses
its own seed, so its prefix is one the shared server has not seen.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
from pathlib import Path
from typing import Any

import pytest

from lucebox.bench import agent
from lucebox.bench.http_client import HttpClientError, SSEFrame, get_json
from lucebox.cli import build_parser
from lucebox.data import DATA_DIR
from lucebox.errors import LuceboxError


def agent_args(**overrides: Any) -> argparse.Namespace:
    """The namespace `python -m lucebox bench agent` parses, with its defaults, plus overrides."""
    args = build_parser().parse_args(["bench", "agent"])
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


SMALL = dict(sessions=2, turns=3, prefix_tokens=256, turn_tokens=64, max_tokens=1)


def run_bench(tmp_path: Path, name: str = "agent.json", **overrides: Any) -> dict[str, Any]:
    out = tmp_path / name
    assert agent.main(agent_args(json=out, **{**SMALL, **overrides})) == 0
    return json.loads(out.read_text())


def check_replay(payload: dict[str, Any], sessions: int, turns: int) -> None:
    """Every turn is there once, in order, succeeded, with usage; exactly the first one is cold."""
    rows = payload["turns"]
    assert [(t["session"], t["turn"]) for t in rows] == [(s, k) for s in range(sessions) for k in range(turns)]
    assert [t["kind"] for t in rows] == ["cold"] + ["warm"] * (sessions * turns - 1)
    for t in rows:
        assert t["error"] is None, t
        assert t["ttft_ms"] > 0 and t["total_ms"] >= t["ttft_ms"] and t["ttft_from"] == "content"
        assert t["completion_tokens"] == 1 and t["new_tokens"] > 0
    for s in range(sessions):  # the history grows: every turn's prompt holds the previous one
        prompts = [t["prompt_tokens"] for t in rows if t["session"] == s]
        assert prompts == sorted(prompts) and len(set(prompts)) == turns
    summary = payload["summary"]
    assert summary["cold"]["turns"] == 1 and summary["warm"]["turns"] == sessions * turns - 1
    assert summary["warm"]["errors"] == 0
    assert sum(b["turns"] for b in summary["buckets"]) == sessions * turns - 1
    assert summary["stalls"]["limit"] == agent.STALL_LIMIT


# ----- end to end ------------------------------------------------------------------------


def test_replay_against_a_running_lucebox(live_server, tmp_path, capsys):
    payload = run_bench(tmp_path, url=live_server.url, seed=12_001)
    check_replay(payload, 2, 3)
    work = payload["workload"]
    assert payload["server_command"] is None and payload["url"] == live_server.url
    assert work["token_counts"] == "server /tokenize" and work["schedule"].startswith("interleaved")
    assert abs(work["prefix_tokens"] - 256) <= 8  # cut by the server's tokenizer
    rows = payload["turns"]
    assert rows[0]["cached_tokens"] == 0  # cold: a new seed is a new prefix
    for t in rows[1:]:
        # warm: the shared prefix at least (session starts), the whole previous turn for later turns
        assert 0 < t["cached_tokens"] < t["prompt_tokens"]
        assert t["cached_tokens"] >= work["prefix_tokens"] - 64  # up to a block short of it
    for s in range(2):
        turns = [t for t in rows if t["session"] == s]
        for prev, cur in zip(turns, turns[1:]):
            assert cur["cached_tokens"] > prev["prompt_tokens"] - 64
    assert payload["summary"]["warm"]["turns_reporting_cached"] == 5
    # sent one at a time, round robin after the cold turn: s0t0, s1t0, s0t1, s1t1, s0t2, s1t2
    order = sorted(rows, key=lambda t: t["sent_at_s"])
    assert [(t["session"], t["turn"]) for t in order] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    table = capsys.readouterr().out
    assert "bench agent:" in table and "TTFT p99 ms" in table and "warm, all" in table and "no stalls" in table


def test_same_seed_same_workload_and_a_seen_prefix_is_reported(live_server, tmp_path, capsys):
    first = run_bench(tmp_path, "a.json", url=live_server.url, seed=12_002, sessions=1, turns=2)
    capsys.readouterr()
    again = run_bench(tmp_path, "b.json", url=live_server.url, seed=12_002, sessions=1, turns=2)
    assert "had" in capsys.readouterr().err  # the "cold" turn found this seed's prefix cached
    assert again["turns"][0]["cached_tokens"] > 0
    keys = ("appended", "new_tokens", "prompt_tokens")
    assert [[t[k] for k in keys] for t in first["turns"]] == [[t[k] for k in keys] for t in again["turns"]]
    other = run_bench(tmp_path, "c.json", url=live_server.url, seed=12_003, sessions=1, turns=2)
    assert other["turns"][0]["cached_tokens"] == 0


def test_concurrent_sessions(live_server, tmp_path):
    payload = run_bench(tmp_path, url=live_server.url + "/", seed=12_004, concurrency=2, turns=2)
    check_replay(payload, 2, 2)
    assert payload["workload"]["schedule"].startswith("sessions concurrent")
    assert all(t["cached_tokens"] > 0 for t in payload["turns"][1:])


def test_starts_and_stops_its_own_server(smollm2_path, tmp_path):
    payload = run_bench(tmp_path, model=str(smollm2_path), device="cpu", dtype="float32", kv_tokens=4096,
                        seed=12_005, sessions=1, turns=2)
    check_replay(payload, 1, 2)
    assert payload["server_command"][1:4] == ["-m", "lucebox", "serve"]
    assert payload["turns"][1]["cached_tokens"] > 0
    with pytest.raises(HttpClientError, match="cannot connect"):  # stopped at the end
        asyncio.run(get_json(payload["url"] + "/health"))


def test_bad_arguments(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed on exit: nothing listens there
    with pytest.raises(LuceboxError, match="no server at"):
        agent.main(agent_args(url=f"http://127.0.0.1:{port}", json=tmp_path / "x.json"))
    with pytest.raises(LuceboxError, match="give one or the other"):
        agent.main(agent_args(url="http://127.0.0.1:1", model="smollm2"))
    for flag in ("sessions", "turns", "prefix_tokens", "max_tokens", "concurrency"):
        with pytest.raises(LuceboxError, match=f"--{flag.replace('_', '-')} must be >= 1"):
            agent.main(agent_args(**{flag: 0}))
    assert not (tmp_path / "x.json").exists()


def test_cli_wiring():
    args = build_parser().parse_args(["bench", "agent", "--url", "http://h:1", "--sessions", "4", "--turns", "30",
                                      "--prefix-tokens", "20000", "--concurrency", "2", "--seed", "7"])
    assert (args.sessions, args.turns, args.prefix_tokens, args.concurrency, args.seed) == (4, 30, 20000, 2, 7)
    assert args.max_tokens == 1 and args.json == Path("bench_agent.json") and args.url == "http://h:1"
    zero = build_parser().parse_args(["bench", "agent", "--sessions", "0"])
    with pytest.raises(LuceboxError, match="--sessions must be >= 1"):  # the subcommand runs bench/agent.py
        zero.func(zero)


# ----- statistics ------------------------------------------------------------------------


def turn(ttft_s: float, new_tokens: int, kind: str = agent.WARM, error: str | None = None) -> agent.Turn:
    t = agent.Turn(0, 0, kind, "tool", new_tokens, start=10.0, first=10.0 + ttft_s)
    t.error = error
    return t


def test_size_buckets():
    assert [agent.size_bucket(n) for n in (0, 1, 2, 3, 255, 256, 300, 511, 512)] == [0, 1, 2, 2, 128, 256, 256,
                                                                                      256, 512]
    assert agent.bucket_label(256) == "256-511" and agent.bucket_label(0) == "0"


def test_stall_ratio_is_max_over_median_per_bucket():
    turns = [turn(0.100, 300), turn(0.110, 260), turn(0.300, 400), turn(0.120, 500),  # 256-511: one stall
             turn(0.050, 40), turn(0.055, 60),  # 32-63: steady
             turn(0.900, 3000),  # alone in its bucket: cannot be judged
             turn(5.0, 300, kind=agent.COLD),  # the cold turn is in no bucket
             turn(9.0, 300, error="boom")]  # a failed turn counts as an error, not a time
    buckets = {b["bucket"]: b for b in agent.bucket_stats(turns)}
    assert list(buckets) == ["32-63", "256-511", "2048-4095"]
    b = buckets["256-511"]
    assert (b["turns"], b["errors"]) == (5, 1)
    assert b["ttft_ms"]["p50"] == pytest.approx(115.0) and b["ttft_ms"]["max"] == pytest.approx(300.0)
    assert b["stall_ratio"] == pytest.approx(300 / 115)
    assert buckets["32-63"]["stall_ratio"] == pytest.approx(55 / 52.5)
    check = agent.stall_check(list(buckets.values()))
    assert check["bucket"] == "256-511" and check["max_ratio"] == pytest.approx(300 / 115)
    assert check["no_stalls"] is False and check["buckets_judged"] == 2
    steady = agent.stall_check(agent.bucket_stats(turns[4:6]))
    assert steady["no_stalls"] is True
    assert agent.stall_check(agent.bucket_stats([turn(0.9, 3000)]))["no_stalls"] is None


def test_cold_and_warm_percentiles():
    rng = random.Random(3)
    warm = [turn(rng.uniform(0.05, 0.2), rng.randint(100, 400)) for _ in range(101)]
    s = agent.summarize([turn(1.5, 300, kind=agent.COLD), *warm])
    ms = sorted(t.ttft * 1000 for t in warm)
    assert s["warm"]["ttft_ms"]["p50"] == pytest.approx(statistics.median(ms))
    assert s["warm"]["ttft_ms"]["p99"] == pytest.approx(statistics.quantiles(ms, n=100, method="inclusive")[98])
    assert s["cold"]["ttft_ms"] == {"p50": pytest.approx(1500), "p99": pytest.approx(1500),
                                    "max": pytest.approx(1500)}
    assert s["cold"]["turns"] == 1 and s["warm"]["turns"] == 101


# ----- stream frames of other servers ----------------------------------------------------


def frame(obj: Any, at: float) -> SSEFrame:
    return SSEFrame(at, None, obj if isinstance(obj, str) else json.dumps(obj))


def test_frames_llama_server_style_cache_n_and_role_only_first_frame():
    t = agent.Turn(0, 1, agent.WARM, "tool", 10, start=1.0)
    agent.fold_frame(frame({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, 1.01), t)
    assert t.ttft is None  # a role-only frame is no token (vLLM sends it before the prefill ends)
    agent.fold_frame(frame({"choices": [{"delta": {"content": "Hi"}, "finish_reason": None}]}, 1.25), t)
    agent.fold_frame(frame({"choices": [{"delta": {}, "finish_reason": "length"}]}, 1.30), t)
    agent.fold_frame(frame({"choices": [], "usage": {"prompt_tokens": 900, "completion_tokens": 1},
                            "timings": {"cache_n": 880, "prompt_n": 20}}, 1.31), t)
    agent.fold_frame(frame("[DONE]", 1.32), t)
    assert t.ttft == pytest.approx(0.25) and t.done and "".join(t.reply) == "Hi"
    assert (t.prompt_tokens, t.completion_tokens, t.cached_tokens) == (900, 1, 880)


def test_frames_prompt_tokens_details_win_and_absent_cache_is_none():
    t = agent.Turn(0, 1, agent.WARM, "tool", 10, start=0.0)
    agent.fold_frame(frame({"choices": [], "timings": {"cache_n": 5},
                            "usage": {"prompt_tokens": 9, "completion_tokens": 1,
                                      "prompt_tokens_details": {"cached_tokens": 7}}}, 0.5), t)
    assert t.cached_tokens == 7
    quiet = agent.Turn(0, 1, agent.WARM, "tool", 10, start=0.0)  # vLLM without --enable-prompt-tokens-details
    agent.fold_frame(frame({"choices": [{"delta": {}, "finish_reason": "length"}],
                            "usage": {"prompt_tokens": 9, "completion_tokens": 1, "prompt_tokens_details": None}},
                           0.4), quiet)
    assert quiet.cached_tokens is None and quiet.prompt_tokens == 9
    assert quiet.ttft == pytest.approx(0.4)  # an invisible token: its finish frame is the first token event


# ----- workload --------------------------------------------------------------------------


def test_workload_is_deterministic_given_the_seed():
    pools = agent.load_pools(DATA_DIR)
    assert "swe_bench_verified.parquet" in pools.source
    plan = agent.choose_texts(pools, 3, 10, seed=5)
    assert plan == agent.choose_texts(pools, 3, 10, seed=5)
    assert plan != agent.choose_texts(pools, 3, 10, seed=6)
    assert [s[0][0] for s in plan] == ["task"] * 3 and len({s[0][1] for s in plan}) == 3  # one issue each
    kinds = [kind for s in plan for kind, _ in s[1:]]
    assert set(kinds) == {"tool", "user"}


def test_prefix_extends_and_trims_to_the_target():
    counter = agent.TokenCounter("http://unused", "m", {})  # method "estimate": no server needed
    texts = agent.load_prefix_texts(DATA_DIR)
    for target in (300, 40_000):  # under one agent prompt, and beyond all of them (repeated)
        prefix, n = asyncio.run(agent.build_prefix(counter, texts, 9, target))
        assert abs(n - target) <= target * 0.02 and prefix.startswith(agent.prefix_head(9))
        assert texts[0][:200] in prefix
    assert agent.prefix_head(9) != agent.prefix_head(10)
    sessions = asyncio.run(agent.build_sessions(counter, agent.choose_texts(agent.load_pools(DATA_DIR), 2, 6, 1),
                                                100))
    assert all(m.tokens <= 100 for s in sessions for m in s)
    assert all(m.content.startswith("Tool result") for s in sessions for m in s if m.appended == "tool")
