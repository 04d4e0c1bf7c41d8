"""The client matrix: real agent clients driven against a real Lucebox server.

The tests that drive installed clients (test_clients.py, test_openwebui.py)
are not part of the default test run (tox leaves them out; here they skip
unless `LUCEBOX_CLIENTS=1`, which the `clients` tox env sets after
`python -m lucebox clients install --clients all`); the protocol checks
(probe, regressions, configs) need only the server and run by default. The server is
`python -m lucebox serve` on the default model (SmolLM2-135M-Instruct, CPU)
with the Qwen3 chat template, which renders tools. Each client's output is
kept under the results folder (`$LUCEBOX_CLIENTS_RESULTS`, default
`.clients/results`) for a person to read.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from lucebox import procs

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
QWEN_TEMPLATE = REPO / "tests" / "data" / "templates" / "Qwen-Qwen3-0.6B.jinja"
ENABLED = os.environ.get("LUCEBOX_CLIENTS") == "1"


NEEDS_CLIENTS = {"test_clients.py", "test_openwebui.py"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if ENABLED:
        return
    skip = pytest.mark.skip(reason="client matrix: set LUCEBOX_CLIENTS=1 (tox -e clients)")
    for item in items:
        if Path(str(item.path)).name in NEEDS_CLIENTS and HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout:.0f}s")


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path


@pytest.fixture(scope="session")
def results_dir() -> Path:
    path = Path(os.environ.get("LUCEBOX_CLIENTS_RESULTS") or REPO / ".clients" / "results").resolve()
    path.mkdir(parents=True, exist_ok=True)
    ignore = REPO / ".clients" / ".gitignore"
    if REPO / ".clients" in path.parents and not ignore.exists():
        ignore.write_text("*\n")  # like `clients install` does: nothing under .clients is ever committed
    return path


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, smollm2_path: Path, results_dir: Path) -> Server:
    """`python -m lucebox serve` on a free port, default model, Qwen3 template (tools render).

    One per module, not per session: a server is ~1.3 GB, and under `tox` the modules that use it (the probe,
    the protocol regressions) run early on both workers, which then held two idle servers to the end."""
    port = free_port()
    log = results_dir / f"server-{request.module.__name__.rsplit('.', 1)[-1]}.log"  # one per module and worker
    with open(log, "wb") as out:
        proc = procs.spawn(
            [sys.executable, "-m", "lucebox", "serve", "--model", str(smollm2_path), "--port", str(port),
             "--device", "cpu", "--chat-template-file", str(QWEN_TEMPLATE)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", 300, proc)
    except RuntimeError:
        proc.kill()
        raise RuntimeError(f"server did not start; see {log}:\n{log.read_text()[-2000:]}") from None
    yield Server(url, proc, log)
    procs.stop(proc, timeout=30)
