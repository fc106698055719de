"""safetensors files: every malformed header is a CheckpointError naming the file and the entry (never a
KeyError / TypeError or a silent load); the writer's files read back bit-exactly, also through the
`safetensors` library itself; `convert inspect` reports a bad file in one line."""
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors
import torch
from safetensors.torch import load_file as torch_load_file

import pjax
from pjax.checkpoint.cli import main as cli_main
from pjax.checkpoint.safetensors import Checkpoint, SafetensorsFile, save_file

ROOT = Path(__file__).resolve().parents[1]
DATA = np.arange(4, dtype=np.float32).tobytes()  # 16 bytes


def write_raw(path, header, data=DATA, *, pad=True):
    """A safetensors file from a header object (any JSON value) or raw header bytes, then `data`."""
    hb = header if isinstance(header, bytes) else json.dumps(header).encode()
    if pad:
        hb += b" " * (-len(hb) % 8)
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + data)
    return path


def f32(shape, begin, end):
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


BAD = [
    ("no_offsets", {"a": {"dtype": "F32", "shape": [4]}}, DATA, r"tensor 'a': 'data_offsets' is missing"),
    ("list_header", [f32([4], 0, 16)], DATA, r"header is a JSON array, expected an object"),
    ("shared_bytes", {"a": f32([2], 0, 8), "b": f32([2], 0, 8), "c": f32([2], 8, 16)}, DATA,
     r"tensor '[ab]' \(bytes \[0, 8\)\) overlaps tensor '[ab]' \(bytes \[0, 8\)\)"),
    ("overlap", {"a": f32([2], 0, 8), "b": f32([2], 4, 12), "c": f32([1], 12, 16)}, DATA,
     r"tensor 'b' \(bytes \[4, 12\)\) overlaps tensor 'a' \(bytes \[0, 8\)\)"),
    ("reversed_offsets", {"a": f32([0], 16, 0)}, DATA, r"tensor 'a': data_offsets \[16, 0\] end before they begin"),
    ("dtype_not_string", {"a": {"dtype": 3, "shape": [4], "data_offsets": [0, 16]}}, DATA,
     r"tensor 'a': dtype 3 is not a string"),
    ("negative_shape", {"a": {"dtype": "F32", "shape": [-2, -2], "data_offsets": [0, 16]}}, DATA,
     r"tensor 'a': shape \[-2, -2\] is not a list of non-negative integers"),
    ("float_shape", {"a": {"dtype": "F32", "shape": [4.0], "data_offsets": [0, 16]}}, DATA,
     r"tensor 'a': shape \[4.0\] is not a list of non-negative integers"),
    ("offsets_not_pair", {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0]}}, DATA,
     r"tensor 'a': data_offsets \[0\] is not two non-negative integers"),
    ("entry_not_object", {"a": [1, 2]}, DATA, r"tensor 'a': expected an object with dtype, shape, data_offsets"),
    ("unknown_dtype", {"a": {"dtype": "F7", "shape": [4], "data_offsets": [0, 16]}}, DATA,
     r"tensor 'a' has unsupported dtype 'F7'"),
    ("size_mismatch", {"a": f32([3], 0, 16)}, DATA, r"tensor 'a' occupies 16 bytes, expected 12 for shape \[3\] F32"),
    ("gap", {"a": f32([2], 0, 8), "b": f32([1], 12, 16)}, DATA, r"bytes \[8, 12\) of the data belong to no tensor"),
    ("trailing", {"a": f32([2], 0, 8)}, DATA, r"8 bytes after the last tensor"),
    ("truncated", {"a": f32([4], 0, 16)}, DATA[:12], r"tensors need \d+ bytes but the file has \d+ \(truncated"),
    ("metadata_not_strings", {"__metadata__": {"format": 1}, "a": f32([4], 0, 16)}, DATA,
     r"__metadata__ must map strings to strings"),
    ("not_json", b"{not json", DATA, r"header is not valid JSON"),
]


@pytest.mark.parametrize("name, header, data, match", BAD, ids=[b[0] for b in BAD])
def test_malformed_header_is_a_checkpoint_error(tmp_path, name, header, data, match):
    path = write_raw(tmp_path / "model.safetensors", header, data)
    with pytest.raises(pjax.CheckpointError, match=r"model\.safetensors: " + match):
        SafetensorsFile(path)


def test_header_length_beyond_file_and_limit(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(pjax.CheckpointError, match=r"model\.safetensors: header claims \d+ bytes"):
        SafetensorsFile(path)


def test_malformed_index(tmp_path):
    save_file({"a": np.zeros(2, np.float32)}, tmp_path / "model-1.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    for bad, match in (([1], "expected an object with a 'weight_map'"),
                       ({"weight_map": {"a": 3}}, r"weight_map entry 'a' -> 3 is not a file name"),
                       ({"weight_map": ["a"]}, "weight_map must be an object")):
        index.write_text(json.dumps(bad))
        with pytest.raises(pjax.CheckpointError, match=r"model\.safetensors\.index\.json: " + match):
            Checkpoint(tmp_path)


DTYPES = [np.float64, np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
          ml_dtypes.float8_e8m0fnu, np.int64, np.int32, np.int16, np.int8, np.uint64, np.uint32, np.uint16,
          np.uint8, np.bool_]


def test_round_trip_every_dtype(tmp_path):
    """Every dtype reads back bit-exactly (FP8 / E8M0 too, which the library's numpy framework cannot
    return), and the writer's file is valid for the safetensors library."""
    rng = np.random.default_rng(0)
    tensors = {}
    for i, dt in enumerate(DTYPES):
        shape = (3, 5) if i % 2 else (7,)
        raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dt).itemsize, dtype=np.uint8)
        arr = (raw % 2).astype(np.bool_) if dt is np.bool_ else raw.view(dt)
        tensors[f"t{i}.{np.dtype(dt).name}"] = arr.reshape(shape)
    tensors["empty"] = np.zeros((0, 4), np.float32)
    path = tmp_path / "model.safetensors"
    save_file(tensors, path, metadata={"format": "pt", "n": 3})
    f = SafetensorsFile(path)
    assert f.metadata == {"format": "pt", "n": "3"}
    for k, v in tensors.items():
        got = f.get(k)
        assert got.dtype == v.dtype and got.shape == v.shape, k
        np.testing.assert_array_equal(got.view(np.uint8), v.view(np.uint8))
    with safetensors.safe_open(path, framework="numpy") as lib:  # the library accepts the file
        assert set(lib.keys()) == set(tensors)
        np.testing.assert_array_equal(lib.get_tensor("t1.float32"), tensors["t1.float32"])
    tt = torch_load_file(path)
    assert tt["t4.float8_e4m3fn"].dtype == torch.float8_e4m3fn
    np.testing.assert_array_equal(tt["t4.float8_e4m3fn"].view(torch.uint8).numpy(),
                                  tensors["t4.float8_e4m3fn"].view(np.uint8))


def test_non_contiguous_arrays_are_written_in_logical_order(tmp_path):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    save_file({"t": a.T, "s": a[:, ::2]}, tmp_path / "x.safetensors")
    f = SafetensorsFile(tmp_path / "x.safetensors")
    np.testing.assert_array_equal(f.get("t"), a.T)
    np.testing.assert_array_equal(f.get("s"), a[:, ::2])


def test_unstorable_dtype(tmp_path):
    with pytest.raises(pjax.CheckpointError, match=r"x\.safetensors: cannot store tensor 'c' of dtype complex64"):
        save_file({"c": np.zeros(2, np.complex64)}, tmp_path / "x.safetensors")
    assert os.listdir(tmp_path) == []


@pytest.fixture(scope="module")
def bad_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    write_raw(d / "model.safetensors", [f32([4], 0, 16)])
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8, "hidden_size": 8,
                                               "intermediate_size": 8, "num_hidden_layers": 1,
                                               "num_attention_heads": 2, "num_key_value_heads": 1}))
    return d


def test_loaders_report_bad_files(bad_dir, capsys):
    with pytest.raises(pjax.CheckpointError, match="header is a JSON array"):
        pjax.load_target(bad_dir)
    assert cli_main(["inspect", str(bad_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "header is a JSON array" in err


def test_cli_inspect_bad_file_prints_one_line(bad_dir):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "convert", "inspect", str(bad_dir)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "model.safetensors: header is a JSON array" in lines[0], r.stderr
