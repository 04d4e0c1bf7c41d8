"""A GGUF-quantized weight matrix kept in its block layout.

`QuantWeight` is the raw bytes of a [rows, cols] GGUF tensor as a uint8 tensor [rows, cols / block *
type_size] (one row of blocks per output row, exactly the file's bytes) plus its type name. Row operations
(slicing, gathering, concatenating, llama's q/k un-permute) work on the byte rows unchanged, so nothing is
dequantized to move, fuse or shard a weight. `dequantize` is the exact fp32 reference (`dequant.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lucebox.engine.weights.quant.dequant import FORMATS, dequantize

QUANT_TYPES = tuple(FORMATS)


def row_bytes(qtype: str, cols: int) -> int:
    """Bytes of one row of `cols` values of `qtype`."""
    block, size, _ = FORMATS[qtype]
    if cols % block:
        raise ValueError(f"{qtype} rows hold a multiple of {block} values, not {cols}")
    return cols // block * size


@dataclass
class QuantWeight:
    """Raw GGUF blocks of a [rows, cols] matrix: `data` is uint8 [rows, row_bytes(qtype, cols)]. `dtype` is
    the model's compute dtype, what a dense copy of the weight would be held in. `dense`: that copy, where the
    weights policy keeps both (`--weights both`: the blocks serve a few rows, the copy serves many; see
    triton_qmm.qmatmul); row operations keep it in step with the blocks."""

    data: torch.Tensor
    qtype: str
    cols: int
    dtype: torch.dtype = torch.float32
    dense: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.qtype not in FORMATS:
            raise ValueError(f"no quantized kernels for {self.qtype}")
        want = row_bytes(self.qtype, self.cols)
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.shape[1] != want:
            raise ValueError(f"{self.qtype} data for {self.cols} columns must be uint8 [rows, {want}], "
                             f"got {self.data.dtype} {tuple(self.data.shape)}")

    @property
    def shape(self) -> torch.Size:
        """The logical (dequantized) shape, [rows, cols], as a dense weight's `.shape`."""
        return torch.Size((self.data.shape[0], self.cols))

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def to(self, device: torch.device | str) -> QuantWeight:
        dense = None if self.dense is None else self.dense.to(device)
        return QuantWeight(self.data.to(device), self.qtype, self.cols, self.dtype, dense)

    def with_dense(self) -> QuantWeight:
        """The same blocks with their dense copy in `dtype` beside them (dequantized where the blocks are)."""
        return QuantWeight(self.data, self.qtype, self.cols, self.dtype, self.dequantize(self.dtype))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole matrix, [rows, cols] in `dtype` (exact in fp32)."""
        return dequantize(self.data, self.qtype, self.cols, dtype)

    def dense_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole matrix in `dtype`: the kept dense copy where it is in `dtype`, else dequantized now."""
        if self.dense is not None and self.dense.dtype == dtype:
            return self.dense
        return self.dequantize(dtype)

    def rows(self, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `index` (any shape) dequantized: [*index.shape, cols]. Reads only those rows' blocks."""
        picked = self.data.index_select(0, index.reshape(-1))
        return dequantize(picked, self.qtype, self.cols, dtype).reshape(*index.shape, self.cols)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantWeight:
        """The same weight with its byte rows rearranged by `fn` (a function of a [rows, ...] tensor)."""
        dense = None if self.dense is None else fn(self.dense).contiguous()
        return QuantWeight(fn(self.data).contiguous(), self.qtype, self.cols, self.dtype, dense)

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight:
        """Stack weights of one type and width along rows (q|k|v, gate|up)."""
        first = parts[0]
        if any(p.qtype != first.qtype or p.cols != first.cols for p in parts):
            raise ValueError("only weights of one type and width concatenate")
        dense = torch.cat([p.dense for p in parts]) if all(p.dense is not None for p in parts) else None
        return QuantWeight(torch.cat([p.data for p in parts]), first.qtype, first.cols, first.dtype, dense)
