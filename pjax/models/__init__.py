"""Models: the decoder shared by every target family, the target and drafter values and their pure functions,
the head<->target pairing rule, and the layers they are built from. `__all__` lists what a user calls; the
engine's building blocks (caches, feature fusion, vocabulary maps) stay importable here and from their modules."""
from pjax.models.cache import LayerKV, init_cache
from pjax.models.drafter import (Drafter, DrafterConfig, abstract_drafter, combine, draft_logits_from_hidden,
                                 draft_to_target, drafter_forward, init_drafter, init_drafter_cache, mask_feature)
from pjax.models.families import config_from_hf
from pjax.models.pairing import check_pair, resolve_aux_layer_ids
from pjax.models.sharding import make_mesh, place_drafter, place_target
from pjax.models.target import Target, abstract_target, forward, init_target, logits_from_hidden, target_logits

__all__ = ["Drafter", "DrafterConfig", "Target", "abstract_target", "check_pair", "config_from_hf", "drafter_forward",
           "forward", "init_drafter", "init_target", "make_mesh", "place_drafter", "place_target", "target_logits"]
