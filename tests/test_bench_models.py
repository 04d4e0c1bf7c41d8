"""The random-weight GGUFs the benchmarks time (bench decode's quant mixes, bench pflash's F16 pairs)
load as real models of the asked shape: one writer serves both."""

from __future__ import annotations

from pathlib import Path

import pytest

from lucebox.bench.decode import mix_qtype, write_random_quant_gguf
from lucebox.bench.pflash import SHAPES, write_random_gguf
from lucebox.engine.weights.gguf_loader import open_gguf
from lucebox.engine.weights.loader import load_model


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q8_0", "F16"])
def test_quant_mix_file_has_the_shape_and_the_mix(tmp_path: Path, smollm2_path: Path, mix: str) -> None:
    shape = SHAPES["tiny"]
    path = write_random_quant_gguf(tmp_path / "m.gguf", shape, smollm2_path, mix=mix, context=2048)
    reader = open_gguf(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    n = shape.layers
    for i in range(n):
        for name in ("attn_q", "attn_v", "ffn_down"):
            assert types[f"blk.{i}.{name}.weight"] == mix_qtype(mix, name, i, n)
    loaded = load_model(path, quiet=True, weights="quantized")
    cfg = loaded.config
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (
        shape.hidden, shape.layers, shape.heads, shape.kv_heads)
    assert cfg.max_position == 2048


def test_pflash_scorer_file_is_f16_tied_with_its_context(tmp_path: Path, smollm2_path: Path) -> None:
    shape = SHAPES["tiny-scorer"]
    path = write_random_gguf(tmp_path / "a.gguf", shape, smollm2_path, 4096, "a", seed=3)
    reader = open_gguf(path)
    names = {t.name for t in reader.tensors}
    assert "output.weight" not in names, "a tied shape has no separate head"
    assert {t.tensor_type.name for t in reader.tensors if t.name.endswith("attn_q.weight")} == {"F16"}
    cfg = load_model(path, quiet=True).config
    assert cfg.max_position == 4096 and cfg.hidden_size == shape.hidden
