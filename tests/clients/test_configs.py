"""The config each client is given, checked with the parsers the clients use (TOML, JSON, YAML)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomllib

from lucebox.clients import CLIENT_NAMES, ClientError, Target, claude, codex, hermes, llm, opencode, parse_names
from lucebox.clients.install import executable


def target(tmp_path: Path, lean: bool = True, ctx: int = 8192) -> Target:
    return Target(url="http://127.0.0.1:9", model='Odd "model".Q4', api_key="k", context_length=ctx,
                  home=tmp_path / "home", lean=lean)


def test_codex_config_is_valid_toml_with_a_responses_provider(tmp_path):
    cfg = tomllib.loads(codex.config_toml(target(tmp_path), "/x/models.json"))
    assert cfg["model"] == 'Odd "model".Q4' and cfg["model_provider"] == "lucebox"
    provider = cfg["model_providers"]["lucebox"]
    assert provider["wire_api"] == "responses" and provider["base_url"] == "http://127.0.0.1:9/v1"
    assert cfg["analytics"]["enabled"] is False and cfg["check_for_update_on_startup"] is False
    assert cfg["agents"]["enabled"] is False and all(v is False for v in cfg["features"].values())
    full = tomllib.loads(codex.config_toml(target(tmp_path, lean=False, ctx=131072), "/x/models.json"))
    assert "features" not in full and full["model_context_window"] == 131072


def test_claude_points_every_model_slot_at_lucebox(tmp_path):
    t = target(tmp_path)
    launch = claude.launch(t, ["-p", "hi"], "/bin/claude")
    slots = [k for k in launch.env if k.endswith("_MODEL")]
    assert len(slots) >= 5 and {launch.env[k] for k in slots} == {t.model}
    assert launch.env["ANTHROPIC_BASE_URL"] == t.url and launch.env["DISABLE_TELEMETRY"] == "1"
    assert launch.argv[:4] == ["/bin/claude", "--bare", "--tools", claude.LEAN_TOOLS]
    state = json.loads((t.home / ".claude.json").read_text())
    assert state["hasCompletedOnboarding"] and "k" in state["customApiKeyResponses"]["approved"]
    assert claude.launch(t, ["--tools", "Bash"], "/bin/claude").argv.count("--tools") == 1
    assert "CLAUDE_CODE_MAX_CONTEXT_TOKENS" not in launch.env  # at 8k Claude Code would refuse every prompt
    big = claude.launch(target(tmp_path, lean=False, ctx=131072), [], "/bin/claude")
    assert big.env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "131072" and "--bare" not in big.argv
    # replies capped at a quarter of the window (8k: 2048), never above Claude Code's own 32000
    assert launch.env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == str(t.context_length // 4)
    assert big.env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "32000"


def test_opencode_config_uses_openai_compatible(tmp_path):
    t = target(tmp_path)
    launch = opencode.launch(t, [], "/bin/opencode")
    cfg = json.loads(Path(launch.env["OPENCODE_CONFIG"]).read_text())
    provider = cfg["provider"]["lucebox"]
    assert provider["npm"] == "@ai-sdk/openai-compatible" and provider["options"]["baseURL"] == t.base_url
    assert cfg["model"] == f"lucebox/{t.model}" and t.model in provider["models"]
    assert [k for k, on in cfg["tools"].items() if on] == sorted(opencode.LEAN_TOOLS)
    assert all(launch.env[k].startswith(str(t.home)) for k in launch.env if k.startswith("XDG_"))


def test_hermes_config_declares_its_minimum_context(tmp_path):
    yaml = pytest.importorskip("yaml")
    t = target(tmp_path)
    hermes.launch(t, [], "/bin/hermes")
    cfg = yaml.safe_load((t.home / "config.yaml").read_text())
    assert cfg["model"]["provider"] == "custom" and cfg["model"]["base_url"] == t.base_url
    assert cfg["model"]["context_length"] == cfg["auxiliary"]["compression"]["context_length"] == 65536
    assert cfg["model"]["max_tokens"] == hermes.LEAN_MAX_TOKENS


def test_llm_model_file_and_key(tmp_path):
    yaml = pytest.importorskip("yaml")
    t = target(tmp_path)
    launch = llm.launch(t, [], "/bin/llm")
    assert launch.argv == ["/bin/llm", "chat"]
    (entry,) = yaml.safe_load((t.home / "extra-openai-models.yaml").read_text())
    assert entry["model_name"] == t.model and entry["api_base"] == t.base_url and entry["supports_tools"]
    assert json.loads((t.home / "keys.json").read_text())[entry["api_key_name"]] == "k"


def test_names_and_missing_installs(tmp_path, monkeypatch):
    assert parse_names("all") == list(CLIENT_NAMES)
    assert parse_names("llm, codex") == ["codex", "llm"]
    with pytest.raises(ClientError, match="unknown client 'vim'"):
        parse_names("codex,vim")
    with pytest.raises(ClientError, match="clients install --clients codex"):
        executable("codex", tmp_path)
