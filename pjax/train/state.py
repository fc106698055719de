"""Training configuration, state, head initialisation from a target, and orbax checkpointing."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from pjax.config import LayerSpec, ModelConfig
from pjax.models.drafter import Drafter, DrafterConfig, init_drafter
from pjax.target import Target
from pjax.train.cod import CodConfig
from pjax.train.optim import OptimConfig, make_optimizer, split_params, trainable_mask

OBJECTIVES = ("peagle", "eagle3")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything static about a run (hashable).

    objective "peagle" (COD layout, spec D) or "eagle3" (training-time test with ttt_steps).
    batch_rows: packed rows per step (global; split over the data-parallel mesh).
    num_segments: sequence partitioning of each row (spec D.5; peagle only; 1 = single pass).
    compute_dtype: e.g. "bfloat16" to run the drafter in bf16 over float32 master weights.
    attn_chunk / loss_chunk / target_chunk: query / element chunk sizes (None = automatic).
    """
    objective: str = "peagle"
    total_seq_len: int = 2048
    batch_rows: int = 1
    total_steps: int = 1000
    cod: CodConfig = CodConfig()
    ttt_steps: int = 3
    ttt_step_loss_decay: float = 1.0
    loss_type: str = "kl"
    num_segments: int = 1
    optim: OptimConfig = OptimConfig()
    compute_dtype: Optional[str] = None
    attn_chunk: Optional[int] = None
    loss_chunk: Optional[int] = None
    target_chunk: Optional[int] = None
    seed: int = 0

    def validate(self) -> "TrainConfig":
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective {self.objective!r} is not one of {OBJECTIVES}")
        if self.num_segments < 1 or (self.objective == "eagle3" and self.num_segments != 1):
            raise ValueError(f"num_segments={self.num_segments}: must be >= 1 (and 1 for the eagle3 objective)")
        if self.num_segments > self.total_seq_len:
            raise ValueError(f"num_segments={self.num_segments} exceeds total_seq_len={self.total_seq_len}")
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {self.ttt_steps}")
        self.cod.validate()
        return self

    @property
    def effective_optim(self) -> OptimConfig:
        """EAGLE-3 embeddings get no gradient (speculators): keep them out of the optimiser (no decay)."""
        if self.objective == "eagle3" and self.optim.train_embeddings:
            return dataclasses.replace(self.optim, train_embeddings=False)
        return self.optim

    @property
    def num_depths(self) -> int:
        return self.ttt_steps if self.objective == "eagle3" else self.cod.num_depths


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


# --------------------------------------------------------------------------- heads for a target


def drafter_config_for_target(target_cfg: ModelConfig, *, num_layers: int = 1, draft_vocab_size: Optional[int] = None,
                              mask_token_id: Optional[int] = None, aux_layer_ids=None, model_kind: str = "peagle",
                              num_depths: Optional[int] = None, norm_before_residual: bool = False,
                              intermediate_size: Optional[int] = None, sliding_window: Optional[int] = None
                              ) -> DrafterConfig:
    """A drafter shaped like the target (hidden size, heads, head_dim, rope, eps), llama-type layers
    (qwen3-type when the target uses q/k norms), full attention unless `sliding_window`."""
    full = [s for s in target_cfg.layers if s.sliding_window is None] or list(target_cfg.layers)
    ref = full[0]
    spec = LayerSpec(head_dim=ref.head_dim, num_kv_heads=ref.num_kv_heads, rope=ref.rope,
                     sliding_window=sliding_window)
    layer = ModelConfig(model_type="qwen3" if target_cfg.qk_norm else "llama", vocab_size=target_cfg.vocab_size,
                        hidden_size=target_cfg.hidden_size,
                        intermediate_size=intermediate_size or target_cfg.intermediate_size,
                        num_heads=target_cfg.num_heads, layers=(spec,) * num_layers,
                        rms_norm_eps=target_cfg.rms_norm_eps, qk_norm=target_cfg.qk_norm)
    ids = tuple(aux_layer_ids) if aux_layer_ids else target_cfg.default_aux_layer_ids()
    peagle = model_kind == "peagle"
    return DrafterConfig(layer=layer, num_aux=len(ids), target_hidden_size=target_cfg.hidden_size,
                         draft_vocab_size=draft_vocab_size or target_cfg.vocab_size,
                         mask_token_id=mask_token_id if peagle else None, aux_layer_ids=ids,
                         norm_before_residual=norm_before_residual, has_mask_hidden=peagle, model_kind=model_kind,
                         num_depths=num_depths).validate()


def init_drafter_for_target(target: Target, config: DrafterConfig, key, *, d2t=None, dtype=jnp.float32) -> Drafter:
    """Random head whose embeddings come from the target and whose lm_head holds the target's head
    rows of the draft vocabulary (speculators `load_verifier_weights`); d2t [Vd] offsets or None."""
    config.check_target(target.config)
    dr = init_drafter(config, key, dtype)
    vd = config.draft_vocab_size
    if d2t is None:
        d2t_arr = None if vd == config.vocab_size else dr.d2t
    else:
        d2t_arr = jnp.asarray(np.asarray(d2t), jnp.int32)
        if d2t_arr.shape != (vd,):
            raise ValueError(f"d2t has shape {d2t_arr.shape}, expected ({vd},)")
    ids = jnp.arange(vd, dtype=jnp.int32) + (0 if d2t_arr is None else d2t_arr)
    tp = target.params
    params = jax.tree.map(lambda x: x, dr.params)
    emb = tp["embed_tokens"]["embedding"]  # raw table, as speculators copies it
    params["embed_tokens"]["embedding"] = jnp.array(emb, dtype, copy=True)
    head = emb.T if target.config.tie_word_embeddings else tp["lm_head"]["kernel"]
    params["lm_head"]["kernel"] = jnp.asarray(head[:, ids], dtype)
    return Drafter(config, dr.graphdef, params, d2t_arr)


# ------------------------------------------------------------------------------ checkpointing


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
