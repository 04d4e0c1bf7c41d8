"""`clients run` and `probe` on the command line: options anywhere before `--`, everything after it to the
client verbatim, and the server found from the OPENAI_BASE_URL / ANTHROPIC_BASE_URL the README exports."""

from __future__ import annotations

import os
import sys

import pytest

from lucebox import procs
from lucebox.cli import parse_argv
from lucebox.clients import DEFAULT_URL, ClientError, server_from_env


def test_run_options_may_follow_the_client_name():
    args = parse_argv(["clients", "run", "codex", "--url", "http://h:1", "--", "exec", "hi"])
    assert (args.name, args.url, args.args) == ("codex", "http://h:1", ["exec", "hi"])
    args = parse_argv(["-v", "clients", "run", "--url", "http://h:1", "claude", "--full", "--", "-p", "x"])
    assert (args.name, args.url, args.full, args.args) == ("claude", "http://h:1", True, ["-p", "x"])


def test_everything_after_the_first_double_dash_goes_to_the_client_verbatim():
    argv = ["clients", "run", "claude", "--", "-p", "--output-format", "json", "--", "--url", "prompt"]
    args = parse_argv(argv)
    assert args.url is None and args.args == ["-p", "--output-format", "json", "--", "--url", "prompt"]
    assert parse_argv(["clients", "run", "llm", "--", "--"]).args == ["--"]
    assert parse_argv(["clients", "run", "llm", "hello"]).args == ["hello"]  # no --: still the client's


def test_server_url_comes_from_the_readmes_environment():
    env = {"OPENAI_BASE_URL": "http://o:1/v1", "OPENAI_API_KEY": "ok",
           "ANTHROPIC_BASE_URL": "http://a:2/", "ANTHROPIC_API_KEY": "ak"}
    assert server_from_env(None, None, "openai", env) == ("http://o:1", "ok")
    assert server_from_env(None, None, "anthropic", env) == ("http://a:2", "ak")
    assert server_from_env("http://u:3/v1/", None, "openai", env) == ("http://u:3", None)  # --url wins
    assert server_from_env(None, "k", "openai", env) == ("http://o:1", "k")  # --api-key wins
    assert server_from_env(None, None, "openai", {**env, "LUCEBOX_API_KEY": "lk"})[1] == "lk"
    assert server_from_env(None, None, "anthropic", {"OPENAI_BASE_URL": "http://o:1/v1"}) == ("http://o:1", None)
    assert server_from_env(None, None, "openai", {}) == (DEFAULT_URL, None)
    with pytest.raises(ClientError, match=r"\$OPENAI_BASE_URL='o:1' is not an http"):
        server_from_env(None, None, "openai", {"OPENAI_BASE_URL": "o:1"})


def test_probe_without_url_uses_openai_base_url(live_server):
    env = {k: v for k, v in os.environ.items() if not k.endswith(("_BASE_URL", "API_KEY"))}
    env.update(OPENAI_BASE_URL=live_server.base_url, OPENAI_API_KEY="none")
    done = procs.run([sys.executable, "-m", "lucebox.clients", "probe", "--only", "health,models"], env=env,
                     capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed, 0 failed" in done.stderr
