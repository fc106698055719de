"""Next-token training of a (tiny) target model on packed rows — used to make a small target that
has something to predict, so a drafter trained against it shows real learning (examples, CI)."""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pjax.models.target import Target
from pjax.train.masks import DocCausalMask
from pjax.train.data import RowStream
from pjax.train.target_features import document_positions


def lm_loss(params, target: Target, tokens, document_ids):
    """Mean next-token cross-entropy inside documents of packed rows [B, S]."""
    t = Target(target.config, target.graphdef, params)
    out = t.module(tokens, document_positions(document_ids), None, mask=DocCausalMask(document_ids))
    logits = t.module.logits(out.hidden[:, :-1])
    nxt = tokens[:, 1:]
    ok = (document_ids[:, 1:] == document_ids[:, :-1]) & (document_ids[:, 1:] != -1)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, nxt[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * ok) / jnp.maximum(jnp.sum(ok), 1)


def _lm_step(params, opt_state, target: Target, tokens, document_ids, tx):
    loss, g = jax.value_and_grad(lm_loss)(params, target, tokens, document_ids)
    updates, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


@functools.lru_cache(maxsize=8)
def _jit_lm_step(opts):
    kw = {} if opts is None else dict(compiler_options=dict(opts))
    return jax.jit(_lm_step, static_argnames=("tx",), donate_argnums=(0, 1), **kw)


class _Tx:
    """Hashable wrapper so the optax transformation can be a static jit argument."""

    def __init__(self, lr, steps, warmup, weight_decay):
        self.key = (lr, steps, warmup, weight_decay)
        sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, warmup), max(warmup + 1, steps), lr * 0.1)
        self.tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=weight_decay))

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, _Tx) and other.key == self.key

    def init(self, p):
        return self.tx.init(p)

    def update(self, g, s, p):
        return self.tx.update(g, s, p)


def train_target_lm(target: Target, stream: RowStream, steps: int, *, lr: float = 3e-3, warmup: int = 20,
                    weight_decay: float = 0.0, progress: bool = False, log_every: int = 50,
                    log_fn=None, compiler_options: Optional[dict] = None) -> tuple[Target, list]:
    """Train all target params for `steps` batches of `stream`; returns (target, [(step, loss), ...])."""
    tx = _Tx(lr, steps, warmup, weight_decay)
    step = _jit_lm_step(None if compiler_options is None else tuple(sorted(compiler_options.items())))
    params = jax.tree.map(jnp.array, target.params)
    opt_state = tx.init(params)
    shell = Target(target.config, target.graphdef, None)
    history, bar = [], None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=steps, desc="train target", dynamic_ncols=True)
    losses = []
    for i in range(steps):
        b = stream.batch(i)
        params, opt_state, loss = step(params, opt_state, shell, jnp.asarray(b["tokens"]),
                                           jnp.asarray(b["document_ids"]), tx)
        losses.append(loss)
        if (i + 1) % log_every == 0 or i + 1 == steps:
            val = float(np.mean(jax.device_get(losses)))
            history.append((i + 1, val))
            losses = []
            if bar is not None:
                bar.set_postfix(loss=f"{val:.3f}")
            if log_fn is not None:
                log_fn(dict(step=i + 1, loss=val))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return Target(target.config, target.graphdef, params), history
