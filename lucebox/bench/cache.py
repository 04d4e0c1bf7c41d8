"""`python -m lucebox bench cache`: the prefix cache on replayed multi-turn agent sessions.

Each session has a real Codex CLI system prompt (lucebox/data/agent_prompts) and
user turns made of real SWE-bench issues; assistant turns are what the model
answered. The same sessions replay against servers started with different
cache settings, in one run:
  - off:      --no-prefix-cache (every prompt prefilled from scratch)
  - gpu:      tier 0 only (GPU blocks shared by prefix)
  - ram:      tiers 1 + 2 only (snapshots in host RAM, restored into fresh blocks)
  - all+disk: every tier, persisting to --kv-cache-dir
  - restart:  a fresh server on the same --kv-cache-dir (nothing in GPU or RAM)
Reported per mode: TTFT per turn, the share of prompt tokens served from the
cache, and the TTFT speedup over `off` (same prompts, same run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from lucebox.bench.http_client import request_json, stream_sse
from lucebox.bench.report import environment, print_table, write_json
from lucebox.bench.serve import ServerProcess, wait_ready
from lucebox.data import data_dir as resolve_data_dir
from lucebox.errors import LuceboxError
from lucebox.progress import Progress

MODES = {
    "off": ["--no-prefix-cache"],
    "gpu": ["--prefix-cache-slots", "0", "--prefill-cache-slots", "0"],
    "ram": ["--prefix-cache-slots", "32", "--prefill-cache-slots", "8", "--no-gpu-prefix-cache"],
    "all+disk": ["--prefix-cache-slots", "32", "--prefill-cache-slots", "8"],
}


def sessions(data_dir: Path, n_sessions: int, n_turns: int, system_chars: int, user_chars: int) -> list[dict]:
    prompts = sorted((data_dir / "agent_prompts").glob("*.md"))
    if not prompts:
        raise LuceboxError(f"no agent prompts in {data_dir / 'agent_prompts'}")
    issues = _issues(data_dir)
    out = []
    for s in range(n_sessions):
        system = prompts[s % len(prompts)].read_text(encoding="utf-8")[:system_chars]
        users = [issues[(s * n_turns + t) % len(issues)][:user_chars] for t in range(n_turns)]
        out.append({"system": system, "users": users})
    return out


def _issues(data_dir: Path) -> list[str]:
    """SWE-bench problem statements (needs pyarrow) or, failing that, the MT-Bench questions."""
    try:
        import pyarrow.parquet as pq

        table = pq.read_table(data_dir / "swe_bench_verified.parquet", columns=["problem_statement"])
        return [t for t in table.column("problem_statement").to_pylist() if t]
    except Exception:  # noqa: BLE001 - optional dependency or missing file: fall back to other real text
        rows = [json.loads(line) for line in (data_dir / "prompts" / "mt_bench.jsonl").read_text().splitlines()]
        return [" ".join(r["turns"]) for r in rows]


async def one_turn(base: str, messages: list[dict], max_tokens: int) -> dict[str, Any]:
    body = {"model": "bench", "messages": messages, "temperature": 0, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    text = []
    usage: dict[str, Any] = {}
    async for frame in stream_sse(base + "/v1/chat/completions", body):
        if frame.data == "[DONE]":
            break
        obj = json.loads(frame.data)
        for ch in obj.get("choices") or []:
            piece = (ch.get("delta") or {}).get("content")
            if piece:
                first = first or frame.time
                text.append(piece)
        usage = obj.get("usage") or usage
    ttft = (first or time.perf_counter()) - t0
    return {"ttft": ttft, "text": "".join(text), "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


async def replay(base: str, sess: list[dict], max_tokens: int, progress: Progress) -> list[list[dict]]:
    results = []
    for s in sess:
        messages = [{"role": "system", "content": s["system"]}]
        turns = []
        for user in s["users"]:
            messages.append({"role": "user", "content": user})
            r = await one_turn(base, messages, max_tokens)
            messages.append({"role": "assistant", "content": r["text"]})
            turns.append(r)
            progress.advance()
        results.append(turns)
    return results


def _summary(results: list[list[dict]], n_turns: int) -> dict[str, Any]:
    flat = [t for s in results for t in s]
    per_turn = [statistics.mean(s[i]["ttft"] for s in results) * 1000 for i in range(n_turns)]
    prompt = sum(t["prompt_tokens"] for t in flat)
    return {"ttft_ms_per_turn": per_turn, "ttft_ms_mean": statistics.mean(t["ttft"] for t in flat) * 1000,
            "cached_share": sum(t["cached_tokens"] for t in flat) / max(prompt, 1), "prompt_tokens": prompt}


def main(args: argparse.Namespace) -> int:
    data_dir = resolve_data_dir(args.data_dir)
    sess = sessions(data_dir, args.sessions, args.turns, args.system_chars, args.user_chars)
    cache_dir = Path(args.kv_cache_dir) if args.kv_cache_dir else Path(tempfile.mkdtemp(prefix="lucebox-kv-"))
    runs = [(m, MODES[m] + (["--kv-cache-dir", str(cache_dir)] if m == "all+disk" else [])) for m in MODES]
    runs.append(("restart", MODES["all+disk"] + ["--kv-cache-dir", str(cache_dir)]))
    progress = Progress("bench cache", total=len(runs) * args.sessions * args.turns, unit="turns")
    summaries: dict[str, Any] = {}
    outputs: dict[str, list] = {}
    props: dict[str, Any] = {}
    for mode, extra in runs:
        server = ServerProcess(args, max_num_seqs=4, extra=extra)
        try:
            asyncio.run(wait_ready(server.url, server, {}))
            results = asyncio.run(replay(server.url, sess, args.gen_len, progress))
            if not props:
                props = asyncio.run(request_json("GET", server.url + "/props"))[1]
        finally:
            server.stop()
        summaries[mode] = _summary(results, args.turns)
        outputs[mode] = [[t["text"] for t in s] for s in results]
    progress.close()
    base = summaries["off"]
    rows = []
    for mode, s in summaries.items():
        same = outputs[mode] == outputs["off"]
        rows.append([mode, *[round(x) for x in s["ttft_ms_per_turn"]], round(s["ttft_ms_mean"]),
                     f"{100 * s['cached_share']:.0f}%", base["ttft_ms_mean"] / s["ttft_ms_mean"], same])
        s["speedup_vs_off"] = base["ttft_ms_mean"] / s["ttft_ms_mean"]
        s["identical_to_off"] = same
    model = props.get("model", {})
    title = (f"bench cache: {model.get('name')} on {model.get('device')}, {args.sessions} sessions x {args.turns} "
             f"turns (Codex system prompt + SWE-bench issues), TTFT in ms")
    cols = ["mode", *[f"turn {i + 1}" for i in range(args.turns)], "mean", "cached", "speedup", "same output"]
    print_table(title, cols, rows)
    import torch

    write_json(args.json, {"benchmark": "cache", "model": model, "modes": summaries,
                           "env": environment(torch.device(args.device if args.device != "auto" else "cpu"))})
    return 0

