"""`python -m lucebox clients run NAME [-- ARGS]`: start one client configured against a running server.

The server is asked for its model (`GET /v1/models`); the client's config
lives in `.clients/home/NAME` (or `--home`), written fresh on every run.
ARGS go to the client unchanged, e.g.

    python -m lucebox clients run codex -- exec --json "list the files here"
    python -m lucebox clients run claude -- -p "what does main.py do?"
    python -m lucebox clients run opencode -- run "explain this repo"
    python -m lucebox clients run hermes -- -z "hello"
    python -m lucebox clients run llm -- "hello"
    python -m lucebox clients run openwebui          # http://127.0.0.1:3000

When the server's context is under 32 k tokens each client gets its lean
settings (smaller prompts and tool sets; `--full` keeps the defaults).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from lucebox.clients import DEFAULT_URL, Launch, Target, client_module, discover, server_from_env
from lucebox.clients.install import executable


def prepare(name: str, url: str = DEFAULT_URL, args: list[str] | None = None, api_key: str | None = None,
            home: Path | None = None, lean: bool | None = None) -> tuple[Target, Launch]:
    """Discover the server, write the client's config, and return (target, how to start it)."""
    mod = client_module(name)
    exe = str(executable(name))
    target = discover(url, api_key=api_key, home=home, name=name, lean=lean)
    return target, mod.launch(target, list(args or []), exe)


def main(args: argparse.Namespace) -> int:
    extra = list(args.args or [])  # the client's arguments, verbatim (cli.split_passthrough)
    url, api_key = server_from_env(args.url, args.api_key, "anthropic" if args.name == "claude" else "openai")
    lean = False if args.full else None
    target, launch = prepare(args.name, url, extra, api_key, Path(args.home) if args.home else None, lean)
    print(f"clients: {args.name} -> {target.url} (model {target.model}, context {target.context_length})",
          file=sys.stderr)
    for note in launch.notes:
        print(f"clients:   {note}", file=sys.stderr)
    try:
        return subprocess.call(launch.argv, env=launch.full_env(), cwd=launch.cwd)
    except KeyboardInterrupt:
        return 130
