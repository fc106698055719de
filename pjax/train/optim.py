"""Optimiser: optax AdamW, or Muon on the weight matrices and AdamW on the rest (speculators' `--optimizer muon`,
its CLI default), with warmup + cosine/linear decay and global-norm clipping over the trainable part of the drafter
params (speculators: everything but `lm_head`, which is a frozen copy of the target's head rows; embeddings
trainable for P-EAGLE, frozen for EAGLE-3)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 6e-4
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    schedule: str = "cosine"  # "cosine" | "linear" | "constant"
    warmup_steps: Optional[int] = None  # None -> 1% of total steps (speculators default)
    min_lr_ratio: float = 0.0
    grad_clip: Optional[float] = 1.0
    train_embeddings: bool = True
    train_lm_head: bool = False
    # "adamw" | "muon": Muon (torch.optim.Muon: Nesterov momentum, 5 Newton-Schulz steps in bf16, lr scaled by
    # 0.2 sqrt(max(rows, cols)) to match AdamW's update RMS, decoupled weight decay) on every 2-D weight with both
    # sides > 1 except embeddings and lm_head (`muon_mask`); AdamW (lr, weight_decay) on the rest
    optimizer: str = "adamw"
    muon_lr: Optional[float] = None  # None: lr (speculators)
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.1
    muon_ns_steps: int = 5


def learning_rate_schedule(cfg: OptimConfig, total_steps: int):
    total = max(1, int(total_steps))
    warm = total // 100 if cfg.warmup_steps is None else int(cfg.warmup_steps)
    warm = min(warm, total)
    end = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "constant":
        decay = optax.constant_schedule(cfg.lr)
    elif cfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(cfg.lr, max(1, total - warm), alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "linear":
        decay = optax.linear_schedule(cfg.lr, end, max(1, total - warm))
    else:
        raise ValueError(f"schedule {cfg.schedule!r} is not one of 'cosine', 'linear', 'constant'")
    if warm == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warm), decay], [warm])


NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic Newton-Schulz iteration (torch.optim.Muon)
MUON_EPS = 1e-7
ADAMW_NAMES = ("embed_tokens", "lm_head")  # 2-D but updated by AdamW under Muon (speculators' convention)


def newton_schulz(g, steps: int = 5, eps: float = MUON_EPS):
    """[A, B] -> an approximately orthogonalised [A, B] (U S' V^T with S' ~ 1), computed in bfloat16 on the wide
    orientation, as torch.optim.Muon."""
    a, b, c = NS_COEFFICIENTS
    bf, f32 = jnp.bfloat16, jnp.float32
    mm = lambda u, v: jnp.matmul(u, v, preferred_element_type=f32)  # noqa: E731  (bf16 operands, f32 sums)
    tall = g.shape[0] > g.shape[1]
    x = (g.T if tall else g).astype(bf)
    x = (x / jnp.maximum(jnp.linalg.norm(x.astype(f32)).astype(bf), eps)).astype(bf)
    for _ in range(steps):  # each product-and-add rounded to bf16 once, as torch.addmm
        gram = mm(x, x.T).astype(bf)
        update = (b * gram.astype(f32) + c * mm(gram, gram)).astype(bf)
        x = (a * x.astype(f32) + mm(update, x)).astype(bf)
    return (x.T if tall else x).astype(g.dtype)


def scale_by_muon(momentum: float, ns_steps: int) -> optax.GradientTransformation:
    """Muon's direction for 2-D leaves: Nesterov momentum (buf <- lerp(buf, g, 1 - m); u = lerp(g, buf, m)),
    Newton-Schulz, times 0.2 sqrt(max(A, B)) (the learning rate and weight decay come after in the chain)."""
    def init(params):
        return jax.tree.map(jnp.zeros_like, params)

    def update(updates, buf, params=None):
        buf = jax.tree.map(lambda b, g: b + (1 - momentum) * (g - b), buf, updates)
        out = jax.tree.map(lambda g, b: 0.2 * max(g.shape) ** 0.5 * newton_schulz(g + momentum * (b - g), ns_steps),
                           updates, buf)
        return out, buf
    return optax.GradientTransformation(init, update)


def muon_mask(params):
    """Same tree as params: True where Muon updates the leaf (2-D, both sides > 1, not an embedding or lm_head)."""
    def muon(path, leaf):
        names = [str(getattr(k, "key", k)) for k in path]
        return leaf.ndim == 2 and min(leaf.shape) > 1 and not any(n in ADAMW_NAMES for n in names)
    return jax.tree_util.tree_map_with_path(muon, params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    parts = []
    if cfg.grad_clip is not None and cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    adamw = optax.adamw(learning_rate_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        parts.append(adamw)
    elif cfg.optimizer == "muon":
        lr = learning_rate_schedule(dataclasses.replace(cfg, lr=cfg.lr if cfg.muon_lr is None else cfg.muon_lr),
                                    total_steps)
        muon = optax.chain(scale_by_muon(cfg.muon_momentum, cfg.muon_ns_steps),
                           optax.add_decayed_weights(cfg.muon_weight_decay), optax.scale_by_learning_rate(lr))
        labels = lambda params: jax.tree.map(lambda m: "muon" if m else "adamw", muon_mask(params))  # noqa: E731
        parts.append(optax.multi_transform({"muon": muon, "adamw": adamw}, labels))
    else:
        raise ValueError(f"optimizer {cfg.optimizer!r} is not one of 'adamw', 'muon'")
    return optax.chain(*parts)


def trainable_mask(params, cfg: OptimConfig):
    """Same tree as params, True where the leaf is trained."""
    def keep(path, leaf):
        top = str(getattr(path[0], "key", path[0]))
        if top == "lm_head":
            return cfg.train_lm_head
        if top == "embed_tokens":
            return cfg.train_embeddings
        return True
    return jax.tree_util.tree_map_with_path(keep, params)


def split_params(params, mask):
    """(trainable, frozen): two trees with None where the other one holds the leaf."""
    a = jax.tree.map(lambda m, x: x if m else None, mask, params)
    b = jax.tree.map(lambda m, x: None if m else x, mask, params)
    return a, b


def merge_params(a, b):
    return jax.tree.map(lambda x, y: y if x is None else x, a, b, is_leaf=lambda x: x is None)
