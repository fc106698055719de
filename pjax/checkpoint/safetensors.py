"""Minimal, strict safetensors reader/writer on numpy memmaps (bf16 / fp8 through ml_dtypes).

The official bindings cannot return FP8 as numpy; parsing the header ourselves also lets us report
truncated or corrupt files precisely.
"""
from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

from pjax.checkpoint.errors import CheckpointError

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


class SafetensorsFile:
    """Lazy view of one .safetensors file: `keys()`, `shape(name)`, `dtype(name)`, `get(name)`."""

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
            try:
                header = json.loads(f.read(n))
            except ValueError as e:
                raise CheckpointError(f"{self.path}: header is not valid JSON ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self.header = header
        self.data_start = 8 + n
        end = max((info["data_offsets"][1] for info in header.values()), default=0)
        if self.data_start + end > size:
            raise CheckpointError(f"{self.path}: tensors need {self.data_start + end} bytes but the file has "
                                  f"{size} (truncated file?)")
        for name, info in header.items():
            if info.get("dtype") not in DTYPES:
                raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
            b, e = info["data_offsets"]
            want = int(np.prod(info["shape"], dtype=np.int64)) * np.dtype(DTYPES[info["dtype"]]).itemsize
            if e - b != want:
                raise CheckpointError(f"{self.path}: tensor {name!r} occupies {e - b} bytes, expected {want} "
                                      f"for shape {info['shape']} {info['dtype']}")
        self._mm = None

    def keys(self):
        return self.header.keys()

    def shape(self, name) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def dtype(self, name):
        return np.dtype(DTYPES[self.header[name]["dtype"]])

    def get(self, name) -> np.ndarray:
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        info = self.header[name]
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
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
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

    def get(self, name) -> np.ndarray:
        if name not in self.where:
            raise CheckpointError(f"{self.dir}: tensor {name!r} is missing")
        return self.files[self.where[name]].get(name)


def save_file(tensors: dict[str, np.ndarray], path, metadata: dict | None = None) -> None:
    """Write a safetensors file atomically (temporary file + rename)."""
    path = Path(path)
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if arr.dtype not in NAMES:
            raise CheckpointError(f"{path}: cannot store tensor {name!r} of dtype {arr.dtype}")
        data = arr.tobytes()
        header[name] = {"dtype": NAMES[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(hb)))
            f.write(hb)
            for b in blobs:
                f.write(b)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
