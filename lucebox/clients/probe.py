"""`python -m lucebox clients probe [--url URL]`: the protocol features each agent client relies on.

Each check sends what a real client sends (recorded from Codex 0.171, Claude
Code 2.1.332, OpenCode 1.18, Hermes 0.19, llm 0.36, Open WebUI 0.12 against
Lucebox) and checks what that client needs back. Plain HTTP (http.client), no
SDK: the checks must see the wire, not what an SDK forgives. Prints a table;
exit code 1 when any check fails.

Tool checks force a call (`tool_choice` required / a named tool) because the
server must then produce one whatever the model; they need a chat template
that renders tools (e.g. `--chat-template-file tests/data/templates/Qwen-Qwen3-0.6B.jinja`
for SmolLM2).
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import sys
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

from lucebox.clients import DUMMY_KEY, server_from_env


class ProbeFailure(AssertionError):
    """A check's expectation did not hold; the message says what came back."""


def expect(cond: bool, msg: str) -> None:
    if not cond:
        raise ProbeFailure(msg)


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict:
        try:
            return json.loads(self.body)
        except ValueError:
            raise ProbeFailure(f"HTTP {self.status}: body is not JSON: {self.body[:200]!r}") from None

    def events(self) -> list[tuple[str | None, str]]:
        """SSE frames as (event name or None, data); each frame's data lines joined."""
        out: list[tuple[str | None, str]] = []
        for frame in self.body.decode("utf-8", errors="replace").replace("\r\n", "\n").split("\n\n"):
            event, data = None, []
            for line in frame.split("\n"):
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].removeprefix(" "))
            if data:
                out.append((event, "\n".join(data)))
        return out


class Client:
    """One server: plain HTTP/1.1 requests with the auth headers every client sends."""

    def __init__(self, url: str, api_key: str = DUMMY_KEY, timeout: float = 300) -> None:
        u = urllib.parse.urlsplit(url.rstrip("/"))
        self.host, self.port = u.hostname or "127.0.0.1", u.port or (443 if u.scheme == "https" else 80)
        self.https = u.scheme == "https"
        self.prefix = u.path.removesuffix("/v1")
        self.api_key, self.timeout = api_key, timeout

    def request(self, method: str, path: str, body: dict | None = None, headers: dict | None = None) -> Reply:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=self.timeout)
        hdrs = {"authorization": f"Bearer {self.api_key}", "x-api-key": self.api_key, **(headers or {})}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            hdrs["content-type"] = "application/json"
        try:
            conn.request(method, self.prefix + path, body=data, headers=hdrs)
            resp = conn.getresponse()
            return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
        except OSError as exc:
            raise ProbeFailure(f"{method} {path}: {exc}") from None
        finally:
            conn.close()

    def get(self, path: str) -> Reply:
        return self.request("GET", path)

    def post(self, path: str, body: dict, headers: dict | None = None) -> Reply:
        return self.request("POST", path, body, headers)


def ok_json(r: Reply, what: str) -> dict:
    expect(r.status == 200, f"{what}: HTTP {r.status}: {r.body[:300].decode(errors='replace')}")
    return r.json()


def sse(r: Reply, what: str) -> list[tuple[str | None, str]]:
    expect(r.status == 200, f"{what}: HTTP {r.status}: {r.body[:300].decode(errors='replace')}")
    ctype = r.headers.get("content-type", "")
    expect(ctype.startswith("text/event-stream"), f"{what}: content-type {ctype!r}, not text/event-stream")
    return r.events()


def model_id(c: Client) -> str:
    return ok_json(c.get("/v1/models"), "GET /v1/models")["data"][0]["id"]


# ---------------------------------------------------------------- the checks

CODEX_VERSION = "0.171.0"
RAW_TAG = re.compile(r"</?tool_call>|<function=|</function>")  # tool-call markup that must never reach a client
ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01",
                     "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"}
EXEC_TOOL = {"type": "function", "name": "exec_command", "description": "Runs a command in a PTY.", "strict": False,
             "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
BASH_TOOL = {"name": "Bash", "description": "Run a shell command.",
             "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
CHAT_TOOL = {"type": "function", "function": {"name": "bash", "description": "Run a shell command.", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}


def check_health(c: Client) -> str:
    body = ok_json(c.get("/health"), "GET /health")
    expect(body.get("status") == "ok", f"/health says {body}")
    return "status ok"


def check_models(c: Client) -> str:
    body = ok_json(c.get("/v1/models"), "GET /v1/models")
    expect(body.get("object") == "list" and body.get("data"), f"/v1/models: {str(body)[:200]}")
    m = body["data"][0]
    for k in ("id", "object", "created", "owned_by"):
        expect(k in m, f"/v1/models data[0] lacks {k!r}")
    return f"{m['id']} (context {m.get('context_length')})"


def check_codex_models(c: Client) -> str:
    mid = model_id(c)
    body = ok_json(c.get(f"/v1/models?client_version={CODEX_VERSION}"), "GET /v1/models?client_version")
    expect(isinstance(body.get("models"), list) and body["models"], f"no `models` list: {str(body)[:200]}")
    m = body["models"][0]
    for k in ("slug", "display_name", "default_reasoning_level", "supported_reasoning_levels", "shell_type",
              "visibility", "supported_in_api", "priority", "context_window", "supports_reasoning_summaries",
              "supports_parallel_tool_calls"):
        expect(k in m, f"Codex model entry lacks {k!r}")
    expect(m["slug"] == mid, f"slug {m['slug']!r} != /v1/models id {mid!r}")
    return f"slug {m['slug']}, context_window {m['context_window']}"


def responses_stream(c: Client, body: dict, what: str) -> tuple[list[dict], dict]:
    """Stream /v1/responses; check the event grammar Codex relies on; return (events, final response)."""
    frames = sse(c.post("/v1/responses", {**body, "stream": True}), what)
    events = []
    for name, data in frames:
        expect(data != "[DONE]", f"{what}: a [DONE] frame (Responses streams end with response.completed)")
        ev = json.loads(data)
        expect("type" in ev, f"{what}: event without `type`: {data[:120]}")
        expect(name in (None, ev["type"]), f"{what}: `event: {name}` but type {ev['type']}")
        events.append(ev)
    types = [e["type"] for e in events]
    expect(types[:1] == ["response.created"], f"{what}: first event {types[:1]}")
    expect(types[-1] in ("response.completed", "response.incomplete"),
           f"{what}: stream closed before response.completed (last {types[-1]})")
    seqs = [e.get("sequence_number") for e in events]
    expect(all(isinstance(s, int) for s in seqs) and seqs == sorted(set(seqs)),
           f"{what}: sequence_number not strictly growing: {seqs[:10]}")
    final = events[-1].get("response")
    expect(isinstance(final, dict) and final.get("id", "").startswith("resp_"),
           f"{what}: response object not nested under `response`")
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    expect([i.get("id") for i in done] == [i.get("id") for i in final.get("output", [])],
           f"{what}: item ids of output_item.done {[i.get('id') for i in done]} != response.completed output "
           f"{[i.get('id') for i in final.get('output', [])]}")
    for e in events:
        if "output_index" in e and "item_id" in e:
            expect(final["output"][e["output_index"]]["id"] == e["item_id"],
                   f"{what}: {e['type']} item_id/output_index disagree with the final output")
    return events, final


def check_responses_text(c: Client) -> str:
    _, final = responses_stream(c, {"model": model_id(c), "instructions": "Answer briefly.",
                                    "input": "Say hello.", "max_output_tokens": 8}, "POST /v1/responses")
    text = "".join(p.get("text", "") for i in final["output"] if i["type"] == "message" for p in i["content"])
    expect(final.get("output_text", text) == text, "output_text differs from the message parts")
    expect("usage" in final and "input_tokens" in final["usage"], "response.usage missing")
    return f"{final['status']}, {len(text)} chars"


def check_responses_codex_shapes(c: Client) -> str:
    body = {
        "model": model_id(c), "stream": False, "max_output_tokens": 4, "store": False, "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "probe",
        "tool_choice": "auto",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: none."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<environment_context/>"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "x"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
            {"type": "message", "role": "user", "content": []},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        ],
        "tools": [EXEC_TOOL,
                  {"type": "custom", "name": "apply_patch", "description": "Apply a patch.",
                   "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
                  {"type": "web_search", "external_web_access": False},
                  {"type": "namespace", "name": "multi_agent_v1", "description": "agents",
                   "tools": [{"type": "function", "name": "wait_agent", "description": "wait", "strict": False,
                              "parameters": {"type": "object", "properties": {}}}]}],
    }
    final = ok_json(c.post("/v1/responses", body), "Codex-shaped request")
    expect(final.get("object") == "response", f"not a response object: {str(final)[:200]}")
    return "developer x2, empty content, reasoning item, custom/web_search/namespace tools: accepted"


def check_responses_tool_call(c: Client) -> str:
    events, final = responses_stream(c, {
        "model": model_id(c), "input": "Run `echo hi`.", "tools": [EXEC_TOOL], "max_output_tokens": 64,
        "tool_choice": {"type": "function", "name": "exec_command"}}, "function call stream")
    calls = [i for i in final["output"] if i["type"] == "function_call"]
    expect(len(calls) == 1, f"expected one function_call item, got {[i['type'] for i in final['output']]}")
    call = calls[0]
    expect(call["name"] == "exec_command" and call.get("call_id"), f"function_call {call}")
    args = json.loads(call["arguments"])
    expect(isinstance(args, dict), f"arguments are not a JSON object: {call['arguments']!r}")
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    dones = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    expect(dones and dones[0]["arguments"] == call["arguments"] == deltas,
           "function_call_arguments deltas/done differ from the final arguments")
    text = "".join(p.get("text", "") for i in final["output"] if i["type"] == "message" for p in i["content"])
    expect(not RAW_TAG.search(text), f"raw tool-call text leaked into the message: {text[:80]!r}")
    return f"exec_command({call['arguments'][:40]}) call_id {call['call_id'][:12]}…"


def check_responses_tool_result(c: Client) -> str:
    body = {"model": model_id(c), "stream": False, "max_output_tokens": 8, "tools": [EXEC_TOOL], "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Run echo hi"}]},
        {"type": "function_call", "call_id": "call_probe1", "name": "exec_command", "arguments": '{"cmd":"echo hi"}'},
        {"type": "function_call_output", "call_id": "call_probe1", "output": "hi\n"},
        {"type": "custom_tool_call", "call_id": "call_probe2", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "call_probe2", "output": "done"}]}
    final = ok_json(c.post("/v1/responses", body), "function_call_output replay")
    expect(final.get("status") in ("completed", "incomplete"), f"status {final.get('status')}")
    return "function_call + function_call_output replayed"


def messages_stream(c: Client, body: dict, what: str) -> tuple[list[dict], dict]:
    """Stream /v1/messages?beta=true as Claude Code does; check the event grammar; return (events, message)."""
    frames = sse(c.post("/v1/messages?beta=true", {**body, "stream": True}, ANTHROPIC_HEADERS), what)
    events = []
    for name, data in frames:
        ev = json.loads(data)
        expect(name == ev.get("type"), f"{what}: `event: {name}` but data type {ev.get('type')}")
        expect(ev["type"] != "error", f"{what}: error event {data[:200]}")
        if ev["type"] != "ping":
            events.append(ev)
    types = [e["type"] for e in events]
    expect(types[:1] == ["message_start"] and types[-2:] == ["message_delta", "message_stop"],
           f"{what}: event order {types[:3]}…{types[-2:]}")
    start = events[0]["message"]
    expect(start.get("id", "").startswith("msg_") and start.get("content") == [], f"{what}: message_start {start}")
    expect(isinstance(start.get("usage", {}).get("input_tokens"), int),
           f"{what}: message_start usage lacks input_tokens")
    content: list[dict] = []
    open_index = None
    for e in events[1:-2]:
        if e["type"] == "content_block_start":
            expect(open_index is None and e["index"] == len(content), f"{what}: block {e['index']} opened out of order")
            open_index = e["index"]
            content.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            expect(e["index"] == open_index, f"{what}: delta for block {e['index']} while {open_index} is open")
            d, block = e["delta"], content[open_index]
            if d["type"] == "text_delta":
                expect(block["type"] == "text" and d["text"] != "", f"{what}: empty or misplaced text_delta")
                block["text"] = block.get("text", "") + d["text"]
            elif d["type"] == "input_json_delta":
                expect(block["type"] == "tool_use", f"{what}: input_json_delta outside a tool_use block")
                block["_json"] = block.get("_json", "") + d["partial_json"]
            elif d["type"] == "thinking_delta":
                expect(block["type"] == "thinking", f"{what}: thinking_delta inside a {block['type']} block")
        elif e["type"] == "content_block_stop":
            expect(e["index"] == open_index, f"{what}: stop for block {e['index']} while {open_index} is open")
            open_index = None
        else:
            expect(False, f"{what}: unexpected event {e['type']} between blocks")
    expect(open_index is None, f"{what}: block {open_index} never stopped")
    delta = events[-2]
    expect(delta["delta"].get("stop_reason") in ("end_turn", "max_tokens", "stop_sequence", "tool_use"),
           f"{what}: stop_reason {delta['delta'].get('stop_reason')}")
    expect("stop_sequence" in delta["delta"], f"{what}: message_delta lacks stop_sequence")
    expect(isinstance(delta.get("usage", {}).get("output_tokens"), int), f"{what}: message_delta lacks output_tokens")
    for block in content:
        if block["type"] == "tool_use":
            block["input"] = json.loads(block.pop("_json", "") or "{}")
    return events, {**start, "content": content, "stop_reason": delta["delta"]["stop_reason"]}


CLAUDE_SYSTEM = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332; cch=12345;"},
                 {"type": "text", "text": "You are a helpful assistant. Answer briefly."}]


def check_messages_text(c: Client) -> str:
    body = {"model": model_id(c), "max_tokens": 8, "system": CLAUDE_SYSTEM,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}],
            "metadata": {"user_id": "probe"}, "thinking": {"type": "disabled"}}
    _, msg = messages_stream(c, body, "POST /v1/messages stream")
    return f"{msg['stop_reason']}, blocks {[b['type'] for b in msg['content']]}"


def check_count_tokens(c: Client) -> str:
    body = {"model": model_id(c), "system": CLAUDE_SYSTEM, "tools": [BASH_TOOL],
            "messages": [{"role": "user", "content": "Say hello."}]}
    r = ok_json(c.post("/v1/messages/count_tokens?beta=true", body, ANTHROPIC_HEADERS), "count_tokens")
    n = r.get("input_tokens")
    expect(isinstance(n, int) and n > 0, f"count_tokens answered {r}")
    events, _ = messages_stream(c, {**body, "max_tokens": 1}, "the same body, streamed")
    started = events[0]["message"]["usage"]["input_tokens"]
    expect(started == n, f"count_tokens says {n}, message_start says {started} for the same body")
    return f"{n} tokens, equal to message_start"


def check_messages_tool_use(c: Client) -> str:
    body = {"model": model_id(c), "max_tokens": 64, "system": CLAUDE_SYSTEM, "tools": [BASH_TOOL],
            "tool_choice": {"type": "tool", "name": "Bash"},
            "messages": [{"role": "user", "content": "Run `echo hi`."}]}
    events, msg = messages_stream(c, body, "tool_use stream")
    uses = [b for b in msg["content"] if b["type"] == "tool_use"]
    starts = [e for e in events if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use"]
    expect(len(uses) == 1 == len(starts), f"expected one tool_use block, got {[b['type'] for b in msg['content']]}")
    expect(starts[0]["content_block"].get("input") == {}, "tool_use content_block_start must carry input: {}")
    use = uses[0]
    expect(use["id"].startswith("toolu_") and use["name"] == "Bash", f"tool_use block {use}")
    expect(isinstance(use["input"], dict), f"tool_use input {use['input']!r}")
    text = "".join(b.get("text", "") for b in msg["content"] if b["type"] == "text")
    expect(not RAW_TAG.search(text), f"raw tool-call text leaked into a text block: {text[:80]!r}")
    expect(msg["stop_reason"] == "tool_use", f"stop_reason {msg['stop_reason']}")
    return f"Bash({json.dumps(use['input'])[:40]}) id {use['id'][:14]}…"


def check_messages_history(c: Client) -> str:
    body = {"model": model_id(c), "max_tokens": 8, "system": CLAUDE_SYSTEM, "tools": [BASH_TOOL], "messages": [
        {"role": "user", "content": "Run echo hi"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should run it.", "signature": ""},
            {"type": "text", "text": "Running it."},
            {"type": "tool_use", "id": "toolu_probe1", "name": "Bash", "input": {"command": "echo hi"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_probe1", "content": [{"type": "text", "text": "hi"}],
             "is_error": False},
            {"type": "text", "text": "<system-reminder>ok</system-reminder>"}]},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_probe2", "name": "Bash", "input": {"command": "false"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_probe2", "content": "exit 1",
                                      "is_error": True}]}]}
    messages_stream(c, body, "tool_result/thinking history")
    return "thinking + tool_use + tool_result(is_error) replayed"


def chat_stream(c: Client, body: dict, what: str) -> tuple[list[dict], dict]:
    """Stream /v1/chat/completions; check the chunk grammar; return (chunks, merged message)."""
    frames = sse(c.post("/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}),
                 what)
    expect(frames and frames[-1][1] == "[DONE]", f"{what}: the stream does not end with data: [DONE]")
    chunks = [json.loads(d) for _, d in frames[:-1]]
    expect(all(ch.get("object") == "chat.completion.chunk" for ch in chunks), f"{what}: chunk object type")
    with_choice = [ch for ch in chunks if ch["choices"]]
    expect(with_choice and with_choice[0]["choices"][0]["delta"].get("role") == "assistant",
           f"{what}: first delta has no role assistant")
    finishes = [ch["choices"][0]["finish_reason"] for ch in with_choice if ch["choices"][0].get("finish_reason")]
    expect(len(finishes) == 1, f"{what}: finish_reason chunks {finishes}")
    usage = [ch for ch in chunks if not ch["choices"]]
    expect(usage and "prompt_tokens" in usage[-1].get("usage", {}), f"{what}: no usage chunk with choices: []")
    text, calls = "", {}
    for ch in with_choice:
        d = ch["choices"][0]["delta"]
        text += d.get("content") or ""
        for tc in d.get("tool_calls") or []:
            nulls = [k for k in ("id", "type") if k in tc and tc[k] is None]
            nulls += ["name"] if "name" in tc.get("function", {}) and tc["function"]["name"] is None else []
            expect(not nulls, f"{what}: tool call delta with null {nulls}: {tc}")
            if tc["index"] not in calls:
                expect(tc.get("id") and tc.get("type") == "function" and tc["function"].get("name"),
                       f"{what}: first delta of a tool call lacks id/type/name: {tc}")
                calls[tc["index"]] = {"id": tc["id"], "name": tc["function"]["name"], "arguments": ""}
            calls[tc["index"]]["arguments"] += tc.get("function", {}).get("arguments") or ""
    return chunks, {"content": text, "tool_calls": [calls[i] for i in sorted(calls)], "finish_reason": finishes[0]}


def check_chat_stream(c: Client) -> str:
    _, msg = chat_stream(c, {"model": model_id(c), "max_tokens": 8,
                             "messages": [{"role": "system", "content": "Answer briefly."},
                                          {"role": "user", "content": "Say hello."}]}, "chat stream")
    expect(not RAW_TAG.search(msg["content"]), "raw tool-call text leaked into content")
    return f"finish {msg['finish_reason']}, {len(msg['content'])} chars, [DONE]"


def check_chat_tool_call(c: Client) -> str:
    _, msg = chat_stream(c, {"model": model_id(c), "max_tokens": 64, "tools": [CHAT_TOOL],
                             "tool_choice": {"type": "function", "function": {"name": "bash"}},
                             "messages": [{"role": "user", "content": "Run `echo hi`."}]}, "chat tool-call stream")
    expect(len(msg["tool_calls"]) >= 1, f"no tool call streamed (content {msg['content'][:80]!r})")
    call = msg["tool_calls"][0]
    expect(call["name"] == "bash" and isinstance(json.loads(call["arguments"]), dict), f"tool call {call}")
    expect(msg["finish_reason"] == "tool_calls", f"finish_reason {msg['finish_reason']}")
    expect(not RAW_TAG.search(msg["content"]), f"raw tool-call text leaked into content: {msg['content'][:80]!r}")
    return f"bash({call['arguments'][:40]}) finish tool_calls"


def check_chat_tool_result(c: Client) -> str:
    body = {"model": model_id(c), "max_tokens": 8, "tools": [CHAT_TOOL], "messages": [
        {"role": "user", "content": "Run echo hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_probe1", "type": "function",
             "function": {"name": "bash", "arguments": '{"command":"echo hi"}'}}]},
        {"role": "tool", "tool_call_id": "call_probe1", "content": "hi"}]}
    _, msg = chat_stream(c, body, "tool result replay")
    return f"finish {msg['finish_reason']}"


def check_chat_nonstream(c: Client) -> str:
    body = ok_json(c.post("/v1/chat/completions", {"model": model_id(c), "max_tokens": 8, "stream": False,
                                                   "messages": [{"role": "user", "content": "Say hello."}]}),
                   "chat non-stream")
    msg = body["choices"][0]["message"]
    expect(msg.get("role") == "assistant" and isinstance(msg.get("content"), str), f"message {msg}")
    expect({"prompt_tokens", "completion_tokens", "total_tokens"} <= set(body.get("usage", {})), "usage incomplete")
    return f"finish {body['choices'][0]['finish_reason']}"


def check_props(c: Client) -> str:
    body = ok_json(c.get("/props"), "GET /props")
    expect(isinstance(body.get("model", {}).get("n_ctx"), int), "/props lacks model.n_ctx")
    return f"n_ctx {body['model']['n_ctx']}"


@dataclass(frozen=True)
class Check:
    name: str
    clients: str
    what: str
    fn: Callable[[Client], str]


CHECKS = (
    Check("health", "all", "GET /health -> 200 status ok", check_health),
    Check("models", "opencode llm hermes openwebui", "GET /v1/models -> list with id", check_models),
    Check("codex-models", "codex", "GET /v1/models?client_version -> Codex model catalog", check_codex_models),
    Check("responses-text", "codex", "POST /v1/responses stream -> created … completed, ids consistent",
          check_responses_text),
    Check("responses-codex-shapes", "codex", "developer roles, empty content, reasoning items, custom/web_search/"
          "namespace tools -> 200", check_responses_codex_shapes),
    Check("responses-tool-call", "codex", "forced function_call streams as function_call item",
          check_responses_tool_call),
    Check("responses-tool-result", "codex", "function_call_output / custom_tool_call_output replay -> 200",
          check_responses_tool_result),
    Check("messages-text", "claude", "POST /v1/messages?beta=true stream: message_start … message_stop",
          check_messages_text),
    Check("count-tokens", "claude", "POST /v1/messages/count_tokens = message_start input_tokens", check_count_tokens),
    Check("messages-tool-use", "claude", "forced tool: one tool_use block, input_json_delta, stop tool_use",
          check_messages_tool_use),
    Check("messages-history", "claude", "thinking + tool_use + tool_result(is_error) history -> 200",
          check_messages_history),
    Check("chat-stream", "opencode llm hermes openwebui", "POST /v1/chat/completions stream: role, finish, usage, "
          "[DONE]", check_chat_stream),
    Check("chat-tool-call", "opencode llm hermes", "named tool_choice: tool_calls deltas, finish tool_calls",
          check_chat_tool_call),
    Check("chat-tool-result", "opencode llm hermes", "assistant tool_calls + role tool replay -> 200",
          check_chat_tool_result),
    Check("chat-nonstream", "openwebui llm", "POST /v1/chat/completions non-stream", check_chat_nonstream),
    Check("props", "hermes", "GET /props -> model.n_ctx (Hermes reads the context size)", check_props),
)


@dataclass
class Result:
    check: Check
    ok: bool
    detail: str
    seconds: float


def run_checks(url: str, api_key: str = DUMMY_KEY, only: list[str] | None = None) -> list[Result]:
    """Run the checks (or those named in `only`) against a server; never raises for a failed check."""
    client = Client(url, api_key)
    results = []
    for check in CHECKS:
        if only and check.name not in only:
            continue
        t0 = time.monotonic()
        try:
            detail, ok = check.fn(client), True
        except (ProbeFailure, KeyError, IndexError, TypeError, ValueError) as exc:
            detail, ok = f"{type(exc).__name__}: {exc}" if not isinstance(exc, ProbeFailure) else str(exc), False
        results.append(Result(check, ok, detail, time.monotonic() - t0))
    return results


def table(results: list[Result]) -> str:
    rows = [("check", "clients", "result", "s", "detail")]
    rows += [(r.check.name, r.check.clients, "ok" if r.ok else "FAIL", f"{r.seconds:.1f}", r.detail[:110])
             for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths, strict=True)) + "  " + row[4] for row in rows]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    url, api_key = server_from_env(getattr(args, "url", None), getattr(args, "api_key", None))
    api_key = api_key or DUMMY_KEY
    only = [s.strip() for s in args.only.split(",")] if getattr(args, "only", None) else None
    if only:
        unknown = set(only) - {c.name for c in CHECKS}
        if unknown:
            from lucebox.errors import LuceboxError
            raise LuceboxError(f"--only: unknown checks {sorted(unknown)}; known: {[c.name for c in CHECKS]}")
    results = run_checks(url, api_key, only)
    print(table(results))
    failed = [r.check.name for r in results if not r.ok]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""),
          file=sys.stderr)
    return 1 if failed else 0
