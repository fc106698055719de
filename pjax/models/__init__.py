"""Models: the decoder shared by every target family, the target and drafter values and their pure functions,
the head<->target pairing rule, and the layers they are built from."""
from pjax.models.cache import LayerKV, init_cache
from pjax.models.drafter import (Drafter, DrafterConfig, abstract_drafter, combine, draft_logits_from_hidden,
                                 draft_to_target, drafter_forward, init_drafter, init_drafter_cache, mask_feature)
from pjax.models.families import config_from_hf
from pjax.models.pairing import check_pair, resolve_aux_layer_ids
from pjax.models.target import Target, abstract_target, forward, init_target, logits_from_hidden, target_logits

__all__ = ["Drafter", "DrafterConfig", "LayerKV", "Target", "abstract_drafter", "abstract_target", "check_pair",
           "combine", "config_from_hf", "draft_logits_from_hidden", "draft_to_target", "drafter_forward", "forward",
           "init_cache", "init_drafter", "init_drafter_cache", "init_target", "logits_from_hidden", "mask_feature",
           "resolve_aux_layer_ids", "target_logits"]
