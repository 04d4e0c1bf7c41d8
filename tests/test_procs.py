"""Servers started by tests (and by `bench serve`) die with their parent, even when it is SIGKILLed."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lucebox import procs

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")

# A listening server that would run for a minute, started by a parent (as pytest starts a test's server);
# the parent prints the child's pid and port and then waits, as a test would.
SERVER = "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); " \
         "print(s.getsockname()[1], flush=True); time.sleep(60)"
PARENT = """
import subprocess, sys
from lucebox import procs
start = procs.spawn if sys.argv[1] == "spawn" else subprocess.Popen
child = start([sys.executable, "-c", sys.argv[2]], stdout=subprocess.PIPE, text=True)
print(child.pid, child.stdout.readline().strip(), flush=True)
child.wait()
"""


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (a container's init may be slow to reap)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return not alive(pid)


def accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def start_parent(how: str) -> tuple[subprocess.Popen, int, int]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, how, SERVER], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
    pid, port = map(int, parent.stdout.readline().split())
    assert alive(pid) and accepts(port)
    return parent, pid, port


@pytest.mark.parametrize("how", ["spawn", "plain"])
def test_a_server_dies_when_its_parent_is_sigkilled(how):
    parent, pid, port = start_parent(how)
    try:
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        if how == "spawn":
            assert gone_within(pid, 5), "the child outlived its SIGKILLed parent"
            assert not accepts(port)
        else:  # the control: a plain Popen child is orphaned and keeps running (what tests did before)
            time.sleep(0.5)
            assert alive(pid) and accepts(port)
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_stop_ends_the_childs_whole_process_group():
    grandchild = "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; " \
                 "time.sleep(60)']); print(p.pid, flush=True); time.sleep(60)"
    child = procs.spawn([sys.executable, "-c", grandchild], stdout=subprocess.PIPE, text=True)
    gpid = int(child.stdout.readline())
    try:
        assert os.getpgid(child.pid) == child.pid != os.getpgid(0)  # its own group
        assert procs.stop(child, timeout=5) == -signal.SIGTERM
        assert gone_within(gpid, 5), "stop() left the child's own child running"
    finally:
        if alive(gpid):
            os.kill(gpid, signal.SIGKILL)


def test_run_passes_output_and_requires_a_timeout():
    done = procs.run([sys.executable, "-c", "print('ok')"], timeout=30, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "ok\n"
    with pytest.raises(TypeError):
        procs.run([sys.executable, "-c", "pass"])  # type: ignore[call-arg]
