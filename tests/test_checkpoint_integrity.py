"""Loads that would be silently wrong are errors: a pjax-native copy with flipped bytes fails its per-tensor
checksum, a truncated or deleted data file is one CheckpointError naming the file, and NaN / inf weights
are found on device (one jitted pass) and named, in Hugging Face targets, native copies and heads."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf

import pjax
from pjax.checkpoint.native import save_native_target
from pjax.checkpoint.safetensors import SafetensorsFile, save_file
from pjax.config import LayerSpec, ModelConfig, RopeSpec
from pjax.models.drafter import DrafterConfig

ROOT = Path(__file__).resolve().parents[1]
QK = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tiny_llama"
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    tf.LlamaForCausalLM(cfg).float().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def native_dir(hf_dir, tmp_path_factory):
    target = pjax.load_target(hf_dir, dtype=jnp.float32)
    return save_native_target(target, json.loads((hf_dir / "config.json").read_text()),
                              tmp_path_factory.mktemp("n") / "native")


def data_files(native: Path) -> list:
    """The orbax data files of a native copy, largest first."""
    files = [p for p in (native / "params").rglob("*") if p.is_file() and p.parent.name == "d"]
    return sorted(files, key=lambda p: -p.stat().st_size)


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def same_params(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a.params),
                                                                          jax.tree.leaves(b.params)))


# ------------------------------------------------------------------------------------------- checksums
def test_native_copy_records_checksums(native_dir):
    from pjax.checkpoint import integrity
    marker = json.loads((native_dir / "pjax_target.json").read_text())
    assert marker["version"] == 2 and marker["checksum"] == integrity.CHECKSUM
    assert "layers.0.self_attn.q_proj.kernel" in marker["checksums"]
    assert all(len(v) == 16 for v in marker["checksums"].values())
    assert {f for f in marker["files"]} == {str(p.relative_to(native_dir)) for p in native_dir.rglob("*")
                                            if p.is_file() and p.parts[len(native_dir.parts)] == "params"}


def test_flipped_bytes_fail_the_checksum(hf_dir, native_dir, tmp_path):
    ref = pjax.load_target(native_dir, dtype=jnp.float32)
    bad = copy(native_dir, tmp_path / "flipped")
    f = data_files(bad)[0]
    b = bytearray(f.read_bytes())
    mid = len(b) // 2
    b[mid:mid + 64] = bytes(x ^ 0xFF for x in b[mid:mid + 64])
    f.write_bytes(bytes(b))
    # the damage decodes: values change (flipped exponent bits may read as NaN / inf, hence no finite check)
    changed = pjax.load_target(bad, dtype=jnp.float32, verify=False, check_finite=False)
    assert not same_params(ref, changed)
    with pytest.raises(pjax.CheckpointError, match=r"flipped/params: tensor '[\w.]+' fails its checksum "
                                                   r"\(stored [0-9a-f]{16}, read [0-9a-f]{16}\)"):
        pjax.load_target(bad, dtype=jnp.float32)


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_truncated_or_deleted_data_file(native_dir, tmp_path, damage):
    bad = copy(native_dir, tmp_path / "bad")
    f = data_files(bad)[0]
    rel = f.relative_to(bad)
    if damage == "truncate":
        size = f.stat().st_size
        f.write_bytes(f.read_bytes()[:size // 2])
        match = rf"bad/{rel}: {size // 2} bytes, expected {size} \(truncated or damaged copy\)"
    else:
        f.unlink()
        match = rf"bad/{rel}: missing \(incomplete copy\)"
    for verify in (True, False):
        with pytest.raises(pjax.CheckpointError, match=match):
            pjax.load_target(bad, dtype=jnp.float32, verify=verify)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "convert", "inspect", str(bad)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert [ln for ln in r.stderr.splitlines() if ln.strip()] == [f"error: {bad / rel}: " + (
        f"{size // 2} bytes, expected {size} (truncated or damaged copy)" if damage == "truncate"
        else "missing (incomplete copy)")]


def test_copy_without_checksums_needs_verify_false(native_dir, tmp_path):
    old = copy(native_dir, tmp_path / "old")
    marker = json.loads((old / "pjax_target.json").read_text())
    for k in ("checksum", "checksums", "files"):
        marker.pop(k)
    marker["version"] = 1
    (old / "pjax_target.json").write_text(json.dumps(marker))
    with pytest.raises(pjax.CheckpointError, match=r"version 1 copy has no checksums.*verify=False / --no-verify"):
        pjax.load_target(old, dtype=jnp.float32)
    assert same_params(pjax.load_target(old, dtype=jnp.float32, verify=False),
                       pjax.load_target(native_dir, dtype=jnp.float32))


def test_checksum_is_positional_and_dtype_exact():
    from pjax.checkpoint import integrity
    x = jnp.arange(64, dtype=jnp.float32).reshape(8, 8)
    swapped = x.at[0, 0].set(1.0).at[0, 1].set(0.0)
    bits = jax.lax.bitcast_convert_type(x, jnp.int32).at[3, 3].add(1)
    one_ulp = jax.lax.bitcast_convert_type(bits, jnp.float32)
    sums = integrity.checksums([x, swapped, one_ulp, x.astype(jnp.bfloat16), jnp.zeros(5, jnp.int8),
                                jnp.ones(3, bool), x.T, x])
    assert len(set(sums[:-1])) == 7 and sums[0] == sums[-1]
    # the same bits give the same checksum on any backend: integer arithmetic modulo 2**32 only
    assert sums[0] == integrity.checksums([np.arange(64, dtype=np.float32).reshape(8, 8)])[0]


# ---------------------------------------------------------------------------------------- finite check
def with_tensor(src: Path, dst: Path, name, fn) -> Path:
    shutil.copytree(src, dst)
    f = SafetensorsFile(dst / "model.safetensors")
    tensors = {k: np.array(f.get(k)) for k in f.keys()}
    tensors[name] = fn(tensors[name])
    save_file(tensors, dst / "model.safetensors")
    return dst


def poke(value, at=(3, 5)):
    def fn(a):
        a = a.copy()
        a[at] = value
        return a
    return fn


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_hf_target_non_finite_is_named(hf_dir, tmp_path, value):
    d = with_tensor(hf_dir, tmp_path / "nan", QK, poke(value))
    with pytest.raises(pjax.CheckpointError, match=rf"nan/model\.safetensors: tensor '{QK}' has 1 non-finite "
                                                   r"value\(s\) \(NaN / inf\) as float32"):
        pjax.load_target(d, dtype=jnp.float32)
    t = pjax.load_target(d, dtype=jnp.float32, check_finite=False)
    assert not np.isfinite(np.asarray(t.params["layers"][0]["self_attn"]["q_proj"]["kernel"])).all()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_overflow_in_the_requested_dtype_is_named(hf_dir, tmp_path):
    d = with_tensor(hf_dir, tmp_path / "big", "model.norm.weight", poke(1e6, at=(4,)))
    pjax.load_target(d, dtype=jnp.float32)
    with pytest.raises(pjax.CheckpointError, match=r"tensor 'model\.norm\.weight' has 1 non-finite .* as float16"):
        pjax.load_target(d, dtype=jnp.float16)


def test_native_copy_non_finite_is_named(hf_dir, tmp_path):
    d = with_tensor(hf_dir, tmp_path / "nan", QK, poke(np.nan))
    target = pjax.load_target(d, dtype=jnp.float32, check_finite=False)
    out = save_native_target(target, json.loads((d / "config.json").read_text()), tmp_path / "native")
    with pytest.raises(pjax.CheckpointError, match=r"native/params: tensor 'layers\.0\.self_attn\.q_proj\.kernel' "
                                                   r"has 1 non-finite value\(s\)"):
        pjax.load_target(out, dtype=jnp.float32)
    pjax.load_target(out, dtype=jnp.float32, check_finite=False)


def test_head_non_finite_is_named(tmp_path):
    layer = ModelConfig("llama", 61, 32, 40, 4, (LayerSpec(8, 2, RopeSpec(theta=10000.0)),), rms_norm_eps=1e-5)
    cfg = DrafterConfig(layer=layer, num_aux=3, target_hidden_size=32, draft_vocab_size=61, mask_token_id=60,
                        aux_layer_ids=(0, 1, 2))
    good = pjax.init_drafter(cfg, jax.random.key(0), jnp.float32, scale=0.2)
    d = good.__class__(good.config, good.graphdef, {**good.params, "fc": {"kernel": good.params["fc"]["kernel"].at[
        2, 2].set(jnp.inf)}}, good.d2t)
    with pytest.raises(pjax.CheckpointError, match=r"head: not written: tensor 'fc\.weight' has 1 non-finite .*"
                                                   r"a head with NaN / inf weights is never saved"):
        pjax.save_drafter(d, tmp_path / "head", dtype="float32")
    assert not (tmp_path / "head").exists()
    saved = pjax.save_drafter(good, tmp_path / "good", dtype="float32")
    path = with_tensor(saved, tmp_path / "head", "fc.weight", poke(np.inf, at=(2, 2)))
    with pytest.raises(pjax.CheckpointError, match=r"head/model\.safetensors: tensor 'fc\.weight' has 1 non-finite"):
        pjax.load_drafter(path, dtype=jnp.float32)
    pjax.load_drafter(path, dtype=jnp.float32, check_finite=False)


def test_finite_check_is_one_device_pass(hf_dir, monkeypatch):
    """All leaves in one jitted reduction (one call, device arrays in), no host numpy scan."""
    from pjax.checkpoint import integrity
    calls = []
    real = integrity.finite_flags

    def spy(leaves):
        calls.append([type(x) for x in leaves])
        return real(leaves)
    monkeypatch.setattr(integrity, "finite_flags", spy)

    def no_host_scan(*a, **k):
        raise AssertionError("host numpy scan")
    monkeypatch.setattr(np, "isfinite", no_host_scan)
    pjax.load_target(hf_dir, dtype=jnp.float32)
    assert len(calls) == 1 and all(issubclass(t, jax.Array) for t in calls[0]) and len(calls[0]) == 21


def test_finite_flags_every_dtype():
    from pjax.checkpoint import integrity
    x = np.zeros((5, 7), np.float32)
    leaves = [jnp.asarray(x, dt).at[2, 3].set(v) for dt in (jnp.float32, jnp.bfloat16, jnp.float16)
              for v in (0.5, np.nan, np.inf, -np.inf)]
    leaves += [jnp.zeros((0, 3), jnp.float32), jnp.arange(4), jnp.ones(3, bool)]
    flags = np.asarray(integrity.finite_flags(leaves))
    np.testing.assert_array_equal(flags, [True, False, False, False] * 3 + [True] * 3)
    np.testing.assert_array_equal(np.asarray(integrity.nonfinite_counts(leaves[:4])), [0, 1, 1, 1])


def test_finite_flags_find_one_bad_value_anywhere():
    """One NaN / inf at the start, middle or end of a tensor of any size is found in every floating dtype (a max |x|
    reduction drops a NaN in float32 arrays of a few thousand elements on XLA's CPU backend)."""
    import ml_dtypes
    from pjax.checkpoint import integrity
    dtypes = (jnp.float32, jnp.bfloat16, jnp.float16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)
    leaves, want = [], []
    for dt in dtypes:
        for n in (1, 7, 4099, 11_001, 65_537):
            for at in sorted({0, n // 2, n - 1}):
                for v in (np.nan, np.inf, -np.inf):  # built in numpy: no program per shape (float8_e4m3fn: inf -> nan)
                    x = np.zeros((n,), dt)
                    x[at] = v
                    leaves.append(jnp.asarray(x))
                    want.append(False)
        leaves.append(jnp.ones((11_001,), dt))
        want.append(True)
    np.testing.assert_array_equal(np.asarray(integrity.finite_flags(leaves)), want)
