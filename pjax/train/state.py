"""Training state (step, params, optimizer state, RNG, data position) and its creation from a drafter."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from pjax.models.drafter import Drafter
from pjax.train.config import TrainConfig
from pjax.train.optim import make_optimizer, split_params, trainable_mask

__all__ = ["TrainState", "drafter_from_state", "init_train_state"]


@dataclasses.dataclass(frozen=True)
class TrainState:
    step: Any  # int32 []
    params: Any  # full drafter params (frozen leaves included, never updated)
    opt_state: Any  # optax state over the trainable leaves
    rng: Any  # uint32 key data of the run's base key (step keys are fold_in(base, step))
    data_position: Any  # int32 []: index of the next batch in the data stream


jax.tree_util.register_dataclass(TrainState, data_fields=["step", "params", "opt_state", "rng", "data_position"],
                                 meta_fields=[])


def init_train_state(drafter: Drafter, cfg: TrainConfig) -> TrainState:
    tx = make_optimizer(cfg.optim, cfg.total_steps)
    params = jax.tree.map(jnp.copy, drafter.params)  # the train step donates its state: never alias the caller's
    p_t, _ = split_params(params, trainable_mask(params, cfg.effective_optim))
    key = jax.random.key_data(jax.random.key(cfg.seed))
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(p_t), key, jnp.zeros((), jnp.int32))


def drafter_from_state(drafter: Drafter, state: TrainState) -> Drafter:
    return Drafter(drafter.config, drafter.graphdef, state.params, drafter.d2t)
