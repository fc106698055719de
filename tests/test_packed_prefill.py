"""The packed target prefill (`prefill_target(..., packed_len=N)`: a batch's prompts in one row under a document mask,
each token's K/V written to its prompt's cache row) equals the padded one ([B, Lp], one row per prompt) in float32 on
every target family (dense, q/k norms, MoE, GPT-OSS sinks and sliding windows, Gemma sandwich norms / sliding windows
/ shared K=V): logits at every real position, aux features, the whole KV cache, the first tokens. A prompt's results
do not depend on the other prompts of the row (their tokens or lengths), the layout follows `prefill=`, programs
are compiled per packed bucket, not per length, and the drafter's packed prefill equals its padded one."""
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pjax
from pjax.decode import EngineSpec, Sampling, prefill_target
from pjax.decode.inputs import packed_length, prefill_buckets
from pjax.decode.packing import pack_prompts
from pjax.kernels.flash_attention import document_mask
from pjax.models.cache import init_cache
from pjax.models.target import forward, logits_from_hidden
from tests.engine_utils import AVAILABLE, FAST, build, make_drafter, tiny_pair
from tests.kernel_jaxpr import pallas_kernel_names

# ragged, two longer than the sliding window (6) of the gpt_oss / gemma4 checkpoints; one single-token prompt
RAGGED = [[5, 17, 3], [9, 1, 44, 60, 2, 71, 33, 8, 90, 12, 4], [30, 31, 32, 33, 34, 35], [7],
          [3, 1, 4, 1, 5, 9, 2, 6, 5]]
LP, N, CAP = 16, 32, 48  # 30 real tokens packed into 32 positions instead of 5 x 16


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return tmp_path_factory.mktemp("packed_prefill")


@pytest.fixture(scope="module", params=AVAILABLE)
def family(request, tmp_root):
    return request.param, build(request.param, tmp_root)


def padded(prompts, lp=LP):
    """prompts -> (prompts [B, lp] right-padded with zeros, lengths [B])."""
    pad = np.zeros((len(prompts), lp), np.int32)
    for i, p in enumerate(prompts):
        pad[i, :len(p)] = p
    return jnp.asarray(pad), jnp.asarray([len(p) for p in prompts], jnp.int32)


def aux_ids(target):
    return (0, 1, target.config.num_layers)  # embeddings, after layer 0, the final pre-norm state


@functools.partial(jax.jit, static_argnames=("packed_len", "aux"), compiler_options=FAST)
def forward_both_layouts(target, prompts, lengths, *, packed_len, aux):
    """The target's forward over the prompts padded ([B, Lp]) and packed (one row of packed_len): (logits, aux,
    cache) of each, the packed ones unpacked to [B, Lp, ...] (zeros past each prompt's length)."""
    b, lp = prompts.shape
    j = jnp.arange(lp, dtype=jnp.int32)[None]
    valid = j < lengths[:, None]
    pad = forward(target, prompts, jnp.broadcast_to(j, (b, lp)), init_cache(target.config, b, CAP, jnp.float32),
                  valid=valid, aux_layer_ids=aux)
    tokens, positions, segment, rows, starts = pack_prompts(prompts, lengths, packed_len)
    pk = forward(target, tokens, positions, init_cache(target.config, b, CAP, jnp.float32), valid=segment >= 0,
                 mask=document_mask(segment), cache_rows=rows, aux_layer_ids=aux)
    idx = jnp.minimum(starts[:, None] + j, packed_len - 1)
    unpack = lambda x: jnp.where(valid[..., None], x[0, idx], 0)  # noqa: E731
    return ((logits_from_hidden(target, pad.hidden), pad.aux, pad.cache),
            (logits_from_hidden(target, unpack(pk.hidden)), unpack(pk.aux), pk.cache))


def sampling(b):
    return Sampling(jnp.zeros(b), jnp.zeros(b, jnp.int32), jnp.ones(b), jnp.zeros(b, jnp.uint32))


_prefill = jax.jit(prefill_target, static_argnames=("spec", "capacity", "cache_dtype", "packed_len"),
                   compiler_options=FAST)


def run_prefill(target, prompts, packed_len, aux, implementation="auto"):
    pad, lengths = padded(prompts)
    spec = EngineSpec(0, "none", 8, aux_layer_ids=aux, implementation=implementation)
    return _prefill(target, pad, lengths, sampling(len(prompts)), spec=spec, capacity=CAP, packed_len=packed_len)


def caches(state):
    return [np.asarray(x) for layer in state.target_cache for x in (layer.k, layer.v)]


def test_pack_prompts_layout():
    pad, lengths = padded([[11, 12, 13], [21], [31, 32, 33, 34]], lp=4)
    tokens, positions, segment, rows, starts = (np.asarray(x) for x in pack_prompts(pad, lengths, 10))
    np.testing.assert_array_equal(tokens, [[11, 12, 13, 21, 31, 32, 33, 34, 0, 0]])
    np.testing.assert_array_equal(positions, [[0, 1, 2, 0, 0, 1, 2, 3, 0, 0]])
    np.testing.assert_array_equal(segment, [[0, 0, 0, 1, 2, 2, 2, 2, -1, -1]])
    np.testing.assert_array_equal(rows, [[0, 0, 0, 1, 2, 2, 2, 2, 2, 2]])
    np.testing.assert_array_equal(starts, [0, 3, 4])


def test_packed_forward_equals_padded_at_every_position(family):
    """Logits and aux features at every real position, and the whole KV cache (rows, positions, zeros past each
    prompt): a token written to another row, a key seen across prompts or a position not restarting shows here."""
    name, (target, _, _) = family
    pad, lengths = padded(RAGGED)
    (lg, aux, cache), (lg_p, aux_p, cache_p) = forward_both_layouts(target, pad, lengths, packed_len=N,
                                                                    aux=aux_ids(target))
    valid = np.asarray(jnp.arange(LP)[None] < lengths[:, None])
    np.testing.assert_allclose(np.asarray(lg_p)[valid], np.asarray(lg)[valid], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(aux_p)[valid], np.asarray(aux)[valid], rtol=1e-5, atol=1e-5)
    for a, b in zip(cache, cache_p):
        for x, y in ((a.k, b.k), (a.v, b.v)):
            np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-5)
            assert not np.asarray(y)[valid.shape[0]:].any() and not np.asarray(y)[:, LP:].any()


# `prefill_target`'s packing around the forward: the default run keeps a dense family and GPT-OSS's sinks and sliding
# windows (the family-specific forward is test_packed_forward_equals_padded_at_every_position's, on every family, and
# test_packed_prefill_with_the_flash_kernel compares this prefill again on GPT-OSS); the others run with --full
PREFILL_FAMILIES = ("llama", "gpt_oss")
prefill_family = pytest.mark.parametrize("family", [
    pytest.param(name, marks=() if name in PREFILL_FAMILIES else pytest.mark.full) for name in AVAILABLE],
    indirect=True)


@prefill_family
def test_packed_prefill_target_equals_padded(family):
    name, (target, _, _) = family
    aux = aux_ids(target)
    a = run_prefill(target, RAGGED, None, aux)
    p = run_prefill(target, RAGGED, N, aux)
    sa, sp = a[0], p[0]
    for field in ("last", "pos", "out", "num_out", "done", "stop"):
        np.testing.assert_array_equal(np.asarray(getattr(sp, field)), np.asarray(getattr(sa, field)), err_msg=field)
    for x, y in zip(caches(sa), caches(sp)):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-5)
    valid = np.arange(LP)[None] < np.asarray([len(r) for r in RAGGED])[:, None]
    np.testing.assert_allclose(np.asarray(p[1])[valid], np.asarray(a[1])[valid], rtol=1e-5, atol=1e-5)
    assert not np.asarray(p[1])[~valid].any()


# the default run keeps GPT-OSS (sinks and sliding windows merged in); Gemma 4 runs with --full
@pytest.mark.parametrize("name", ["gpt_oss", pytest.param("gemma4", marks=pytest.mark.full)])
def test_packed_prefill_with_the_flash_kernel(tmp_root, name):
    """implementation="pallas" (a GPU's "auto"): the packed prefill's attention runs the Pallas flash kernel (interpret
    mode here) under the document mask, with the sliding window and GPT-OSS's sinks merged in; it equals the padded
    prefill of the reference."""
    if name not in AVAILABLE:
        pytest.skip(f"{name} is not in this transformers")
    target = build(name, tmp_root)[0]
    aux = aux_ids(target)
    a, aux_a = run_prefill(target, RAGGED, None, aux, "xla")
    p, aux_p = run_prefill(target, RAGGED, N, aux, "pallas")
    pad, lengths = padded(RAGGED)
    spec = EngineSpec(0, "none", 8, aux_layer_ids=aux, implementation="pallas")
    names = pallas_kernel_names(lambda t: prefill_target(t, pad, lengths, sampling(len(RAGGED)), spec=spec,
                                                         capacity=CAP, packed_len=N), target)
    assert names.count("pjax_flash_attention_fwd") == target.config.num_layers
    np.testing.assert_array_equal(np.asarray(p.last), np.asarray(a.last))
    for x, y in zip(caches(a), caches(p)):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-5)
    valid = np.arange(LP)[None] < np.asarray([len(r) for r in RAGGED])[:, None]
    np.testing.assert_allclose(np.asarray(aux_p)[valid], np.asarray(aux_a)[valid], rtol=1e-5, atol=1e-5)


@prefill_family
def test_a_prompt_does_not_see_the_others(family):
    """Prompt 0 replaced (other tokens, another length, so every later prompt moves in the packed row): the other
    prompts' first tokens, KV cache rows and aux features stay what they were; prompt 0's change."""
    name, (target, _, _) = family
    aux = aux_ids(target)
    s1, a1 = run_prefill(target, RAGGED, N, aux)
    s2, a2 = run_prefill(target, [[60, 61, 62, 63, 64]] + RAGGED[1:], N, aux)
    np.testing.assert_array_equal(np.asarray(s2.last)[1:], np.asarray(s1.last)[1:])
    np.testing.assert_allclose(np.asarray(a2)[1:], np.asarray(a1)[1:], rtol=1e-5, atol=1e-5)
    for x, y in zip(caches(s1), caches(s2)):
        np.testing.assert_allclose(y[1:], x[1:], rtol=1e-5, atol=1e-5)
        assert not np.allclose(y[0], x[0])


def test_packed_length_rule():
    assert packed_length(30, 5, 16, "padded") is None
    assert packed_length(30, 5, 16, "packed") == 32
    assert packed_length(30, 5, 16, "auto") == 32  # 32 < 80 positions
    assert packed_length(7, 1, 16, "auto") is None  # one row: nothing to save
    assert packed_length(7, 1, 16, "packed") == 16
    assert packed_length(60, 4, 16, "auto") is None  # 64 = 4 x 16: no saving
    assert packed_length(3, 2, 16, "packed") == 16  # at least 16
    assert prefill_buckets([3, 11, 6], 64, "auto") == (4, 16, 32)  # one padding row of one token: 21 -> 32
    assert prefill_buckets([300, 40, 7], 4096, "auto") == (4, 512, 512)
    assert prefill_buckets([300, 40, 7], 400, "padded") == (4, 400, None)  # the prompt bucket stops at the capacity


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(97)


def gen(pair, prompts, **kw):
    return pjax.generate(*pair, prompts, max_new_tokens=6, num_speculative_tokens=2, compiler_options=FAST, **kw)


def test_the_layout_follows_prefill(pair):
    ragged = [RAGGED[0], RAGGED[1], RAGGED[3]]  # 15 tokens + a padding row -> 16 packed positions, not 4 x 16
    stats = {m: gen(pair, ragged, prefill=m).stats for m in ("auto", "packed", "padded")}
    assert [stats[m]["prefill"] for m in stats] == ["packed", "packed", "padded"]
    assert [stats[m]["prefill_tokens"] for m in stats] == [16, 16, 64]
    for bad in ("pack", None, 1):
        with pytest.raises(ValueError, match=r"prefill=.*expected one of \('auto', 'packed', 'padded'\)"):
            gen(pair, ragged, prefill=bad)


@pytest.mark.full  # one row's programs: test_packed_length_rule checks the rule for one row, the test above its use
def test_one_prompt_is_padded_unless_packing_is_asked_for(pair):
    one = gen(pair, [RAGGED[1]]).stats
    assert (one["prefill"], one["prefill_tokens"]) == ("padded", 16)
    assert gen(pair, [RAGGED[1]], prefill="packed").stats["prefill"] == "packed"


def test_packed_programs_are_bucketed(pair):
    """A batch of other prompt lengths in the same (rows, prompt, packed row) buckets reuses the admission (the
    batch's prefill): 3 prompts of 12, 2, 7 tokens and 4 of 10, 3, 3, 2 both run 4 rows of 16 positions packed into
    32."""
    G = sys.modules["pjax.decode.engine"]
    built = []
    orig = G.compiled

    def record(name, *a):
        exe, seconds = orig(name, *a)
        if seconds and name == "admit":
            built.append(a[0][4].shape)
        return exe, seconds
    second = [[6] * 10, [7] * 3, [8] * 3, [9] * 2]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(G, "compiled", record)
        first = gen(pair, [[3] * 12, [4] * 2, [5] * 7], prefill="packed")
        compiled = len(built)
        out = gen(pair, second, prefill="packed")
    assert first.stats["prefill_tokens"] == out.stats["prefill_tokens"] == 32
    assert len(built) == compiled
    assert out.tokens == gen(pair, second, prefill="padded").tokens


_full_prefill = jax.jit(pjax.decode.prefill, static_argnames=("spec", "capacity", "cache_dtype", "packed_len"),
                        compiler_options=FAST)


# the default run keeps each drafting mode and each implementation once (sequential with XLA's attention, parallel with
# the flash kernel); parallel with XLA's runs with --full
@pytest.mark.parametrize("drafting,implementation", [pytest.param("parallel", "auto", marks=pytest.mark.full),
                                                     ("sequential", "auto"), ("parallel", "pallas")])
def test_packed_drafter_prefill_equals_padded(pair, drafting, implementation):
    """With a packed target prefill the drafter's prefill slots (each prompt's L + K - 1, or L for sequential
    drafting) are packed too: the same first drafts, draft probabilities and drafter KV cache (every row, every
    position) as the padded [B, Lp + mask slots] pass, for a 2-layer head (its fused first layer and a decoder
    layer), float32; under "pallas" the packed attention is the flash kernel's (interpret mode off a GPU)."""
    from pjax.decode.settings import EngineConfig, make_spec
    target, _ = pair
    drafter = make_drafter(target, num_layers=2)
    spec = make_spec(target, drafter, EngineConfig(num_speculative_tokens=3, drafting=drafting, draft_sampling="sample",
                                                   implementation=implementation), max_new_tokens=8)
    prompts, lengths = padded(RAGGED)
    samp = Sampling(jnp.full(5, 0.8), jnp.zeros(5, jnp.int32), jnp.ones(5), jnp.arange(5, dtype=jnp.uint32))
    run = functools.partial(_full_prefill, target, drafter, prompts, lengths, samp, spec=spec, capacity=CAP)
    pad, pk = run(packed_len=None), run(packed_len=N)
    np.testing.assert_array_equal(np.asarray(pk.drafts), np.asarray(pad.drafts))
    np.testing.assert_allclose(np.asarray(pk.draft_probs), np.asarray(pad.draft_probs), atol=1e-5)
    for a, b in zip(jax.tree.leaves(pk.drafter_cache), jax.tree.leaves(pad.drafter_cache)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    assert float(jnp.abs(pad.drafter_cache[1].k[1]).max()) > 0  # the second layer wrote the longest prompt's K
