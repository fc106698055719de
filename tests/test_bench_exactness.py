"""Exactness of speculative outputs against plain decoding: the first mismatch, the near-tie rule on constructed
logits, and the target's next-token logits used for it (against `pjax.models.target_logits`)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pjax
from pjax.bench.exactness import (NEAR_TIE_EPS, classify, compare_outputs, first_mismatch, near_tie_threshold,
                                  next_token_logits)
from pjax.config import LayerSpec, ModelConfig, RopeSpec
from pjax.models import target_logits


def test_first_mismatch():
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([], []) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert first_mismatch([7], [8]) == 0
    assert first_mismatch([1, 2], [1, 2, 3]) == 2  # one output ended early
    assert first_mismatch([1, 2, 3, 4], [1, 2]) == 2


def test_threshold_scales_with_dtype_and_logit():
    assert near_tie_threshold(10.0, jnp.bfloat16) == pytest.approx(NEAR_TIE_EPS * 2 ** -7 * 10)
    assert near_tie_threshold(-10.0, jnp.bfloat16) == pytest.approx(NEAR_TIE_EPS * 2 ** -7 * 10)
    assert near_tie_threshold(0.25, jnp.bfloat16) == pytest.approx(NEAR_TIE_EPS * 2 ** -7)  # floor at |l| = 1
    assert near_tie_threshold(10.0, jnp.float16) == pytest.approx(NEAR_TIE_EPS * 2 ** -10 * 10)
    assert near_tie_threshold(10.0, jnp.float32) == pytest.approx(NEAR_TIE_EPS * 2 ** -23 * 10)
    assert near_tie_threshold(10.0, jnp.bfloat16, eps_multiple=1) == pytest.approx(2 ** -7 * 10)


def test_classify_constructed_logits():
    logits = np.full(16, -5.0, np.float32)
    logits[[3, 7, 9, 11]] = [12.0, 11.9, 11.85, 8.0]
    # the top two 0.1 apart: a flip bf16 rounding can cause (threshold 0.75 at 12), not float32's (1.1e-5)
    bf = classify(logits, 7, 3, jnp.bfloat16)
    assert bf["near_tie"] and bf["margin"] == pytest.approx(0.1, abs=1e-5) and bf["top_logit"] == 12.0
    assert bf["gap"] == pytest.approx(0.1, abs=1e-5) and bf["threshold"] == pytest.approx(8 * 2 ** -7 * 12)
    assert not classify(logits, 7, 3, jnp.float32)["near_tie"]
    # a three-way tie: the third token is within rounding too
    assert classify(logits, 9, 3, jnp.bfloat16)["near_tie"]
    # a token 4 below the top is no rounding effect, whatever the margin of the top two
    far = classify(logits, 11, 3, jnp.bfloat16)
    assert not far["near_tie"] and far["gap"] == pytest.approx(4.0) and far["margin"] == pytest.approx(0.1, abs=1e-5)
    # symmetric in the two tokens, and a wider threshold turns it into a tie
    assert classify(logits, 3, 11, jnp.bfloat16) == far
    assert classify(logits, 11, 3, jnp.bfloat16, eps_multiple=64)["near_tie"]


def test_compare_outputs_calls_the_logits_on_the_shared_prefix():
    prompts = [[5, 6], [7], [8, 9, 10]]
    ref = [[1, 2, 3], [4, 4, 4], [1, 1]]
    outs = [[1, 2, 3], [4, 9, 4], [1, 1, 2]]
    seen = []

    def logits_fn(prefix):
        seen.append(prefix)
        lg = np.zeros(12, np.float32)
        lg[[4, 9]] = [3.0, 2.99]
        return lg
    exact, found = compare_outputs(outs, ref, prompts, ["a", "b", "c"], logits_fn, jnp.bfloat16)
    assert exact == 1 and [m.prompt_id for m in found] == ["b", "c"]
    assert seen == [[7, 4]]  # prompt + the common output, once; not for the length mismatch
    b, c = found
    assert (b.position, b.token, b.reference_token, b.near_tie) == (1, 9, 4, True)
    assert b.margin == pytest.approx(0.01, abs=1e-5)
    assert (c.position, c.token, c.reference_token, c.near_tie, c.margin) == (2, 2, None, None, None)
    _, plain = compare_outputs(outs, ref, prompts, ["a", "b", "c"], None, jnp.bfloat16)
    assert plain[0].margin is None and plain[0].position == 1
    with pytest.raises(ValueError):
        compare_outputs(outs, ref[:2], prompts, ["a", "b", "c"], None, jnp.bfloat16)


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig("llama", 97, 32, 64, 4, tuple(LayerSpec(8, 2, RopeSpec(theta=10000.0)) for _ in range(2)),
                      rms_norm_eps=1e-5)
    return pjax.init_target(cfg, jax.random.key(0), scale=0.2)


@pytest.mark.parametrize("n", [1, 5, 16, 17])
def test_next_token_logits_is_the_last_row_of_a_full_forward(tiny, n):
    ids = list(np.random.default_rng(n).integers(0, 97, n))
    want = np.asarray(target_logits(tiny, jnp.asarray([ids], jnp.int32)))[0, -1]
    got = next_token_logits(tiny, ids)
    assert got.shape == (97,) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_real_mismatch_is_not_a_near_tie(tiny):
    """An output that takes the target's second choice where plain greedy took the first: the margin read from
    the target is the real top-2 gap, and in float32 it is far beyond rounding (a bug the check reports)."""
    prompt = [3, 14, 15, 92, 65]
    ref, ids = [], list(prompt)
    for _ in range(4):
        ref.append(int(np.argmax(next_token_logits(tiny, ids))))
        ids.append(ref[-1])
    lg = next_token_logits(tiny, prompt + ref[:2])
    second = int(np.argsort(lg)[-2])
    bad = ref[:2] + [second, ref[3]]
    exact, (m,) = compare_outputs([bad], [ref], [prompt], ["p"], lambda p: next_token_logits(tiny, p), jnp.float32)
    assert exact == 0 and (m.position, m.token, m.reference_token) == (2, second, ref[2])
    top2 = np.sort(lg)[-2:]
    assert m.margin == pytest.approx(float(top2[1] - top2[0]), rel=1e-5) and m.gap == pytest.approx(m.margin)
    assert m.margin > m.threshold and m.near_tie is False
