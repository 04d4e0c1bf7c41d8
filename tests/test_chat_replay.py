"""Tool-call replay: the LRU gives back the model's own text only for exactly the calls it made."""

from __future__ import annotations

from lucebox.chat.replay import ToolCallReplay


def call(cid: str) -> dict:
    return {"id": cid, "type": "function", "function": {"name": "f", "arguments": "{}"}}


def test_a_known_turn_is_replaced_by_its_text_and_others_are_left_alone():
    r = ToolCallReplay()
    r.remember(["call_a", "call_b"], '<tool_call>{"name": "f"}</tool_call><tool_call>{"name": "f"}</tool_call>')
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [call("call_a"), call("call_b")]},
            {"role": "tool", "tool_call_id": "call_a", "content": "ok"}]
    out = r.rewrite(msgs)
    assert out[1] == {"role": "assistant", "content": '<tool_call>{"name": "f"}</tool_call>'
                                                      '<tool_call>{"name": "f"}</tool_call>'}
    assert out[0] is msgs[0] and out[2] is msgs[2] and msgs[1]["tool_calls"]  # the request itself is untouched
    assert r.replayed == 1
    # A turn with only one of the two calls, or an extra one, is not the turn the model wrote.
    assert r.rewrite([{"role": "assistant", "tool_calls": [call("call_a")]}])[0]["tool_calls"]
    assert r.rewrite([{"role": "assistant", "tool_calls": [call("call_a"), call("call_b"), call("call_c")]}])[0][
        "tool_calls"]
    assert r.replayed == 1


def test_the_oldest_calls_are_forgotten_first():
    r = ToolCallReplay(capacity=2)
    for i in range(3):
        r.remember([f"call_{i}"], f"text {i}")
    assert r.rewrite([{"role": "assistant", "tool_calls": [call("call_0")]}])[0].get("tool_calls")
    assert r.rewrite([{"role": "assistant", "tool_calls": [call("call_2")]}])[0] == {"role": "assistant",
                                                                                      "content": "text 2"}
