"""`bench serve` and its HTTP client: the client against the real server, the benchmark end to end.

The client tests use the shared `live_server` (SmolLM2 on CPU, ~10-20 tok/s),
so "frames arrive incrementally" is visible as tens of milliseconds between
tokens. One test starts the server as a subprocess the way the CLI does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

from lucebox.bench import serve
from lucebox.bench.http_client import (
    HttpClientError,
    HttpStatusError,
    SSEFrame,
    SSEParser,
    get_json,
    post_json,
    request_json,
    stream_sse,
)
from lucebox.data import DATA_DIR
from lucebox.errors import LuceboxError
from lucebox.http.sse import encode_comment, encode_event

CHAT = "/v1/chat/completions"


def chat(content: str, max_tokens: int) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}


def bench_args(**overrides: Any) -> argparse.Namespace:
    """The namespace `python -m lucebox bench serve` parses, with its defaults."""
    args = dict(url=None, model=None, device="auto", dtype="auto", n_ctx=None, chat_template_file=None,
                max_num_seqs=None, kv_tokens=None, concurrency="1,4,16,64", prompt_len=256, gen_len=128,
                requests=None, json=Path("bench_serve.json"), dialect="chat", data_dir=None, api_key=None,
                long_prompt=None, constrained=False)
    args.update(overrides)
    return argparse.Namespace(**args)


def refused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on exit: nothing listens there


# ----- percentile, levels ---------------------------------------------------------------


def test_percentile_matches_statistics_inclusive_quantiles():
    rng = random.Random(7)
    for n in (2, 3, 10, 101, 257):
        xs = [rng.uniform(0, 1000) for _ in range(n)]
        reference = statistics.quantiles(xs, n=100, method="inclusive")  # linear between closest ranks
        for q in (1, 25, 50, 90, 99):
            assert serve.percentile(xs, q) == pytest.approx(reference[q - 1], rel=1e-12)
        assert serve.percentile(xs, 0) == min(xs) and serve.percentile(xs, 100) == max(xs)


def test_percentile_small_cases():
    assert serve.percentile([], 50) is None
    assert serve.percentile([5.0], 99) == 5.0
    assert serve.percentile([3, 1, 2], 50) == 2  # order of input does not matter
    assert serve.percentile([0, 10], 99) == pytest.approx(9.9)
    assert serve.percentile([1, 2, 3, 4], 50) == 2.5
    with pytest.raises(ValueError, match="q=101"):
        serve.percentile([1], 101)


def test_parse_levels():
    assert serve.parse_levels("1,4, 16,") == [1, 4, 16]
    for bad in ("", "0", "1,x", "-2"):
        with pytest.raises(LuceboxError, match="--concurrency"):
            serve.parse_levels(bad)


# ----- SSE parsing ----------------------------------------------------------------------


def test_sse_parser_reassembles_frames_split_anywhere():
    frames = [("message_start", '{"a": 1}'), (None, "line one\nline two"), (None, "[DONE]"), ("x", "")]
    wire = b"".join(encode_event(d, e) for e, d in frames)
    wire = encode_comment("keep-alive") + wire
    rng = random.Random(3)
    for _ in range(50):
        parser, got, i = SSEParser(), [], 0
        while i < len(wire):
            j = i + rng.randint(1, 7)
            got += parser.feed(wire[i:j])
            i = j
        assert got == frames


def test_sse_parser_line_endings_and_fields():
    p = SSEParser()
    assert p.feed(b"event: ping\r") == []  # a lone \r may be half of \r\n
    assert p.feed(b"\ndata:no-space\r\ndata:  two spaces\rid: 7\nretry: 5\nunknown: z\n") == []
    assert p.feed(b"\r\n") == [("ping", "no-space\n two spaces")]
    assert p.feed(b"event: lonely\n\n") == []  # no data: nothing dispatched, and the event name is reset
    assert p.feed(b"data: x\n\n") == [(None, "x")]


# ----- the client against the real server -----------------------------------------------


def test_stream_frames_arrive_incrementally_with_timestamps(live_server):
    async def go() -> list[tuple[float, Any]]:
        seen = []
        async for frame in stream_sse(live_server.url + CHAT, chat("Write a very long story about the sea.", 16)):
            seen.append((time.perf_counter(), frame))
        return seen

    seen = asyncio.run(go())
    frames = [f for _, f in seen]
    assert frames[-1].data == "[DONE]"
    chunks = [json.loads(f.data) for f in frames[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 16
    times = [f.time for f in frames]
    assert times == sorted(times)
    assert all(f.time <= yielded for yielded, f in seen)  # stamped at arrival, before it was handed over
    content = [(yielded, f) for (yielded, f), c in zip(seen, chunks) if c["choices"] and c["choices"][0]["delta"].get(
        "content")]
    assert len(content) >= 8
    # The first token was in the caller's hands before the last one had even arrived: no buffering of the body.
    assert content[0][0] < content[-1][1].time
    assert len({f.time for _, f in content}) >= len(content) // 2
    assert content[-1][1].time - content[0][1].time > 0.05


def test_non_200_raises_with_status_and_body(live_server):
    async def go() -> None:
        async for _ in stream_sse(live_server.url + CHAT, {"messages": 3, "stream": True}):
            pytest.fail("no frame expected from a 400")

    with pytest.raises(HttpStatusError) as info:
        asyncio.run(go())
    assert info.value.status == 400
    assert json.loads(info.value.body)["error"]["param"] == "messages"
    assert "400" in str(info.value) and CHAT in str(info.value)

    with pytest.raises(HttpStatusError) as info:
        asyncio.run(post_json(live_server.url + "/tokenize", {"tokens": []}))
    assert info.value.status == 400 and "content" in info.value.body
    with pytest.raises(HttpStatusError) as info:
        asyncio.run(get_json(live_server.url + "/no/such/path"))
    assert info.value.status == 404
    status, body = asyncio.run(request_json("GET", live_server.url + "/health"))
    assert (status, body) == (200, {"status": "ok"})


def test_connection_refused_and_bad_url_are_client_errors():
    url = f"http://127.0.0.1:{refused_port()}/health"
    with pytest.raises(HttpClientError, match="cannot connect") as info:
        asyncio.run(get_json(url))
    assert not isinstance(info.value, HttpStatusError)
    with pytest.raises(HttpClientError, match="only http://"):
        asyncio.run(get_json("https://example.com/"))


def test_leaving_the_stream_early_closes_the_connection(live_server):
    engine = live_server.ctx.engine
    before = engine.num_disconnects

    async def go() -> None:
        async for frame in stream_sse(live_server.url + CHAT, chat("Write a very long story about the sea.", 400)):
            if '"content":"' in frame.data and '"content":""' not in frame.data:
                break

    asyncio.run(go())
    deadline = time.monotonic() + 10
    while engine.num_disconnects == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.num_disconnects == before + 1
    live_server.wait_idle(timeout=10)


# ----- workload -------------------------------------------------------------------------


def test_documents_from_jsonl_prompts(tmp_path):
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "a.jsonl").write_text(
        '{"turns": ["First question?", "Second question?"]}\n\n'
        '{"messages": [{"role": "user", "content": "A message."}], "max_tokens": 5}\n'
        '{"prompt": "First question?"}\n')
    docs, source = serve.load_documents(tmp_path)
    assert docs == ["First question?", "Second question?", "A message."]
    assert "prompts" in source
    (tmp_path / "prompts" / "b.jsonl").write_text("{oops\n")
    with pytest.raises(LuceboxError, match="b.jsonl:1"):
        serve.load_documents(tmp_path)
    with pytest.raises(LuceboxError, match="--data-dir"):
        serve.load_documents(tmp_path / "nothing")


def test_prompts_are_distinct_and_near_the_target_length(live_server):
    docs, _ = serve.load_documents(DATA_DIR)
    builder = serve.PromptBuilder(live_server.url, docs, {})

    async def go() -> tuple[list[str], list[int]]:
        prompts = await builder.build(6, 96, template_tokens=0)
        return prompts, [await builder.count(p) for p in prompts]

    prompts, counts = asyncio.run(go())
    assert len(set(prompts)) == 6
    assert [p.split("\n", 1)[0] for p in prompts] == [f"Text {k}:" for k in range(1, 7)]
    assert all(p.endswith(serve.INSTRUCTION) for p in prompts)
    assert all(abs(c - 96) <= 4 for c in counts), counts
    with pytest.raises(LuceboxError, match="--prompt-len 20 is too short"):
        asyncio.run(builder.build(1, 20, template_tokens=10))


# ----- the benchmark end to end ---------------------------------------------------------


def check_payload(payload: dict[str, Any], levels: list[int], requests: int, prompt_len: int) -> None:
    assert payload["benchmark"] == "serve"
    assert {"url", "dialect", "model", "server", "workload", "env", "sequential", "levels"} <= payload.keys()
    assert payload["model"]["arch"] == "llama" and payload["model"]["n_params"] > 0
    seq = payload["sequential"]
    assert seq["concurrency"] == 1 and seq["speedup"] == pytest.approx(1.0)
    assert [lv["concurrency"] for lv in payload["levels"]] == levels
    for s in [seq, *payload["levels"]]:
        assert s["requests"] == requests and s["errors"] == 0 and s["first_error"] is None
        assert s["tok_s"] > 0 and s["output_tokens"] > 0
        assert s["tok_s"] == pytest.approx(s["output_tokens"] / s["wall_s"])
        assert s["speedup"] == pytest.approx(s["tok_s"] / seq["tok_s"])
        assert abs(s["prompt_tokens_mean"] - prompt_len) <= 6
        assert 0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"] < s["latency_ms"]["p99"]
        assert s["itl_ms"]["p50"] is not None and s["itl_ms"]["p50"] >= 0
        for key in ("ttft_ms", "itl_ms", "tpot_ms", "latency_ms"):
            assert set(s[key]) == {"p50", "p99", "mean"}


def test_bench_against_a_running_server(live_server, tmp_path, capsys):
    out = tmp_path / "serve.json"
    code = serve.main(bench_args(url=live_server.url, concurrency="1,2", requests=2, gen_len=8, prompt_len=64,
                                 json=out))
    assert code == 0
    payload = json.loads(out.read_text())
    check_payload(payload, [1, 2], 2, 64)
    assert payload["server_command"] is None and payload["url"] == live_server.url
    assert payload["workload"]["gen_len"] == 8
    for s in [payload["sequential"], *payload["levels"]]:
        assert s["output_tokens_mean"] <= 8
        # the server's host time per token, by thread, from its /metrics over the level
        cpu = s["server_cpu_us_per_token"]
        assert set(cpu) == {"event_loop", "engine"} and cpu["event_loop"] > 0 and cpu["engine"] > 0
    table = capsys.readouterr().out
    assert "bench serve:" in table and "concurrency 2" in table and "sequential" in table and "TTFT p50 ms" in table
    assert "loop CPU us/tok" in table


@pytest.mark.parametrize("dialect", ["chat", "anthropic"])
def test_bench_constrained_runs_the_same_prompts_held_to_json(live_server, tmp_path, capsys, dialect):
    """--constrained: each level again with every answer a JSON object, then free with each answer's length (the
    baseline the JSON run's tok/s is set against)."""
    out = tmp_path / "serve.json"
    before = live_server.ctx.metrics.constrained_counts().get("json_object" if dialect == "chat" else "json_schema", 0)
    assert serve.main(bench_args(url=live_server.url, concurrency="2", requests=2, gen_len=16, prompt_len=64,
                                 json=out, dialect=dialect, constrained=True)) == 0
    free, held = json.loads(out.read_text())["constrained"]
    assert free["name"] == "concurrency 2, free, same lengths" and held["name"] == "concurrency 2, JSON"
    assert held["vs"] == free["name"] and held["errors"] == free["errors"] == 0
    assert held["tok_s"] > 0 and held["speedup"] == held["tok_s"] / free["tok_s"]
    assert free["output_tokens"] == held["output_tokens"] and held["output_tokens_mean"] <= 16  # the same lengths
    after = live_server.ctx.metrics.constrained_counts().get("json_object" if dialect == "chat" else "json_schema", 0)
    assert after - before == 2  # the server held exactly those requests
    assert "every answer a JSON object" in capsys.readouterr().out


def test_bench_long_prompt_beside_streams(live_server, tmp_path, capsys):
    """Two streams decode while a 3000-token prompt prefills (two chunks): both windows measured, then cut."""
    out = tmp_path / "serve.json"
    assert serve.main(bench_args(url=live_server.url, concurrency="2", requests=2, gen_len=4, prompt_len=64,
                                 long_prompt=3000, json=out)) == 0
    lp = json.loads(out.read_text())["long_prompt"]
    assert lp["streams"] == 2 and abs(lp["long_prompt_tokens"] - 3000) <= 8
    assert lp["steady_gaps"] > 0 and lp["during_gaps"] > 0
    assert lp["during_itl_ms"]["max"] >= lp["during_itl_ms"]["p99"] > 0 and lp["long_ttft_ms"] > 0
    assert lp["p99_during_over_steady_p50"] > 0
    assert "while one" in capsys.readouterr().out
    # the cut streams were dropped: the server answers the next request at once
    r = asyncio.run(serve.one_request(live_server.url, serve.DIALECTS["chat"], "m", "Hi", 2, {}))
    assert r.error is None and r.output_tokens == 2


def test_bench_anthropic_dialect(live_server, tmp_path):
    out = tmp_path / "serve.json"
    serve.main(bench_args(url=live_server.url + "/", concurrency="2", requests=2, gen_len=4, prompt_len=64,
                          json=out, dialect="anthropic"))
    payload = json.loads(out.read_text())
    check_payload(payload, [2], 2, 64)
    assert payload["dialect"] == "anthropic"


def test_bench_starts_and_stops_its_own_server(smollm2_path, tmp_path):
    out = tmp_path / "serve.json"
    code = serve.main(bench_args(model=str(smollm2_path), device="cpu", dtype="float32", concurrency="1",
                                 kv_tokens=2048,  # one short request: the default pool would be ~1 GB of fp32 KV
                                 requests=1, gen_len=4, prompt_len=64, json=out))
    assert code == 0
    payload = json.loads(out.read_text())
    check_payload(payload, [1], 1, 64)
    assert payload["server_command"][1:4] == ["-m", "lucebox", "serve"]
    assert payload["server"]["max_num_seqs"] == 1  # the largest level, so every level can batch fully
    with pytest.raises(HttpClientError, match="cannot connect"):  # stopped at the end
        asyncio.run(get_json(payload["url"] + "/health"))


def test_bench_rejects_bad_arguments(tmp_path):
    with pytest.raises(LuceboxError, match="no server at"):
        serve.main(bench_args(url=f"http://127.0.0.1:{refused_port()}", json=tmp_path / "x.json"))
    with pytest.raises(LuceboxError, match="give one or the other"):
        serve.main(bench_args(url="http://127.0.0.1:1", model="smollm2"))
    with pytest.raises(LuceboxError, match="--gen-len must be >= 1"):
        serve.main(bench_args(gen_len=0))
    with pytest.raises(LuceboxError, match="--dialect"):
        serve.main(bench_args(dialect="grpc"))
    assert not (tmp_path / "x.json").exists()


def test_the_started_server_gets_the_benchs_engine_flags() -> None:
    """--weights and --gpu-memory given to a bench reach the server it starts (they were dropped)."""
    from lucebox import cli
    from lucebox.bench.serve import serve_command

    args = cli.build_parser().parse_args(["bench", "agent", "--model", "m.gguf", "--weights", "quantized",
                                          "--gpu-memory", "20", "--kv-tokens", "4096"])
    cmd = serve_command(args, 8123, 4)
    for flag, value in (("--weights", "quantized"), ("--gpu-memory", "20.0"), ("--kv-tokens", "4096"),
                        ("--port", "8123"), ("--max-num-seqs", "4"), ("--model", "m.gguf")):
        assert cmd[cmd.index(flag) + 1] == value
    assert "--weights" not in serve_command(cli.build_parser().parse_args(["bench", "agent"]), 1, 1)


def test_chat_frames_count_every_kind_of_generated_content():
    def at(obj: Any, t: float) -> SSEFrame:
        return SSEFrame(t, None, obj if isinstance(obj, str) else json.dumps(obj))

    r = serve.RequestResult(start=0.0)
    for t, delta in enumerate([{"role": "assistant"}, {"content": "a"}, {"reasoning_content": "b"},
                               {"reasoning": "c"}, {"tool_calls": [{"index": 0}]}, {}]):
        serve.chat_frame(at({"choices": [{"delta": delta, "finish_reason": None}]}, float(t)), r)
    assert r.deltas == [1.0, 2.0, 3.0, 4.0]  # the role-only first frame and the empty one are not tokens
    serve.chat_frame(at({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4}}, 6.0), r)
    serve.chat_frame(at("[DONE]", 7.0), r)
    assert (r.prompt_tokens, r.output_tokens, r.done, r.error) == (7, 4, True, None)
    serve.chat_frame(at({"error": {"message": "boom"}}, 8.0), r)
    assert "boom" in r.error
