"""PFlash in the server: which requests get compressed, the scorer's turns, and reuse of past compressions.

    service = PFlashService(PFlash.for_model(target, scorer), mode="auto", threshold=32000, cache=engine.cache)
    if service.wants(len(raw_ids), has_tools=bool(req.tools)):
        done = service.reuse(raw_ids)                                         # a repeat: no scorer
        done = done or service.compress(raw_ids, text, query, keep_bos)       # blocking: off the event loop
        hint = cache.prepare(done.ids, exact_key=done.key)                    # KV stored under the raw prompt

Policy (spec PFLASH.md, "Server policy"): mode `off` never compresses,
`always` compresses every prompt, `auto` only prompts longer than the
threshold; a request that declares tools is never compressed (a tool-calling
agent needs its whole context: the tool schemas, the file it just read).

Reuse: a compression is remembered under a key derived from the RAW prompt
(SHA-1 of its token ids, plus the scorer and keep ratio, which decide the
result). The same key names the compressed prompt's KV in the prefix cache's
exact tier (`CacheHint.exact_key`), so a repeated long prompt skips the scorer
(this object's small LRU map, or the exact tier's stored tokens, which also
survive a restart through the disk tier) and the target's prefill (the exact
tier restores the KV).

Parking: a scorer that is not the target itself is, on CUDA, kept in pinned
host memory while idle and moved to the device for each compression
(`--prefill-skip-park` keeps it resident). On CPU parking does nothing.

Where it runs: `compress` blocks its caller, a worker thread (never the event
loop, never the engine thread). On CUDA every scorer pass (unparking included)
is queued on the service's own stream and waits only for that stream, so the
engine thread keeps stepping the running requests on its stream meanwhile; the
request being scored is not submitted to the engine until its compression is
done. Under tensor parallelism the target as its own scorer runs on every rank
between two of the engine's steps (engine/parallel/plan.py), which wait for it.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import threading
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from lucebox.engine.pflash.compress import PFlash

log = logging.getLogger(__name__)

MODES = ("off", "auto", "always")
DEFAULT_THRESHOLD = 32000  # tokens (spec): below that, full prefill is cheap next to scoring plus the risk of loss
REMEMBERED = 64  # compressions kept in the LRU map (ids only: a few KB each)


@dataclass(frozen=True)
class Compression:
    """A prompt as the target prefills it, and what making it cost."""

    key: str  # the raw prompt's key (exact-tier key too)
    ids: list[int]  # the compressed prompt, target ids (BOS kept when the raw prompt had it)
    original_tokens: int  # raw prompt, target tokens
    scorer_seconds: float  # tokenize + scorer forward; 0 when reused
    total_seconds: float  # scorer + selection + mapping back; 0 when reused
    reused: bool = False  # a repeat of a prompt compressed before: no scorer run

    @property
    def compressed_tokens(self) -> int:
        return len(self.ids)

    @property
    def shrinks(self) -> bool:
        """False when selection kept (nearly) everything and re-added the query: then the raw prompt is used."""
        return len(self.ids) < self.original_tokens

    @property
    def ratio(self) -> float:
        return self.original_tokens / max(1, len(self.ids))

    def as_dict(self) -> dict[str, Any]:
        """What a response reports (the `timings.prefill_compression` object)."""
        return {"original_tokens": self.original_tokens, "compressed_tokens": self.compressed_tokens,
                "ratio": round(self.ratio, 3), "scorer_ms": round(self.scorer_seconds * 1000, 2),
                "compress_ms": round(self.total_seconds * 1000, 2), "reused": self.reused}


@dataclass
class PFlashStats:
    compressed_requests: int = 0  # requests whose prompt the target got compressed (fresh or reused)
    tokens_saved: int = 0  # sum of original - compressed over those requests
    original_tokens: int = 0
    scorer_calls: int = 0
    scorer_seconds: float = 0.0
    reused: int = 0  # compressions reused without the scorer


class ScorerParking:
    """Keep a module's weights in pinned host memory while idle, on the device while in use (CUDA only).

    The host copy is made once (weights never change) and kept, so parking is
    only a pointer swap plus freeing the device copy; unparking is one
    host-to-device copy per tensor. On any other device both calls do nothing.
    """

    def __init__(self, module: nn.Module, device: torch.device, enabled: bool = True) -> None:
        self.module = module
        self.device = torch.device(device)
        self.enabled = enabled and self.device.type == "cuda"
        self.parked = False
        self._host: dict[int, torch.Tensor] = {}

    def _tensors(self) -> list[torch.Tensor]:
        return [*self.module.parameters(), *self.module.buffers()]

    def park(self) -> None:
        if not self.enabled or self.parked:
            return
        for t in self._tensors():
            host = self._host.get(id(t))
            if host is None:
                host = self._host[id(t)] = t.detach().to("cpu").pin_memory()
            t.data = host
        self.parked = True
        torch.cuda.empty_cache()

    def unpark(self) -> None:
        """Copy the weights to the device on the current stream and wait for that stream (not the device)."""
        if not self.enabled or not self.parked:
            return
        for t in self._tensors():
            t.data = t.data.to(self.device, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        self.parked = False


class PFlashService:
    """Policy, scorer turns, reuse and counters for PFlash in the server (thread-safe)."""

    def __init__(self, pflash: PFlash, *, mode: str = "auto", threshold: int = DEFAULT_THRESHOLD,
                 keep_ratio: float | None = None, cache: Any = None, scorer_name: str | None = None,
                 target_model: nn.Module | None = None, park: bool = True) -> None:
        if mode not in MODES:
            raise ValueError(f"PFlash mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.pflash = pflash
        self.mode = mode
        self.threshold = threshold
        self.keep_ratio = pflash.config.keep_ratio if keep_ratio is None else keep_ratio
        self.cache = cache  # lucebox.cache.manager.PrefixCache or None
        scorer = pflash.scorer
        self.scorer_name = scorer_name or str(scorer.path)
        self.scorer_is_target = target_model is None or scorer.model is target_model  # never park the target
        self.parking = ScorerParking(scorer.model, scorer.device, enabled=park and not self.scorer_is_target)
        # The scorer's own stream: its passes overlap the engine's decode steps instead of queueing behind them.
        self.stream = torch.cuda.Stream(self.parking.device) if self.parking.device.type == "cuda" else None
        self.parking.park()
        self.stats = PFlashStats()
        self._remembered: collections.OrderedDict[str, Compression] = collections.OrderedDict()
        self._lock = threading.Lock()  # the map and the counters
        self._scorer_lock = threading.Lock()  # one scorer pass at a time
        self._waiting = 0  # threads waiting for the scorer (park only when nobody is)
        tag = f"pflash\0{self.scorer_name}\0{self.keep_ratio!r}\0".encode()
        self._key_prefix = hashlib.sha1(tag).digest()

    @property
    def device(self) -> torch.device:
        return self.parking.device

    # ----- policy ---------------------------------------------------------------------------------

    def wants(self, n_tokens: int, has_tools: bool) -> bool:
        """Whether a prompt of `n_tokens` raw tokens gets compressed."""
        if has_tools or self.mode == "off":
            return False
        return self.mode == "always" or n_tokens > self.threshold

    def key(self, raw_ids: list[int]) -> str:
        """SHA-1 of the raw prompt's ids, salted with what decides the result (scorer, keep ratio)."""
        h = hashlib.sha1(self._key_prefix)
        h.update(np.asarray(raw_ids, dtype="<i4").tobytes())
        return h.hexdigest()

    # ----- reuse and compression (blocking: call off the event loop) ------------------------------

    def reuse(self, raw_ids: list[int]) -> Compression | None:
        """A past compression of this raw prompt (this process's map, else the exact cache tier), or None."""
        key = self.key(raw_ids)
        found = self._recall(key, len(raw_ids))
        if found is not None:
            self._count(found)
        return found

    def compress(self, raw_ids: list[int], text: str, query: str | None, keep_bos: bool = False) -> Compression:
        """Score and select now (unless an identical prompt finished compressing while this one waited).

        `text` is the rendered prompt without BOS; `keep_bos` puts `raw_ids[0]` (BOS) back in front.
        """
        key = self.key(raw_ids)
        with self._lock:
            self._waiting += 1
        with self._scorer_lock:
            with self._lock:
                self._waiting -= 1
            found = self._recall(key, len(raw_ids))
            if found is None:
                found = self._run_scorer(key, raw_ids, text, query, keep_bos)
        self._count(found)
        return found

    def _run_scorer(self, key: str, raw_ids: list[int], text: str, query: str | None,
                    keep_bos: bool) -> Compression:
        on_stream = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        try:
            with on_stream:
                self.parking.unpark()
                res = self.pflash.compress(text, query=query, keep_ratio=self.keep_ratio)
        finally:
            with self._lock:
                idle = self._waiting == 0
            if idle:
                self.parking.park()
        ids = ([raw_ids[0]] if keep_bos and raw_ids else []) + res.ids
        done = Compression(key, ids, len(raw_ids), res.scorer_seconds, res.total_seconds)
        with self._lock:
            self.stats.scorer_calls += 1
            self.stats.scorer_seconds += res.scorer_seconds
            self._remember(done)
        log.info("PFlash: %d -> %d tokens (%.1fx), scorer %.2fs, total %.2fs", done.original_tokens,
                 done.compressed_tokens, done.ratio, res.scorer_seconds, res.total_seconds)
        return done

    def _recall(self, key: str, original_tokens: int) -> Compression | None:
        with self._lock:
            found = self._remembered.get(key)
            if found is not None:
                self._remembered.move_to_end(key)
                return replace(found, scorer_seconds=0.0, total_seconds=0.0, reused=True)
        ids = self.cache.exact_tokens(key) if self.cache is not None else None
        if ids is None:
            return None
        found = Compression(key, ids, original_tokens, 0.0, 0.0, reused=True)
        with self._lock:
            self._remember(found)
        return found

    def _remember(self, done: Compression) -> None:
        self._remembered[done.key] = done
        self._remembered.move_to_end(done.key)
        while len(self._remembered) > REMEMBERED:
            self._remembered.popitem(last=False)

    def _count(self, done: Compression) -> None:
        if not done.shrinks:
            return
        with self._lock:
            s = self.stats
            s.compressed_requests += 1
            s.original_tokens += done.original_tokens
            s.tokens_saved += max(0, done.original_tokens - done.compressed_tokens)
            s.reused += done.reused

    # ----- reporting ------------------------------------------------------------------------------

    def props(self) -> dict[str, Any]:
        """The `/props` `pflash` object: configuration and counters."""
        with self._lock:
            s = self.stats
            counters = {"compressed_requests": s.compressed_requests, "tokens_saved": s.tokens_saved,
                        "scorer_calls": s.scorer_calls, "scorer_seconds": round(s.scorer_seconds, 3),
                        "reused": s.reused}
        return {"mode": self.mode, "threshold": self.threshold, "keep_ratio": self.keep_ratio,
                "scorer": self.scorer_name, "scorer_is_target": self.scorer_is_target,
                "parking": self.parking.enabled, "parked": self.parking.parked, **counters}
