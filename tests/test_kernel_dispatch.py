"""The kernel switch end to end: a jitted decode round and a training step, traced (jax.make_jaxpr, sub-jaxprs
included), run no Pallas kernel under implementation="xla", and under "pallas" run every kernel their code reaches
(cache attention, the MoE expert matmul, acceptance and the drafter-input metadata in the round; the expert matmul
in the step, whose MoE target is small enough for the few-pair path)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjax.config import LayerSpec, ModelConfig, MoeSpec, RopeSpec
from pjax.decode import EngineConfig, Sampling, make_spec, prefill, spec_round
from pjax.models import init_target
from pjax.models.drafter import Drafter
from pjax.models.moe import MOE_FEW_PAIRS
from pjax.train.cod import CodConfig
from pjax.train.config import TrainConfig
from pjax.train.heads import drafter_config_for_target, init_drafter_for_target
from pjax.train.optim import OptimConfig
from pjax.train.state import init_train_state
from pjax.train.step import train_step
from tests.kernel_jaxpr import pallas_kernel_names

ROUND_KERNELS = ("pjax_cache_attention", "pjax_expert_matmul", "pjax_accept", "pjax_draft_inputs")
B, K, CAPACITY = 1, 3, 32


@pytest.fixture(scope="module")
def models():
    """A 2-layer qwen3_moe target (8 experts, top-2: a verify of K + 1 = 4 tokens has 8 pairs, the few-pair path)
    and a random P-EAGLE head for it."""
    rope = RopeSpec(theta=1e4)
    cfg = ModelConfig("qwen3_moe", 64, 32, 64, 4, (LayerSpec(8, 2, rope, moe=True), LayerSpec(8, 2, rope, moe=True)),
                      qk_norm=True, moe=MoeSpec(8, 2, 16))
    target = init_target(cfg, jax.random.key(0), scale=0.2)
    dcfg = drafter_config_for_target(cfg, num_layers=1, mask_token_id=63, num_depths=4, aux_layer_ids=(0, 1, 2))
    return target, init_drafter_for_target(target, dcfg, jax.random.key(1))


def round_kernels(target, drafter, implementation):
    spec = make_spec(target, drafter, EngineConfig(num_speculative_tokens=K, drafting="parallel",
                                                   implementation=implementation), max_new_tokens=8)
    sampling = Sampling(jnp.ones((B,)), jnp.zeros((B,), jnp.int32), jnp.ones((B,)), jnp.zeros((B,), jnp.uint32))
    state = jax.eval_shape(lambda t, d: prefill(t, d, jnp.ones((B, 5), jnp.int32), jnp.full((B,), 5, jnp.int32),
                                                sampling, spec=spec, capacity=CAPACITY), target, drafter)
    rnd = jax.jit(spec_round, static_argnames=("spec",))
    return pallas_kernel_names(lambda *a: rnd(*a, spec=spec), target, drafter, state, sampling)


def step_kernels(target, drafter, implementation):
    s = 8  # one row of 8 tokens: 16 token-expert pairs <= min(MOE_FEW_PAIRS, 2 x 8 experts)
    assert s * 2 <= min(MOE_FEW_PAIRS, 16)
    cfg = TrainConfig(total_seq_len=s, batch_rows=1, total_steps=2, cod=CodConfig(num_depths=2, max_anchors=None),
                      optim=OptimConfig(lr=1e-3, warmup_steps=1), implementation=implementation)
    shell = Drafter(drafter.config, drafter.graphdef, None, drafter.d2t)
    batch = dict(tokens=jnp.asarray(np.arange(s)[None] % 60, jnp.int32), loss_mask=jnp.ones((1, s), jnp.int32),
                 document_ids=jnp.zeros((1, s), jnp.int32))
    step = jax.jit(lambda st, sh, t, b: train_step(st, sh, t, b, cfg))
    return pallas_kernel_names(step, init_train_state(drafter, cfg), shell, target, batch)


def test_xla_decode_round_runs_no_kernel(models):
    assert round_kernels(*models, "xla") == []
    assert round_kernels(*models, "auto") == []  # off GPU


def test_pallas_decode_round_runs_every_kernel(models):
    names = round_kernels(*models, "pallas")
    for kernel in ROUND_KERNELS:
        assert any(n.startswith(kernel) for n in names), (kernel, sorted(set(names)))


def test_train_step_follows_the_switch(models):
    target, drafter = models
    assert step_kernels(target, drafter, "xla") == []
    assert step_kernels(target, drafter, "auto") == []
    assert "pjax_expert_matmul" in step_kernels(target, drafter, "pallas")
