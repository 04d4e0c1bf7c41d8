"""OpenCode against Lucebox: a provider built on `@ai-sdk/openai-compatible` (Chat Completions).

OpenCode reads the file named by `OPENCODE_CONFIG`. We declare a provider
`lucebox` with `npm: "@ai-sdk/openai-compatible"`, the server's `/v1` as
`baseURL`, and the model with its context limit; `model` and `small_model`
(titles) both name it. OpenCode 1.18 bundles `@ai-sdk/openai-compatible` in
its binary: nothing is fetched from npm when it runs (its optional install of
`@opencode-ai/plugin` into the config folder may fail offline without harm).
All XDG folders live under the client's home, so runs never touch
`~/.config/opencode`. Autoupdate, sharing and the models.dev fetch are off.

Lean (small context): the built-in `build` agent gets a one-line prompt, only
bash/read/write stay enabled, and title generation is off.

Quirk: `opencode run "text with spaces"` sends the message wrapped in double
quotes and JSON-escaped; a prompt given on stdin arrives verbatim.
"""

from __future__ import annotations

import json

from lucebox.clients import ClientSpec, Launch, Target

SPEC = ClientSpec("opencode", "npm", "opencode-ai", "1.18.33", "opencode",
                  note="native binary from the npm package opencode-linux-x64 (~180 MiB)")

ALL_TOOLS = ("bash", "edit", "glob", "grep", "read", "skill", "task", "todowrite", "webfetch", "write")
LEAN_TOOLS = ("bash", "read", "write")
LEAN_PROMPT = "You are opencode, a coding assistant. Use the tools to run commands and read or write files. Be brief."


def config(target: Target) -> dict:
    out_limit = 1024 if target.lean else 8192
    model: dict = {"name": target.model, "tool_call": True}
    if target.context_length:
        model["limit"] = {"context": target.context_length, "output": min(out_limit, target.context_length // 4)}
    cfg: dict = {
        "$schema": "https://opencode.ai/config.json",
        "autoupdate": False,
        "share": "disabled",
        "model": f"lucebox/{target.model}",
        "small_model": f"lucebox/{target.model}",
        "provider": {
            "lucebox": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "Lucebox",
                "options": {"baseURL": target.base_url, "apiKey": target.api_key},
                "models": {target.model: model},
            }
        },
    }
    if target.lean:
        cfg["tools"] = {t: t in LEAN_TOOLS for t in ALL_TOOLS}
        cfg["agent"] = {"build": {"prompt": LEAN_PROMPT}, "title": {"disable": True}}
    return cfg


def launch(target: Target, args: list[str], exe: str) -> Launch:
    """Write opencode.json and the XDG folders under the client's home; return how to start OpenCode."""
    home = target.home
    for sub in ("config", "data", "cache", "state"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    path = home / "opencode.json"
    path.write_text(json.dumps(config(target), indent=1))
    return Launch(
        argv=[exe, *args],
        env={
            "OPENCODE_CONFIG": str(path),
            "XDG_CONFIG_HOME": str(home / "config"),
            "XDG_DATA_HOME": str(home / "data"),
            "XDG_CACHE_HOME": str(home / "cache"),
            "XDG_STATE_HOME": str(home / "state"),
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        },
        notes=[f"OPENCODE_CONFIG={path} (provider lucebox via @ai-sdk/openai-compatible, {target.base_url})"]
        + (["lean: short build prompt, tools " + ",".join(LEAN_TOOLS)] if target.lean else []),
    )
