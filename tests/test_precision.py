"""One matmul-precision rule for every public forward (`pjax.precision`): a float32 model's products run at
precision "highest" (full float32 on the GPU, where XLA's default is TF32), a bfloat16 model's at the default, and a
precision chosen explicitly is kept. The CPU suite sets "highest" globally (conftest), so each check clears it and
reads the precision off the traced program."""
import re

import jax
import jax.numpy as jnp
import pytest

import pjax
from pjax.config import LayerSpec, ModelConfig, RopeSpec
from pjax.models.drafter import combine, draft_logits_from_hidden, drafter_forward
from pjax.models.target import forward, logits_from_hidden, target_logits
from pjax.precision import matmul_precision
from pjax.train.target_features import target_features
from tests.engine_utils import make_drafter


@pytest.fixture(scope="module")
def models():
    cfg = ModelConfig("llama", 61, 32, 64, 4, tuple(LayerSpec(8, 2, RopeSpec()) for _ in range(2)), rms_norm_eps=1e-5)
    target = pjax.init_target(cfg, jax.random.key(0), jnp.float32, scale=0.3)
    return target, make_drafter(target)


def precisions(fn, *args, chosen=None) -> set:
    """The precisions of the dot_generals in fn(*args)'s program, traced with the precision `chosen` (None: none)."""
    with jax.default_matmul_precision(chosen):
        text = str(jax.make_jaxpr(fn)(*args))
    assert "dot_general" in text
    return set(re.findall(r"Precision\.(\w+)", text))


ENTRY_POINTS = {
    "target_logits": lambda t, d: (target_logits, t, jnp.ones((1, 4), jnp.int32)),
    "forward": lambda t, d: (lambda t, x: forward(t, x, jnp.arange(4)[None]).hidden, t, jnp.ones((1, 4), jnp.int32)),
    "logits_from_hidden": lambda t, d: (logits_from_hidden, t, jnp.ones((2, 32), t.dtype)),
    "target_features": lambda t, d: (lambda t, x: target_features(t, x, jnp.zeros_like(x), (0, 1, 2)), t,
                                     jnp.ones((1, 4), jnp.int32)),
    "combine": lambda t, d: (combine, d, jnp.ones((2, 96), d.dtype)),
    "drafter_forward": lambda t, d: (lambda d, x: drafter_forward(d, jnp.ones((1, 2), jnp.int32), x,
                                                                  jnp.arange(2)[None])[0], d,
                                     jnp.ones((1, 2, 32), d.dtype)),
    "draft_logits_from_hidden": lambda t, d: (draft_logits_from_hidden, d, jnp.ones((2, 32), d.dtype)),
}


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_float32_forwards_run_full_precision_products(models, name):
    target, drafter = models
    fn, model, x = ENTRY_POINTS[name](target, drafter)
    assert precisions(fn, model, x) == {"HIGHEST"}
    assert precisions(fn, model, x, chosen="default") == {"DEFAULT"}  # an explicit choice (allow_tf32) is kept
    half = model.astype(jnp.bfloat16)
    assert precisions(fn, half, x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x) == set()


def test_the_rule(models):
    target, drafter = models
    assert matmul_precision(target, None) == "highest"
    assert matmul_precision(target.astype(jnp.bfloat16), drafter) == "highest"
    assert matmul_precision(target.astype(jnp.bfloat16), drafter.astype(jnp.bfloat16)) is None
    assert matmul_precision(target, drafter, allow_tf32=True) == "default"
    from pjax.decode.compiled import matmul_precision as decode_rule
    assert decode_rule(target, drafter, False) == "highest" and decode_rule(target, drafter, True) == "default"


@pytest.fixture(scope="module")
def training():
    from tests.train_utils import byte_training_setup
    return byte_training_setup(32, 2, draft_vocab_size=200, num_depths=2, max_anchors=None)


@pytest.mark.parametrize("dtype, compute, want", [(jnp.float32, None, "highest"), (jnp.float32, "bfloat16", "highest"),
                                                  (jnp.bfloat16, "bfloat16", None),
                                                  (jnp.bfloat16, None, "highest")])
def test_training_steps_follow_the_rule(training, monkeypatch, dtype, compute, want):
    """train_drafter's steps run (and are traced) under the rule: a float32 target, or float32 compute of the head."""
    import dataclasses

    import numpy as np

    import pjax.train.loop as loop
    target, drafter, stream, cfg = training
    seen = []

    def fake_step(*a, **k):
        def step(state, shell, target, batch):
            seen.append(jax.config.jax_default_matmul_precision)
            return state, dict(loss=np.float32(1), grad_norm=np.float32(1), correct=np.zeros(2), total=np.ones(2),
                               tokens=np.float32(1), lr=np.float32(0))
        return step
    monkeypatch.setattr(loop, "make_train_step", fake_step)
    with jax.default_matmul_precision(None):
        loop.train_drafter(target.astype(dtype), drafter, stream, dataclasses.replace(cfg, compute_dtype=compute),
                           steps=1, progress=False)
    assert seen == [want]
