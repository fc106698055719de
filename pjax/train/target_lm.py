"""Next-token training of a target model on packed rows: small targets that have something to predict (examples,
CI), and the scaling path of the library's training (examples/benchmarks/bench_train.py).

Memory-bounded at any row length: attention under a document mask runs the flash kernel (cuDNN where every row is
one document) or the query-chunked reference, never a [S, S] score tensor; the cross-entropy runs over token chunks
of the vocabulary, never a whole [tokens, V] float32 tensor; `remat` rematerialises each decoder layer. Mixed
precision: float32 master weights and optimizer state, the forward and backward in `compute_dtype`.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from pjax.kernels.flash_attention import causal_mask, document_mask
from pjax.kernels.flash_attention.chunking import chunk_size, chunked_map
from pjax.models.layers import head_logits
from pjax.models.target import Target
from pjax.train.data import RowStream
from pjax.train.target_features import document_positions

__all__ = ["causal_lengths", "lm_loss", "make_lm_step", "token_nll", "train_target_lm"]

LOSS_CHUNK_ELEMENTS = 1 << 25  # float32 logits of one token chunk (tokens x vocabulary): 128 MiB


def token_nll(module, hidden, labels, chunk: Optional[int] = None):
    """-log p(label) [N] of hidden states [N, H] (after the final norm) under the model's LM head (soft-capped),
    over token chunks of at most LOSS_CHUNK_ELEMENTS logits (`chunk` tokens when given), each rematerialised in the
    backward pass."""
    w, cap = module.head_weight(), module.cfg.final_logit_softcap

    def fn(x):
        logits = head_logits(x["h"], w, cap)
        return jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, x["y"][:, None], axis=-1)[:, 0]

    return chunked_map(fn, dict(h=hidden, y=labels), chunk_size(hidden.shape[0], w.shape[-1], LOSS_CHUNK_ELEMENTS,
                                                                chunk))


def lm_loss(params, target: Target, tokens, document_ids, lengths=None, *, compute_dtype: Optional[str] = None,
            remat: bool = False, loss_chunk: Optional[int] = None, attn_chunk: Optional[int] = None,
            implementation: str = "auto"):
    """Mean next-token cross-entropy inside documents of packed rows: tokens, document_ids [B, S] (-1 padding).
    lengths [B] or None: every row is one document of that length with its padding after it (`causal_lengths`),
    which cuDNN's attention can take; else document masks. compute_dtype: cast the float params for the forward and
    backward (float32 gradients reach float32 master params); remat: recompute each decoder layer in the backward
    pass; loss_chunk / attn_chunk: token / query chunk sizes (None = automatic); implementation: the kernel switch."""
    model = Target(target.config, target.graphdef, params)
    if compute_dtype is not None:  # params and the layers' compute dtype (casting the params alone runs f32 matmuls)
        model = model.astype(compute_dtype)
    module = model.module
    b, s = tokens.shape
    mask = document_mask(document_ids, attn_chunk) if lengths is None else causal_mask(lengths, s, attn_chunk)
    positions = document_positions(document_ids)

    def layer_fn(layer, x):
        return layer(x, positions, None, mask=mask, implementation=implementation)[0]

    if remat:
        layer_fn = nnx.remat(layer_fn)
    x = module.embed(tokens)
    for layer in module.layers:
        x = layer_fn(layer, x)
    hidden = module.norm(x)[:, :-1]
    nll = token_nll(module, hidden.reshape(b * (s - 1), -1), tokens[:, 1:].reshape(-1), loss_chunk).reshape(b, s - 1)
    ok = (document_ids[:, 1:] == document_ids[:, :-1]) & (document_ids[:, 1:] != -1)
    return jnp.sum(nll * ok) / jnp.maximum(jnp.sum(ok), 1)


def causal_lengths(document_ids) -> Optional[np.ndarray]:
    """Host check of a batch's document_ids [B, S]: the per-row lengths [B] when every row is one document followed
    by padding (the layout cuDNN's attention takes), else None."""
    doc = np.asarray(document_ids)
    pad = doc == -1
    first = doc[:, :1]
    if not (np.all(pad | (doc == first)) and np.all(np.diff(pad.astype(np.int8), axis=1) >= 0)):
        return None
    return (~pad).sum(axis=1).astype(np.int32)


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


def _lm_step(params, opt_state, target: Target, tokens, document_ids, lengths, tx, options):
    loss, g = jax.value_and_grad(lm_loss)(params, target, tokens, document_ids, lengths, **dict(options))
    updates, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


@functools.lru_cache(maxsize=8)
def _jit_lm_step(compiler_options):
    kw = {} if compiler_options is None else dict(compiler_options=dict(compiler_options))
    return jax.jit(_lm_step, static_argnames=("tx", "options"), donate_argnums=(0, 1), **kw)


def make_lm_step(*, lr: float = 3e-3, steps: int = 1000, warmup: int = 20, weight_decay: float = 0.0,
                 compute_dtype: Optional[str] = None, remat: bool = False, loss_chunk: Optional[int] = None,
                 attn_chunk: Optional[int] = None, implementation: str = "auto",
                 compiler_options: Optional[dict] = None):
    """(init, step) of next-token training (AdamW, warmup + cosine, global-norm clip 1.0): init(params) -> optimizer
    state; step(params, opt_state, target_shell, tokens, document_ids, lengths=None) -> (params, opt_state, loss),
    jitted with params and state donated (float32 masters; `lm_loss` for the other options)."""
    tx = _Tx(lr, steps, warmup, weight_decay)
    options = tuple(sorted(dict(compute_dtype=compute_dtype, remat=remat, loss_chunk=loss_chunk, attn_chunk=attn_chunk,
                                implementation=implementation).items()))
    jitted = _jit_lm_step(None if compiler_options is None else tuple(sorted(compiler_options.items())))

    def step(params, opt_state, target: Target, tokens, document_ids, lengths=None):
        return jitted(params, opt_state, target, tokens, document_ids, lengths, tx, options)

    return tx.init, step


def train_target_lm(target: Target, stream: RowStream, steps: int, *, lr: float = 3e-3, warmup: int = 20,
                    weight_decay: float = 0.0, progress: bool = False, log_every: int = 50, log_fn=None,
                    compiler_options: Optional[dict] = None, compute_dtype: Optional[str] = None,
                    remat: bool = False, loss_chunk: Optional[int] = None, attn_chunk: Optional[int] = None,
                    implementation: str = "auto") -> tuple[Target, list]:
    """Train all target params for `steps` batches of `stream`; returns (target, [(step, loss), ...]).
    Params and optimizer state stay in the target's dtype (float32 masters); compute_dtype (e.g. "bfloat16") runs
    the forward and backward in that dtype; remat rematerialises each decoder layer; loss_chunk / attn_chunk: token /
    query chunk sizes (None = automatic); implementation: the kernel switch ("xla" | "pallas" | "auto": on a GPU
    cuDNN attention for batches of single-document rows, the flash kernel otherwise)."""
    init, step = make_lm_step(lr=lr, steps=steps, warmup=warmup, weight_decay=weight_decay,
                              compute_dtype=compute_dtype, remat=remat, loss_chunk=loss_chunk, attn_chunk=attn_chunk,
                              implementation=implementation, compiler_options=compiler_options)
    params = jax.tree.map(jnp.array, target.params)
    opt_state = init(params)
    shell = Target(target.config, target.graphdef, None)
    history, bar = [], None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=steps, desc="train target", dynamic_ncols=True)
    losses = []
    for i in range(steps):
        b = stream.batch(i)
        lengths = causal_lengths(b["document_ids"])
        lengths = None if lengths is None else jnp.asarray(lengths)
        params, opt_state, loss = step(params, opt_state, shell, jnp.asarray(b["tokens"]),
                                       jnp.asarray(b["document_ids"]), lengths)
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
