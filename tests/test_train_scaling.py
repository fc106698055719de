"""Training that scales, on CPU: losses over the vocabulary in token chunks equal the whole-vocabulary losses (values
and gradients), per-layer rematerialisation changes nothing, bf16 compute keeps float32 masters, and rows that are
one document each take the causal-rows mask (cuDNN's layout on a GPU) with the same result as document masks."""
import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pjax.config import LayerSpec, ModelConfig, RopeSpec
from pjax.models.layers import head_logits
from pjax.models.target import init_target
from pjax.train.data import ByteTokenizer, RowStream, text_document
from pjax.train.eagle3 import eagle3_row_loss
from pjax.train.heads import drafter_config_for_target, init_drafter_for_target
from pjax.train.losses import element_terms, target_draft_head, target_logits, vocab_terms, with_params
from pjax.train.target_lm import causal_lengths, lm_loss, token_nll, train_target_lm

FAST = {"xla_backend_optimization_level": 0}


def tree_rel(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    num = sum(float(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2)) for x, y in zip(la, lb))
    return (num / sum(float(np.sum(np.asarray(y, np.float64) ** 2)) for y in lb)) ** 0.5


@pytest.fixture(scope="module")
def models():
    """A 2-layer target with a final logit softcap and a P-EAGLE head for it (draft vocabulary 40 of 64)."""
    cfg = ModelConfig("llama", 64, 32, 64, 4, tuple(LayerSpec(8, 2, RopeSpec()) for _ in range(2)),
                      final_logit_softcap=5.0)
    target = init_target(cfg, jax.random.key(0), scale=0.3)
    dcfg = drafter_config_for_target(cfg, num_layers=1, draft_vocab_size=40, mask_token_id=63, num_depths=3,
                                     aux_layer_ids=(0, 1, 2))
    return target, init_drafter_for_target(target, dcfg, jax.random.key(1))


def test_token_nll_chunks_equal_whole_vocabulary(models):
    target, _ = models
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(37, 32)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 64, 37), jnp.int32)

    def whole(h, params):
        logits = head_logits(h, params["lm_head"]["kernel"], 5.0)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=-1)[:, 0]

    def chunked(h, params):
        from pjax.models.target import Target
        return token_nll(Target(target.config, target.graphdef, params).module, h, y, chunk=8)

    w = jnp.asarray(rng.normal(size=37), jnp.float32)

    @functools.partial(jax.jit, compiler_options=FAST)  # one program (op by op: a program per operation)
    def both(h, params):
        return (jax.value_and_grad(lambda *x: jnp.sum(chunked(*x) * w), argnums=(0, 1))(h, params),
                jax.value_and_grad(lambda *x: jnp.sum(whole(*x) * w), argnums=(0, 1))(h, params),
                chunked(h, params), whole(h, params))

    (a, ga), (b, gb), nll_chunked, nll_whole = both(h, target.params)
    np.testing.assert_allclose(np.asarray(nll_chunked), np.asarray(nll_whole), rtol=1e-5, atol=1e-5)
    assert abs(float(a) - float(b)) <= 1e-5 * abs(float(b)) and tree_rel(ga, gb) <= 1e-5


@pytest.mark.parametrize("loss_type", ["kl", "ce"])
def test_vocab_terms_chunks_equal_whole_vocabulary(models, loss_type):
    """The P-EAGLE / EAGLE-3 per-element terms over element chunks == over all elements at once (loss, agreement,
    gradients w.r.t. the drafter's states and head)."""
    target, drafter = models
    rng = np.random.default_rng(1)
    normed = jnp.asarray(rng.normal(size=(29, 32)), jnp.float32)
    vl = jnp.asarray(rng.normal(size=(20, 32)), jnp.float32)
    ref = jnp.asarray(rng.integers(0, 20, 29), jnp.int32)
    wt = jnp.asarray(rng.random(29), jnp.float32)

    def whole(normed, params):
        dr = with_params(drafter, params)
        norm, w = target_draft_head(target, dr)
        logits = head_logits(normed, params["lm_head"]["kernel"])
        return element_terms(logits, target_logits(target, norm, w, vl[ref]), loss_type)

    def chunked(normed, params):
        return vocab_terms(with_params(drafter, params), target, normed, vl, ref, loss_type=loss_type, loss_chunk=6)

    @functools.partial(jax.jit, compiler_options=FAST)  # one program (op by op: a program per operation)
    def both(normed, params):
        return (chunked(normed, params), whole(normed, params),
                jax.grad(lambda *x: jnp.sum(chunked(*x)[0] * wt), argnums=(0, 1))(normed, params),
                jax.grad(lambda *x: jnp.sum(whole(*x)[0] * wt), argnums=(0, 1))(normed, params))

    (la, ca), (lb, cb), ga, gb = both(normed, drafter.params)
    np.testing.assert_allclose(np.asarray(la), np.asarray(lb), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(ca), np.asarray(cb))
    assert tree_rel(ga, gb) <= 1e-5


def test_eagle3_loss_chunks(models):
    """The EAGLE-3 TTT loss with element chunks and query chunks == without (value and gradients)."""
    target, drafter = models
    rng = np.random.default_rng(2)
    s = 20
    args = (jnp.asarray(rng.integers(0, 64, s), jnp.int32), jnp.asarray(rng.normal(size=(s, 96)), jnp.float32),
            jnp.asarray(rng.normal(size=(s, 32)), jnp.float32), jnp.asarray(rng.random(s) < 0.8, jnp.int32),
            jnp.asarray([0] * 12 + [1] * 6 + [-1] * 2, jnp.int32))

    def loss(p, **kw):
        return eagle3_row_loss(with_params(drafter, p), target, *args, ttt_steps=3, **kw)[0]

    a, ga = jax.jit(jax.value_and_grad(lambda p: loss(p, loss_chunk=7, attn_chunk=6)), compiler_options=FAST)(
        drafter.params)
    b, gb = jax.jit(jax.value_and_grad(loss), compiler_options=FAST)(drafter.params)
    assert abs(float(a) - float(b)) <= 1e-5 * abs(float(b)) and tree_rel(ga, gb) <= 1e-5


def test_lm_loss_remat_chunks_and_causal_rows(models):
    """lm_loss with per-layer remat and token / query chunks == plain; single-document rows through the causal-rows
    mask (`causal_lengths`) == through document masks; bf16 compute is close to float32 and its gradients reach the
    float32 params as float32."""
    target, _ = models
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, 64, (2, 48)), jnp.int32)
    doc = np.zeros((2, 48), np.int32)
    doc[0, 20:] = 1
    doc[1, 40:] = -1

    def run(d, lengths=None, **kw):
        fn = jax.value_and_grad(lambda p: lm_loss(p, target, tokens, jnp.asarray(d), lengths, **kw))
        return jax.jit(fn, compiler_options=FAST)(target.params)

    base, g0 = run(doc)
    chunked, g1 = run(doc, remat=True, loss_chunk=10, attn_chunk=16)
    assert abs(float(base) - float(chunked)) <= 1e-6 and tree_rel(g1, g0) <= 1e-5
    single = doc.copy()
    single[0] = 0
    lengths = causal_lengths(single)
    np.testing.assert_array_equal(lengths, [48, 40])
    assert causal_lengths(doc) is None and causal_lengths(np.array([[0, -1, 0]])) is None
    a, ga = run(single, jnp.asarray(lengths))
    b, gb = run(single)
    assert abs(float(a) - float(b)) <= 1e-6 and tree_rel(ga, gb) <= 1e-6
    half, gh = run(doc, compute_dtype="bfloat16")
    assert abs(float(half) - float(base)) <= 0.02 * float(base)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(gh)) and tree_rel(gh, g0) <= 0.05


def test_train_target_lm_bf16_keeps_float32_masters():
    tok = ByteTokenizer()
    cfg = ModelConfig("llama", tok.vocab_size, 32, 64, 4, tuple(LayerSpec(8, 2, RopeSpec()) for _ in range(2)))
    target = init_target(cfg, jax.random.key(0), scale=0.1)
    docs = [text_document("the quick brown fox jumps over the lazy dog " * 3, tok, tok.bos_token_id)
            for _ in range(8)]
    trained, hist = train_target_lm(target, RowStream(docs, 64, 2, seed=0), 6, lr=1e-2, warmup=1, log_every=3,
                                    compute_dtype="bfloat16", remat=True, compiler_options=FAST)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(trained.params))
    assert len(hist) == 2 and hist[1][1] < hist[0][1]
