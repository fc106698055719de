"""One rule pairs a head with a target (`pjax.models.pairing`): a head saved without aux layer ids reads the same
target layers whether it is loaded with a target, without one, run by the engine or trained — and the engine's output
is the same every way."""
import dataclasses
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pjax
from pjax.config import LayerSpec, ModelConfig, RopeSpec
from pjax.decode import EngineConfig, make_spec
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


# 7 layers: the vLLM default (2, n // 2, n - 3) fits; 5: the shallow fallback (1, ~n / 2, n)
@pytest.mark.parametrize("layers,target_aux,want", [(7, (), (2, 3, 4)), (7, (1, 4, 7), (1, 4, 7)),
                                                   (5, (), (1, 3, 5))])
def test_one_head_four_ways(request, tmp_path, monkeypatch, layers, target_aux, want):
    """Saved without aux ids; loaded (1) without a target, (2) with one; (3) run by the engine; (4) trained: the same
    ids everywhere, from the precedence head ids -> target config ids -> default, and the same engine output. (3): the
    engine's static settings for every case; its generations for the first case, and for every case with --full (each
    case's generations compile their own programs)."""
    target = target_of(layers, target_aux)
    path = pjax.save_drafter(head_for(target), tmp_path / "head", dtype="float32")
    bare = pjax.load_drafter(path, dtype="float32")
    paired = pjax.load_drafter(path, dtype="float32", target=target)
    assert bare.config.aux_layer_ids == ()  # the checkpoint names none
    assert paired.config.aux_layer_ids == want
    assert resolve_aux_layer_ids(bare.config, target.config) == check_pair(target.config, bare.config) == want
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a shallow target's default ids are announced (test_engine_inputs checks it)
        specs = [make_spec(target, d, EngineConfig(num_speculative_tokens=3), max_new_tokens=6) for d in (bare, paired)]
    assert specs[0] == specs[1] and specs[0].aux_layer_ids == want
    if (layers, target_aux) == (7, ()) or request.config.getoption("--full"):
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


def test_a_head_for_another_model_of_the_same_shape_is_named(request, tmp_path):
    """The head records its verifier's name or directory; a target loaded from elsewhere (same architecture, same
    shape) is reported, a native copy keeps its source's name, and the same model in another directory is not."""
    from pjax.checkpoint.native import save_native_target
    from pjax.models.pairing import pair_warnings
    from tests.hf_utils import randomize
    import torch
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    for name in ("Model-A", "Model-B"):
        randomize(tf.LlamaForCausalLM(cfg).float(), std=0.2).save_pretrained(tmp_path / name)
    a, b = (pjax.load_target(tmp_path / n, dtype=jnp.float32) for n in ("Model-A", "Model-B"))
    assert a.config.name_or_path == str(tmp_path / "Model-A")
    head = pjax.load_drafter(pjax.save_drafter(head_for(a, aux=(0, 1, 2)), tmp_path / "head", dtype="float32",
                                               verifier_name_or_path="org/model-a"), dtype=jnp.float32)
    assert pair_warnings(a.config, head.config) == []
    assert pair_warnings(b.config, head.config) == [
        f"the head was trained for the verifier 'org/model-a' but the target is '{tmp_path / 'Model-B'}': if they "
        "are different models, expect low acceptance"]
    hf = json.loads((tmp_path / "Model-A" / "config.json").read_text())
    native = pjax.load_target(save_native_target(a, hf, tmp_path / "native"), dtype=jnp.float32)
    assert native.config.name_or_path == str(tmp_path / "Model-A") and pair_warnings(native.config, head.config) == []
    # the engine reports it (a generation's stats carry the engine's warnings: tests/test_engine_inputs.py's
    # test_verifier_mismatch_is_reported; with --full, a generation here too)
    with pytest.warns(UserWarning, match="trained for the verifier 'org/model-a' but the target is .*Model-B"):
        engine = pjax.decode.Engine(b, head, pjax.decode.EngineConfig(max_slots=2, max_len=64, compiler_options=FAST))
    assert any("org/model-a" in w for w in engine.warnings)
    if request.config.getoption("--full"):
        with pytest.warns(UserWarning, match="trained for the verifier 'org/model-a' but the target is .*Model-B"):
            res = pjax.generate(b, head, PROMPTS, max_new_tokens=2, compiler_options=FAST)
        assert any("org/model-a" in w for w in res.stats["warnings"])
