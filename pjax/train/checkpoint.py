"""orbax checkpointing of the training state, with exact resume, and the run record that makes a resume safe.

A checkpoint directory holds orbax step directories ("100", "200", ...) and `RUN_RECORD` (pjax_train.json): the
settings of the run that wrote them (the head's config, the training config, a fingerprint of the data). A run
resuming from the directory with another value of one of them is refused, naming the setting."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Optional

import jax

from pjax.train.state import TrainState

__all__ = ["RUN_RECORD", "Checkpointer", "TrainError", "check_checkpoint_dir", "run_settings"]

RUN_RECORD = "pjax_train.json"
# TrainConfig fields that choose kernels or memory layouts, not the model or the data: free to change on resume
_LAYOUT_FIELDS = ("attn_chunk", "loss_chunk", "target_chunk", "remat", "implementation")


class TrainError(ValueError):
    """A training run that cannot go on as asked (a checkpoint directory it may not use, a setting changed on
    resume, a non-finite loss); the message names the directory, setting or step."""


def check_checkpoint_dir(path) -> Path:
    """The absolute checkpoint directory `path`, checked before any work: absent (it is created), or a directory
    that is empty or holds a pjax training checkpoint (orbax step directories, `RUN_RECORD`). A file, a directory
    holding anything else (a model, a user's folder) or a location where no directory can be made is a
    TrainError naming the path."""
    out = Path(os.path.abspath(os.fspath(path)))
    if out.exists() and not out.is_dir():
        raise TrainError(f"checkpoint directory {out}: is a file, expected a directory")
    if out.is_dir():
        other = sorted(p.name for p in out.iterdir() if p.name != RUN_RECORD and not p.name.startswith(".")
                       and not p.name.split(".")[0].isdigit())  # orbax steps "200", "200.orbax-checkpoint-tmp-*"
        if other:
            raise TrainError(f"checkpoint directory {out}: holds other files ({', '.join(other[:3])}"
                             f"{' ...' if len(other) > 3 else ''}), not a pjax training checkpoint; choose an empty "
                             "or new directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TrainError(f"checkpoint directory {out}: cannot be created ({e.strerror or e})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise TrainError(f"checkpoint directory {out}: is not writable")
    return out


def _flat(prefix: str, value) -> dict:
    """Dotted names -> JSON values of a (nested) dataclass."""
    if dataclasses.is_dataclass(value):
        out = {}
        for f in dataclasses.fields(value):
            out.update(_flat(f"{prefix}.{f.name}" if prefix else f.name, getattr(value, f.name)))
        return out
    if isinstance(value, (list, tuple)) and any(dataclasses.is_dataclass(v) for v in value):
        out = {}
        for i, v in enumerate(value):
            out.update(_flat(f"{prefix}[{i}]", v))
        return out
    return {prefix: json.loads(json.dumps(value, default=str))}


def run_settings(drafter_config, cfg, data: Optional[str], d2t: Optional[str] = None,
                 target: Optional[str] = None) -> dict:
    """The settings a checkpoint depends on: the head's config ("head.*"), the training config (minus kernel and
    memory layout choices), and fingerprints of the draft vocabulary ("head.d2t"), the target's weights ("target")
    and the data ("data")."""
    train = {k: v for k, v in _flat("", cfg).items() if k.split(".")[0] not in _LAYOUT_FIELDS}
    return {**_flat("head", drafter_config), "head.d2t": d2t, **train, "target": target, "data": data}


class Checkpointer:
    """orbax CheckpointManager over `TrainState` (params, optimizer state, step, RNG, data position). The directory
    is checked first (`check_checkpoint_dir`)."""

    def __init__(self, directory, *, max_to_keep: Optional[int] = 3):
        import orbax.checkpoint as ocp
        self._ocp = ocp
        self.directory = str(check_checkpoint_dir(directory))
        opts = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False)
        self.manager = ocp.CheckpointManager(self.directory, options=opts)

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def check_settings(self, settings: dict) -> None:
        """Refuse to resume a run recorded with other settings (TrainError naming the first that differs); record
        `settings` when the directory holds no checkpoint yet (or none recorded)."""
        record = Path(self.directory) / RUN_RECORD
        old = json.loads(record.read_text()) if record.exists() else None
        if old is not None and self.latest_step() is not None:
            hashed = {"head.d2t": "the draft vocabulary (d2t) differs", "target": "the target's weights differ",
                      "data": "the training data differs"}
            # settings both runs know (one recorded by another pjax version may lack a newer field)
            diff = sorted((k for k in set(old) & set(settings) if old[k] != settings[k]),
                          key=lambda k: (k in hashed, k))
            if diff:
                k = diff[0]
                what = hashed.get(k) or f"{k} was {old[k]!r}, this run has {settings[k]!r}"
                more = [d for d in diff if d != k]
                raise TrainError(f"checkpoint directory {self.directory}: cannot resume: {what}"
                                 f"{f' (also {len(more)} more: ' + ', '.join(more[:4]) + ')' if more else ''}; "
                                 "resume with the same settings or use another checkpoint directory")
            return
        tmp = record.with_name(f".{RUN_RECORD}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(settings, indent=1, sort_keys=True))
        os.replace(tmp, record)

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
