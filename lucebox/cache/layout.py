"""`layout_id`: one short hash of everything that makes saved KV incompatible.

A KV snapshot is only valid for the exact model weights, KV dtype and shapes
that produced it (and, for turn-boundary snapshots, the chat template that
placed the boundaries). The disk store files entries under
`<root>/<layout_id>/`, and every file repeats the id in its header, so KV of
another model, quantization, dtype or template is never loaded.

Model identity is a content fingerprint (size plus a hash of the file's head
and tail), not path and mtime: a model moved or re-downloaded byte-identical
keeps its cache, a different quantization or fine-tune (other size, other
metadata or other last tensor) does not.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

import torch

# Bump when the meaning of saved KV changes (e.g. how positions are encoded).
KV_FORMAT_VERSION = 1

_EDGE_BYTES = 1 << 20  # hashed from each end of a model file
_FOLDER_EDGE_BYTES = 64 << 10  # per file of a Hugging Face folder


def _file_fingerprint(path: Path, edge: int) -> str:
    size = path.stat().st_size
    h = hashlib.blake2b(digest_size=16)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(edge))
        if size > edge:
            f.seek(max(edge, size - edge))
            h.update(f.read(edge))
    return h.hexdigest()


def model_identity(path: str | Path) -> str:
    """Fingerprint of a model file (GGUF) or folder (Hugging Face: every file at its top level).

    Reads at most 2 MiB per file, so it is cheap at start-up even for large models.
    """
    path = Path(path)
    if path.is_file():
        return _file_fingerprint(path, _EDGE_BYTES)
    if path.is_dir():
        parts = [f"{p.name}:{_file_fingerprint(p, _FOLDER_EDGE_BYTES)}"
                 for p in sorted(path.iterdir()) if p.is_file() and not p.name.startswith(".")]
        return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()
    raise FileNotFoundError(f"{path}: no such model file or folder")


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def layout_id(
    *,
    model_path: str | Path,
    kv_dtype: torch.dtype | str,
    block_size: int,
    n_ctx: int,
    template_sha1: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    extra: Mapping[str, object] | None = None,
) -> str:
    """32 hex characters naming the KV layout; equal ids mean saved KV can be restored.

    `model_path` is the model file or folder (fingerprinted with `model_identity`).
    `extra` takes anything else that changes what
    is stored for a key (e.g. PFlash settings, since the exact tier stores the KV
    after compression); its values must be JSON-serialisable.
    """
    fields = {
        "format": KV_FORMAT_VERSION,
        "model": model_identity(model_path),
        "kv_dtype": _dtype_name(kv_dtype),
        "block_size": int(block_size),
        "n_ctx": int(n_ctx),
        "template_sha1": template_sha1,
        "shape": [int(num_layers), int(num_kv_heads), int(head_dim)],
        "extra": dict(extra or {}),
    }
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]
