"""OpenAI Codex CLI against Lucebox: a custom provider speaking the Responses API.

Codex reads `$CODEX_HOME/config.toml`. We write a provider `lucebox` with
`wire_api = "responses"` (Codex streams `POST /v1/responses` and waits for
`response.completed`), and a model catalog file fetched from the server's
`GET /v1/models?client_version=…` (the Codex form): with it Codex knows the
model's context window, reasoning levels and base instructions instead of
warning "Model metadata … not found" and using its 17 k-character default
prompt. Update checks and analytics are off. The key is read from
`LUCEBOX_API_KEY` (a dummy when the server has none).

Lean (small context): the features that add big tool schemas (sub-agents,
goals, image tools, web search, apps, plugins) are switched off, which takes
Codex's first request from ~9 k to ~1.7 k SmolLM2 tokens.
"""

from __future__ import annotations

import json

from lucebox.clients import ClientSpec, Launch, Target, http_json

SPEC = ClientSpec("codex", "npm", "@openai/codex", "0.171.0", "codex",
                  note="native binary from the npm package @openai/codex-linux-x64 (~420 MiB)")

LEAN_FEATURES_OFF = ("goals", "view_image", "apps", "plugins", "image_generation", "browser_use", "computer_use",
                     "tool_suggest", "skill_search")


def toml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def config_toml(target: Target, catalog: str) -> str:
    lines = [
        "# written by `python -m lucebox clients run codex`: Codex against a local Lucebox server",
        f"model = {toml_str(target.model)}",
        'model_provider = "lucebox"',
        f"model_catalog_json = {toml_str(catalog)}",
        "check_for_update_on_startup = false",
    ]
    if target.context_length:
        lines.append(f"model_context_window = {target.context_length}")
    if target.lean:
        lines += ['web_search = "disabled"', "", "[agents]", "enabled = false", "", "[features]"]
        lines += [f"{f} = false" for f in LEAN_FEATURES_OFF]
    lines += [
        "",
        "[model_providers.lucebox]",
        'name = "Lucebox"',
        f"base_url = {toml_str(target.base_url)}",
        'wire_api = "responses"',
        'env_key = "LUCEBOX_API_KEY"',
        "request_max_retries = 1",
        "stream_max_retries = 1",
        "",
        "[analytics]",
        "enabled = false",
        "",
    ]
    return "\n".join(lines)


def launch(target: Target, args: list[str], exe: str) -> Launch:
    """Write CODEX_HOME (config.toml + the server's model catalog) and return how to start Codex."""
    home = target.home
    home.mkdir(parents=True, exist_ok=True)
    catalog = http_json(f"{target.url}/v1/models?client_version={SPEC.version}", api_key=target.api_key)
    (home / "models.json").write_text(json.dumps(catalog, indent=1))
    (home / "config.toml").write_text(config_toml(target, str(home / "models.json")))
    return Launch(
        argv=[exe, *args],
        env={"CODEX_HOME": str(home), "LUCEBOX_API_KEY": target.api_key},
        notes=[f"CODEX_HOME={home} (config.toml: provider lucebox, wire_api=responses, {target.base_url})",
               f"model catalog from /v1/models?client_version={SPEC.version}" + (", lean features" if target.lean
                                                                                  else "")],
    )
