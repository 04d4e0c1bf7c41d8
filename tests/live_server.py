"""A real Lucebox server on a real socket, in a background thread, for API tests.

It runs the same code as `python -m lucebox` (ServerConfig, start_engine,
make_app, HttpServer); only the process differs, so tests can also reach
into `server.ctx` (metrics, engine) to check what happened inside.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lucebox.api.common import ServerContext
from lucebox.http import HttpServer
from lucebox.serve import ServerConfig, http_options, make_app, start_engine
from tests.memory import release_memory


@dataclass
class LiveServer:
    url: str
    ctx: ServerContext
    cfg: ServerConfig
    loop: asyncio.AbstractEventLoop
    _stop: asyncio.Event = field(repr=False)
    _thread: threading.Thread = field(repr=False)

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def wait_idle(self, timeout: float = 30) -> None:
        """Wait until the engine holds nothing: no request running, waiting or streaming, no KV block but the
        prefix cache's (generations of earlier tests, or aborted ones, drain first). Fails after `timeout`
        seconds: a stuck request or a leaked block."""
        eng = self.ctx.engine
        deadline = time.monotonic() + timeout
        while eng.num_running or eng.num_waiting or eng._active or eng.engine.blocks_in_use:
            assert time.monotonic() < deadline, (
                f"the engine did not go idle in {timeout} s: {eng.num_running} running, {eng.num_waiting} waiting, "
                f"{len(eng._active)} streaming, {eng.engine.blocks_in_use} KV blocks held")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop serving and give the memory back: the context (engine, weights, KV) is dropped, so a test
        that starts servers one after another holds one at a time, not all of them until it returns."""
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)
        self.ctx = None  # type: ignore[assignment]
        release_memory()


def start_server(model: Path | str, **overrides: Any) -> LiveServer:
    """Start a server on 127.0.0.1:<free port>; returns once the model is loaded."""
    overrides.setdefault("kv_tokens", 8704)  # a full 8K context and a bit (~0.4 GiB of fp32 KV): servers share the box
    overrides.setdefault("cache_ram", 256)  # RAM snapshots: the default 4 GiB would let each server grow ~0.6 GB
    cfg = ServerConfig(model=str(model), port=0, device="cpu", dtype="float32", **overrides)
    ctx = ServerContext(model_id=str(model), n_ctx=cfg.n_ctx or 0)
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        stop = asyncio.Event()
        box["stop"] = stop
        box["loop"] = asyncio.get_running_loop()
        router = make_app(ctx)
        server = HttpServer(router, **http_options(ctx, cfg, router))
        await server.start()
        box["port"] = server.port
        try:
            await start_engine(ctx, cfg)
        except BaseException as exc:
            box["error"] = exc
            ready.set()
            await server.shutdown(0)
            return
        ready.set()
        await stop.wait()
        await server.shutdown(2.0)
        await ctx.engine.stop()

    thread = threading.Thread(target=lambda: asyncio.run(main()), name="live-server", daemon=True)
    thread.start()
    if not ready.wait(timeout=300):
        raise RuntimeError("server did not start in 300 s")
    if "error" in box:
        raise box["error"]
    return LiveServer(f"http://127.0.0.1:{box['port']}", ctx, cfg, box["loop"], box["stop"], thread)
