"""`python -m pjax check`, section `targets`: every target family against transformers in float32.

A tiny checkpoint of each family (`pjax.check.families`: random float32 weights written by transformers) is loaded by
pjax in float32; a cached prefill, a verify-sized extend (K + 1 = 4 tokens: the MoE layers take the few-pair
expert-matmul path) and a decode step run with each implementation, and their logits are compared with transformers'
float32 forward of the whole sequence: relative error (Frobenius) <= PARITY_BOUND. Needs transformers and torch (CPU
torch is enough); without them the section is skipped, not failed.
"""
from __future__ import annotations

import functools
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from pjax.check.families import AVAILABLE, FAMILIES, hf_logits, randomize
from pjax.check.report import PARITY_BOUND, Report, float_errors, frobenius_rel, kernels_in
from pjax.checkpoint import load_target
from pjax.kernels import IMPLEMENTATIONS
from pjax.models.cache import init_cache
from pjax.models.target import forward, logits_from_hidden

__all__ = ["CHECKS", "NEEDS"]

NEEDS = "needs transformers and torch (pip install 'transformers>=5.17,<=5.19' torch; CPU torch is enough)"


def check_targets(report: Report, quick: bool) -> None:
    try:
        import transformers
        import torch
    except ImportError:
        report.skip("targets", NEEDS)
        return
    transformers.utils.logging.disable_progress_bar()
    prefill, extends = 12, (4, 1)  # a verify of K + 1 = 4 tokens, then a decode step
    total = prefill + sum(extends)
    for name in AVAILABLE:
        model_name, config_name, kw = FAMILIES[name]
        if not hasattr(transformers, model_name):
            report.skip(f"targets {name}", f"{name}: transformers {transformers.__version__} has no {model_name}")
            continue
        if name == "gpt_oss" and not _reads_swiglu_limit():
            kw = dict(kw, swiglu_limit=7.0)  # this transformers hard-codes the clamp at 7.0 and ignores the config's
        torch.manual_seed(0)
        model_cls, config_cls = getattr(transformers, model_name), getattr(transformers, config_name)
        model = randomize(model_cls(config_cls(**kw)).float().eval(), std=0.2)
        ids = np.random.default_rng(1).integers(0, kw["vocab_size"], (1, total))
        ref = hf_logits(model, ids)
        with tempfile.TemporaryDirectory() as path:
            model.save_pretrained(path)
            target = load_target(path, dtype=jnp.float32)
        for impl in IMPLEMENTATIONS:
            step = jax.jit(functools.partial(forward, implementation=impl))
            cache = init_cache(target.config, 1, 32, jnp.float32)
            start, worst, worst_abs, ran = 0, 0.0, 0.0, set()
            for n in (prefill,) + extends:
                toks = jnp.asarray(ids[:, start:start + n], jnp.int32)
                pos = jnp.arange(start, start + n, dtype=jnp.int32)[None]
                out = step(target, toks, pos, cache)
                cache = out.cache
                got = np.asarray(logits_from_hidden(target, out.hidden))
                worst = max(worst, frobenius_rel(got, ref[:, start:start + n]))
                worst_abs = max(worst_abs, float_errors(got, ref[:, start:start + n])[0])
                ran.add(kernels_in(step, target, toks, pos, cache))
                start += n
            report.record("targets", f"{name} logits vs transformers", impl,
                          f"prefill {prefill}, extend {extends[0]}, decode {extends[1]} (f32)", abs_err=worst_abs,
                          rel_err=worst, bound=f"rel<={PARITY_BOUND}", ok=worst <= PARITY_BOUND,
                          ran="; ".join(sorted(ran)))


def _reads_swiglu_limit() -> bool:
    """transformers < 5.18 builds GPT-OSS experts with a fixed limit 7.0 / alpha 1.702 whatever the config says
    (5.18 reads config.swiglu_limit / swiglu_alpha, as pjax does)."""
    import inspect

    from transformers.models.gpt_oss import modeling_gpt_oss
    return "config.swiglu_limit" in inspect.getsource(modeling_gpt_oss)


CHECKS = (check_targets,)
