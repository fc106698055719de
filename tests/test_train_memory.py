"""Training memory grows linearly with the row length: the compiled step's temporaries (XLA's memory analysis on
CPU) at 4S are about 4x those at S, not 16x. Attention runs in query chunks (or the flash kernel), the vocabulary
losses in token chunks, so no [S, S] or [S, V] tensor of a whole row exists. The unchunked attention reference at
the same shapes is the control: it grows quadratically, so the check can fail."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjax.config import LayerSpec, ModelConfig, RopeSpec
from pjax.models.drafter import Drafter
from pjax.models.target import init_target
from pjax.train.cod import CodConfig, cod_budget
from pjax.train.config import TrainConfig
from pjax.train.heads import drafter_config_for_target, init_drafter_for_target
from pjax.train.optim import OptimConfig
from pjax.train.state import init_train_state
from pjax.train.step import make_train_step
from pjax.train.target_lm import lm_loss

S = 1024
FAST = {"xla_backend_optimization_level": 0}


def temp_bytes(fn, *args) -> int:
    return jax.jit(fn, compiler_options=FAST).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.fixture(scope="module", autouse=True)
def _release_programs():
    """This module compiles many large training steps: drop them afterwards (a whole-suite process keeps every
    compiled program otherwise)."""
    yield
    jax.clear_caches()


@pytest.fixture(scope="module")
def target():
    cfg = ModelConfig("llama", 512, 32, 64, 4, tuple(LayerSpec(8, 2, RopeSpec()) for _ in range(2)))
    return init_target(cfg, jax.random.key(0), scale=0.1)


def lm_step_bytes(target, s, attn_chunk):
    tokens = jax.ShapeDtypeStruct((1, s), jnp.int32)
    fn = jax.grad(lambda p, t, d: lm_loss(p, target, t, d, attn_chunk=attn_chunk, loss_chunk=128))
    return temp_bytes(fn, target.params, tokens, tokens)


def test_target_lm_step_memory_is_linear_in_row_length(target):
    small, large = lm_step_bytes(target, S, 128), lm_step_bytes(target, 4 * S, 128)
    assert large / small < 6, (small, large)
    dense_small, dense_large = lm_step_bytes(target, S, None), lm_step_bytes(target, 4 * S, None)  # one chunk
    assert dense_large / dense_small > 10, (dense_small, dense_large)


@pytest.mark.full  # test_head_step_stores_one_layer_input_per_draft_layer checks the same step at 4x the row (2 heads)
def test_drafter_step_memory_is_linear_in_row_length(target):
    """The whole P-EAGLE train step: online target features, COD sampling, drafter forward / backward, AdamW."""
    dcfg = drafter_config_for_target(target.config, num_layers=1, draft_vocab_size=200, mask_token_id=511,
                                     num_depths=3, aux_layer_ids=(0, 1, 2))
    drafter = init_drafter_for_target(target, dcfg, jax.random.key(1))
    shell = Drafter(drafter.config, drafter.graphdef, None, drafter.d2t)

    def step_bytes(s):
        cfg = TrainConfig(total_seq_len=s, batch_rows=1, total_steps=10, cod=CodConfig(num_depths=3, max_anchors=64),
                          optim=OptimConfig(lr=1e-3, warmup_steps=1), attn_chunk=128, target_chunk=128,
                          loss_chunk=128)
        batch = {k: jax.ShapeDtypeStruct((1, s), jnp.int32) for k in ("tokens", "loss_mask", "document_ids")}
        step = make_train_step(cfg, donate=False, compiler_options=FAST)
        state = init_train_state(drafter, cfg)
        return step.lower(state, shell, target, batch).compile().memory_analysis().temp_size_in_bytes

    small, large = step_bytes(S // 2), step_bytes(2 * S)
    assert large / small < 6, (small, large)
    assert np.isfinite(large)


@pytest.mark.full  # compiles four training steps for their memory analysis
def test_head_step_stores_one_layer_input_per_draft_layer():
    """The P-EAGLE step's temporaries per COD element grow by one stored layer input ([N, H]) per draft layer, not by
    a layer's attention and MLP intermediates ([N, intermediate] several times): the draft layers are rematerialised
    one at a time in the backward pass. Shapes where the MLP is 16x the hidden size make the difference plain: a
    stored layer costs 3 x 16 x H floats per element at least, the bound is 2 x H."""
    h, inter = 64, 1024
    cfg = ModelConfig("llama", 512, h, inter, 4, tuple(LayerSpec(16, 2, RopeSpec()) for _ in range(2)))
    tgt = init_target(cfg, jax.random.key(0), scale=0.1)
    cod = CodConfig(num_depths=4, max_anchors=None)

    def step_bytes(layers, s):
        dcfg = drafter_config_for_target(cfg, num_layers=layers, draft_vocab_size=200, mask_token_id=511,
                                         num_depths=4, aux_layer_ids=(0, 1, 2))
        drafter = init_drafter_for_target(tgt, dcfg, jax.random.key(1))
        shell = Drafter(drafter.config, drafter.graphdef, None, drafter.d2t)
        tc = TrainConfig(total_seq_len=s, batch_rows=1, total_steps=10, cod=cod, optim=OptimConfig(lr=1e-3,
                         warmup_steps=1), attn_chunk=128, target_chunk=128, loss_chunk=128)
        batch = {k: jax.ShapeDtypeStruct((1, s), jnp.int32) for k in ("tokens", "loss_mask", "document_ids")}
        step = make_train_step(tc, donate=False, compiler_options=FAST)
        return step.lower(init_train_state(drafter, tc), shell, tgt, batch).compile().memory_analysis() \
            .temp_size_in_bytes

    lengths = (S // 4, S)
    elements = [cod_budget(s, cod) for s in lengths]
    per_element = {}
    for layers in (2, 3):
        small, large = (step_bytes(layers, s) for s in lengths)
        assert large / small < 6, (layers, small, large)  # linear in the row length (4x the row)
        per_element[layers] = (large - small) / (elements[1] - elements[0])
    per_layer = per_element[3] - per_element[2]
    assert per_layer <= 4 * 2 * h, per_element  # float32 bytes per element and draft layer

