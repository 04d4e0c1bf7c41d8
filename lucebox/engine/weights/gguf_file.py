"""A fast, strict reader for the GGUF container (metadata + memory-mapped tensors).

`gguf.GGUFReader` builds a numpy memmap view per metadata element; for the
default models' vocabularies (49K and 262K tokens) that costs 4 s and 17 s
before the first tensor is touched. This reader parses the metadata from one
bytes read with `struct` (well under a second) and keeps everything else in
the `gguf` package: its constants for value and tensor types, its block sizes,
and `gguf.quants` for dequantization. Tensor data stays memory-mapped.

Every structural problem (bad magic, unknown type, sizes past the end of the
file) is a `ModelFileError` naming the file and what is wrong.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from lucebox.engine.weights.config_check import describe
from lucebox.errors import ModelFileError

_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NUMPY = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2", GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4", GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}


class _Truncated(Exception):
    pass


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the row length
    tensor_type: GGMLQuantizationType
    offset: int  # absolute file offset
    n_bytes: int
    data: np.ndarray  # what gguf.quants.dequantize takes: floats, or [rows, bytes per row] uint8

    @property
    def numpy_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))


class GGUFFile:
    """Metadata as plain Python values (`fields`) and the tensors, memory-mapped."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._map = np.memmap(self.path, mode="r")
        except (OSError, ValueError) as exc:
            raise ModelFileError(f"{self.path}: cannot map file ({exc})") from None
        self.size = len(self._map)
        self.fields: dict[str, Any] = {}
        self.tensors: list[GGUFTensor] = []
        try:
            self._parse()
        except _Truncated:
            raise ModelFileError(f"{self.path}: truncated GGUF file (header ends past the end of the file)") from None
        except (struct.error, UnicodeDecodeError, ValueError, OverflowError) as exc:
            raise ModelFileError(f"{self.path}: corrupt GGUF header ({exc})") from None

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    # ----- parsing -----------------------------------------------------------

    def _parse(self) -> None:
        head = bytes(self._map[: min(self.size, 24)])
        if head[:4] != b"GGUF":
            raise ModelFileError(f"{self.path}: not a GGUF file (bad magic {head[:4]!r})")
        if len(head) < 24:
            raise _Truncated
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
        if version not in (2, 3):
            raise ModelFileError(f"{self.path}: unsupported GGUF version {version}")
        # A metadata entry takes at least 13 bytes and a tensor entry 24: counts past that are corrupt.
        if n_kv * 13 + n_tensors * 24 > self.size:
            raise ModelFileError(f"{self.path}: corrupt GGUF header (it claims {n_kv} metadata entries and "
                                 f"{n_tensors} tensors, more than a file of {self.size} bytes can hold)")
        # The header is parsed in place, from the map: no copy, and a header that runs past the end is truncated.
        pos = self._parse_header(memoryview(self._map), 24, n_kv, n_tensors)
        align = self.fields.get("general.alignment", 32)
        if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ModelFileError(f"{self.path}: general.alignment is {describe(align)}; it must be a power of two")
        data_start = -(-pos // align) * align
        for t in self.tensors:
            t.offset += data_start
            if t.offset + t.n_bytes > self.size:
                raise ModelFileError(
                    f"{self.path}: truncated GGUF file (tensor {t.name} ends at byte {t.offset + t.n_bytes}, "
                    f"file has {self.size})"
                )
            t.data = self._tensor_view(t)

    def _parse_header(self, buf: memoryview, pos: int, n_kv: int, n_tensors: int) -> int:
        fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = _read_str(buf, pos)
            vtype, pos = _read(buf, pos, "<I")
            fields[key], pos = _read_value(buf, pos, vtype)
        tensors = []
        for _ in range(n_tensors):
            name, pos = _read_str(buf, pos)
            n_dims, pos = _read(buf, pos, "<I")
            if not 1 <= n_dims <= 8:
                raise ValueError(f"tensor {name} has {n_dims} dimensions")
            shape = struct.unpack_from(f"<{n_dims}Q", buf, pos) if pos + 8 * n_dims <= len(buf) else None
            if shape is None:
                raise _Truncated
            pos += 8 * n_dims
            raw_type, pos = _read(buf, pos, "<I")
            offset, pos = _read(buf, pos, "<Q")
            try:
                ttype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise ModelFileError(f"{self.path}: tensor {name} has unknown type id {raw_type}") from None
            block, type_size = GGML_QUANT_SIZES[ttype]
            if shape[0] % block:
                raise ModelFileError(f"{self.path}: tensor {name} row length {shape[0]} is not a multiple of {block}")
            n_elems = math.prod(shape)  # Python ints: absurd shapes make absurd sizes, refused below, not overflow
            n_bytes = n_elems // block * type_size
            tensors.append(GGUFTensor(name, tuple(int(d) for d in shape), ttype, offset, n_bytes, np.empty(0)))
        self.fields, self.tensors = fields, tensors
        return pos

    def _tensor_view(self, t: GGUFTensor) -> np.ndarray:
        raw = self._map[t.offset: t.offset + t.n_bytes]
        if t.tensor_type == GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(t.numpy_shape)
        if t.tensor_type == GGMLQuantizationType.F16:
            return raw.view(np.float16).reshape(t.numpy_shape)
        block, type_size = GGML_QUANT_SIZES[t.tensor_type]
        rows = t.numpy_shape[:-1] or (1,)
        return raw.reshape(*rows, t.shape[0] // block * type_size)


def _read(buf: memoryview, pos: int, fmt: str) -> tuple[Any, int]:
    size = struct.calcsize(fmt)
    if pos + size > len(buf):
        raise _Truncated
    return struct.unpack_from(fmt, buf, pos)[0], pos + size


def _read_str(buf: memoryview, pos: int) -> tuple[str, int]:
    n, pos = _read(buf, pos, "<Q")
    if pos + n > len(buf):
        raise _Truncated
    return str(buf[pos: pos + n], "utf-8", "replace"), pos + n


def _read_value(buf: memoryview, pos: int, vtype: int) -> tuple[Any, int]:
    if vtype == GGUFValueType.STRING:
        return _read_str(buf, pos)
    if vtype == GGUFValueType.ARRAY:
        item_type, pos = _read(buf, pos, "<I")
        count, pos = _read(buf, pos, "<Q")
        if item_type in _NUMPY:  # numbers: one bulk read
            dt = np.dtype(_NUMPY[GGUFValueType(item_type)])
            end = pos + count * dt.itemsize
            if end > len(buf):
                raise _Truncated
            return np.frombuffer(buf, dt, count, pos).tolist(), end
        if item_type == GGUFValueType.STRING:
            out, size, unpack = [], len(buf), struct.Struct("<Q").unpack_from  # the hot loop: vocabularies, merges
            for _ in range(count):
                if pos + 8 > size:
                    raise _Truncated
                start = pos + 8
                pos = start + unpack(buf, pos)[0]
                if pos > size:
                    raise _Truncated
                out.append(str(buf[start:pos], "utf-8", "replace"))
            return out, pos
        items = []
        for _ in range(count):
            item, pos = _read_value(buf, pos, item_type)
            items.append(item)
        return items, pos
    try:
        fmt = _SCALARS[GGUFValueType(vtype)]
    except (ValueError, KeyError):
        raise ValueError(f"unknown metadata value type {vtype}") from None
    return _read(buf, pos, fmt)
