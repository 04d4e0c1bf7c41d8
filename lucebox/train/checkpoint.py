"""Training checkpoints in small pieces: a folder of shard files of at most SHARD_BYTES each and an index.json,
so a checkpoint can be carried off a machine that only lets small files through.

A checkpoint is a nested state (dicts, lists, numbers, strings, tensors: a model's and an optimizer's
state_dict, the step, the history). Its tensors' bytes are written one after another as one stream, cut
into shards (a tensor may span several); index.json holds everything else, each tensor's dtype, shape and
place in the stream, and every shard's size and SHA-256, checked when read. write_checkpoint replaces the
folder atomically (a new folder renamed over the old one).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from lucebox.errors import LuceboxError

SHARD_BYTES = 16 << 20
INDEX = "index.json"
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                                torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


def _flatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """obj with every tensor replaced by {"__tensor__": its number in `tensors`}; JSON-ready."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"__tensor__": len(tensors) - 1}
    if isinstance(obj, dict):
        if not all(isinstance(k, (str, int)) for k in obj):
            raise TypeError(f"checkpoint keys must be str or int, got {list(obj)[:3]}")
        # int keys (an optimizer's state) survive JSON as a list of pairs
        return {"__dict__": [[k, _flatten(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return [_flatten(v, tensors) for v in obj]
    return obj


def _unflatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        return {k: _unflatten(v, tensors) for k, v in obj["__dict__"]}
    if isinstance(obj, list):
        return [_unflatten(v, tensors) for v in obj]
    return obj


def write_checkpoint(folder: Path, state: dict[str, Any], shard_bytes: int = SHARD_BYTES) -> None:
    """Write `state` as shards + index.json into `folder` (replacing what was there, atomically)."""
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    tensors: list[torch.Tensor] = []
    tree = _flatten(state, tensors)
    entries, shards = [], []
    cur, cur_hash, cur_len = None, None, 0

    def close() -> None:
        if cur is not None:
            cur.close()
            shards.append({"file": cur_name, "bytes": cur_len, "sha256": cur_hash.hexdigest()})

    offset = 0
    try:
        for t in tensors:
            data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            entries.append({"dtype": str(t.dtype), "shape": list(t.shape), "offset": offset, "nbytes": len(data)})
            offset += len(data)
            view = memoryview(data)
            while view.nbytes:
                if cur is None or cur_len == shard_bytes:
                    close()
                    cur_name = f"shard-{len(shards):05d}.bin"
                    cur, cur_hash, cur_len = (tmp / cur_name).open("wb"), hashlib.sha256(), 0
                piece = view[: shard_bytes - cur_len]
                cur.write(piece)
                cur_hash.update(piece)
                cur_len += piece.nbytes
                view = view[piece.nbytes:]
        close()
        cur = None
    finally:
        if cur is not None:
            cur.close()
    index = {"format": "lucebox-checkpoint-1", "shard_bytes": shard_bytes, "shards": shards, "tensors": entries,
             "state": tree}
    (tmp / INDEX).write_text(json.dumps(index) + "\n")
    old = folder.with_name(folder.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if folder.exists():
        os.replace(folder, old)
    os.replace(tmp, folder)
    if old.exists():
        shutil.rmtree(old)


def read_checkpoint(folder: Path) -> dict[str, Any]:
    """The state write_checkpoint wrote (tensors on the CPU); a missing or damaged shard is an error.
    Each shard is read once, checked, and copied into the tensors it covers (memory: the tensors + a shard)."""
    folder = Path(folder)
    try:
        index = json.loads((folder / INDEX).read_text())
    except FileNotFoundError:
        raise LuceboxError(f"{folder}: no {INDEX} (not a checkpoint folder)") from None
    except (OSError, ValueError) as exc:
        raise LuceboxError(f"{folder}/{INDEX}: {exc}") from None
    tensors = [torch.empty(e["shape"], dtype=_DTYPES[e["dtype"]]) for e in index["tensors"]]
    views = [(e["offset"], t.reshape(-1).view(torch.uint8)) for e, t in zip(index["tensors"], tensors) if e["nbytes"]]
    k, start = 0, 0  # the first tensor not yet complete; the shard's place in the stream
    for s in index["shards"]:
        try:
            data = (folder / s["file"]).read_bytes()
        except OSError as exc:
            raise LuceboxError(f"{folder}: shard {s['file']} unreadable ({exc})") from None
        if len(data) != s["bytes"] or hashlib.sha256(data).hexdigest() != s["sha256"]:
            raise LuceboxError(f"{folder}: shard {s['file']} is damaged (size or SHA-256 differs from {INDEX})")
        shard = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        end = start + len(data)
        while k < len(views) and views[k][0] < end:
            off, view = views[k]
            lo, hi = max(off, start), min(off + view.numel(), end)
            view[lo - off: hi - off] = shard[lo - start: hi - start]
            if off + view.numel() > end:
                break  # continues in the next shard
            k += 1
        start = end
    return _unflatten(index["state"], tensors)
