"""The suite's memory: a stopped test server gives its ~1.5 GB back, and the shared server does not sit beside
modules that never use it (the suite must stay under 6 GB resident; it reached 13.4 GB)."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import SHARED_SERVER
from tests.live_server import start_server

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")


def rss_mib() -> int:
    for line in open("/proc/self/status", encoding="ascii"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no VmRSS")


def test_the_shared_server_is_not_running_in_a_module_that_does_not_use_it():
    assert SHARED_SERVER.server is None


def test_a_stopped_server_gives_its_memory_back_while_still_referenced(smollm2_path):
    """A test that starts servers one after another (restart tests) keeps its LiveServer objects until it
    returns; stop() must still hand the engine's memory back, or each restart adds a server's worth."""
    before = rss_mib()
    servers = []
    for _ in range(2):
        server = start_server(smollm2_path, kv_tokens=4096)
        running = rss_mib()
        assert running > before + 400, "a loaded fp32 SmolLM2 server holds well over 400 MiB"
        server.stop()
        servers.append(server)  # still referenced, as in a test body
        assert rss_mib() < before + 300, f"stopped server kept {rss_mib() - before} MiB"
