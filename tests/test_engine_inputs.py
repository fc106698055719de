"""Nothing silent at the engine's door: bad sampling values, seeds, dtypes, stop lists and argument types are
errors naming the argument; casts the JAX way work; non-finite logits stop a row with its own reason; a head for
another verifier, a shallow target's default aux layers and an over-long context are reported."""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pjax
from pjax.bench.simulate import SimulatedAcceptance
from pjax.config import LayerSpec, ModelConfig, RopeSpec
from pjax.models.drafter import DrafterConfig, init_drafter
from tests.engine_utils import FAST, make_drafter

V, H = 61, 32
PROMPTS = [[5, 17, 3], [9, 1, 44, 60, 2, 10, 33, 8], [30, 31, 32, 33, 34, 35]]
gen = functools.partial(pjax.generate, compiler_options=FAST, drafting="parallel", num_speculative_tokens=3)


def tiny_target(seed=0, layers=2, **kw):
    rope = RopeSpec(theta=10000.0)
    cfg = ModelConfig("llama", V, H, 64, 4, tuple(LayerSpec(8, 2, rope) for _ in range(layers)), rms_norm_eps=1e-5,
                      **kw)
    return pjax.init_target(cfg, jax.random.key(seed), jnp.float32, scale=0.3)


@pytest.fixture(scope="module")
def models():
    target = tiny_target()
    return target, make_drafter(target)


@pytest.mark.parametrize("kw,err,match", [
    (dict(seed=2 ** 32), ValueError, r"seed=4294967296 must be < 4294967296"),
    (dict(seed=-1), ValueError, r"seed=-1 must be >= 0"),
    (dict(seed=1.5), TypeError, r"seed=1.5 must be an integer"),
    (dict(top_p=float("nan")), ValueError, r"top_p=nan must be a finite number"),
    (dict(top_p=[1.0, 1.5, 1.0]), ValueError, r"top_p\[1\]=1.5 must be <= 1"),
    (dict(top_k=2.7), TypeError, r"top_k=2.7 must be an integer"),
    (dict(top_k=True), TypeError, r"top_k=True must be an integer"),
    (dict(temperature="0.7"), TypeError, r"temperature='0.7' must be a finite number"),
    (dict(temperature=math.inf), ValueError, r"temperature=inf must be a finite number"),
    (dict(temperature=1e300), ValueError, r"temperature=1e\+300 is out of range: give 0 \(greedy\) or a temperature "
                                          r"in \[1e-30, 1e\+30\]"),
    (dict(temperature=[1.0, 1e-40, 1.0]), ValueError, r"temperature\[1\]=1e-40 is out of range"),
    (dict(top_p=1e-45), ValueError, r"top_p=1e-45 is out of range: give a top_p in \[1e-30, 1\]"),
    (dict(top_k=2 ** 40), ValueError, r"top_k=1099511627776 must be < 2147483648"),
    (dict(max_new_tokens=4.0), TypeError, r"max_new_tokens=4.0 must be an integer"),
    (dict(cache_dtype="int8"), ValueError, r"cache_dtype=int8 is not supported here; expected one of bfloat16"),
    (dict(cache_dtype=jnp.float64), ValueError, r"cache_dtype=float64 .*64-bit floats are not supported"),
    (dict(cache_dtype="fp8"), ValueError, r"cache_dtype='fp8' is not a supported dtype"),
    (dict(eos_token_id=[[1], [2]]), ValueError, r"2 stop lists for 3 prompts"),
    (dict(eos_token_id=[1, [2]]), TypeError, r"mixes ids and lists"),
    (dict(eos_token_id=["1"]), TypeError, r"'1' is not an integer token id"),
    (dict(acceptance=SimulatedAcceptance((0.5,))), ValueError, r"gives 1 probabilities for K = 3"),
    (dict(implementation="triton"), ValueError, r"implementation='triton'"),
])
def test_bad_values_are_errors(models, kw, err, match):
    """(also an acceptance hook whose probabilities do not match K: the benchmark's simulated acceptance)"""
    target, drafter = models
    args = dict(max_new_tokens=4)
    args.update(kw)
    with pytest.raises(err, match=match):
        gen(target, drafter, PROMPTS, **args)


def test_bad_types_are_errors(models, tmp_path):
    target, drafter = models
    with pytest.raises(TypeError, match="target must be a pjax Target .*pjax.load_target"):
        gen(str(tmp_path), drafter, PROMPTS, max_new_tokens=4)
    with pytest.raises(TypeError, match="drafter must be a pjax Drafter .* got Target"):
        gen(target, target, PROMPTS, max_new_tokens=4)
    with pytest.raises(TypeError, match="prompts must be a list of token-id lists; for text"):
        gen(target, drafter, "hello", max_new_tokens=4)


def test_dtype_parser_spellings():
    from pjax.dtypes import parse_dtype
    for s in ("bf16", "bfloat16", "BF16", jnp.bfloat16, np.dtype(jnp.bfloat16)):
        assert parse_dtype(s) == jnp.bfloat16
    for s in ("f32", "fp32", "float32", np.float32):
        assert parse_dtype(s) == jnp.float32
    with pytest.raises(ValueError, match=r"--dtype=int8 is not supported"):
        parse_dtype(np.int8, what="--dtype")


def test_per_prompt_stop_lists(models):
    """One stop list per prompt: each row stops at its own ids (and only there)."""
    target, drafter = models
    ref = gen(target, drafter, PROMPTS, max_new_tokens=10).tokens
    stops = [[ref[0][3]], [ref[1][5], 60], []]
    res = gen(target, drafter, PROMPTS, max_new_tokens=10, eos_token_id=stops)
    for i, (r, s) in enumerate(zip(ref, stops)):
        want = r[:r.index(s[0]) + 1] if s and s[0] in r else r
        assert res.tokens[i] == want, i
    assert res.stats["stop_reasons"][2] == "length"


def test_per_prompt_max_new_tokens(models):
    target, drafter = models
    ref = gen(target, drafter, PROMPTS, max_new_tokens=9).tokens
    res = gen(target, drafter, PROMPTS, max_new_tokens=[3, 9, 5])
    assert res.tokens == [ref[0][:3], ref[1], ref[2][:5]]


def test_cast_the_jax_way_works(models):
    """Params cast with jax.tree.map keep a float32 module; the engine rebuilds the module for the params' dtype,
    and .astype does it explicitly: both give the same output as a properly built bfloat16 pair."""
    target, drafter = models
    cast = lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x  # noqa: E731
    jt, jd = jax.tree.map(cast, target), jax.tree.map(cast, drafter)
    assert jt.graphdef == target.graphdef  # the module definition still says float32
    bt, bd = target.astype("bfloat16"), drafter.astype(jnp.bfloat16)
    assert bt.graphdef != target.graphdef and bt.dtype == jnp.bfloat16 and bd.dtype == jnp.bfloat16
    want = gen(bt, bd, PROMPTS, max_new_tokens=8)
    got = gen(jt, jd, PROMPTS, max_new_tokens=8)
    assert got.tokens == want.tokens
    mixed = dataclasses.replace(target, params=jax.tree.map(lambda x: x, target.params))
    mixed.params["norm"]["weight"] = mixed.params["norm"]["weight"].astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="mix dtypes .* target.astype"):
        gen(mixed, drafter, PROMPTS, max_new_tokens=4)


def test_model_checks_are_remembered(models, monkeypatch):
    """Every generation checks that a model's module definition fits its params' dtype; a definition equal to the
    needed one but not the same object (a model built outside the loaders) is compared once, not on every call (a
    24-layer definition takes ~1 ms to compare)."""
    from pjax.models.target import abstract_target, consistent_target
    target, _ = models
    fresh = dataclasses.replace(target, graphdef=abstract_target(target.config, target.dtype).graphdef)
    assert fresh.graphdef is not target.graphdef
    cls = type(fresh.graphdef)
    calls, real = [], cls.__eq__
    monkeypatch.setattr(cls, "__eq__", lambda a, b: calls.append(1) or real(a, b))
    assert consistent_target(fresh) is fresh and calls
    n = len(calls)
    assert consistent_target(fresh) is fresh and len(calls) == n


def test_program_keys_see_shapes_dtypes_and_weak_types():
    """A program is looked up by its arguments' (shape, dtype, weak type): numpy and JAX inputs and the compile-only
    path's shape structs of one shape and dtype find the same program; a weakly typed scalar does not; an array
    sharded over several devices does not either."""
    from jax.sharding import NamedSharding, PartitionSpec
    from pjax.decode.compiled import _signature
    want = ((2, 3), jnp.dtype(jnp.float32), False, None)
    assert _signature(jnp.zeros((2, 3))) == _signature(np.zeros((2, 3))) == want
    assert _signature(jax.ShapeDtypeStruct((2, 3), jnp.float32)) == want
    assert _signature(np.int32(1)) == _signature(jnp.int32(1)) == ((), jnp.dtype(jnp.int32), False, None)
    assert _signature(1) == _signature(jnp.asarray(1)) == ((), jnp.dtype(jnp.int32), True, None)
    if len(jax.devices()) >= 2:
        mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("x",))
        split = jax.device_put(jnp.zeros((2, 3)), NamedSharding(mesh, PartitionSpec("x")))
        assert _signature(split)[:3] == want[:3] and _signature(split)[3] is not None


def test_nonfinite_logits_stop_the_row(models):
    """NaN weights: the row stops with reason "nonfinite" instead of emitting argmax-of-NaN (token 0) forever."""
    target, drafter = models
    bad = dataclasses.replace(target, params=jax.tree.map(lambda x: x, target.params))
    bad.params["lm_head"]["kernel"] = bad.params["lm_head"]["kernel"].at[0, 0].set(jnp.nan)
    res = gen(bad, drafter, PROMPTS, max_new_tokens=6)
    assert res.stats["stop_reasons"] == ["nonfinite"] * 3
    assert res.tokens == [[], [], []]
    plain = gen(bad, None, PROMPTS, max_new_tokens=6, drafting="none")
    assert plain.stats["stop_reasons"] == ["nonfinite"] * 3


def test_verifier_mismatch_is_reported(models):
    target, _ = models
    qwen = dataclasses.replace(target, config=dataclasses.replace(target.config, architectures=("Qwen3ForCausalLM",)))
    drafter = make_drafter(qwen)
    drafter = dataclasses.replace(drafter, config=dataclasses.replace(
        drafter.config, verifier_architectures=("LlamaForCausalLM",), verifier_name_or_path="meta-llama/x"))
    with pytest.warns(UserWarning, match="trained for a LlamaForCausalLM verifier .*Qwen3ForCausalLM"):
        res = gen(qwen, drafter, PROMPTS, max_new_tokens=4)
    assert any("LlamaForCausalLM" in w for w in res.stats["warnings"])


# the shallow fallback, and the vLLM default where it fits (the latter with --full: tests/test_pairing.py's
# test_one_head_four_ways runs the engine on a 7-layer target with the default ids)
@pytest.mark.parametrize("layers", [4, pytest.param(7, marks=pytest.mark.full)])
def test_default_aux_ids_fit_shallow_targets(layers):
    """A head without aux ids on a target of 3..7 layers: distinct default ids, said in a warning and the stats."""
    target = tiny_target(layers=layers)
    h = target.config.hidden_size
    layer = ModelConfig("llama", V, h, 2 * h, 4, (LayerSpec(8, 2, RopeSpec(theta=1e4)),), rms_norm_eps=1e-5)
    cfg = DrafterConfig(layer=layer, num_aux=3, target_hidden_size=h, draft_vocab_size=V, mask_token_id=V - 1)
    drafter = init_drafter(cfg, jax.random.key(1), jnp.float32, scale=0.2)
    ids = target.config.default_aux_layer_ids()
    assert len(set(ids)) == 3 and all(0 <= i <= layers for i in ids)
    with pytest.warns(UserWarning) if layers < 8 and (2, layers // 2, layers - 3) != ids else _nothing():
        res = gen(target, drafter, PROMPTS, max_new_tokens=3)
    assert res.stats["aux_layer_ids"] == list(ids)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_context_beyond_max_positions_warns(models):
    _, drafter = models
    target = tiny_target(max_position_embeddings=12)
    with pytest.warns(UserWarning, match="beyond the target's max_position_embeddings=12"):
        gen(target, drafter, PROMPTS, max_new_tokens=8)


def test_float32_models_run_full_precision_products(models, monkeypatch):
    """float32 models compile under matmul precision "highest" unless TF32 is allowed (CPU: the setting is seen)."""
    import sys
    G = sys.modules["pjax.decode.engine"]
    target, drafter = models
    seen = []
    orig = G.compiled
    monkeypatch.setattr(G, "compiled", lambda *a: seen.append(a[-1]) or orig(*a))
    gen(target, drafter, PROMPTS, max_new_tokens=3)
    gen(target, drafter, PROMPTS, max_new_tokens=3, allow_tf32=True)
    bf = gen(target.astype("bf16"), drafter.astype("bf16"), PROMPTS, max_new_tokens=3)
    per = len(seen) // 3  # programs of one generation: the admission, the chunk ending early (3 tokens never
    # outlive a chunk: no fixed-trip chunk)
    assert per == 2 and seen == ["highest"] * per + ["default"] * per + [None] * per, seen
    assert bf.tokens
