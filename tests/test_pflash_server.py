"""PFlash in the server: which requests get compressed, what the responses and /props and /metrics report,
and that a repeated long prompt skips the scorer and the prefill (exact cache tier, also after a restart).

Real servers on real sockets (tests/live_server.py) on the default model, scored by the model itself, and
one pair of servers scored by a tiny GGUF of another tokenizer (`--prefill-drafter`).
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from lucebox import cli, procs
from lucebox.engine.pflash.service import DEFAULT_THRESHOLD, ScorerParking
from tests.live_server import start_server

KEEP = 0.1
THRESHOLD = 600
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def haystack(n_lines: int, key: int) -> str:
    """A long user message with one pass key in it (~19 tokens a line on the default model)."""
    lines = [f"Line {i}: the quick brown fox jumps over the lazy dog number {i}." for i in range(n_lines)]
    lines.insert(n_lines // 3, f"The pass key is {key}. Remember it.")
    return "\n".join(lines) + "\nWhat is the pass key?"


def post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def get(url: str, path: str) -> bytes:
    with urllib.request.urlopen(url + path, timeout=60) as r:
        return r.read()


def chat(url: str, content: str, **extra) -> dict:
    return post(url, "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": content}],
                                              "max_tokens": 3, "temperature": 0, **extra})


def metric(url: str, name: str) -> float:
    for line in get(url, "/metrics").decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not in /metrics")


def raw_tokens(server, content: str) -> int:
    return len(server.ctx.prompt.render_ids([{"role": "user", "content": content}], add_generation_prompt=True))


@pytest.fixture(scope="module")
def auto_server(smollm2_path):
    """auto above 600 tokens, scored by the model itself; the GPU-block tier off, so a repeat's KV can only
    come from the exact tier (keyed by the raw prompt)."""
    server = start_server(smollm2_path, kv_tokens=4096, prefill_compression="auto", prefill_threshold=THRESHOLD,
                          prefill_keep_ratio=KEEP, gpu_prefix_cache=False)
    yield server
    server.stop()


def test_auto_leaves_a_prompt_under_the_threshold_alone(auto_server):
    url = auto_server.url
    before = metric(url, "lucebox_pflash_compressed_requests_total")
    content = haystack(20, 1111)
    n = raw_tokens(auto_server, content)
    assert 100 < n <= THRESHOLD
    r = chat(url, content)
    assert r["usage"]["prompt_tokens"] == n and "prefill_compression" not in r["timings"]
    assert metric(url, "lucebox_pflash_compressed_requests_total") == before


def test_auto_compresses_a_long_prompt_and_a_repeat_skips_scorer_and_prefill(auto_server):
    url, cache = auto_server.url, auto_server.ctx.engine.engine.cache
    content = haystack(60, 48213)
    n = raw_tokens(auto_server, content)
    assert n > THRESHOLD
    calls, hits = metric(url, "lucebox_pflash_scorer_calls_total"), cache.counters["exact"].hits
    first = chat(url, content)
    pc = first["timings"]["prefill_compression"]
    assert pc["original_tokens"] == n and pc["compressed_tokens"] == first["usage"]["prompt_tokens"]
    assert pc["compressed_tokens"] < n / 4 and pc["ratio"] == pytest.approx(n / pc["compressed_tokens"], abs=1e-3)
    assert pc["reused"] is False and pc["scorer_ms"] > 0
    assert first["timings"]["ttft_ms"] > first["timings"]["prefill_ms"] + pc["compress_ms"] - 0.1  # counts the scorer
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert metric(url, "lucebox_pflash_scorer_calls_total") == calls + 1

    again = chat(url, content)
    pc2 = again["timings"]["prefill_compression"]
    assert metric(url, "lucebox_pflash_scorer_calls_total") == calls + 1, "the repeat ran the scorer"
    assert pc2["reused"] is True and pc2["scorer_ms"] == 0 and pc2["compressed_tokens"] == pc["compressed_tokens"]
    # The compressed prompt's KV came back from the exact tier (the GPU-block tier is off): all but the last token.
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == pc["compressed_tokens"] - 1
    assert cache.counters["exact"].hits == hits + 1
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


def test_a_request_with_tools_is_never_compressed(auto_server):
    url = auto_server.url
    compressed, calls = (metric(url, f"lucebox_pflash_{n}_total") for n in ("compressed_requests", "scorer_calls"))
    content = haystack(60, 70519)
    r = chat(url, content, tools=[WEATHER])
    assert "prefill_compression" not in r["timings"] and r["usage"]["prompt_tokens"] > THRESHOLD
    anthropic = {"model": "m", "max_tokens": 3, "temperature": 0, "messages": [{"role": "user", "content": content}],
                 "tools": [{"name": "get_weather", "description": "Weather in a city.",
                            "input_schema": WEATHER["function"]["parameters"]}]}
    n = post(url, "/v1/messages/count_tokens", anthropic)["input_tokens"]
    usage = post(url, "/v1/messages", anthropic)["usage"]
    assert usage["input_tokens"] + usage.get("cache_read_input_tokens", 0) == n > THRESHOLD
    assert metric(url, "lucebox_pflash_compressed_requests_total") == compressed
    assert metric(url, "lucebox_pflash_scorer_calls_total") == calls


def test_anthropic_long_prompt_is_compressed(auto_server):
    url = auto_server.url
    body = {"model": "m", "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "text", "text": haystack(60, 36642)}]}]}
    n = post(url, "/v1/messages/count_tokens", body)["input_tokens"]
    saved = metric(url, "lucebox_pflash_tokens_saved_total")
    usage = post(url, "/v1/messages", body)["usage"]
    processed = usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
    assert n > THRESHOLD and processed < n / 4
    assert metric(url, "lucebox_pflash_tokens_saved_total") == saved + n - processed


def test_props_and_metrics_report_pflash(auto_server, smollm2_path):
    url = auto_server.url
    pf = json.loads(get(url, "/props"))["pflash"]
    assert (pf["mode"], pf["threshold"], pf["keep_ratio"]) == ("auto", THRESHOLD, KEEP)
    assert pf["scorer"] == str(smollm2_path) and pf["scorer_is_target"] is True and pf["parking"] is False
    assert pf["compressed_requests"] == metric(url, "lucebox_pflash_compressed_requests_total")
    assert pf["tokens_saved"] == metric(url, "lucebox_pflash_tokens_saved_total")
    assert pf["scorer_calls"] == metric(url, "lucebox_pflash_scorer_calls_total")
    assert pf["reused"] == metric(url, "lucebox_pflash_reused_total")
    assert pf["scorer_seconds"] == pytest.approx(metric(url, "lucebox_pflash_scorer_seconds_total"), abs=1e-3)
    assert pf["scorer_calls"] >= 1 and pf["scorer_seconds"] > 0
    server = json.loads(get(url, "/props"))["server"]
    assert server["prefill_compression"] == "auto" and server["prefill_threshold"] == THRESHOLD


def test_a_selection_that_does_not_shrink_the_prompt_is_not_used(smollm2_path):
    """Keeping every chunk (plus the re-added query) would make the prompt longer: the raw one is prefilled."""
    server = start_server(smollm2_path, kv_tokens=4096, prefill_compression="always", prefill_keep_ratio=1.0)
    try:
        content = haystack(12, 4242)
        body = chat(server.url, content)
        assert "prefill_compression" not in body["timings"]
        assert body["usage"]["prompt_tokens"] == raw_tokens(server, content)
        assert metric(server.url, "lucebox_pflash_scorer_calls_total") == 1
        assert metric(server.url, "lucebox_pflash_compressed_requests_total") == 0
    finally:
        server.stop()


def test_always_with_a_separate_scorer_reuses_its_compression_after_a_restart(smollm2_path, tiny_gguf, tmp_path):
    """`always` compresses even a prompt under the default threshold, scored by a tiny model of another
    tokenizer (the kept text is tokenized again for the target); the exact tier persists the result on disk
    under the raw prompt's key, so a fresh server answers the same prompt without the scorer and without
    prefill. Tools still turn compression off."""
    scorer = tiny_gguf("llama", "F32")
    options = dict(kv_tokens=4096, prefill_compression="always", prefill_keep_ratio=0.25, prefill_drafter=str(scorer),
                   kv_cache_dir=tmp_path / "kv", kv_cache_min_tokens=16)
    content = haystack(25, 90210)
    server = start_server(smollm2_path, **options)
    try:
        n = raw_tokens(server, content)
        assert n < DEFAULT_THRESHOLD
        pf = json.loads(get(server.url, "/props"))["pflash"]
        assert pf["threshold"] == DEFAULT_THRESHOLD
        assert pf["scorer"] == str(scorer) and pf["scorer_is_target"] is False
        first = chat(server.url, content)
        pc = first["timings"]["prefill_compression"]
        assert pc["original_tokens"] == n and pc["compressed_tokens"] < n and not pc["reused"]
        server.ctx.engine.engine.cache.disk.flush()
        assert server.ctx.engine.engine.cache.stats()["disk"]["written"] >= 1
    finally:
        server.stop()

    server = start_server(smollm2_path, **options)
    try:
        again = chat(server.url, content)
        pc2 = again["timings"]["prefill_compression"]
        assert pc2["reused"] and pc2["compressed_tokens"] == pc["compressed_tokens"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == pc["compressed_tokens"] - 1
        assert metric(server.url, "lucebox_pflash_scorer_calls_total") == 0
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        with_tools = chat(server.url, content, tools=[WEATHER])
        assert "prefill_compression" not in with_tools["timings"]
        assert metric(server.url, "lucebox_pflash_compressed_requests_total") == 1
    finally:
        server.stop()


@pytest.mark.parametrize("argv, problem", [
    (["--prefill-compression", "sometimes"], "--prefill-compression must be one of off, auto, always"),
    (["--prefill-threshold", "lots"], "--prefill-threshold must be an integer"),
    (["--prefill-threshold", "-5"], "--prefill-threshold must be a token count >= 0"),
    (["--prefill-keep-ratio", "0"], "--prefill-keep-ratio must be in (0, 1]"),
    (["--prefill-keep-ratio", "1.5"], "--prefill-keep-ratio must be in (0, 1]"),
    (["--prefill-keep-ratio", "nan"], "--prefill-keep-ratio must be a number"),
    (["--prefill-drafter", "/no/such/scorer.gguf"], "--prefill-drafter '/no/such/scorer.gguf' is neither"),
])
def test_bad_flag_values_are_one_line_and_exit_2(argv, problem, capsys):
    assert cli.main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lucebox: error: {problem}") and "\n" not in err


def test_bad_environment_value_names_the_flag(monkeypatch, capsys):
    monkeypatch.setenv("LUCEBOX_PREFILL_KEEP_RATIO", "2")
    assert cli.main(["serve"]) == 2
    assert capsys.readouterr().err.strip() == "lucebox: error: --prefill-keep-ratio must be in (0, 1], got 2.0"


def test_bad_flag_in_a_real_process_exits_2_before_loading_anything():
    done = procs.run([sys.executable, "-m", "lucebox", "--prefill-compression", "never", "--prefill-skip-park"],
                     capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1])
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "lucebox: error: --prefill-compression must be one of off, auto, always, got 'never'"]


def test_parking_is_a_no_op_off_cuda():
    layer = torch.nn.Linear(4, 4)
    where = layer.weight.data_ptr()
    parking = ScorerParking(layer, torch.device("cpu"))
    parking.park()
    assert not parking.enabled and not parking.parked
    assert layer.weight.data_ptr() == where and not layer.weight.is_pinned()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="parking moves weights between GPU and pinned host memory")
def test_parking_moves_weights_to_pinned_host_memory_and_back():
    layer = torch.nn.Linear(64, 64).cuda()
    x = torch.randn(2, 64, device="cuda")
    expected = layer(x)
    parking = ScorerParking(layer, torch.device("cuda"))
    parking.park()
    assert parking.parked and layer.weight.device.type == "cpu" and layer.weight.is_pinned()
    parking.unpark()
    assert not parking.parked and layer.weight.device.type == "cuda"
    torch.testing.assert_close(layer(x), expected)
