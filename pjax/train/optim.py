"""Optimiser: optax AdamW with warmup + cosine/linear decay and global-norm clipping over the
trainable part of the drafter params (speculators: everything but `lm_head`, which is a frozen copy of
the target's head rows; embeddings trainable for P-EAGLE, frozen for EAGLE-3)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
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


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    parts = []
    if cfg.grad_clip is not None and cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(optax.adamw(learning_rate_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay))
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
