"""pjax: P-EAGLE parallel speculative decoding in JAX / Flax NNX / Pallas.

The curated API. Subpackages hold the rest: `pjax.models` (targets, drafters, layers), `pjax.decode` (the engine
and its research API), `pjax.train`, `pjax.checkpoint`, `pjax.kernels`.
"""
from pjax.checkpoint import CheckpointError, load_drafter, load_target, save_drafter, save_native_target
from pjax.config import ConfigError, LayerSpec, ModelConfig, MoeSpec, RopeSpec
from pjax.decode import GenerateResult, generate
from pjax.models import Drafter, DrafterConfig, Target, init_drafter, init_target

__all__ = [
    "CheckpointError", "ConfigError", "Drafter", "DrafterConfig", "GenerateResult", "LayerSpec", "ModelConfig",
    "MoeSpec", "RopeSpec", "Target", "generate", "init_drafter", "init_target", "load_drafter", "load_target",
    "save_drafter", "save_native_target", "train_drafter",
]


def __getattr__(name):  # training pulls in optax / orbax: imported on first use
    if name == "train_drafter":
        from pjax.train import train_drafter
        return train_drafter
    raise AttributeError(f"module 'pjax' has no attribute {name!r}")
