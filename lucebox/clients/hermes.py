"""Hermes Agent (Nous Research) against Lucebox: its `custom` OpenAI-compatible provider.

Hermes reads `$HERMES_HOME/config.yaml`; we set `model.provider: custom`,
`model.base_url` (the server's `/v1`), `model.default` and `model.api_key`.
At start it probes `GET /api/v1/models`, `/api/tags`, `/v1/props`, `/props`
and `/v1/models` to learn the context window, then streams
`POST /v1/chat/completions` with tools.

Hermes refuses models whose context is under 64 k tokens (for itself and for
its compression helper). A smaller server context is declared as 65536 in
`model.context_length` and `auxiliary.compression.context_length`; Hermes
then sends `max_tokens: 65536`, which Lucebox clamps to the context left.
Lazy installs of optional dependencies are off (`HERMES_DISABLE_LAZY_INSTALLS`).

Lean (small context): only the `terminal` toolset (terminal + process), about
2.3 k SmolLM2 tokens per first request instead of ~12 k, and `model.max_tokens`
512 (Hermes otherwise asks for max_tokens = the declared 64k context, which
the server clamps to all the context left: a small model that never stops
then generates for minutes).
"""

from __future__ import annotations

import json

from lucebox.clients import ClientSpec, Launch, Target

SPEC = ClientSpec("hermes", "pypi", "hermes-agent", "0.19.0", "hermes", note="~230 MiB venv")

HERMES_MIN_CONTEXT = 65536  # Hermes' floor is 64 000; a power of two is what servers report
LEAN_MAX_TOKENS = 512  # else Hermes asks for max_tokens = its context, and a tiny model may ramble to the end


def config_yaml(target: Target) -> str:
    ctx = max(target.context_length, HERMES_MIN_CONTEXT)
    q = json.dumps  # JSON strings are valid YAML scalars
    lines = [
        "# written by `python -m lucebox clients run hermes`: Hermes against a local Lucebox server",
        "model:",
        "  provider: custom",
        f"  base_url: {q(target.base_url)}",
        f"  default: {q(target.model)}",
        f"  api_key: {q(target.api_key)}",
        f"  context_length: {ctx}",
        *([f"  max_tokens: {LEAN_MAX_TOKENS}"] if target.lean else []),
        "auxiliary:",
        "  compression:",
        f"    context_length: {ctx}",
    ]
    if target.lean:
        lines.append('toolsets: ["terminal"]')
    return "\n".join(lines) + "\n"


def launch(target: Target, args: list[str], exe: str) -> Launch:
    """Write HERMES_HOME/config.yaml and return how to start Hermes against the server."""
    home = target.home
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.yaml").write_text(config_yaml(target))
    extra = ["-t", "terminal"] if target.lean and "-t" not in args and "--toolsets" not in args else []
    notes = [f"HERMES_HOME={home} (config.yaml: provider custom, {target.base_url})"]
    if target.context_length < HERMES_MIN_CONTEXT:
        notes.append(f"server context {target.context_length} < Hermes' 64k floor: declared as {HERMES_MIN_CONTEXT}")
    return Launch(argv=[exe, *extra, *args],
                  env={"HERMES_HOME": str(home), "HERMES_DISABLE_LAZY_INSTALLS": "1"}, notes=notes)
