"""The training data: the target's own responses to the training prompts (self-distillation). Example is
one prompt + response; generate_examples makes them, batched through LLMEngine (generation_engine sizes
one), and caches their token ids in an examples.npz keyed by a fingerprint of the target, the prompts and
the sampling settings, so a second or resumed run (or an interrupted generation) does not regenerate;
load_examples_file reads such a file back whatever it was made for."""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.engine.runtime.sequence import Sequence
from lucebox.engine.weights.loader import LoadedModel
from lucebox.train.log import hms, say


@dataclass
class Example:
    prompt_len: int
    tokens: list[int]  # prompt + response

    @property
    def response_len(self) -> int:
        return len(self.tokens) - self.prompt_len


def _fingerprint(loaded: LoadedModel, prompts: list[list[int]], params: dict[str, Any]) -> str:
    h = hashlib.sha256()
    st = loaded.path.stat()
    h.update(json.dumps([loaded.path.name, st.st_size, loaded.config.name, loaded.config.vocab_size,
                         params], sort_keys=True).encode())
    for p in prompts:
        h.update(np.asarray(p, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()


def _save_examples(path: Path, fingerprint: str, done: dict[int, list[int]], prompts: list[list[int]]) -> None:
    idx = sorted(done)
    resp = [done[i] for i in idx]
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(
        tmp, meta=np.array(json.dumps({"fingerprint": fingerprint, "n_prompts": len(prompts)})),
        index=np.asarray(idx, dtype=np.int64),
        prompt_offsets=np.cumsum([0] + [len(prompts[i]) for i in idx]).astype(np.int64),
        prompt_tokens=np.asarray([t for i in idx for t in prompts[i]], dtype=np.int32),
        offsets=np.cumsum([0] + [len(r) for r in resp]).astype(np.int64),
        tokens=np.asarray([t for r in resp for t in r], dtype=np.int32))
    os.replace(tmp, path)


def _load_examples(path: Path, fingerprint: str) -> dict[int, list[int]] | None:
    """The cached responses by prompt index, or None when the cache is for other prompts/settings."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if meta.get("fingerprint") != fingerprint:
                return None
            idx, off, tok = z["index"].tolist(), z["offsets"], z["tokens"]
            return {i: tok[off[j]: off[j + 1]].tolist() for j, i in enumerate(idx)}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError) as exc:
        say(f"train-drafter: ignoring unreadable {path} ({exc})")
        return None


def load_examples_file(path: Path) -> list[Example]:
    """Every (prompt, response) of an examples.npz, whatever it was made for (inspection, tests)."""
    with np.load(path, allow_pickle=False) as z:
        po, pt, off, tok = z["prompt_offsets"], z["prompt_tokens"], z["offsets"], z["tokens"]
        return [Example(int(po[j + 1] - po[j]), pt[po[j]: po[j + 1]].tolist() + tok[off[j]: off[j + 1]].tolist())
                for j in range(len(off) - 1)]


def generate_examples(loaded: LoadedModel, prompts: list[list[int]], *, max_new_tokens: int,
                      temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, batch: int = 64,
                      cache: Path | None = None, engine: LLMEngine | None = None,
                      quiet: bool = False) -> list[Example]:
    """The target's responses to `prompts` (self-distillation data), batched, with progress.

    Greedy unless `temperature` > 0 (then prompt i samples with seed `seed + i`).
    With `cache`, finished responses are saved there as they come (every minute)
    and reused by the next call with the same target, prompts and settings.
    """
    settings = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed}
    fingerprint = _fingerprint(loaded, prompts, settings)
    done: dict[int, list[int]] = {}
    if cache is not None:
        done = _load_examples(cache, fingerprint) or {}
        if done:
            say(f"train-drafter: {len(done)}/{len(prompts)} responses from {cache}")
    todo = [i for i in range(len(prompts)) if i not in done]
    if todo:
        if engine is None:
            engine = generation_engine(loaded, batch, max(len(prompts[i]) for i in todo), max_new_tokens)
        _run_generation(engine, prompts, todo, done, settings, cache, fingerprint, quiet)
    return [Example(len(prompts[i]), list(prompts[i]) + done[i]) for i in range(len(prompts))]


def generation_engine(loaded: LoadedModel, batch: int, max_prompt: int, max_new: int) -> LLMEngine:
    """An engine sized for `batch` sequences of up to max_prompt + max_new tokens."""
    cuda = loaded.device.type == "cuda"
    per_seq = max_prompt + max_new + 64
    return LLMEngine(loaded, EngineConfig(max_num_seqs=batch, kv_tokens=batch * per_seq,
                                          max_step_tokens=8192 if cuda else 2048, cuda_graphs=cuda))


def _run_generation(engine: LLMEngine, prompts: list[list[int]], todo: list[int], done: dict[int, list[int]],
                    settings: dict[str, Any], cache: Path | None, fingerprint: str, quiet: bool) -> None:
    cap = engine.config.max_num_seqs * 2  # keep the scheduler's queue short: admission order stays ours
    queue = list(todo)
    live: dict[int, int] = {}  # seq id -> prompt index
    seqs: dict[int, Sequence] = {}
    start = last_report = last_flush = time.monotonic()
    tokens = 0
    n_total = len(todo)
    while queue or live:
        while queue and len(live) < cap:
            i = queue.pop(0)
            temp = settings["temperature"]
            params = SamplingParams(max_tokens=settings["max_new_tokens"], temperature=temp, top_p=settings["top_p"],
                                    seed=settings["seed"] + i if temp > 0 else None)
            seq = engine.add(prompts[i], params)
            live[seq.seq_id] = i
            seqs[seq.seq_id] = seq
        for out in engine.step():
            tokens += len(out.new_tokens)
            if out.finished:
                sid = out.seq.seq_id
                done[live.pop(sid)] = list(seqs.pop(sid).output_ids)
        now = time.monotonic()
        if not quiet and (now - last_report >= 10 or not (queue or live)):
            last_report = now
            finished = n_total - len(queue) - len(live)
            rate = tokens / max(now - start, 1e-6)
            eta = (n_total - finished) * (tokens / max(finished, 1)) / max(rate, 1e-6)
            say(f"generate: {finished}/{n_total} responses, {tokens} tokens, {rate:,.0f} tok/s, "
                 f"eta {hms(eta) if finished else '?'}")
        if cache is not None and (now - last_flush >= 60 or not (queue or live)):
            last_flush = now
            _save_examples(cache, fingerprint, done, prompts)
