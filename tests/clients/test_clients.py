"""Each real client does one task to completion against Lucebox, then one task through its tool machinery.

The model is SmolLM2-135M: it cannot plan, but it copies text well. The tool
tasks therefore ask it to repeat a tool call verbatim (`<tool_call>{"name":
…}</tool_call>`, the form the Qwen3 template teaches); the server parses that
into the dialect's tool call, the client runs the tool, sends the result back,
and the model answers. What is checked is each client's own success signal
(Codex `turn.completed`, Claude Code `result`, OpenCode `step_finish`, ...)
and the tool's real effect, never what the model chose to say.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from lucebox import procs
from lucebox.clients.install import is_installed
from lucebox.clients.llm import SPEC as llm_spec
from lucebox.clients.run import prepare

TOKEN = "lucebox-ok"


def copy_call(name: str, arguments: dict) -> str:
    call = json.dumps({"name": name, "arguments": arguments})
    return f"Repeat exactly this text and nothing else:\n<tool_call>\n{call}\n</tool_call>"


def run_client(name: str, server, results_dir: Path, tmp_path: Path, args: list[str], tag: str,
               stdin: str | None = None, timeout: float = 420) -> subprocess.CompletedProcess:
    """Start a client exactly as `python -m lucebox clients run` does, in a scratch folder; keep its output."""
    if not is_installed(name):
        pytest.fail(f"{name} is not installed: python -m lucebox clients install --clients {name}")
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    _, launch = prepare(name, server.url, args, home=tmp_path / "home")
    proc = procs.run(launch.argv, env=launch.full_env(), cwd=launch.cwd or work, input=stdin,
                     capture_output=True, text=True, timeout=timeout)
    (results_dir / f"{name}-{tag}.stdout.txt").write_text(proc.stdout)
    (results_dir / f"{name}-{tag}.stderr.txt").write_text(proc.stderr)
    return proc


def jsonl(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\nstdout tail:\n{proc.stdout[-1500:]}\nstderr tail:\n{proc.stderr[-1500:]}"


# ---------------------------------------------------------------- Codex (Responses API)

def test_codex_exec_completes(server, results_dir, tmp_path):
    proc = run_client("codex", server, results_dir, tmp_path,
                      ["exec", "--json", "--skip-git-repo-check", "Say hello."], "exec", stdin="")
    events = jsonl(proc.stdout)
    types = [e.get("type") for e in events]
    assert proc.returncode == 0 and "turn.completed" in types, explain(proc)
    assert "turn.failed" not in types and "error" not in types, explain(proc)
    messages = [e["item"] for e in events if e.get("type") == "item.completed"
                and e["item"].get("type") == "agent_message"]
    assert messages and messages[-1]["text"].strip(), explain(proc)
    assert not any(e["item"].get("type") == "error" for e in events if e.get("type") == "item.completed"), \
        "Codex warned (e.g. model metadata not found): " + explain(proc)


def test_codex_runs_a_shell_command(server, results_dir, tmp_path):
    prompt = copy_call("exec_command", {"cmd": f"echo {TOKEN}"})
    proc = run_client("codex", server, results_dir, tmp_path,
                      ["exec", "--json", "--skip-git-repo-check", prompt], "tool", stdin="")
    events = jsonl(proc.stdout)
    runs = [e["item"] for e in events if e.get("type") == "item.completed"
            and e["item"].get("type") == "command_execution"]
    assert runs, "Codex ran no command: " + explain(proc)
    assert runs[0]["exit_code"] == 0 and TOKEN in runs[0]["aggregated_output"], explain(proc)
    assert "turn.completed" in [e.get("type") for e in events], explain(proc)


# ---------------------------------------------------------------- Claude Code (Anthropic Messages)

def test_claude_print_reaches_result(server, results_dir, tmp_path):
    proc = run_client("claude", server, results_dir, tmp_path,
                      ["-p", "--output-format", "stream-json", "--verbose", "Say hello."], "print", stdin="")
    events = jsonl(proc.stdout)
    results = [e for e in events if e.get("type") == "result"]
    assert proc.returncode == 0 and results, explain(proc)
    assert results[-1].get("subtype") == "success" and not results[-1].get("is_error"), explain(proc)
    texts = [b["text"] for e in events if e.get("type") == "assistant"
             for b in e["message"]["content"] if b.get("type") == "text"]
    assert texts and texts[0].strip(), explain(proc)


def test_claude_uses_bash(server, results_dir, tmp_path):
    prompt = copy_call("Bash", {"command": f"echo {TOKEN}"})
    proc = run_client("claude", server, results_dir, tmp_path,
                      ["-p", "--output-format", "stream-json", "--verbose", "--allowedTools", "Bash", "--", prompt],
                      "tool", stdin="")
    events = jsonl(proc.stdout)
    uses = [b for e in events if e.get("type") == "assistant" for b in e["message"]["content"]
            if b.get("type") == "tool_use"]
    assert uses and uses[0]["name"] == "Bash", "no Bash tool_use: " + explain(proc)
    results = [b for e in events if e.get("type") == "user" for b in e["message"]["content"]
               if isinstance(b, dict) and b.get("type") == "tool_result"]
    assert results and results[0]["tool_use_id"] == uses[0]["id"] and not results[0].get("is_error"), explain(proc)
    assert TOKEN in json.dumps(results[0]["content"]), explain(proc)
    assert [e for e in events if e.get("type") == "result"], "no final result after the tool: " + explain(proc)


# ---------------------------------------------------------------- OpenCode (Chat Completions via @ai-sdk)

def test_opencode_run_completes(server, results_dir, tmp_path):
    proc = run_client("opencode", server, results_dir, tmp_path, ["run", "--format", "json"], "run",
                      stdin="Say hello.")
    events = jsonl(proc.stdout)
    assert proc.returncode == 0, explain(proc)
    assert not [e for e in events if e.get("type") == "error"], explain(proc)
    texts = [e["part"]["text"] for e in events if e.get("type") == "text"]
    finishes = [e["part"].get("reason") for e in events if e.get("type") == "step_finish"]
    assert texts and texts[-1].strip() and finishes and finishes[-1] in ("stop", "length"), explain(proc)


def test_opencode_runs_bash(server, results_dir, tmp_path):
    prompt = copy_call("bash", {"command": f"echo {TOKEN}", "description": "Print a word"})
    # on stdin: `opencode run "…"` would wrap the message in quotes and JSON-escape it
    proc = run_client("opencode", server, results_dir, tmp_path, ["run", "--format", "json", "--auto"], "tool",
                      stdin=prompt)
    events = jsonl(proc.stdout)
    tools = [e["part"] for e in events if e.get("type") == "tool_use"]
    assert tools and tools[0]["tool"] == "bash", "no bash tool_use: " + explain(proc)
    state = tools[0]["state"]
    assert state["status"] == "completed" and TOKEN in state["output"], explain(proc)
    assert proc.returncode == 0 and len([e for e in events if e.get("type") == "step_finish"]) >= 2, explain(proc)


# ---------------------------------------------------------------- llm (Chat Completions, OpenAI SDK)

def test_llm_prompt(server, results_dir, tmp_path):
    proc = run_client("llm", server, results_dir, tmp_path, ["Say hello.", "-o", "max_tokens", "24"], "prompt")
    assert proc.returncode == 0 and proc.stdout.strip(), explain(proc)
    proc = run_client("llm", server, results_dir, tmp_path,
                      ["--no-stream", "Say hello.", "-o", "max_tokens", "24"], "prompt-nostream")
    assert proc.returncode == 0 and proc.stdout.strip(), explain(proc)


def test_llm_calls_a_tool(server, results_dir, tmp_path):
    proc = run_client("llm", server, results_dir, tmp_path,
                      ["-T", "llm_version", "--td", "--cl", "4", "-o", "max_tokens", "48",
                       copy_call("llm_version", {})], "tool")
    out = proc.stdout + proc.stderr
    assert "Tool call: llm_version" in out, "no tool call: " + explain(proc)
    # --td prints the tool's result under the call: llm's own version, which went back to the model
    after = out.split("Tool call: llm_version", 1)[1]
    assert llm_spec.version in after.splitlines()[1], explain(proc)


# ---------------------------------------------------------------- Hermes Agent (Chat Completions, OpenAI SDK)

def test_hermes_oneshot(server, results_dir, tmp_path):
    proc = run_client("hermes", server, results_dir, tmp_path, ["-z", "Say hello."], "oneshot", stdin="")
    assert proc.returncode == 0 and proc.stdout.strip(), explain(proc)
    assert "agent failed" not in proc.stdout + proc.stderr, explain(proc)


def test_hermes_runs_terminal(server, results_dir, tmp_path):
    marker = tmp_path / "work" / "hermes-tool.txt"
    prompt = copy_call("terminal", {"command": f"echo {TOKEN} > {marker}"})
    proc = run_client("hermes", server, results_dir, tmp_path, ["-z", prompt], "tool", stdin="")
    assert marker.exists() and marker.read_text().strip() == TOKEN, "the terminal tool did not run: " + explain(proc)
    assert proc.returncode == 0, explain(proc)
