"""Traffic files for calibration: each file becomes a list of conversations (chat messages) to prefill.

Formats, by suffix:

- `.jsonl`: one request per line: `{"messages": [...]}` (an OpenAI or Anthropic request body as logged,
  `system` beside the messages included), a bare JSON list of messages, `{"prompt": "..."}`, or
  `{"turns": [...]}` (MT-Bench: the turns joined into one user message). Message content may be a
  string or a list of content blocks; their text parts are kept (tool calls and results as their JSON).
- `.parquet`: SWE-bench's `problem_statement` column, one issue a user message.
- anything else (`.md`, `.txt`): the whole file as one system prompt (the agent prompts), one conversation.

A file is named in the profile by its name, sha256 and the tokens it gave, so a profile says what it was
calibrated on.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lucebox.errors import LuceboxError

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class TrafficFile:
    path: Path
    sha256: str
    conversations: list[list[dict[str, str]]]


def read_traffic(path: Path) -> TrafficFile:
    """The conversations of one traffic file; a LuceboxError naming the file and line when it is not one."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise LuceboxError(f"--traffic {path}: {exc.strerror or exc}") from None
    sha = hashlib.sha256(raw).hexdigest()
    if path.suffix == ".parquet":
        convs = _parquet(path)
    elif path.suffix == ".jsonl":
        convs = _jsonl(path, raw)
    else:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise LuceboxError(f"--traffic {path}: not UTF-8 text (give .jsonl, .parquet, .md or .txt)") from None
        convs = [[{"role": "system", "content": text}]] if text.strip() else []
    if not convs:
        raise LuceboxError(f"--traffic {path}: holds no prompts")
    return TrafficFile(path, sha, convs)


def _parquet(path: Path) -> list[list[dict[str, str]]]:
    from lucebox.train.data import read_parquet_column

    try:
        issues = read_parquet_column(path, "problem_statement")
    except (KeyError, ValueError, IndexError) as exc:
        raise LuceboxError(f"--traffic {path}: no readable problem_statement column ({exc})") from None
    return [[{"role": "user", "content": t}] for t in issues if t and t.strip()]


def _jsonl(path: Path, raw: bytes) -> list[list[dict[str, str]]]:
    try:
        lines = raw.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise LuceboxError(f"--traffic {path}: not UTF-8 text") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise LuceboxError(f"--traffic {path}:{n}: not a JSON line ({exc.msg})") from None
        conv = _conversation(row)
        if conv is None:
            raise LuceboxError(f"--traffic {path}:{n}: expected `messages` (a list of role/content objects), "
                               "a list of messages, `prompt` or `turns`")
        out.append(conv)
    return out


def _conversation(row: Any) -> list[dict[str, str]] | None:
    if isinstance(row, list):
        row = {"messages": row}
    if not isinstance(row, dict):
        return None
    if isinstance(row.get("messages"), list):
        msgs = [m for m in (_message(m) for m in row["messages"]) if m is not None]
        if len(msgs) != len(row["messages"]) or not msgs:
            return None
        system = _text(row.get("system")) if row.get("system") is not None else None
        return ([{"role": "system", "content": system}] if system else []) + msgs
    if isinstance(row.get("prompt"), str) and row["prompt"].strip():
        return [{"role": "user", "content": row["prompt"]}]
    turns = row.get("turns")
    if isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns):
        # no answers were logged: the turns as one user message (templates refuse two user turns in a row)
        return [{"role": "user", "content": "\n\n".join(turns)}]
    return None


def _message(m: Any) -> dict[str, str] | None:
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        return None
    text = _text(m.get("content"))
    if m.get("tool_calls"):
        text = (text + "\n" if text else "") + json.dumps(m["tool_calls"], ensure_ascii=False)
    role = "system" if m["role"] == "developer" else m["role"]
    return {"role": role, "content": text}


def _text(content: Any) -> str:
    """A message content as text: a string as is; content blocks' text, other blocks as their JSON."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for block in content:
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                parts.append(block["text"])
            elif isinstance(block, str):
                parts.append(block)
            else:
                parts.append(json.dumps(block, ensure_ascii=False))
        return "\n".join(parts)
    return json.dumps(content, ensure_ascii=False)
