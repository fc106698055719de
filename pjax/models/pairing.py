"""The one rule that pairs a drafter head with a target: which target layers feed the head, and whether the two
fit (vocabulary, widths, layer depth). Loading, the engine and training all call `check_pair`, so a head reads the
same target layers however it was loaded — the wrong layers silently collapse acceptance (spec A.3).

Aux layer ids, in this order of precedence: the head's own `eagle_aux_hidden_state_layer_ids`, the target
config's `eagle_aux_hidden_state_layer_ids`, the default `ModelConfig.default_aux_layer_ids()` (vLLM's
(2, n//2, n-3), or evenly spread distinct ids on targets too shallow for it).
"""
from __future__ import annotations

from pjax.config import ConfigError, ModelConfig
from pjax.models.drafter import DrafterConfig

__all__ = ["aux_layer_source", "check_pair", "pair_warnings", "resolve_aux_layer_ids"]


def aux_layer_source(drafter_cfg: DrafterConfig, target_cfg: ModelConfig) -> str:
    """Where the aux layer ids come from: "head", "target config" or "default"."""
    if drafter_cfg.aux_layer_ids:
        return "head"
    if target_cfg.aux_layer_ids:
        return "target config"
    return "default"


def resolve_aux_layer_ids(drafter_cfg: DrafterConfig, target_cfg: ModelConfig) -> tuple[int, ...]:
    """The target layers (residual stream entering each, pre-norm) that feed this head, in feature order."""
    source = aux_layer_source(drafter_cfg, target_cfg)
    if source == "head":
        return tuple(drafter_cfg.aux_layer_ids)
    if source == "target config":
        return tuple(target_cfg.aux_layer_ids)
    return target_cfg.default_aux_layer_ids()


def check_pair(target_cfg: ModelConfig, drafter_cfg: DrafterConfig, where: str = "drafter") -> tuple[int, ...]:
    """Raise ConfigError naming the mismatch if the head cannot be fed by the target; return its aux layer ids."""
    if target_cfg.vocab_size != drafter_cfg.vocab_size:
        raise ConfigError(f"{where}: drafter vocab_size={drafter_cfg.vocab_size} but the target has vocab_size="
                          f"{target_cfg.vocab_size} (the drafter embeds target token ids)")
    if target_cfg.hidden_size != drafter_cfg.target_hidden_size:
        raise ConfigError(f"{where}: target_hidden_size={drafter_cfg.target_hidden_size} but the target has "
                          f"hidden_size={target_cfg.hidden_size}")
    ids = resolve_aux_layer_ids(drafter_cfg, target_cfg)
    source = aux_layer_source(drafter_cfg, target_cfg)
    n = target_cfg.num_layers
    if len(ids) != drafter_cfg.num_aux:
        raise ConfigError(f"{where}: aux layer ids {list(ids)} (from the {source}) do not match the head's "
                          f"num_aux={drafter_cfg.num_aux} (fc input {drafter_cfg.fc_in} = num_aux x target hidden "
                          f"size); pass eagle_aux_hidden_state_layer_ids with {drafter_cfg.num_aux} ids")
    bad = [i for i in ids if not 0 <= i <= n]
    if bad:
        raise ConfigError(f"{where}: eagle_aux_hidden_state_layer_ids {list(ids)} (from the {source}) contain {bad}, "
                          f"outside the target depth [0, {n}]")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{where}: aux layer ids {list(ids)} (from the {source}) are not distinct; pass "
                          f"eagle_aux_hidden_state_layer_ids with {drafter_cfg.num_aux} distinct ids in [0, {n}]")
    return ids


def _model_name(name_or_path: str) -> str:
    """A model's name from a hub id or a directory ("org/Model-8B", "/models/Model-8B/" -> "model-8b")."""
    return name_or_path.replace("\\", "/").rstrip("/").rpartition("/")[2].lower()


def pair_warnings(target_cfg: ModelConfig, drafter_cfg: DrafterConfig) -> list[str]:
    """Things that pass `check_pair` but deserve a word: a head trained for another verifier (another architecture:
    acceptance collapses to ~0; another model name than the target's name or directory: it may), or aux layer ids
    defaulted on a target too shallow for vLLM's default."""
    out = []
    want, have = set(drafter_cfg.verifier_architectures), set(target_cfg.architectures)
    verifier, target = drafter_cfg.verifier_name_or_path, target_cfg.name_or_path
    if want and have and not want & have:
        name = f" ({verifier})" if verifier else ""
        out.append(f"the head was trained for a {'/'.join(sorted(want))} verifier{name} but the target is "
                   f"{'/'.join(sorted(have))}: expect acceptance near zero")
    elif verifier and target and _model_name(verifier) != _model_name(target):
        out.append(f"the head was trained for the verifier {verifier!r} but the target is {target!r}: if they are "
                   "different models, expect low acceptance")
    n = target_cfg.num_layers
    if aux_layer_source(drafter_cfg, target_cfg) == "default" and target_cfg.default_aux_layer_ids() != (
            2, n // 2, n - 3):
        out.append(f"the head names no aux layer ids and the target has {target_cfg.num_layers} layers (< 8, too "
                   f"shallow for the default (2, n//2, n-3)): using {list(target_cfg.default_aux_layer_ids())}")
    return out
