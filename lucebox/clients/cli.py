"""The `clients` command line: `python -m lucebox clients install|run|probe` (also `python -m lucebox.clients`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from lucebox.clients import CLIENT_NAMES, DEFAULT_URL

URL_HELP = f"server URL (default $OPENAI_BASE_URL or $ANTHROPIC_BASE_URL without /v1, else {DEFAULT_URL})"
KEY_HELP = "server key (default $LUCEBOX_API_KEY, else the *_API_KEY exported with the *_BASE_URL used, else a dummy)"


def add_clients_parser(sub: Any, lazy: Callable[[str, str], Callable[[argparse.Namespace], int]]) -> None:
    """Add `clients install|run|probe` to a subparsers object; `lazy(module, attr)` defers imports."""
    p = sub.add_parser("clients", help="install, run and probe real agent clients against a running server")
    csub = p.add_subparsers(dest="clients_command", required=True)

    i = csub.add_parser("install", help="install agent clients into ./.clients (npm prefix + one venv each)")
    i.add_argument("--clients", default="all", help=f"comma-separated: {','.join(CLIENT_NAMES)} (default: all)")
    i.add_argument("--dir", default=None, help="install folder (default $LUCEBOX_CLIENTS_DIR or ./.clients)")
    i.add_argument("--force", action="store_true", help="reinstall even when the pinned version is present")
    i.set_defaults(func=lazy("lucebox.clients.install", "main"))

    r = csub.add_parser("run", help="start a client configured against a running server; args after -- go to it")
    r.add_argument("name", choices=CLIENT_NAMES)
    r.add_argument("--url", default=None, help=URL_HELP)
    r.add_argument("--api-key", default=None, help=KEY_HELP)
    r.add_argument("--home", default=None, help="client config/state folder (default ./.clients/home/NAME)")
    r.add_argument("--full", action="store_true", help="keep the client's full prompts/tools even on a small context")
    r.add_argument("args", nargs="*", help="arguments for the client; put them after -- (e.g. -- exec --json hi): "
                   "everything after the first -- goes to the client unchanged, options of run may come before it")
    r.set_defaults(func=lazy("lucebox.clients.run", "main"))

    q = csub.add_parser("probe", help="check the protocol features each client relies on; non-zero exit on failure")
    q.add_argument("--url", default=None, help=URL_HELP)
    q.add_argument("--api-key", default=None, help=KEY_HELP)
    q.add_argument("--only", default=None, help="comma-separated check names")
    q.set_defaults(func=lazy("lucebox.clients.probe", "main"))


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """For `clients run`: (what argparse parses, the client's own arguments or None).

    Everything after the first `--` goes to the client verbatim, a later `--` included; argparse sees only
    the part before it, so `run codex --url URL -- exec hi` works with run's options after the client name.
    """
    words = [a for a in argv if a not in ("-v", "--verbose")]
    if words[:2] != ["clients", "run"] or "--" not in argv:
        return argv, None
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]
