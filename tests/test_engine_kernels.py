"""The engine with the Pallas kernels switched on (interpret mode on CPU), and every K of the issue on one
family: greedy output still equals transformers, and sampled output is token-for-token the XLA path's
(integer outputs of the kernels equal the reference given the same counter-hash noise, so the distribution
tests of the XLA path carry over)."""
import pytest

import pjax
from tests.engine_utils import FAST, NEW, PROMPTS, build


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build("llama", tmp_path_factory.mktemp("engine_kernels"))


@pytest.mark.parametrize("k", [1, 7, 11])
@pytest.mark.parametrize("drafting", ["parallel", "sequential"])
def test_greedy_every_k(llama, k, drafting):
    target, drafter, ref = llama
    res = pjax.generate(target, drafter, PROMPTS, max_new_tokens=NEW, num_speculative_tokens=k, drafting=drafting,
                        compiler_options=FAST)
    assert res.tokens == [r[:NEW] for r in ref]


def test_greedy_with_pallas_kernels(llama):
    target, drafter, ref = llama
    res = pjax.generate(target, drafter, PROMPTS, max_new_tokens=NEW, num_speculative_tokens=3,
                        implementation="pallas", compiler_options=FAST)
    assert res.tokens == [r[:NEW] for r in ref]


def test_sampling_with_pallas_kernels_equals_xla(llama):
    target, drafter, _ = llama
    kw = dict(max_new_tokens=NEW, num_speculative_tokens=3, temperature=[1.0, 0.7, 1.3], top_k=[0, 5, 0],
              top_p=[1.0, 1.0, 0.9], seed=[3, 4, 5], compiler_options=FAST)
    xla = pjax.generate(target, drafter, PROMPTS, implementation="xla", **kw)
    pal = pjax.generate(target, drafter, PROMPTS, implementation="pallas", **kw)
    assert pal.tokens == xla.tokens
    assert pal.stats["num_accepted_tokens"] == xla.stats["num_accepted_tokens"]
