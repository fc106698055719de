"""orbax checkpointing of the training state, with exact resume."""
from __future__ import annotations

import os
from typing import Optional

import jax

from pjax.train.state import TrainState

__all__ = ["Checkpointer"]


class Checkpointer:
    """orbax CheckpointManager over `TrainState` (params, optimizer state, step, RNG, data position)."""

    def __init__(self, directory, *, max_to_keep: Optional[int] = 3):
        import orbax.checkpoint as ocp
        self._ocp = ocp
        self.directory = os.path.abspath(os.fspath(directory))
        opts = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False)
        self.manager = ocp.CheckpointManager(self.directory, options=opts)

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def save(self, state: TrainState, *, force: bool = True) -> int:
        step = int(jax.device_get(state.step))
        self.manager.save(step, args=self._ocp.args.StandardSave(_to_tree(state)), force=force)
        self.manager.wait_until_finished()
        return step

    def restore(self, like: TrainState, step: Optional[int] = None) -> TrainState:
        """Restore into the structure (and shardings) of `like` (e.g. a fresh `init_train_state`)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        abstract = jax.tree.map(_abstract, _to_tree(like))
        tree = self.manager.restore(step, args=self._ocp.args.StandardRestore(abstract))
        return _from_tree(tree, like)

    def close(self):
        self.manager.close()


def _abstract(x):
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _to_tree(state: TrainState) -> dict:
    leaves, _ = jax.tree.flatten(state.opt_state)
    return dict(step=state.step, params=state.params, opt_state={str(i): x for i, x in enumerate(leaves)},
                rng=state.rng, data_position=state.data_position)


def _from_tree(tree: dict, like: TrainState) -> TrainState:
    _, treedef = jax.tree.flatten(like.opt_state)
    n = treedef.num_leaves
    opt = jax.tree.unflatten(treedef, [tree["opt_state"][str(i)] for i in range(n)])
    return TrainState(tree["step"], tree["params"], opt, tree["rng"], tree["data_position"])
