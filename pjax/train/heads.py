"""A new drafter head for a target: its config shaped like the target, and a random head initialised from the
target's embeddings and head rows (speculators `load_verifier_weights`)."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from pjax.config import LayerSpec, ModelConfig
from pjax.models.drafter import Drafter, DrafterConfig, init_drafter
from pjax.models.pairing import check_pair
from pjax.models.target import Target

__all__ = ["drafter_config_for_target", "init_drafter_for_target"]


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
    check_pair(target.config, config)
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
