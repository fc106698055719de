"""Parameter paths: the key path `jax.tree.flatten_with_path` gives a leaf, as a plain tuple of dict keys and sequence
indices (("layers", 0, "mlp", "gate_up")), the form the sharding plan and the checkpoint readers and writers match."""
from __future__ import annotations

__all__ = ["param_path"]


def param_path(key_path) -> tuple:
    """A jax key path (DictKey / SequenceKey entries) -> the tuple of its keys and indices."""
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in key_path)
