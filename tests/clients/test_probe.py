"""`clients probe` against the real server: every check a client depends on, one test each."""

from __future__ import annotations

import sys

import pytest

from lucebox import procs
from lucebox.clients.probe import CHECKS, run_checks


@pytest.mark.parametrize("name", [c.name for c in CHECKS])
def test_probe_check(server, name):
    (result,) = run_checks(server.url, only=[name])
    assert result.ok, f"{name} ({result.check.clients}): {result.detail}"


def test_probe_command_prints_table_and_fails_on_failure(server):
    """The CLI: a table with one row per check, exit 1 while any check fails, 0 when all pass."""
    proc = procs.run([sys.executable, "-m", "lucebox.clients", "probe", "--url", server.url],
                     capture_output=True, text=True, timeout=600)
    rows = [line.split()[0] for line in proc.stdout.splitlines()[1:]]
    assert rows == [c.name for c in CHECKS], proc.stdout
    failed = [line.split()[0] for line in proc.stdout.splitlines()[1:] if "FAIL" in line.split()[:4]]
    assert proc.returncode == (1 if failed else 0), proc.stdout + proc.stderr
    ok = procs.run([sys.executable, "-m", "lucebox.clients", "probe", "--url", server.url,
                    "--only", "health,models,chat-stream"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
