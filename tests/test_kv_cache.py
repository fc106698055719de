"""LayerKV.write keeps exactly the valid in-range entries (batch 1 and batched, one and several new tokens), against a
NumPy reference."""
import jax.numpy as jnp
import numpy as np
import pytest

from pjax.models.cache import LayerKV


def reference(buf, new, positions, valid):
    out = buf.copy()
    for b in range(positions.shape[0]):
        for t in range(positions.shape[1]):
            p = positions[b, t]
            if valid[b, t] and 0 <= p < buf.shape[1]:
                out[b, p] = new[b, t]
    return out


@pytest.mark.parametrize("b,t", [(1, 1), (1, 3), (2, 1), (3, 2)])
@pytest.mark.parametrize("case", ["in-range", "invalid", "negative", "past-end", "last"])
def test_write_keeps_valid_in_range_entries(b, t, case):
    rng = np.random.default_rng(b * 10 + t)
    cap, nkv, hd = 8, 2, 4
    k0, v0 = (rng.standard_normal((b, cap, nkv, hd)).astype(np.float32) for _ in range(2))
    kn, vn = (rng.standard_normal((b, t, nkv, hd)).astype(np.float32) for _ in range(2))
    positions = np.stack([rng.permutation(cap - 1)[:t] for _ in range(b)]).astype(np.int32)
    valid = np.ones((b, t), bool)
    if case == "invalid":
        valid[:, 0] = False
    elif case == "negative":
        positions[:, 0] = -1
    elif case == "past-end":
        positions[:, -1] = cap + 2
    elif case == "last":
        positions[:, -1] = cap - 1
    kv = LayerKV(jnp.asarray(k0, jnp.bfloat16), jnp.asarray(v0, jnp.bfloat16))
    out = kv.write(jnp.asarray(kn), jnp.asarray(vn), jnp.asarray(positions), jnp.asarray(valid))
    bf = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))  # noqa: E731
    np.testing.assert_array_equal(np.asarray(out.k.astype(jnp.float32)), reference(bf(k0), bf(kn), positions, valid))
    np.testing.assert_array_equal(np.asarray(out.v.astype(jnp.float32)), reference(bf(v0), bf(vn), positions, valid))
    assert out.k.dtype == jnp.bfloat16
    no_mask = kv.write(jnp.asarray(kn), jnp.asarray(vn), jnp.asarray(positions))
    np.testing.assert_array_equal(np.asarray(no_mask.k.astype(jnp.float32)),
                                  reference(bf(k0), bf(kn), positions, np.ones_like(valid)))


def test_write_to_given_rows():
    """rows [1, T]: each new token goes to its own cache row (the packed prefill); invalid tokens write nothing."""
    rng = np.random.default_rng(7)
    b, cap, nkv, hd = 3, 6, 2, 4
    k0 = rng.standard_normal((b, cap, nkv, hd)).astype(np.float32)
    kn = rng.standard_normal((1, 7, nkv, hd)).astype(np.float32)
    rows = np.array([[0, 0, 2, 2, 2, 1, 1]], np.int32)
    positions = np.array([[0, 1, 0, 1, 2, 0, 1]], np.int32)
    valid = np.array([[True, True, True, True, True, True, False]])
    out = LayerKV(jnp.asarray(k0), jnp.asarray(k0)).write(jnp.asarray(kn), jnp.asarray(kn), jnp.asarray(positions),
                                                          jnp.asarray(valid), jnp.asarray(rows))
    want = k0.copy()
    for t in range(6):
        want[rows[0, t], positions[0, t]] = kn[0, t]
    np.testing.assert_array_equal(np.asarray(out.k), want)
    np.testing.assert_array_equal(np.asarray(out.v), want)
