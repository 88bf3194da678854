"""Reading a GGUF file's header: its key-value metadata and its tensors' names, shapes,
types and bytes (mapped from the file, not copied).

The format (version 2 and 3, little-endian): the magic ``GGUF``, a u32 version, u64
tensor and key-value counts; each key-value pair a string key, a u32 value type and the
value (a string is a u64 length and UTF-8 bytes; an array a u32 item type, a u64
count and the items); each tensor a string name, a u32 dimension count, that many u64
dimensions (the innermost first), a u32 ggml type and a u64 offset into the data,
which starts at the next multiple of ``general.alignment`` (32 unless given).

The gguf package's own reader builds a numpy view per value, ~250,000 of them for a
vocabulary of 49,152 tokens and as many merges: 2.4 s at every start of the default
model's file on a Xeon. This one reads the header with ``struct`` over the mapped file
in ~0.1 s and keeps each tensor's bytes as one uint8 view, its rows by their bytes, the
layout the gguf package's dequantization and the kernels' block packing take.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
STRING, ARRAY = 8, 9
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}   # value type -> struct format
_ARRAYS = {k: np.dtype(v) for k, v in _SCALARS.items()}   # numeric arrays, as numpy


def ggml_type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"unknown type {ggml_type}"


def unpermute_rows(num_rows: int, num_heads: int) -> np.ndarray:
    """Row order that takes llama.cpp's RoPE layout of a q or k weight (each head's
    rotated pairs interleaved) back to Hugging Face's (each head's halves)."""
    head_dim = num_rows // num_heads
    return np.arange(num_rows).reshape(num_heads, head_dim // 2, 2).transpose(0, 2, 1).reshape(-1)


@dataclass(frozen=True)
class GgufTensor:
    name: str
    # ggml's order, the innermost (contiguous) dimension first: (in_features, rows)
    shape: tuple[int, ...]
    ggml_type: int
    # (rows, bytes of a row): every dimension but the first flattened into rows
    data: np.ndarray

    @property
    def type_name(self) -> str:
        return ggml_type_name(self.ggml_type)


class GgufReader:
    """The metadata (``fields``: key -> str, int, float, bool, or a list of strings or
    numpy array of numbers) and the tensors (``tensors``, in the file's order) of a
    GGUF file. Raises ModelLoadError naming what is wrong with a file that is not one,
    or is cut short."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:   # ValueError: an empty file cannot be mapped
            raise ModelLoadError(f"{self.path} is not a readable GGUF file: {e}") from e
        self._at = 0
        try:
            self._read_header()
        except struct.error as e:
            raise ModelLoadError(f"{self.path} is not a readable GGUF file: it ends inside "
                                 f"its header (at byte {self._at})") from e
        except UnicodeDecodeError as e:
            raise ModelLoadError(f"{self.path} is not a readable GGUF file: a name or "
                                 f"string near byte {self._at} is not UTF-8") from e

    def _read_header(self) -> None:
        if self._map[:4] != GGUF_MAGIC:
            raise ModelLoadError(f"{self.path} is not a GGUF file (it does not begin with "
                                 f"'GGUF')")
        self._at = 4
        version = self._scalar("<I")
        if version & 0xFFFF == 0:
            raise ModelLoadError(f"{self.path} is a big-endian GGUF file; roseserve reads "
                                 f"little-endian ones")
        if version not in (2, 3):
            raise ModelLoadError(f"{self.path} is GGUF version {version}; roseserve reads "
                                 f"versions 2 and 3")
        num_tensors, num_fields = self._scalar("<Q"), self._scalar("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            self.fields[key] = self._value(self._scalar("<I"))
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            shape = tuple(self._scalar("<Q") for _ in range(self._scalar("<I")))
            infos.append((name, shape, self._scalar("<I"), self._scalar("<Q")))
        alignment = self.fields.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ModelLoadError(f"{self.path}: general.alignment {alignment!r} is not a "
                                 f"power of two")
        start = -(-self._at // alignment) * alignment
        data = np.frombuffer(self._map, dtype=np.uint8)
        self.tensors = [self._tensor(data, start, *info) for info in infos]

    def _tensor(self, data: np.ndarray, start: int, name: str, shape: tuple[int, ...],
                ggml_type: int, offset: int) -> GgufTensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise ModelLoadError(f"{self.path.name}: tensor {name!r} has ggml type "
                                 f"{ggml_type}, which roseserve does not know") from None
        if not shape or shape[0] % block:
            raise ModelLoadError(f"{self.path.name}: tensor {name!r} of shape {list(shape)} "
                                 f"is not whole {ggml_type_name(ggml_type)} blocks of "
                                 f"{block} a row")
        rows, row_bytes = int(np.prod(shape[1:], dtype=np.int64)), shape[0] // block * block_bytes
        begin, end = start + offset, start + offset + rows * row_bytes
        if end > len(data):
            raise ModelLoadError(f"{self.path.name} is cut short: tensor {name!r} ends at "
                                 f"byte {end}, the file at {len(data)}")
        return GgufTensor(name, shape, ggml_type, data[begin:end].reshape(rows, row_bytes))

    def _scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._map, self._at)
        self._at += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        size = self._scalar("<Q")
        end = self._at + size
        if end > len(self._map):
            raise struct.error("a string runs past the end")
        text = self._map[self._at:end].decode()
        self._at = end
        return text

    def _value(self, value_type: int):
        if value_type == STRING:
            return self._string()
        if value_type in _SCALARS:
            return self._scalar(_SCALARS[value_type])
        if value_type != ARRAY:
            raise ModelLoadError(f"{self.path}: a metadata value near byte {self._at} has "
                                 f"type {value_type}, which GGUF does not define")
        item_type, count = self._scalar("<I"), self._scalar("<Q")
        if item_type in _ARRAYS:
            size = count * _ARRAYS[item_type].itemsize
            if self._at + size > len(self._map):
                raise struct.error("an array runs past the end")
            items = np.frombuffer(self._map, _ARRAYS[item_type], count, self._at)
            self._at += size
            return items
        return [self._value(item_type) for _ in range(count)]
