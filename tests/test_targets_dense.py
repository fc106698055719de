"""Llama and Qwen3 parity against transformers, cached extend, aux hidden states."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers as tf

import pjax
from pjax.models.cache import init_cache
from pjax.models.target import forward, logits_from_hidden
from tests.hf_utils import hf_logits, rel_err, save_tiny

LLAMA = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=8,
             num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256, rope_theta=500000.0,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 16})
QWEN3 = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=True)


@pytest.fixture(scope="module", params=["llama", "llama_tied", "qwen3"])
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3":
        model = save_tiny(tf.Qwen3ForCausalLM, tf.Qwen3Config(**QWEN3), path, init_std=0.1)
    else:
        kw = dict(LLAMA, tie_word_embeddings=request.param == "llama_tied")
        model = save_tiny(tf.LlamaForCausalLM, tf.LlamaConfig(**kw), path, init_std=0.1)
    return model, pjax.load_target(path, dtype=jnp.float32)


def test_logits_match_transformers(pair):
    model, target = pair
    ids = np.random.default_rng(0).integers(0, 97, (2, 40))
    ref = hf_logits(model, ids)
    got = np.asarray(pjax.models.target_logits(target, ids))
    assert rel_err(got, ref) <= 1e-4


def test_aux_hidden_states_match_transformers(pair):
    model, target = pair
    import torch
    ids = np.random.default_rng(1).integers(0, 97, (1, 12))
    with torch.no_grad():
        hs = model(torch.as_tensor(ids), output_hidden_states=True).hidden_states
    layer_ids = (0, 2, 4)
    out = jax.jit(forward, static_argnames=("aux_layer_ids", "return_final"))(  # one program (eager: an op each)
        target, jnp.asarray(ids, jnp.int32), jnp.arange(12)[None], aux_layer_ids=layer_ids, return_final=True)
    ref = np.concatenate([hs[k].numpy() for k in layer_ids], axis=-1)
    assert rel_err(out.aux, ref) <= 1e-5
    # hidden_states[L] is post-norm in HF; our final pre-norm state normalised must match it
    assert rel_err(target.module.norm(out.final), hs[-1].numpy()) <= 1e-5


@pytest.mark.parametrize("chunk", [1, 4])
def test_cached_extend_matches_full_forward(pair, chunk):
    _, target = pair
    rng = np.random.default_rng(2)
    b, total = 3, 24
    ids = jnp.asarray(rng.integers(0, 97, (b, total)), jnp.int32)
    full = np.asarray(pjax.models.target_logits(target, ids))
    prefix = np.array([5, 9, 7])  # ragged per-row lengths
    cache = init_cache(target.config, b, 32, jnp.float32)
    step = jax.jit(forward)
    t0 = int(prefix.max())
    pos = np.minimum(np.arange(t0)[None], prefix[:, None] - 1)
    valid = np.arange(t0)[None] < prefix[:, None]
    out = step(target, jnp.take_along_axis(ids, jnp.asarray(pos), 1), jnp.asarray(pos), cache,
               valid=jnp.asarray(valid))
    cache = out.cache
    cur = prefix.copy()
    while (cur + chunk <= total).all():
        pos = cur[:, None] + np.arange(chunk)[None]
        o = step(target, jnp.take_along_axis(ids, jnp.asarray(pos), 1), jnp.asarray(pos), cache)
        cache = o.cache
        got = np.asarray(logits_from_hidden(target, o.hidden))
        ref = full[np.arange(b)[:, None], pos]
        assert rel_err(got, ref) <= 1e-5
        cur += chunk


def test_one_token_decode_matches_full_forward(pair):
    """Batch 1, one token per step: every projection takes the one-row path of `pjax.models.layers.Linear`."""
    _, target = pair
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 97, (1, 12)), jnp.int32)
    full = np.asarray(pjax.models.target_logits(target, ids))
    step = jax.jit(forward)
    cache = step(target, ids[:, :8], jnp.arange(8, dtype=jnp.int32)[None], init_cache(target.config, 1, 16,
                                                                                        jnp.float32)).cache
    for p in range(8, 12):
        out = step(target, ids[:, p:p + 1], jnp.full((1, 1), p, jnp.int32), cache)
        cache = out.cache
        assert rel_err(np.asarray(logits_from_hidden(target, out.hidden))[0, 0], full[0, p]) <= 1e-5


def test_one_row_linear_is_a_two_row_matrix_product():
    """XLA on GPU turns a one-row product with a small weight into a slow multiply + column reduce; the padded
    row keeps it a GEMM. The output equals the plain product for any leading shape."""
    from flax import nnx

    from pjax.models.layers import Linear
    lin = Linear(64, 32, use_bias=True, rngs=nnx.Rngs(0))
    w, b = np.asarray(lin.kernel[...]), np.asarray(lin.bias[...])
    for shape in [(64,), (1, 64), (1, 1, 64), (3, 64)]:
        x = np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32)
        np.testing.assert_allclose(np.asarray(lin(jnp.asarray(x))), x @ w + b, rtol=1e-5, atol=1e-5)
    hlo = jax.jit(lambda x: lin(x)).lower(jnp.zeros((1, 1, 64))).as_text()
    dots = [line for line in hlo.splitlines() if "dot_general" in line]
    assert len(dots) == 1 and "tensor<2x64xf32>" in dots[0], dots
