"""pjax: P-EAGLE parallel speculative decoding in JAX / Flax NNX / Pallas."""
from pjax.cache import init_cache
from pjax.config import ConfigError, LayerSpec, ModelConfig, MoeSpec, RopeSpec
from pjax.target import Target, abstract_target, forward, init_target, logits_from_hidden, target_logits

__all__ = [
    "ConfigError", "LayerSpec", "ModelConfig", "MoeSpec", "RopeSpec", "Target", "abstract_target", "forward",
    "init_cache", "init_target", "logits_from_hidden", "target_logits",
]
