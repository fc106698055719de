"""pjax.kernels.flash_attention: the reference (query chunks with remat) and the Pallas kernel (interpret mode) equal a
plain softmax under the dense mask, forward and gradients, for packed documents, sliding windows, sinks, GQA and
masks shared by every row; the EAGLE-3 training-time-test mask is speculators'; the kernels lower to Triton for CUDA;
the implementation switch."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pjax.kernels import dispatch
from pjax.kernels.flash_attention import api, attention, causal_mask, document_mask, position_mask
from pjax.kernels.flash_attention.config import FlashConfig
from pjax.kernels.flash_attention.mask import query_bounds, visible
from pjax.kernels.flash_attention.pallas import flash_attention
from pjax.train.masks import ttt_mask
from tests.dense_attention import dense_attention
from tests.gpu_lowering import triton_modules
from tests.kernel_jaxpr import equations

SMALL = FlashConfig(block_q=16, block_k=16, dkv_block_q=16, dkv_block_k=16, dq_block_q=16, dq_block_k=16)
DOCS = np.array([[0] * 10 + [1] * 20 + [2] * 6 + [-1] * 4, [0] * 33 + [1] * 7])


def doc_allowed(doc, window):
    """Causal inside documents (contiguous runs), padding sees nothing: bool [B, T, T] built from the definition."""
    t = doc.shape[-1]
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    ok = (j <= i) & (doc[:, :, None] == doc[:, None, :]) & (doc[:, :, None] != -1)
    if window is not None:
        ok &= j > i - window
    return ok


def inputs(b, t, nh, nkv, hd, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, hd)), jnp.float32) for n in (nh, nkv, nkv))
    return q, k, v, rng


def assert_dense(ours, q, k, v, sk, allowed, live, w):
    """ours(q, k, v, sk) equals the dense softmax under `allowed` (scale 0.3) on the `live` rows, and so do the
    gradients of sum(ours * w) with respect to q, k, v (and the sinks when given). Returns ours(q, k, v, sk)."""
    argnums = (0, 1, 2, 3) if sk is not None else (0, 1, 2)
    dense = lambda *a: dense_attention(*a[:3], allowed, 0.3, a[3])  # noqa: E731

    @jax.jit  # one program (a program per output: each compiles alone)
    def outputs_and_gradients(*a):
        return [(f(*a), jax.grad(lambda *a_: jnp.sum(f(*a_) * w), argnums=argnums)(*a)) for f in (ours, dense)]
    (got, grads), (want, wants) = outputs_and_gradients(q, k, v, sk)
    np.testing.assert_allclose(np.asarray(got)[live], np.asarray(want)[live], rtol=1e-5, atol=1e-5)
    for g, gw in zip(grads, wants):
        np.testing.assert_allclose(np.asarray(g), np.asarray(gw), rtol=1e-4, atol=1e-5)
    return got


# The default run keeps each implementation, and each of window + sinks / a shared mask / neither, once (window and sinks
# through both); --full runs every implementation on every mask.
@pytest.mark.parametrize("implementation,window,sinks,shared", [
    pytest.param("xla", None, False, False, marks=pytest.mark.full), ("pallas", None, False, False),
    ("xla", 5, True, False), ("pallas", 5, True, False),
    ("xla", 7, False, True), pytest.param("pallas", 7, False, True, marks=pytest.mark.full)])
def test_document_attention_equals_dense(implementation, window, sinks, shared):
    """Packed documents (one row with three documents and padding, one with two), GQA 4/2, T = 40 (not a tile
    multiple), the reference in chunks of 7 queries; gradients through q, k, v and the sinks."""
    doc = DOCS[:1] if shared else DOCS
    q, k, v, rng = inputs(2, 40, 4, 2, 16)
    sk = jnp.asarray(rng.normal(size=(4,)), jnp.float32) if sinks else None
    allowed = doc_allowed(doc, window)
    live = np.broadcast_to(allowed.any(-1), (2, 40))
    w = jnp.asarray(rng.normal(size=q.shape) * live[..., None, None], jnp.float32)
    mask = document_mask(doc, chunk=7)

    def ours(q, k, v, sk):
        return attention(q, k, v, mask, scale=0.3, window=window, sinks=sk, implementation=implementation,
                         config=SMALL)

    got = assert_dense(ours, q, k, v, sk, allowed, live, w)
    assert np.isfinite(np.asarray(got)).all()  # rows that see nothing: finite (uniform / zeros)


# The default run keeps the case where a short band shows (no window); window + sinks on the reference: also
# test_document_attention_equals_dense[xla-5-True-False]
@pytest.mark.parametrize("window,sinks", [(None, False), pytest.param(5, True, marks=pytest.mark.full)])
def test_a_span_bands_the_reference(window, sinks):
    """document_mask(span=12) (no document longer): the reference scores each chunk of 7 queries against the 18 keys
    it can see (a dynamic slice of the keys), and equals the dense softmax, forward and gradients. Documents of 12
    tokens end where chunks start, so a band one key short shows."""
    lengths = [[10, 12, 9, 12, 8, 9], [12] * 5]
    docs = np.array([sum(([d] * n for d, n in enumerate(row)), []) + [-1] * 4 for row in lengths])
    q, k, v, rng = inputs(2, 64, 4, 2, 16, seed=2)
    sk = jnp.asarray(rng.normal(size=(4,)), jnp.float32) if sinks else None
    allowed = doc_allowed(docs, window)
    live = allowed.any(-1)
    w = jnp.asarray(rng.normal(size=q.shape) * live[..., None, None], jnp.float32)
    mask = document_mask(docs, chunk=7, span=12)

    def ours(q, k, v, sk):
        return attention(q, k, v, mask, scale=0.3, window=window, sinks=sk, implementation="xla")

    prims = {e.primitive.name for e, _ in equations(jax.make_jaxpr(ours)(q, k, v, sk).jaxpr)}
    assert "dynamic_slice" in prims
    assert_dense(ours, q, k, v, sk, allowed, live, w)


def test_kernel_log_sum_exp_and_its_gradient():
    """The kernel's second output is each query's log-sum-exp over its visible keys (natural log), MASK_VALUE for
    a query that sees none (with o = 0), and gradients flow through it."""
    q, k, v, rng = inputs(2, 40, 4, 2, 16, seed=1)
    mask = document_mask(DOCS)
    lo, hi = query_bounds(mask, 6)
    allowed = doc_allowed(DOCS, 6)
    live = allowed.any(-1)

    def lse_dense(q, k):
        s = jnp.einsum("bthd,bshd->bhts", q, jnp.repeat(k, 2, axis=2), precision="highest") * 0.3
        s = jnp.where(jnp.asarray(allowed)[:, None], s, -1e30)
        return jnp.moveaxis(jax.nn.logsumexp(s, axis=-1), 1, 2)  # [B, T, nh]

    kernel_lse = lambda q, k: flash_attention(q, k, v, lo, hi, scale=0.3, config=SMALL)[1]  # noqa: E731
    wl = jnp.asarray(rng.normal(size=(2, 40, 4)) * live[..., None], jnp.float32)

    @jax.jit  # one program (a program per output: each compiles alone)
    def outputs_and_gradients(q, k):
        grads = [jax.grad(lambda q_, k_: jnp.sum(f(q_, k_) * wl), argnums=(0, 1))(q, k) for f in (kernel_lse, lse_dense)]
        return flash_attention(q, k, v, lo, hi, scale=0.3, config=SMALL), lse_dense(q, k), grads
    (o, lse), want, (g, gw) = outputs_and_gradients(q, k)
    assert lse.shape == wl.shape
    np.testing.assert_allclose(np.asarray(lse)[live], np.asarray(want)[live], rtol=1e-5, atol=1e-5)
    assert (np.asarray(lse)[~live] == -1e30).all() and (np.asarray(o)[~live] == 0).all()
    for a, b in zip(g, gw):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window", [None, 3])
def test_ttt_mask_is_speculators_eagle3_mask(window):
    """Pass t of the training-time test sees exactly speculators' eagle3 mask (`create_combined_mask_mod`, extended
    by `extend_dense_mask_for_draft_tokens` t times) on every non-padding row (padding rows carry no loss;
    speculators lets them see their own step-0 key, here they see only their later passes)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("speculators")
    from torch.nn.attention.flex_attention import create_mask
    from speculators.models.eagle3.attention import create_combined_mask_mod, extend_dense_mask_for_draft_tokens

    doc = np.array([0] * 5 + [1] * 4 + [-1] * 3)
    s, passes = len(doc), 3
    ref = create_mask(create_combined_mask_mod(torch.tensor(doc), s, window), None, None, s, s, device="cpu")
    for step in range(passes):
        m = ttt_mask(doc, step, passes)
        ours = np.zeros((s, passes * s), bool)
        ours[:, :s] = np.asarray(visible(m, s, window)[0])
        ci, cv = np.asarray(m.chain_index[0]), np.asarray(m.chain_valid[0])
        for i in range(s):
            ours[i, ci[i][cv[i]]] = True
        real = doc != -1
        np.testing.assert_array_equal(ours[real, :(step + 1) * s], ref[0, 0].numpy()[real])
        ref = extend_dense_mask_for_draft_tokens(ref, s)


@pytest.mark.parametrize("b,t,nh,nkv,hd,shared", [(2, 256, 8, 2, 64, False), (1, 200, 4, 4, 128, True),
                                                  (1, 72, 4, 2, 96, True)])
def test_flash_kernels_lower_to_triton_for_cuda(b, t, nh, nkv, hd, shared):
    """Forward, dQ and dK/dV kernels (bf16, the default tiles) through the Pallas -> Triton lowering, with a mask per
    row or shared by the rows, lengths that are not tile multiples and a head dim that is not a power of two."""
    sd = jax.ShapeDtypeStruct

    def step(q, k, v, lo, hi):
        def loss(q, k, v):
            o, lse = flash_attention(q, k, v, lo, hi, scale=0.1, interpret=False)
            return jnp.sum(o.astype(jnp.float32)) + jnp.sum(lse)
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    bf = jnp.bfloat16
    bm = 1 if shared else b
    mods = triton_modules(step, sd((b, t, nh, hd), bf), sd((b, t, nkv, hd), bf), sd((b, t, nkv, hd), bf),
                          sd((bm, t), jnp.int32), sd((bm, t), jnp.int32))
    assert len(mods) == 3


def test_implementation_choice(monkeypatch):
    """"xla" and "auto" off a GPU: the reference; "pallas": the kernel where the keys sit at their index (else the
    reference); "cudnn": only causal rows without sinks in 16-bit (else an error naming why); "auto" on a GPU: cuDNN
    where it can, the kernel where it can, the reference otherwise."""
    q = jnp.ones((2, 32, 4, 16), jnp.bfloat16)
    k = jnp.ones((2, 32, 2, 16), jnp.bfloat16)
    doc, causal = document_mask(np.zeros((2, 32), int)), causal_mask(np.array([32, 20]), 32)
    pos = position_mask(np.tile(np.arange(32), (2, 1)), np.arange(32))
    sinks = jnp.zeros((4,))
    assert [api.choose(q, k, m, None, "auto") for m in (doc, causal, pos)] == ["xla"] * 3
    assert [api.choose(q, k, m, None, "pallas") for m in (doc, causal, pos)] == ["pallas", "pallas", "xla"]
    assert api.choose(q, k, causal, None, "cudnn") == "cudnn"
    for m, s, x in ((doc, None, q), (causal, sinks, q), (causal, None, q.astype(jnp.float32))):
        with pytest.raises(ValueError, match="implementation='cudnn' cannot run"):
            api.choose(x, k, m, s, "cudnn")
    with pytest.raises(ValueError, match="flash_attention: implementation must be one of"):
        api.choose(q, k, doc, None, "triton")
    monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
    assert [api.choose(q, k, m, None, "auto") for m in (doc, causal, pos)] == ["pallas", "cudnn", "xla"]
    assert api.choose(q, k, causal, sinks, "auto") == "pallas"
