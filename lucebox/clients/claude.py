"""Claude Code against Lucebox: `ANTHROPIC_BASE_URL` and every model slot pointed at the local model.

Claude Code speaks Anthropic Messages (`POST /v1/messages?beta=true`, always
streaming) and makes background calls (titles, summaries, sub-agents) with
its small/fast model: all slots (`ANTHROPIC_MODEL`,
`ANTHROPIC_SMALL_FAST_MODEL`, `ANTHROPIC_DEFAULT_{HAIKU,SONNET,OPUS}_MODEL`,
`CLAUDE_CODE_SUBAGENT_MODEL`) name the Lucebox model, so no call leaves for
Anthropic. A server context of 64k or more goes to
`CLAUDE_CODE_MAX_CONTEXT_TOKENS` (unknown models are otherwise assumed to have
1M tokens); with SmolLM2's 8k that setting made Claude Code refuse every
prompt locally (`blocking_limit`), so small windows are left unsaid and Claude
Code only warns "context assumed to be 1m tokens". Replies are capped at a
quarter of the server's window (`CLAUDE_CODE_MAX_OUTPUT_TOKENS`, at most
Claude Code's own 32000): Claude Code asks for 32000 at temperature 1, and a
small model that never samples its end-of-turn token otherwise streams until
the window is full (3,680 tokens, seven minutes, for "Say hello." on SmolLM2
on a CPU). Telemetry, error
reporting, the auto-updater and other nonessential traffic are off.
`CLAUDE_CONFIG_DIR` is a private folder whose `.claude.json` marks onboarding
done and the dummy API key approved, so the interactive UI starts without
questions (it still asks, as it should, whether to trust the working folder).

Lean (small context): `--bare` (no hooks, plugins, CLAUDE.md discovery, the
long agent system prompt) and `--tools Bash,Read,Edit,Write`: about 1.1 k
SmolLM2 tokens instead of ~12 k for a first request.
"""

from __future__ import annotations

import json

from lucebox.clients import ClientSpec, Launch, Target

SPEC = ClientSpec("claude", "npm", "@anthropic-ai/claude-code", "2.1.332", "claude",
                  note="native binary from the npm package @anthropic-ai/claude-code-linux-x64 (~385 MiB)")

LEAN_TOOLS = "Bash,Read,Edit,Write"
CLAUDE_MAX_OUTPUT = 32000  # Claude Code's default reply budget
CLAUDE_MIN_WINDOW = 65536  # CLAUDE_CODE_MAX_CONTEXT_TOKENS only from here up (at 8k Claude Code refuses all prompts)


def env_for(target: Target) -> dict[str, str]:
    m = target.model
    # Claude Code assumes 1M tokens for a model it does not know. Telling it the real window helps it compact
    # in time, but it keeps ~32k of that window for output and compaction: with a smaller window it refuses
    # every prompt locally ("blocking_limit") without calling the server, so small windows are left unsaid.
    window = ({"CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(target.context_length)}
              if target.context_length >= CLAUDE_MIN_WINDOW else {})
    return {
        **window,
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max(256, min(CLAUDE_MAX_OUTPUT, target.context_length // 4))),
        "CLAUDE_CONFIG_DIR": str(target.home),
        "ANTHROPIC_BASE_URL": target.url,
        "ANTHROPIC_API_KEY": target.api_key,
        "ANTHROPIC_MODEL": m,
        "ANTHROPIC_SMALL_FAST_MODEL": m,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": m,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": m,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": m,
        "CLAUDE_CODE_SUBAGENT_MODEL": m,
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_BUG_COMMAND": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
    }


def launch(target: Target, args: list[str], exe: str) -> Launch:
    """Write CLAUDE_CONFIG_DIR/.claude.json and return how to start Claude Code against the server."""
    home = target.home
    home.mkdir(parents=True, exist_ok=True)
    state_file = home / ".claude.json"
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError):
        state = {}
    state["hasCompletedOnboarding"] = True
    approved = state.setdefault("customApiKeyResponses", {}).setdefault("approved", [])
    if target.api_key[-20:] not in approved:
        approved.append(target.api_key[-20:])
    state_file.write_text(json.dumps(state, indent=1))
    extra: list[str] = []
    if target.lean:
        if "--bare" not in args:
            extra.append("--bare")
        if "--tools" not in args:
            extra += ["--tools", LEAN_TOOLS]
    return Launch(
        argv=[exe, *extra, *args],
        env=env_for(target),
        notes=[f"ANTHROPIC_BASE_URL={target.url}, every model slot = {target.model}, CLAUDE_CONFIG_DIR={home}"]
        + ([f"lean: --bare --tools {LEAN_TOOLS}"] if extra else []),
    )
