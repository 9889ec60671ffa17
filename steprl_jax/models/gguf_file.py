"""The GGUF container: metadata and tensor table, read straight from a memory map.

`gguf.GGUFReader` makes one numpy view per part of every metadata value, which for a tokenizer's
vocabulary (SmolLM2: 49,152 tokens and 48,900 merges) is ~250,000 views: 5.2 s before any
weight is read. The layout is small and stable (GGUF v2/v3: a header, key/value pairs, a tensor
table, aligned data), so it is parsed here with `struct`; the `gguf` package still gives the
type tables and dequantizes the data (`gguf.quants.dequantize`).
"""
from __future__ import annotations

import dataclasses
import mmap
import struct

import numpy as np

from steprl_jax.models.loading import CheckpointError

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_STRING, _ARRAY = 8, 9
# value type -> struct format (little endian): uint8, int8, uint16, int16, uint32, int32, float32,
# bool, (string, array), uint64, int64, float64
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
# Plain (not block-quantized) tensor types and their numpy dtypes, as gguf.GGUFReader views them.
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple  # GGUF's order: innermost dimension first
    data: np.ndarray  # read-only view of the file: its dtype's elements, or the raw bytes of quantized rows


class _Cursor:
    """Reads little-endian values from `buf` at `pos`, naming the file and offset when it runs out."""

    def __init__(self, buf, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise CheckpointError(f"{self.path}: truncated GGUF file (header ends at byte {len(self.buf)})")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise CheckpointError(f"{self.path}: truncated GGUF file (a string of {n} bytes at byte {self.pos})")
        raw = self.buf[self.pos:self.pos + n]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{self.path}: a GGUF string at byte {self.pos} is not UTF-8 ({e.reason})") from None
        self.pos += n
        return text

    def numbers(self, fmt: str, count: int) -> list:
        size = struct.calcsize(fmt) * count
        if self.pos + size > len(self.buf):
            raise CheckpointError(f"{self.path}: truncated GGUF file (an array of {count} at byte {self.pos})")
        values = np.frombuffer(self.buf, np.dtype(fmt), count, self.pos).tolist()
        self.pos += size
        return values

    def value(self, kind: int, key: str):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item not in _SCALARS:
                raise CheckpointError(f"{self.path}: GGUF field {key!r} is an array of unsupported type {item}")
            return self.numbers(_SCALARS[item], count)
        if kind not in _SCALARS:
            raise CheckpointError(f"{self.path}: GGUF field {key!r} has unknown value type {kind}")
        return self.scalar(_SCALARS[kind])


def read_gguf(path: str) -> tuple[dict, list[GGUFTensor]]:
    """(metadata, tensors) of a GGUF file: every key/value pair (strings, numbers, lists) plus
    `GGUF.version`, and the tensors in file order as read-only views of a memory map."""
    import gguf

    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            raise CheckpointError(f"{path}: not a GGUF file (empty)") from None
    if buf[:4] != _MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (starts with {bytes(buf[:4])!r}, not {_MAGIC!r})")
    cursor = _Cursor(buf, path)
    cursor.pos = 4
    version = cursor.scalar("<I")
    if version not in _VERSIONS:
        swapped = struct.unpack("<I", struct.pack(">I", version))[0]
        hint = " (a big-endian file)" if swapped in _VERSIONS else ""
        raise CheckpointError(f"{path}: GGUF version {version}{hint} is not supported (versions {_VERSIONS})")
    n_tensors, n_fields = cursor.scalar("<Q"), cursor.scalar("<Q")
    metadata = {"GGUF.version": version}
    for _ in range(n_fields):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.scalar("<I"), key)

    table = []
    for _ in range(n_tensors):
        name = cursor.string()
        dims = tuple(cursor.scalar("<Q") for _ in range(cursor.scalar("<I")))
        table.append((name, dims, cursor.scalar("<I"), cursor.scalar("<Q")))
    alignment = metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise CheckpointError(f"{path}: GGUF field 'general.alignment' = {alignment!r} is not a power of two")
    start = -(-cursor.pos // alignment) * alignment

    data = np.frombuffer(buf, np.uint8)
    tensors, seen = [], set()
    for name, dims, raw_type, offset in table:
        if name in seen:
            raise CheckpointError(f"{path}: tensor {name!r} appears twice")
        seen.add(name)
        try:
            kind = gguf.GGMLQuantizationType(raw_type)
        except ValueError:
            raise CheckpointError(f"{path}: tensor {name!r} has unknown type {raw_type}") from None
        block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        elements = int(np.prod(dims, dtype=np.int64))
        begin, size = start + offset, elements * block_bytes // block
        if begin + size > len(data):
            raise CheckpointError(f"{path}: tensor {name!r} ends at byte {begin + size}, past the file's end "
                                  f"({len(data)} bytes): a truncated file")
        shape = tuple(reversed(dims))  # numpy's order: outermost first
        if kind.name in _PLAIN:
            view = data[begin:begin + size].view(_PLAIN[kind.name]).reshape(shape)
        else:
            view = data[begin:begin + size].reshape(gguf.quants.quant_shape_to_byte_shape(shape, kind))
        tensors.append(GGUFTensor(name, kind, dims, view))
    return metadata, tensors
