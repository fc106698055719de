"""One rule pairs a head with a target (`pjax.models.pairing`): a head saved without aux layer ids reads the same
target layers whether it is loaded with a target, without one, run by the engine or trained — and the engine's output
is the same every way."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pjax
from pjax.config import LayerSpec, ModelConfig, RopeSpec
from pjax.models.drafter import DrafterConfig
from pjax.models.pairing import check_pair, resolve_aux_layer_ids
from pjax.train import CodConfig, OptimConfig, TrainConfig
from pjax.train import step as train_step_module
from pjax.train.state import init_train_state
from tests.engine_utils import FAST

V, H = 61, 32
PROMPTS = [[5, 17, 3], [9, 1, 44, 60, 2, 10]]


def target_of(layers, aux=()):
    rope = RopeSpec(theta=10000.0)
    cfg = ModelConfig("llama", V, H, 64, 4, tuple(LayerSpec(8, 2, rope) for _ in range(layers)), rms_norm_eps=1e-5,
                      aux_layer_ids=aux)
    return pjax.init_target(cfg, jax.random.key(0), jnp.float32, scale=0.3)


def head_for(target, aux=()):
    layer = ModelConfig("llama", V, H, 2 * H, 4, (LayerSpec(8, 2, RopeSpec(theta=1e4)),), rms_norm_eps=1e-5)
    cfg = DrafterConfig(layer=layer, num_aux=3, target_hidden_size=H, draft_vocab_size=V, mask_token_id=V - 1,
                        aux_layer_ids=aux, num_depths=4)
    return pjax.init_drafter(cfg, jax.random.key(1), jnp.float32, scale=0.2)


@pytest.mark.parametrize("layers,target_aux,want", [(12, (), (2, 6, 9)), (12, (1, 4, 11), (1, 4, 11)),
                                                   (5, (), (1, 3, 5))])
def test_one_head_four_ways(tmp_path, monkeypatch, layers, target_aux, want):
    """Saved without aux ids; loaded (1) without a target, (2) with one; (3) run by the engine; (4) trained: the same
    ids everywhere, from the precedence head ids -> target config ids -> default, and the same engine output."""
    target = target_of(layers, target_aux)
    path = pjax.save_drafter(head_for(target), tmp_path / "head", dtype="float32")
    bare = pjax.load_drafter(path, dtype="float32")
    paired = pjax.load_drafter(path, dtype="float32", target=target)
    assert bare.config.aux_layer_ids == ()  # the checkpoint names none
    assert paired.config.aux_layer_ids == want
    assert resolve_aux_layer_ids(bare.config, target.config) == check_pair(target.config, bare.config) == want
    outs = [pjax.generate(target, d, PROMPTS, max_new_tokens=6, num_speculative_tokens=3, compiler_options=FAST)
            for d in (bare, paired)]
    assert outs[0].stats["aux_layer_ids"] == outs[1].stats["aux_layer_ids"] == list(want)
    assert outs[0].tokens == outs[1].tokens

    seen = []  # training: the online target features read the same layers
    real = train_step_module.target_features
    monkeypatch.setattr(train_step_module, "target_features",
                        lambda t, toks, doc, ids, **kw: seen.append(tuple(ids)) or real(t, toks, doc, ids, **kw))
    cfg = TrainConfig(total_seq_len=16, batch_rows=1, total_steps=1, cod=CodConfig(num_depths=2, max_anchors=None),
                      optim=OptimConfig(lr=1e-3))
    shell = dataclasses.replace(bare, params=None)
    batch = {"tokens": np.arange(16, dtype=np.int32)[None] % V, "loss_mask": np.ones((1, 16), np.int32),
             "document_ids": np.zeros((1, 16), np.int32)}
    # traced, not run: the ids are static, fixed when the step calls target_features
    jax.eval_shape(lambda state: train_step_module.train_step(state, shell, target, batch, cfg),
                   init_train_state(bare, cfg))
    assert seen == [want]


def test_head_ids_win_and_bad_ids_are_named():
    target = target_of(12, (1, 4, 11))
    assert check_pair(target.config, head_for(target, (3, 5, 7)).config) == (3, 5, 7)
    with pytest.raises(pjax.ConfigError, match=r"\[3, 5, 13\] \(from the head\) contain \[13\], outside the target "
                                               r"depth \[0, 12\]"):
        check_pair(target.config, head_for(target, (3, 5, 13)).config)
    with pytest.raises(pjax.ConfigError, match="target_hidden_size=32 but the target has hidden_size=64"):
        wide = dataclasses.replace(target.config, hidden_size=64)
        check_pair(wide, head_for(target).config)
