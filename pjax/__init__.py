"""pjax: P-EAGLE parallel speculative decoding in JAX / Flax NNX / Pallas."""
from pjax.cache import init_cache
from pjax.config import ConfigError, LayerSpec, ModelConfig, MoeSpec, RopeSpec
from pjax.decode import GenerateResult, generate
from pjax.models.drafter import (Drafter, DrafterConfig, abstract_drafter, combine, draft_logits_from_hidden,
                                  draft_to_target, drafter_forward, init_drafter, init_drafter_cache, mask_feature)
from pjax.target import Target, abstract_target, forward, init_target, logits_from_hidden, target_logits

__all__ = [
    "ConfigError", "Drafter", "DrafterConfig", "LayerSpec", "ModelConfig", "MoeSpec", "RopeSpec", "Target",
    "GenerateResult",
    "abstract_drafter", "abstract_target", "combine", "draft_logits_from_hidden", "draft_to_target",
    "drafter_forward", "forward", "generate", "init_drafter", "init_drafter_cache", "init_cache", "init_target",
    "logits_from_hidden", "mask_feature", "target_logits",
]
