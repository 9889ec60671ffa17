"""Read and write safetensors files with plain file I/O and numpy (no torch, no mmap).

Reading a tensor is one `readinto` of its bytes into a fresh numpy array. We do
not memory-map the file: mapped pages that were touched stay in the process's
resident set until the map is closed, which would count a whole checkpoint on
top of the loaded parameters. bfloat16 is numpy's `ml_dtypes.bfloat16`.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Iterable

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class SafetensorsFile:
    """Tensor index of one `.safetensors` file; `get(name)` reads a single tensor."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no such safetensors file")
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError(f"{path}: truncated safetensors header")
            (size,) = struct.unpack("<Q", raw)
            if size > 100_000_000:
                raise ValueError(f"{path}: implausible safetensors header size {size}")
            try:
                header = json.loads(f.read(size))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: invalid safetensors header ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + size
        self._entries = header
        file_size = os.path.getsize(path)
        for name, entry in header.items():
            if entry.get("dtype") not in _DTYPES:
                raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {entry.get('dtype')!r}")
            start, end = entry["data_offsets"]
            want = int(np.prod(entry["shape"], dtype=np.int64)) * _DTYPES[entry["dtype"]].itemsize
            if end - start != want or self._data_start + end > file_size:
                raise ValueError(f"{path}: tensor {name!r} has inconsistent data offsets (file truncated?)")

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple:
        return tuple(self._entries[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        start, end = entry["data_offsets"]
        out = np.empty(entry["shape"], _DTYPES[entry["dtype"]])
        with open(self.path, "rb") as f:
            f.seek(self._data_start + start)
            view = memoryview(out.reshape(-1).view(np.uint8))
            if f.readinto(view) != end - start:
                raise ValueError(f"{self.path}: tensor {name!r} is truncated")
        return out


def write_safetensors(path: str, tensors: Iterable[tuple[str, np.ndarray]], metadata: dict | None = None) -> None:
    """Write `(name, array)` pairs; arrays are produced lazily and written one at a time.

    The header needs every shape up front, so `tensors` is iterated twice: pass a
    re-iterable (a list of names with a lazy getter, see `LazyTensors`).
    """
    items = list(tensors) if not isinstance(tensors, LazyTensors) else tensors
    header, offset = {}, 0
    for name, shape, dtype in (items.specs() if isinstance(items, LazyTensors)
                               else [(n, a.shape, a.dtype) for n, a in items]):
        dtype = np.dtype(dtype)
        if dtype not in _NAMES:
            raise ValueError(f"{path}: cannot write tensor {name!r} of dtype {dtype}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep tensor data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, array in (items.arrays() if isinstance(items, LazyTensors) else items):
            array = np.ascontiguousarray(array)
            expect = header[name]
            if list(array.shape) != expect["shape"] or _NAMES[array.dtype] != expect["dtype"]:
                raise ValueError(f"{path}: tensor {name!r} changed shape or dtype while writing")
            f.write(memoryview(array.reshape(-1).view(np.uint8)))
            del array


class LazyTensors:
    """Names with shapes/dtypes known up front and arrays produced one at a time by `get(name)`."""

    def __init__(self, specs: list[tuple[str, tuple, np.dtype]], get):
        self._specs, self._get = specs, get

    def specs(self):
        return self._specs

    def arrays(self):
        for name, _, _ in self._specs:
            yield name, self._get(name)
