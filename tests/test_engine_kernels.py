"""The engine with the Pallas kernels switched on (implementation="pallas": every kernel, interpret mode on CPU), and
every K of the issue on one family: greedy output still equals transformers, and sampled output is token-for-token
the XLA path's (integer outputs of the kernels equal the reference given the same counter-hash noise, so the
distribution tests of the XLA path carry over). A dense family (llama) and a MoE family (qwen3_moe, run one prompt at a
time so that its verify passes take the few-pair expert-matmul path) both run with all four kernels."""
import jax
import jax.numpy as jnp
import pytest

import pjax
from pjax.decode import EngineConfig, Sampling, make_spec, prefill, spec_round
from tests.engine_utils import FAST, NEW, PROMPTS, build
from tests.kernel_jaxpr import pallas_kernel_names

KERNELS = ("pjax_cache_attention", "pjax_expert_matmul", "pjax_accept", "pjax_draft_inputs")
# rows per generate call: qwen3_moe (4 experts, top-2) verifies K + 1 = 4 tokens of one row in 8 pairs, within the
# few-pair path's min(128, 2 x experts); three rows would take the grouped matmul
BATCH = {"llama": len(PROMPTS), "qwen3_moe": 1}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_kernels")
    return {name: build(name, root) for name in BATCH}


def round_kernels(model, rows: int, k: int) -> set:
    """The kernels a decode round of `rows` rows with K = k runs under implementation="pallas" (traced)."""
    target, drafter, _ = model
    spec = make_spec(target, drafter, EngineConfig(num_speculative_tokens=k, drafting="parallel",
                                                   implementation="pallas"), max_new_tokens=NEW)
    sampling = Sampling(jnp.ones((rows,)), jnp.zeros((rows,), jnp.int32), jnp.ones((rows,)),
                        jnp.zeros((rows,), jnp.uint32))
    state = jax.eval_shape(lambda t, d: prefill(t, d, jnp.ones((rows, 4), jnp.int32), jnp.full((rows,), 4, jnp.int32),
                                                sampling, spec=spec, capacity=64), target, drafter)
    names = pallas_kernel_names(lambda *a: spec_round(*a, spec=spec), target, drafter, state, sampling)
    return {kernel for kernel in KERNELS if any(n.startswith(kernel) for n in names)}


def generate(model, prompts, **kw):
    target, drafter, _ = model
    return pjax.generate(target, drafter, prompts, max_new_tokens=NEW, compiler_options=FAST, **kw)


def batches(family):
    n = BATCH[family]
    return [PROMPTS[i:i + n] for i in range(0, len(PROMPTS), n)]


# runs with --full: the default run checks greedy exactness at every K of the issue elsewhere, against transformers
# in tests/test_engine_greedy.py (parallel K = 3, 7, 11, sequential K = 1, 11) and against plain decoding in
# tests/test_engine_stream.py (parallel K = 1: no mask slot, sequential K = 4)
@pytest.mark.full
@pytest.mark.parametrize("k", [1, 7, 11])
@pytest.mark.parametrize("drafting", ["parallel", "sequential"])
def test_greedy_every_k(families, k, drafting):
    ref = families["llama"][2]
    res = generate(families["llama"], PROMPTS, num_speculative_tokens=k, drafting=drafting)
    assert res.tokens == [r[:NEW] for r in ref]


@pytest.mark.parametrize("family", list(BATCH))
def test_greedy_with_pallas_kernels(request, families, family):
    ref = families[family][2]
    # qwen3_moe: its longest prompt only (one row a call, each the same programs) unless --full
    runs = batches(family) if family == "llama" or request.config.getoption("--full") else [[PROMPTS[1]]]
    tokens = [t for p in runs
              for t in generate(families[family], p, num_speculative_tokens=3, implementation="pallas").tokens]
    assert tokens == [ref[PROMPTS.index(p)][:NEW] for batch in runs for p in batch]
    dense = {"pjax_expert_matmul"} if family == "llama" else set()
    assert round_kernels(families[family], BATCH[family], 3) == set(KERNELS) - dense


# the default run keeps the dense family (the sampled accept / draft-input kernels); the MoE family, whose expert matmul
# test_greedy_with_pallas_kernels checks, runs with --full
@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.full if f == "qwen3_moe" else ()) for f in BATCH])
def test_sampling_with_pallas_kernels_equals_xla(families, family):
    kw = dict(num_speculative_tokens=3, temperature=[1.0, 0.7, 1.3], top_k=[0, 5, 0], top_p=[1.0, 1.0, 0.9],
              seed=[3, 4, 5])
    n = BATCH[family]
    for i, p in enumerate(batches(family)):
        row = {key: v[i * n:(i + 1) * n] if isinstance(v, list) else v for key, v in kw.items()}
        xla = generate(families[family], p, implementation="xla", **row)
        pal = generate(families[family], p, implementation="pallas", **row)
        assert pal.tokens == xla.tokens
        assert pal.stats["num_accepted_tokens"] == xla.stats["num_accepted_tokens"]
