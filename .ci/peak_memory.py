"""Run a command and print, when it ends, the peak memory of its whole process tree.

CI's budget (6 GB) is for everything the test run holds at once: two pytest workers and the servers their tests
start. getrusage's max RSS only sees the largest single process that was waited for, so this samples the tree
every 0.25 s and sums each process's RssAnon (memory the OS cannot drop; mapped model files are not counted).
Exit code: the command's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading


def descendants(root: int) -> list[int]:
    """`root` and every process below it."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def anon_mib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 0


def main() -> int:
    proc = subprocess.Popen(sys.argv[1:])
    peak = {"total": 0, "largest": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.25):
            sizes = [anon_mib(p) for p in descendants(proc.pid)]
            peak["total"] = max(peak["total"], sum(sizes))
            peak["largest"] = max(peak["largest"], max(sizes, default=0))

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    code = proc.wait()
    done.set()
    watcher.join()
    print(f"peak memory: {peak['total']} MiB (the run's processes together; largest process {peak['largest']} MiB; "
          f"exit code {code})", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
