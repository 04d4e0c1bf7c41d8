"""Counters, gauges and histograms, rendered in the Prometheus text format.

No client library: the exposition format is a few lines of text, and the
server's metrics are a fixed, small set.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.total += 1
        self.sum += value
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1


class Metrics:
    """The server's metrics. Gauges are read at render time from callables."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)  # (route, status) -> count
        self.finish_reasons: dict[str, int] = defaultdict(int)
        self.constrained: dict[str, int] = defaultdict(int)  # generations held to a grammar, by why
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.cached_tokens = 0
        self.disconnects = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.recent: list[dict[str, Any]] = []  # last few generations, for /status
        self.gauges: dict[str, tuple[str, Callable[[], float]]] = {}
        self.counters: dict[str, tuple[str, Callable[[], float]]] = {}

    def count_request(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] += 1

    def count_disconnect(self) -> None:
        with self._lock:
            self.disconnects += 1

    def observe_generation(self, usage: Any, finish_reason: str) -> None:
        with self._lock:
            self.prompt_tokens += usage.prompt_tokens
            self.generated_tokens += usage.completion_tokens
            self.cached_tokens += usage.cached_tokens
            self.finish_reasons[finish_reason] += 1
            if getattr(usage, "constrained", None):
                self.constrained[usage.constrained] += 1
            ttft = usage.timings.get("ttft_ms")
            if ttft is not None:
                self.ttft.observe(ttft / 1000)
            self.recent.append({"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                                "cached_tokens": usage.cached_tokens, "finish_reason": finish_reason,
                                **usage.timings})
            del self.recent[:-20]

    def constrained_counts(self) -> dict[str, int]:
        """Generations held to a grammar so far, by why (/props)."""
        with self._lock:
            return dict(self.constrained)

    def gauge(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        """Register a value read at render time (queue depth, KV blocks, …)."""
        self.gauges[name] = (help_text, read)

    def counter(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        """Register a monotonically growing value owned elsewhere (preemptions, cache hits, …)."""
        self.counters[name] = (help_text, read)

    def render(self) -> str:
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")

        with self._lock:
            family("lucebox_requests_total", "counter",
                   "HTTP requests by route and status (499: the client closed the connection before the answer)")
            for (route, status), n in sorted(self.requests.items()):
                lines.append(f'lucebox_requests_total{{route="{_esc(route)}",status="{status}"}} {n}')
            family("lucebox_generations_total", "counter", "Finished generations by finish reason")
            for reason, n in sorted(self.finish_reasons.items()):
                lines.append(f'lucebox_generations_total{{reason="{_esc(reason)}"}} {n}')
            family("lucebox_constrained_generations_total", "counter",
                   "Generations held to a grammar (forced tool calls, tools, JSON), by why")
            for kind, n in sorted(self.constrained.items()):
                lines.append(f'lucebox_constrained_generations_total{{kind="{_esc(kind)}"}} {n}')
            for name, value, text in (
                ("lucebox_prompt_tokens_total", self.prompt_tokens, "Prompt tokens processed"),
                ("lucebox_generated_tokens_total", self.generated_tokens, "Tokens generated"),
                ("lucebox_cached_prompt_tokens_total", self.cached_tokens, "Prompt tokens served from a cache"),
                ("lucebox_client_disconnects_total", self.disconnects, "Requests whose client went away"),
            ):
                family(name, "counter", text)
                lines.append(f"{name} {value}")
            family("lucebox_ttft_seconds", "histogram", "Time to first token")
            for b, c in zip(self.ttft.buckets, self.ttft.counts):
                lines.append(f'lucebox_ttft_seconds_bucket{{le="{b}"}} {c}')
            lines.append(f'lucebox_ttft_seconds_bucket{{le="+Inf"}} {self.ttft.total}')
            lines.append(f"lucebox_ttft_seconds_sum {self.ttft.sum}")
            lines.append(f"lucebox_ttft_seconds_count {self.ttft.total}")
        for kind, table in (("counter", self.counters), ("gauge", self.gauges)):
            for name, (help_text, read) in sorted(table.items()):
                family(name, kind, help_text)
                lines.append(f"{name} {_num(read())}")
        return "\n".join(lines) + "\n"


def thread_cpu_counter(ident: Callable[[], int | None]) -> Callable[[], float]:
    """A counter's reader: CPU seconds (user + system) used by the thread `ident()` names (a threading ident, or
    None once it has ended), read from its pthread CPU clock; it keeps the last value when the thread is gone,
    so the counter never goes back."""
    last = 0.0

    def read() -> float:
        nonlocal last
        tid = ident()
        if tid is not None:
            with contextlib.suppress(OSError):
                last = time.clock_gettime(time.pthread_getcpuclockid(tid))
        return last

    return read


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))
