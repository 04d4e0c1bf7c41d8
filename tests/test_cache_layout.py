"""layout_id: every input that makes saved KV incompatible changes it; nothing else does."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from lucebox.cache.disk import DiskStore
from lucebox.cache.layout import layout_id, model_identity


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + os.urandom(3 << 20))
    return path


def base(model_path) -> dict:
    return dict(model_path=model_path, kv_dtype=torch.bfloat16, block_size=16, n_ctx=8192,
                template_sha1="a" * 40, num_layers=30, num_kv_heads=3, head_dim=64)


def test_same_inputs_same_id_and_a_store_accepts_it(model_file, tmp_path):
    lid = layout_id(**base(model_file))
    assert lid == layout_id(**base(str(model_file)))
    assert len(lid) == 32 and int(lid, 16) >= 0
    assert DiskStore(tmp_path / "cache", lid, 1 << 20).dir.name == lid


@pytest.mark.parametrize("change", [
    {"kv_dtype": torch.float16}, {"kv_dtype": "float32"}, {"block_size": 32}, {"n_ctx": 4096},
    {"template_sha1": "b" * 40}, {"num_layers": 31}, {"num_kv_heads": 4}, {"head_dim": 128},
    {"extra": {"pflash_keep": 0.25}},
])
def test_each_field_changes_the_id(model_file, change):
    assert layout_id(**{**base(model_file), **change}) != layout_id(**base(model_file))


def test_model_identity_follows_content_not_path(model_file, tmp_path):
    before = layout_id(**base(model_file))
    moved = tmp_path / "elsewhere" / "renamed.gguf"
    moved.parent.mkdir()
    shutil.copy(model_file, moved)
    assert layout_id(**base(moved)) == before, "the same bytes elsewhere are the same model"
    data = bytearray(model_file.read_bytes())
    for offset in (100, len(data) - 100):  # metadata at the head, last tensor at the tail
        changed = tmp_path / f"changed{offset}.gguf"
        data[offset] ^= 1
        changed.write_bytes(bytes(data))
        data[offset] ^= 1
        assert layout_id(**base(changed)) != before
    longer = tmp_path / "longer.gguf"
    longer.write_bytes(bytes(data) + b"\0")
    assert layout_id(**base(longer)) != before


def test_hugging_face_folders(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text('{"num_hidden_layers": 2}')
    (folder / "model.safetensors").write_bytes(os.urandom(1000))
    first = model_identity(folder)
    (folder / ".cache").mkdir()  # hidden entries do not count
    assert model_identity(folder) == first
    (folder / "config.json").write_text('{"num_hidden_layers": 3}')
    assert model_identity(folder) != first
    with pytest.raises(FileNotFoundError):
        model_identity(tmp_path / "missing.gguf")
