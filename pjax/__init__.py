"""pjax: P-EAGLE parallel speculative decoding in JAX / Flax NNX / Pallas.

The curated API. Subpackages hold the rest, each imported on first use (`import pjax` is enough to reach them):
`pjax.models` (targets, drafters, layers), `pjax.decode` (the engine and its research API), `pjax.text` (text in,
text out), `pjax.serve` (the OpenAI-compatible server), `pjax.train`, `pjax.bench`, `pjax.checkpoint`, `pjax.kernels`.
"""
import importlib

from pjax.checkpoint import CheckpointError, OutputError, load_drafter, load_target, save_drafter, save_native_target
from pjax.config import ConfigError, LayerSpec, ModelConfig, MoeSpec, RopeSpec
from pjax.decode import GenerateResult, generate
from pjax.models import Drafter, DrafterConfig, Target, init_drafter, init_target, make_mesh

__all__ = [
    "CheckpointError", "ConfigError", "Drafter", "DrafterConfig", "GenerateResult", "LayerSpec", "ModelConfig",
    "MoeSpec", "OutputError", "RopeSpec", "Target", "generate", "init_drafter", "init_target", "load_drafter",
    "load_target", "make_mesh", "save_drafter", "save_native_target", "train_drafter",
]

_SUBPACKAGES = ("bench", "checkpoint", "decode", "kernels", "models", "serve", "text", "train")
_LAZY = {"train_drafter": "pjax.train"}  # training pulls in optax / orbax: imported on first use


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBPACKAGES:
        return importlib.import_module(f"pjax.{name}")
    raise AttributeError(f"module 'pjax' has no attribute {name!r}")


def __dir__():
    return sorted(set(__all__) | set(_SUBPACKAGES) | {n for n in globals() if n.startswith("__")})
