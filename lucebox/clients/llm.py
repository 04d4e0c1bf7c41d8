"""Simon Willison's `llm` CLI against Lucebox: an `extra-openai-models.yaml` entry.

`llm` keeps its settings in `$LLM_USER_PATH`. We register the server's model
as model id `lucebox` (`api_base` = the server's `/v1`, streaming and tools
on), store the key under the name `lucebox` in `keys.json`, and make it the
default model, so `llm "prompt"` and `llm chat` talk to Lucebox. It speaks
Chat Completions (streaming by default; `--no-stream` for one JSON answer);
`-T tool` / `--functions` run tools through `tool_calls` and `role: tool`.
"""

from __future__ import annotations

import json

from lucebox.clients import ClientSpec, Launch, Target

SPEC = ClientSpec("llm", "pypi", "llm", "0.36", "llm", note="~85 MiB venv")

MODEL_ID = "lucebox"


def models_yaml(target: Target) -> str:
    q = json.dumps
    return "\n".join([
        "# written by `python -m lucebox clients run llm`",
        f"- model_id: {MODEL_ID}",
        f"  model_name: {q(target.model)}",
        f"  api_base: {q(target.base_url)}",
        f"  api_key_name: {MODEL_ID}",
        "  can_stream: true",
        "  supports_tools: true",
        "",
    ])


def launch(target: Target, args: list[str], exe: str) -> Launch:
    """Write LLM_USER_PATH (models, key, default model) and return how to start `llm`."""
    home = target.home
    home.mkdir(parents=True, exist_ok=True)
    (home / "extra-openai-models.yaml").write_text(models_yaml(target))
    keys = home / "keys.json"
    try:
        stored = json.loads(keys.read_text())
    except (OSError, ValueError):
        stored = {}
    stored[MODEL_ID] = target.api_key
    keys.write_text(json.dumps(stored, indent=1))
    (home / "default_model.txt").write_text(MODEL_ID)
    return Launch(argv=[exe, *(args or ["chat"])], env={"LLM_USER_PATH": str(home)},
                  notes=[f"LLM_USER_PATH={home} (model id {MODEL_ID!r} -> {target.model} at {target.base_url})"])
