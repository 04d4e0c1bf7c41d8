"""Speculative decoding and the prefix cache together, through the live server.

{drafter off, chain, DDTree, chain's one-launch steps launched one step ahead} x {prefix cache off, GPU tier,
RAM tier after GPU eviction, disk tier after a restart}, two turns each (the second extends the first
conversation), greedy: every reply is the text plain decoding gives with the cache off. A cell's requests
alternate between streamed and not, and the drafter modes start the alternation differently, so across the
matrix every tier serves both kinds of request with and without a drafter. A batched case runs four
conversations at once, two streamed. Each cell checks that the tier it is about really served the prompt (the
cache's counters and `cached_tokens`), with a drafter that verification passes ran, and ahead that speculative
steps ran ahead, so no cell passes vacuously.

Cost: one server per (drafter mode, cache config), 12-token replies."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.live_server import LiveServer, start_server

DRAFTER = str(Path(__file__).resolve().parents[1] / "model_cards" / "drafters" / "smollm2-135m-instruct-dflash")
MODES = {"off": {"no_draft": True, "ahead": False}, "chain": {"draft": DRAFTER},
         "ddtree": {"draft": DRAFTER, "ddtree": True, "ddtree_budget": 10},
         # CUDA's default: greedy steps launched one step ahead, the drafter's one-launch chain steps and the plain
         # ones of requests whose drafts stop paying (runtime/ahead.py)
         "ahead": {"draft": DRAFTER, "ahead": True, "spec_static": True}}
COMMON = dict(kv_tokens=4096, prefill_compression="off", max_num_seqs=8)
CACHE_ON = dict(kv_cache_min_tokens=16)  # the shared system prompt (~110 tokens) reaches every tier
MAX_TOKENS = 12
SYSTEM = ("You are the assistant of a small hardware shop. You answer questions about tools, screws, paint and "
          "garden supplies. Keep every answer short and friendly, and never invent a price. If a customer asks "
          "about something the shop does not sell, say so and suggest where they could look instead. Opening "
          "hours are nine to six on weekdays and nine to one on Saturdays; the shop is closed on Sundays.")
TOPICS = {"off": "which screws hold a shelf", "gpu": "how to paint a fence", "ram": "what a spirit level is for",
          "disk": "how to store garden hoses", "b0": "what glue fixes a chair", "b1": "how to sharpen a saw",
          "b2": "which nails suit pine", "b3": "what a stud finder does", "hangup": "how to oil a hinge"}


def first_turn(topic: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Tell me {topic}."}]


def second_turn(topic: str, reply: str) -> list[dict[str, str]]:
    return first_turn(topic) + [{"role": "assistant", "content": reply},
                                {"role": "user", "content": "Thanks. And what should I buy for it?"}]


@dataclass
class Reply:
    text: str
    finish: str | None
    cached: int


def chat(server: LiveServer, messages: list[dict[str, str]], stream: bool) -> Reply:
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)
    args: dict[str, Any] = dict(model="x", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    if not stream:
        r = client.chat.completions.create(**args)
        return Reply(r.choices[0].message.content or "", r.choices[0].finish_reason,
                     r.usage.prompt_tokens_details.cached_tokens)
    text, finish, cached = "", None, -1
    for chunk in client.chat.completions.create(**args, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return Reply(text, finish, cached)


class Reference:
    """Plain decoding, prefix cache off: the text every cell must reproduce, every topic's two turns computed up
    front, so its server can stop before a drafter mode starts its own two (CI memory: two servers at a time)."""

    def __init__(self, server: LiveServer) -> None:
        self.server: LiveServer | None = server
        self._turns: dict[str, tuple[str, str]] = {}
        for topic in TOPICS.values():
            one = chat(server, first_turn(topic), stream=False).text
            self._turns[topic] = one, chat(server, second_turn(topic, one), stream=False).text

    def turns(self, topic: str) -> tuple[str, str]:
        """(first reply, second reply) of the conversation about `topic`."""
        return self._turns[topic]

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


@pytest.fixture(scope="module")
def reference(smollm2_path):
    ref = Reference(start_server(smollm2_path, prefix_cache=False, **MODES["off"], **COMMON))
    yield ref
    ref.stop()


@pytest.fixture(scope="module", params=list(MODES))
def mode(request) -> str:
    return request.param


@dataclass
class Servers:
    """The servers of one drafter mode; the disk test swaps `cached` for a restarted one."""

    mode: str
    cache_off: LiveServer
    cached: LiveServer
    kv_dir: Path
    own_cache_off: bool


@pytest.fixture(scope="module")
def servers(mode, reference, smollm2_path, tmp_path_factory):
    own = mode != "off" or reference.server is None  # drafter off, cache off: the reference server, while it runs
    if own:
        reference.stop()
    cache_off = start_server(smollm2_path, prefix_cache=False, **MODES[mode], **COMMON) if own else reference.server
    kv_dir = tmp_path_factory.mktemp(f"kv-{mode}")
    cached = start_server(smollm2_path, kv_cache_dir=kv_dir, **CACHE_ON, **MODES[mode], **COMMON)
    box = Servers(mode, cache_off, cached, kv_dir, own)
    yield box
    box.cached.stop()
    if own:
        cache_off.stop()


def stats(server: LiveServer) -> dict[str, Any]:
    eng = server.ctx.engine.engine
    out = eng.cache.stats() if eng.cache is not None else {}
    out["spec_steps"] = eng.spec.stats.steps if eng.spec is not None else 0
    out["spec_ahead_steps"] = eng.ahead.spec_steps if eng.ahead is not None else 0
    return out


def served(server: LiveServer, messages: list[dict[str, str]], stream: bool) -> tuple[Reply, dict, dict]:
    before = stats(server)
    reply = chat(server, messages, stream)
    return reply, before, stats(server)


def check(reply: Reply, want: str, before: dict, after: dict, mode: str) -> None:
    assert reply.finish in ("stop", "length"), f"finish reason {reply.finish!r}"
    assert reply.text == want
    if mode != "off":
        assert after["spec_steps"] > before["spec_steps"], "the drafter did not run"
    if mode == "ahead":
        assert after["spec_ahead_steps"] > before["spec_ahead_steps"], "no speculative step ran ahead"


def evict_gpu_tier(server: LiveServer) -> None:
    """Drop every block only the GPU-tier index holds (what a full pool does), on the engine thread."""
    cache = server.ctx.engine.engine.cache
    freed = server.ctx.engine.call_in_engine(lambda: cache.evict(cache.kv.pool.num_blocks)).result(timeout=60)
    assert freed > 0 and cache.blocks_held == 0


def delta(before: dict, after: dict, tier: str, field: str) -> int:
    return after[tier][field] - before[tier][field]


def alternating(mode: str) -> Iterator[bool]:
    """`stream` for a cell's requests in turn: json first in "off" and "ddtree", streamed first in the others."""
    return itertools.cycle((False, True) if list(MODES).index(mode) % 2 == 0 else (True, False))


def test_prefix_cache_off(servers, reference):
    want1, want2 = reference.turns(TOPICS["off"])
    stream = alternating(servers.mode)
    for messages, want in ((first_turn(TOPICS["off"]), want1), (second_turn(TOPICS["off"], want1), want2)):
        reply, before, after = served(servers.cache_off, messages, next(stream))
        check(reply, want, before, after, servers.mode)
        assert reply.cached == 0


def test_gpu_tier(servers, reference):
    topic = TOPICS["gpu"]
    want1, want2 = reference.turns(topic)
    stream = alternating(servers.mode)
    reply, before, after = served(servers.cached, first_turn(topic), next(stream))
    check(reply, want1, before, after, servers.mode)
    reply, before, after = served(servers.cached, second_turn(topic, want1), next(stream))
    check(reply, want2, before, after, servers.mode)
    assert delta(before, after, "gpu", "restored_tokens") > 0 and reply.cached > 0


def test_ram_tier_after_gpu_eviction(servers, reference):
    topic = TOPICS["ram"]
    want1, want2 = reference.turns(topic)
    server, stream = servers.cached, alternating(servers.mode)
    reply, before, after = served(server, first_turn(topic), next(stream))
    check(reply, want1, before, after, servers.mode)
    evict_gpu_tier(server)
    reply, before, after = served(server, first_turn(topic), next(stream))  # the same chat again: exact tier
    check(reply, want1, before, after, servers.mode)
    assert delta(before, after, "exact", "hits") == 1 and delta(before, after, "gpu", "restored_tokens") == 0
    assert reply.cached > 0
    evict_gpu_tier(server)
    reply, before, after = served(server, second_turn(topic, want1), next(stream))  # the next turn: turn-boundary tier
    check(reply, want2, before, after, servers.mode)
    assert delta(before, after, "prefix", "hits") == 1 and delta(before, after, "gpu", "restored_tokens") == 0
    assert reply.cached > 0


def test_batched_conversations(servers, reference):
    """Four conversations at once, two streamed: first turns together, then second turns together."""
    topics = [TOPICS[f"b{i}"] for i in range(4)]
    wants = [reference.turns(t) for t in topics]
    server = servers.cached
    def one(i: int, turn: int, replies: dict[int, Reply]) -> None:
        msgs = first_turn(topics[i]) if turn == 0 else second_turn(topics[i], wants[i][0])
        replies[i] = chat(server, msgs, stream=i % 2 == 1)

    for turn in (0, 1):
        replies: dict[int, Reply] = {}
        before = stats(server)
        threads = [threading.Thread(target=one, args=(i, turn, replies)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        after = stats(server)
        for i in range(4):
            check(replies[i], wants[i][turn], before, after, servers.mode)
        assert delta(before, after, "gpu", "restored_tokens") > 0  # the shared system prompt, then the turns
        assert min(replies[i].cached for i in range(4)) > 0


def test_streams_hung_up_mid_reply_leak_nothing(servers, reference):
    """Six streamed first turns at once, every other one hung up after its first delta (its next step may be in
    flight: runtime/ahead.py): the engine notices, goes idle with no block held but the cache's, the others
    get plain decoding's text, and the conversation's second turn is served from the cache with its text."""
    topic = TOPICS["hangup"]
    want1, want2 = reference.turns(topic)
    server = servers.cached
    eng = server.ctx.engine
    disconnects = eng.num_disconnects
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)
    texts: dict[int, str] = {}

    def one(i: int) -> None:
        stream = client.chat.completions.create(model="x", messages=first_turn(topic), max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True)
        text = ""
        for chunk in stream:
            text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
            if text and i % 2:
                stream.close()
                return
        texts[i] = text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    server.wait_idle(timeout=60)
    assert eng.num_disconnects > disconnects, "no hang-up was noticed"
    assert texts == {0: want1, 2: want1, 4: want1}
    reply, before, after = served(server, second_turn(topic, want1), stream=True)
    check(reply, want2, before, after, servers.mode)
    assert reply.cached > 0


def test_disk_tier_after_restart(servers, reference, smollm2_path):
    """A first turn reaches the disk; a new server on the same folder serves it again from there, then the second
    turn from the cache."""
    topic, stream = TOPICS["disk"], alternating(servers.mode)
    want1, want2 = reference.turns(topic)
    reply, before, after = served(servers.cached, first_turn(topic), next(stream))
    check(reply, want1, before, after, servers.mode)
    servers.cached.ctx.engine.engine.cache.disk.flush()
    servers.cached.stop()
    servers.cached = start_server(smollm2_path, kv_cache_dir=servers.kv_dir, **CACHE_ON, **MODES[servers.mode],
                                  **COMMON)
    reply, before, after = served(servers.cached, first_turn(topic), next(stream))
    check(reply, want1, before, after, servers.mode)
    assert after["disk"]["hits"] > before["disk"]["hits"] and delta(before, after, "exact", "hits") == 1
    assert reply.cached > 0
    reply, before, after = served(servers.cached, second_turn(topic, want1), next(stream))
    check(reply, want2, before, after, servers.mode)
    assert reply.cached > 0
