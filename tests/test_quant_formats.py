"""engine/weights/quant's pure-torch dequantizer against `gguf.quants.dequantize`, bit for bit, and QuantWeight's row
operations (gather, concatenate, un-permute) against the same operations on the dequantized matrix.

Random bytes are valid blocks of every type once the fp16 scale fields hold finite values (the fixtures write
K-quant tensors the same way); the scales drawn here span normal and subnormal fp16, both signs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType

from lucebox.engine.weights.gguf_loader import unpermute_qk
from lucebox.engine.weights.quant import FORMATS, QUANT_TYPES, QuantWeight, dequantize, row_bytes

# Byte offsets of each type's fp16 fields (d, and dmin or m where the type has one).
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
              "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(qtype: str, n_blocks: int, seed: int) -> np.ndarray:
    """[n_blocks, type_size] random bytes with finite fp16 scales (normal and subnormal, both signs)."""
    rng = np.random.default_rng(seed)
    _, size, _ = FORMATS[qtype]
    blocks = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        mag = np.exp(rng.uniform(np.log(1e-7), np.log(2.0), n_blocks)) * rng.choice([-1, 1], n_blocks)
        blocks[:, at:at + 2] = mag.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return blocks


def random_weight(qtype: str, rows: int, cols: int, seed: int = 0) -> QuantWeight:
    block = FORMATS[qtype][0]
    data = random_blocks(qtype, rows * cols // block, seed).reshape(rows, -1)
    return QuantWeight(torch.from_numpy(data), qtype, cols)


def test_types_cover_every_quant_in_q4_k_m_q5_k_m_q6_k_q8_0_files_and_the_default_model() -> None:
    assert set(QUANT_TYPES) == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_dequantize_is_bit_exact_with_gguf(qtype: str) -> None:
    blocks = random_blocks(qtype, 3000, seed=QUANT_TYPES.index(qtype))
    ref = quants.dequantize(blocks, GGMLQuantizationType[qtype]).reshape(blocks.shape[0], -1)
    block = FORMATS[qtype][0]
    ours = dequantize(torch.from_numpy(blocks), qtype, block).numpy()
    assert np.isfinite(ref).all()
    assert np.array_equal(ours.view(np.uint32), ref.astype(np.float32).view(np.uint32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_dequantize_on_cuda_is_bit_exact_with_cpu(qtype: str) -> None:
    w = random_weight(qtype, 64, FORMATS[qtype][0] * 6, seed=3)
    assert torch.equal(w.to("cuda").dequantize().cpu(), w.dequantize())


@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K"])
def test_rows_gather_only_the_indexed_rows(qtype: str) -> None:
    w = random_weight(qtype, 50, FORMATS[qtype][0] * 3, seed=1)
    ids = torch.tensor([[7, 0, 49], [7, 7, 2]])
    dense = w.dequantize()
    assert torch.equal(w.rows(ids), dense[ids])
    assert w.rows(ids, torch.bfloat16).dtype == torch.bfloat16


def test_cat_and_unpermute_move_whole_rows() -> None:
    q, k = random_weight("Q4_K", 32, 512, seed=4), random_weight("Q4_K", 16, 512, seed=5)
    both = QuantWeight.cat([q, k])
    assert torch.equal(both.dequantize(), torch.cat([q.dequantize(), k.dequantize()]))
    heads = 4
    moved = q.map_rows(lambda r: unpermute_qk(r, heads))
    assert torch.equal(moved.dequantize(), unpermute_qk(q.dequantize(), heads))
    with pytest.raises(ValueError, match="one type"):
        QuantWeight.cat([q, random_weight("Q6_K", 16, 512)])


def test_bad_layouts_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        row_bytes("Q4_K", 100)
    with pytest.raises(ValueError, match="uint8"):
        QuantWeight(torch.zeros(4, 10, dtype=torch.uint8), "Q8_0", 32)
    with pytest.raises(ValueError, match="no quantized kernels"):
        QuantWeight(torch.zeros(4, 10, dtype=torch.uint8), "Q2_K", 256)
