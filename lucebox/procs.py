"""Child processes that cannot outlive their parent: the servers the tests and `bench serve` start.

A server child holds ~2 GB. When its parent is SIGKILLed (the OOM killer, a CI
timeout, `kill -9` on pytest) none of the parent's cleanup runs, so the kernel
has to end the child: on Linux each child asks for PR_SET_PDEATHSIG=SIGKILL
before it execs. It also gets its own process group, so `stop()` ends whatever
the child started, and a Ctrl-C in the terminal reaches only the parent, whose
cleanup then stops the child in order.

The kernel sends the signal when the *thread* that forked the child exits:
spawn from a thread that lives as long as the child (pytest's main thread, the
command's main thread), not from a short-lived worker.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up once here: the child must not import or load anything between fork and exec."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def _child_setup(parent: int) -> Callable[[], None] | None:
    """The `preexec_fn` for a child of `parent` (None off POSIX, where there are no process groups)."""
    if os.name != "posix":
        return None

    def setup() -> None:
        os.setpgid(0, 0)
        if _PRCTL is not None:
            _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent:  # the parent died before the request: no signal will come
                os._exit(1)

    return setup


def spawn(argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen:
    """`subprocess.Popen(argv, ...)` whose child dies with this process (see the module doc)."""
    return subprocess.Popen(list(argv), preexec_fn=_child_setup(os.getpid()), **popen_kwargs)


def run(argv: Sequence[str], *, timeout: float, **run_kwargs: Any) -> subprocess.CompletedProcess:
    """`subprocess.run(argv, timeout=..., ...)` whose child dies with this process; a timeout is required."""
    return subprocess.run(list(argv), preexec_fn=_child_setup(os.getpid()), timeout=timeout, **run_kwargs)


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGTERM the child's process group (a server finishes in-flight work), SIGKILL it after `timeout`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            break
        try:
            if os.name == "posix":
                os.killpg(proc.pid, sig)
            else:
                proc.terminate()
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()
