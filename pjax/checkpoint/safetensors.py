"""Strict safetensors files: `SafetensorsFile` (one file), `Checkpoint` (a model directory), `save_file`.

What the `safetensors` library does here, and what is our own:
- Tensor bytes are read lazily, one tensor at a time, with `safetensors.safe_open(path, framework="numpy")`
  for every dtype its numpy framework returns (F64 / F32 / F16 / BF16, the integers, BOOL). FP8 (F8_E4M3,
  F8_E5M2) and E8M0 (F8_E8M0) tensors it cannot return (safetensors 0.8.0's numpy framework raises
  AttributeError: numpy has no float8 types) are read here as memory-mapped `ml_dtypes` views.
- Files are written with `safetensors.numpy.save_file` (it stores all the dtypes above), into a temporary
  file that is then renamed over the target (atomic); arrays are made C-contiguous first, since the library
  writes an array's raw buffer whatever its strides.
- The header is parsed and validated here, before the library opens the file, for precise diagnostics that
  name the file and the entry: the library reports "invalid offset for tensor `b`", "incomplete metadata" or
  a JSON deserialisation error for all of these. The checks equal the library's rules (so no file passes
  here and fails there): a JSON object of entries `{"dtype": str, "shape": [int >= 0], "data_offsets":
  [begin, end]}` plus an optional `__metadata__` of strings; each entry's byte count equals its shape times
  its dtype size; the entries, ordered by offset, tile the data exactly (no overlap, no gap, no byte after
  the last one); the header is at most 100 MB.
"""
from __future__ import annotations

import json
import os
import secrets
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

from pjax._io import termination_raises
from pjax.checkpoint.errors import CheckpointError

__all__ = ["Checkpoint", "DTYPES", "SafetensorsFile", "save_file"]

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
# Dtypes read through the library's numpy framework; the others are memory-mapped views.
LIBRARY_DTYPES = frozenset(DTYPES) - {"F8_E4M3", "F8_E5M2", "F8_E8M0"}
MAX_HEADER = 100_000_000  # the library's limit


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _entry(path: Path, name: str, info) -> tuple[str, list, int, int]:
    """Validated (dtype, shape, begin, end) of one header entry."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where}: expected an object with dtype, shape, data_offsets, found "
                              f"{type(info).__name__} {json.dumps(info)[:80]}")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in info:
            raise CheckpointError(f"{where}: {key!r} is missing")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str):
        raise CheckpointError(f"{where}: dtype {json.dumps(dtype)} is not a string")
    if dtype not in DTYPES:
        raise CheckpointError(f"{where} has unsupported dtype {dtype!r} (supported: {sorted(DTYPES)})")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CheckpointError(f"{where}: shape {json.dumps(shape)} is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise CheckpointError(f"{where}: data_offsets {json.dumps(offsets)} is not two non-negative integers")
    begin, end = offsets
    if end < begin:
        raise CheckpointError(f"{where}: data_offsets {offsets} end before they begin")
    want = int(np.prod(shape, dtype=object)) * np.dtype(DTYPES[dtype]).itemsize
    if end - begin != want:
        raise CheckpointError(f"{where} occupies {end - begin} bytes, expected {want} for shape {shape} {dtype}")
    return dtype, shape, begin, end


class SafetensorsFile:
    """Lazy, validated view of one .safetensors file: `keys()`, `shape(name)`, `dtype(name)`, `get(name)`."""

    def __init__(self, path):
        self.path = Path(path)
        size = self.path.stat().st_size
        if size < 8:
            raise CheckpointError(f"{self.path}: file is {size} bytes, too short for a safetensors header")
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if 8 + n > size:
                raise CheckpointError(f"{self.path}: header claims {n} bytes but the file has {size} "
                                      "(truncated file?)")
            if n > MAX_HEADER:
                raise CheckpointError(f"{self.path}: header claims {n} bytes, more than the {MAX_HEADER} allowed")
            raw = f.read(n)
        try:
            header = json.loads(raw)
        except ValueError as e:
            raise CheckpointError(f"{self.path}: header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            kind = {list: "array", str: "string", type(None): "null", bool: "boolean"}.get(type(header), "number")
            raise CheckpointError(f"{self.path}: header is a JSON {kind}, expected an object")
        metadata = header.pop("__metadata__", None)
        metadata = {} if metadata is None else metadata
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise CheckpointError(f"{self.path}: __metadata__ must map strings to strings, found "
                                  f"{json.dumps(metadata)[:120]}")
        self.metadata = metadata
        entries = {name: _entry(self.path, name, info) for name, info in header.items()}
        pos, last = 0, None
        for name, (_, _, begin, end) in sorted(entries.items(), key=lambda kv: (kv[1][2], kv[1][3], kv[0])):
            if begin < pos:
                lb, le = entries[last][2:]
                raise CheckpointError(f"{self.path}: tensor {name!r} (bytes [{begin}, {end})) overlaps tensor "
                                      f"{last!r} (bytes [{lb}, {le}))")
            if begin > pos:
                raise CheckpointError(f"{self.path}: bytes [{pos}, {begin}) of the data belong to no tensor (a gap "
                                      f"before tensor {name!r})")
            if end > pos or last is None:
                pos, last = end, name
        self.data_start = 8 + n
        if self.data_start + pos > size:
            raise CheckpointError(f"{self.path}: tensors need {self.data_start + pos} bytes but the file has "
                                  f"{size} (truncated file?)")
        if self.data_start + pos < size:
            raise CheckpointError(f"{self.path}: {size - self.data_start - pos} bytes after the last tensor (expected "
                                  f"the file to end at byte {self.data_start + pos})")
        self.header = {name: {"dtype": d, "shape": s, "data_offsets": [b, e]}
                       for name, (d, s, b, e) in entries.items()}
        self._lib = None
        self._mm = None

    def keys(self):
        return self.header.keys()

    def __contains__(self, name):
        return name in self.header

    def _info(self, name) -> dict:
        if name not in self.header:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in the file")
        return self.header[name]

    def shape(self, name) -> tuple[int, ...]:
        return tuple(self._info(name)["shape"])

    def dtype(self, name):
        return np.dtype(DTYPES[self._info(name)["dtype"]])

    def nbytes(self, name) -> int:
        b, e = self._info(name)["data_offsets"]
        return e - b

    def get(self, name) -> np.ndarray:
        """Tensor `name` as a numpy array of its stored dtype (a copy, or a read-only memory map for FP8)."""
        info = self._info(name)
        if info["dtype"] in LIBRARY_DTYPES:
            try:
                if self._lib is None:
                    self._lib = safetensors.safe_open(str(self.path), framework="numpy")
                return self._lib.get_tensor(name)
            except (safetensors.SafetensorError, OSError) as e:
                raise CheckpointError(f"{self.path}: tensor {name!r} could not be read ({e})") from None
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        b, e = info["data_offsets"]
        raw = self._mm[self.data_start + b:self.data_start + e]
        return raw.view(DTYPES[info["dtype"]]).reshape(info["shape"])


class Checkpoint:
    """All tensors of a Hugging Face model directory (single file or sharded index)."""

    def __init__(self, directory, stem: str = "model"):
        self.dir = Path(directory)
        single, index = self.dir / f"{stem}.safetensors", self.dir / f"{stem}.safetensors.index.json"
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, str] = {}
        if index.exists():
            try:
                spec = json.loads(index.read_text())
            except ValueError as e:
                raise CheckpointError(f"{index}: not valid JSON ({e})") from None
            if not isinstance(spec, dict) or "weight_map" not in spec:
                raise CheckpointError(f"{index}: expected an object with a 'weight_map'")
            weight_map = spec["weight_map"]
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: weight_map must be an object (tensor name -> file name)")
            for name, fname in weight_map.items():
                if not isinstance(fname, str) or not fname or Path(fname).name != fname:
                    raise CheckpointError(f"{index}: weight_map entry {name!r} -> {json.dumps(fname)} is not a file "
                                          "name in the directory")
            for fname in sorted(set(weight_map.values())):
                if not (self.dir / fname).exists():
                    raise CheckpointError(f"{index}: shard {fname!r} is missing")
                self.files[fname] = SafetensorsFile(self.dir / fname)
            for name, fname in weight_map.items():
                if name not in self.files[fname].header:
                    raise CheckpointError(f"{self.dir / fname}: tensor {name!r} listed in the index is absent")
                self.where[name] = fname
        elif single.exists():
            self.files[single.name] = SafetensorsFile(single)
            self.where = {k: single.name for k in self.files[single.name].keys()}
        else:
            raise CheckpointError(f"{self.dir}: neither {single.name} nor {index.name} found")

    def keys(self):
        return self.where.keys()

    def __contains__(self, name):
        return name in self.where

    def file_of(self, name) -> Path:
        return self.dir / self.where[name]

    def shape(self, name):
        return self.files[self.where[name]].shape(name)

    def dtype(self, name):
        return self.files[self.where[name]].dtype(name)

    def get(self, name) -> np.ndarray:
        if name not in self.where:
            raise CheckpointError(f"{self.dir}: tensor {name!r} is missing")
        return self.files[self.where[name]].get(name)


def save_file(tensors: dict[str, np.ndarray], path, metadata: dict | None = None) -> None:
    """Write a safetensors file atomically (temporary file beside it, then rename); metadata values become strings."""
    path = Path(path)
    arrays = {}
    for name in sorted(tensors):
        arr = np.asarray(tensors[name])
        if arr.dtype not in NAMES:
            raise CheckpointError(f"{path}: cannot store tensor {name!r} of dtype {arr.dtype}")
        arrays[name] = arr if arr.flags.c_contiguous else arr.copy(order="C")
    meta = {str(k): str(v) for k, v in metadata.items()} if metadata else None
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with termination_raises():
            safetensors.numpy.save_file(arrays, tmp, metadata=meta)
            os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
