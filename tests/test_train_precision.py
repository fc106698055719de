"""Mixed precision in training: with compute_dtype="bfloat16" over float32 master weights, every matrix product of
the forward and backward takes bfloat16 operands (tensor cores at bf16 rate), in the target LM step and in the
P-EAGLE and EAGLE-3 head steps; the gradients reach the float32 masters as float32. Casting only the params would
leave the NNX layers computing in float32 (their compute dtype is part of the module definition): the check fails
on that."""
import functools

import jax
import jax.numpy as jnp
import pytest
from jax._src import source_info_util

from pjax.config import LayerSpec, ModelConfig, RopeSpec
from pjax.kernels.rows import take_rows
from pjax.models.drafter import Drafter
from pjax.models.target import init_target
from pjax.train.cod import CodConfig
from pjax.train.config import TrainConfig
from pjax.train.heads import drafter_config_for_target, init_drafter_for_target
from pjax.train.optim import OptimConfig
from pjax.train.state import init_train_state
from pjax.train.step import make_train_step
from pjax.train.target_lm import lm_loss
from tests.kernel_jaxpr import equations


def dot_operand_dtypes(jaxpr) -> list[tuple[str, str]]:
    """(lhs, rhs) dtype names of every dot_general in a closed jaxpr, sub-jaxprs (scan, remat, custom VJP) included,
    except the attention reference's (pjax.kernels: on a GPU, training attention runs the flash kernel or cuDNN,
    whose precision `python -m pjax check` measures)."""
    return [tuple(str(v.aval.dtype) for v in eqn.invars[:2]) for eqn, _ in equations(jaxpr.jaxpr)
            if eqn.primitive.name == "dot_general"
            and "pjax/kernels/" not in str(source_info_util.summarize(eqn.source_info))]


@pytest.fixture(scope="module")
def target():
    cfg = ModelConfig("llama", 256, 32, 64, 4, tuple(LayerSpec(8, 2, RopeSpec()) for _ in range(3)))
    return init_target(cfg, jax.random.key(0), scale=0.1)


def test_target_lm_step_runs_bf16_matmuls_over_f32_masters(target):
    tokens = jnp.zeros((2, 64), jnp.int32)
    docs = jnp.zeros((2, 64), jnp.int32)
    fn = jax.value_and_grad(lambda p: lm_loss(p, target, tokens, docs, compute_dtype="bfloat16"))
    jaxpr = jax.make_jaxpr(fn)(target.params)
    dots = dot_operand_dtypes(jaxpr)
    assert dots and all(d == ("bfloat16", "bfloat16") for d in dots), sorted(set(dots))
    scatters = scatter_add_dtypes(jaxpr)  # the embedding's gradient: frequent tokens repeat (test_take_rows_...)
    assert scatters and set(scatters) == {"float32"}, scatters
    grads = jax.jit(fn, compiler_options={"xla_backend_optimization_level": 0})(target.params)[1]  # op by op: minutes
    assert {str(g.dtype) for g in jax.tree.leaves(grads)} == {"float32"}


@pytest.mark.parametrize("objective", ["peagle", "eagle3"])
def test_head_step_runs_bf16_matmuls_over_f32_masters(target, objective):
    dcfg = drafter_config_for_target(target.config, num_layers=1, draft_vocab_size=100, mask_token_id=255,
                                     num_depths=3, aux_layer_ids=(0, 1, 2))
    drafter = init_drafter_for_target(target, dcfg, jax.random.key(1))
    shell = Drafter(drafter.config, drafter.graphdef, None, drafter.d2t)
    cfg = TrainConfig(total_seq_len=64, batch_rows=1, total_steps=10, cod=CodConfig(num_depths=3),
                      optim=OptimConfig(lr=1e-3, warmup_steps=1), compute_dtype="bfloat16", objective=objective)
    state = init_train_state(drafter, cfg)
    batch = {k: jnp.zeros((1, 64), jnp.int32) for k in ("tokens", "loss_mask", "document_ids")}
    step = make_train_step(cfg, donate=False)
    bf16_target = target.astype("bfloat16")  # the frozen target as the heads' training runs it
    dots = dot_operand_dtypes(jax.make_jaxpr(step)(state, shell, bf16_target, batch))
    assert dots and all(d == ("bfloat16", "bfloat16") for d in dots), sorted(set(dots))


def scatter_add_dtypes(jaxpr) -> list[str]:
    """Operand dtype of every floating scatter-add in a closed jaxpr, sub-jaxprs included."""
    return [str(eqn.invars[0].aval.dtype) for eqn, _ in equations(jaxpr.jaxpr)
            if eqn.primitive.name == "scatter-add" and jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.floating)]


def test_take_rows_sums_repeated_rows_in_float32():
    # a bf16 sum stalls at 256 when adding ones (256 + 1 rounds back to 256): what x[idx]'s gradient does
    x = jnp.zeros((3, 4), jnp.bfloat16)
    idx = jnp.zeros((1027,), jnp.int32).at[:3].set(jnp.array([1, 2, 2]))

    @functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})  # one program, not one per op
    def run(x, idx, y, oob_idx):
        plain = jax.grad(lambda x: x[idx].astype(jnp.float32).sum())(x)
        ours = jax.grad(lambda x: take_rows(x, idx).astype(jnp.float32).sum())(x)
        oob_grad = jax.grad(lambda y: jnp.nansum(take_rows(y, oob_idx)))(y)
        return plain, ours, take_rows(x, idx), x[idx], take_rows(y, oob_idx), oob_grad

    plain, ours, taken, indexed, oob, g = run(x, idx, jnp.ones((3, 2)), jnp.array([0, 3]))
    assert float(plain[0, 0]) == 256.0  # the defect take_rows exists for
    assert ours.dtype == jnp.bfloat16 and ours[:, 0].tolist() == [1024.0, 1.0, 2.0]
    assert jnp.array_equal(taken, indexed)
    assert jnp.isnan(oob[1]).all() and not jnp.isnan(oob[0]).any()  # jnp.take: out of range reads NaN, no gradient
    assert g.tolist() == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]


@pytest.mark.parametrize("remat", [False, True])
def test_bf16_peagle_step_accumulates_gathered_rows_in_float32(target, remat):
    """Every deeper COD element embeds the one mask token and chain keys are read by several queries: a bf16
    scatter-add for those gradients loses precision (above) and on the GPU runs as contended compare-and-swap loops
    (85 of 233 ms of the code pair's head step). Every floating scatter-add of the step must be float32."""
    dcfg = drafter_config_for_target(target.config, num_layers=2, draft_vocab_size=100, mask_token_id=255,
                                     num_depths=3, aux_layer_ids=(0, 1, 2))
    drafter = init_drafter_for_target(target, dcfg, jax.random.key(1))
    shell = Drafter(drafter.config, drafter.graphdef, None, drafter.d2t)
    cfg = TrainConfig(total_seq_len=64, batch_rows=1, total_steps=10, cod=CodConfig(num_depths=3), remat=remat,
                      optim=OptimConfig(lr=1e-3, warmup_steps=1), compute_dtype="bfloat16", implementation="xla")
    batch = {k: jnp.zeros((1, 64), jnp.int32) for k in ("tokens", "loss_mask", "document_ids")}
    jaxpr = jax.make_jaxpr(make_train_step(cfg, donate=False))(init_train_state(drafter, cfg), shell,
                                                               target.astype("bfloat16"), batch)
    dtypes = scatter_add_dtypes(jaxpr)
    assert dtypes and set(dtypes) == {"float32"}, dtypes
