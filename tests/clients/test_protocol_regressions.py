"""Protocol problems the real clients revealed, pinned at the HTTP level.

Each test states what the client needed and pins the fix. Plain HTTP (the
probe's client), no SDK.
"""

from __future__ import annotations

import json

import pytest

from lucebox.clients.probe import (
    BASH_TOOL,
    CHAT_TOOL,
    EXEC_TOOL,
    RAW_TAG,
    Client,
    chat_stream,
    messages_stream,
    model_id,
    responses_stream,
)

# Fixed (forced tool calls): tool_choice naming a function used to append `<tool_call>\n{"name": "bash",
# "arguments": ` to the prompt; SmolLM2 continued with `123}\n</tool_call>…`, the parser emitted the call with
# arguments {} and streamed the rest as text. The prefix now opens the arguments object with the first
# required parameter, and generation stops once the forced call is complete.


@pytest.fixture(scope="module")
def http(server) -> Client:
    return Client(server.url)


def test_forced_tool_call_chat(http):
    """OpenCode/llm/Hermes: a forced call arrives as tool_calls only, arguments an object of the schema."""
    _, msg = chat_stream(http, {"model": model_id(http), "max_tokens": 64, "tools": [CHAT_TOOL],
                                "tool_choice": {"type": "function", "function": {"name": "bash"}},
                                "messages": [{"role": "user", "content": "Run `echo hi`."}]}, "forced chat call")
    assert not RAW_TAG.search(msg["content"]), msg["content"]
    assert len(msg["tool_calls"]) == 1 and "command" in json.loads(msg["tool_calls"][0]["arguments"])


def test_forced_tool_call_responses(http):
    """Codex: a forced call is one function_call item; no message item repeats the call's markup."""
    _, final = responses_stream(http, {"model": model_id(http), "input": "Run `echo hi`.", "tools": [EXEC_TOOL],
                                       "max_output_tokens": 64,
                                       "tool_choice": {"type": "function", "name": "exec_command"}}, "forced call")
    text = "".join(p.get("text", "") for i in final["output"] if i["type"] == "message" for p in i["content"])
    assert not RAW_TAG.search(text), text
    calls = [i for i in final["output"] if i["type"] == "function_call"]
    assert len(calls) == 1 and "cmd" in json.loads(calls[0]["arguments"])


def test_forced_tool_call_messages(http):
    """Claude Code: tool_choice {type: tool} gives one tool_use block with real input and stop_reason tool_use."""
    _, msg = messages_stream(http, {"model": model_id(http), "max_tokens": 64, "tools": [BASH_TOOL],
                                    "tool_choice": {"type": "tool", "name": "Bash"},
                                    "messages": [{"role": "user", "content": "Run `echo hi`."}]}, "forced tool_use")
    text = "".join(b.get("text", "") for b in msg["content"] if b["type"] == "text")
    assert not RAW_TAG.search(text), text
    uses = [b for b in msg["content"] if b["type"] == "tool_use"]
    assert len(uses) == 1 and "command" in uses[0]["input"] and msg["stop_reason"] == "tool_use"


def test_v1_props_alias(http):
    r = http.get("/v1/props")
    assert r.status == 200 and r.json()["model"]["n_ctx"] == http.get("/props").json()["model"]["n_ctx"]

