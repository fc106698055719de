"""The models a benchmark runs: checkpoints from directories, or random weights of a published geometry for timing
large shapes (`random:llama3.1-8b`, `random:llama3.1-70b`, `random:gpt-oss-20b`, `random:qwen3-30b-a3b` targets;
their shipped quantised forms with packed experts `random:gpt-oss-20b-mxfp4`, `random:gpt-oss-120b` (MXFP4) and
`random:qwen3-30b-a3b-fp8` (FP8, 128 x 128 blocks); `random:gpt-oss-120b-bf16`, every weight in bf16, for several
GPUs; `random:code-pair` (the target `examples/code_pair/` trains), and `random:tiny` / `random:tiny-moe-mxfp4` for
CPU smoke runs; `random:N` heads of N layers shaped for the target).

Random geometries are the published `config.json` values of meta-llama/Llama-3.1-8B-Instruct and -70B-Instruct,
openai/gpt-oss-20b, openai/gpt-oss-120b and Qwen/Qwen3-30B-A3B parsed by the same code as a real checkpoint
(`pjax.models.config_from_hf`). Packed experts are generated directly in their packed form on the device (random
codes and one scale giving the dense weights' ~0.02 spread), so no bf16 copy of them ever exists. Random heads
take the draft vocabulary of the published heads of that target where one is known (32,000 tokens with a d2t
map for Llama-3.1-8B and -70B, as their EAGLE-3 heads; the full vocabulary and mask token 201020 for GPT-OSS, as
amazon/GPT-OSS-20B-P-EAGLE), else the target's vocabulary and its last id as mask token.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from pjax.bench.errors import BenchError
from pjax.kernels.quantized import random_weight
from pjax.models.drafter import Drafter, abstract_drafter
from pjax.models.families import config_from_hf
from pjax.models.sharding import MODEL_AXIS, axis_size, leaf_spec, param_specs
from pjax.models.target import Target, abstract_target

__all__ = ["PACKED_SHAPES", "RANDOM_SHAPES", "RANDOM_TARGETS", "geometry", "parse_random", "random_head",
           "random_target"]

RANDOM_SHAPES = {
    "llama3.1-8b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}},
    "llama3.1-70b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}},
    "gpt-oss-20b": {
        "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
        "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072, "rope_theta": 150000.0, "swiglu_limit": 7.0, "attention_bias": True,
        "tie_word_embeddings": False,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)],
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096}},
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
        "tie_word_embeddings": False},
    "code-pair": {  # examples/code_pair/'s target at its full-build defaults (0.34 B parameters)
        "model_type": "llama", "vocab_size": 32768, "hidden_size": 1024, "intermediate_size": 2816,
        "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 4, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 2048, "rope_theta": 10000.0, "tie_word_embeddings": False},
    "tiny": {  # a CPU smoke-test geometry (the random-weight path of the large shapes, in seconds)
        "model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "tie_word_embeddings": False},
}
RANDOM_SHAPES["tiny-moe"] = {  # a CPU smoke-test MoE geometry (packed experts: tiny-moe-mxfp4)
    **RANDOM_SHAPES["gpt-oss-20b"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 64,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 8,
    "layer_types": ["sliding_attention", "full_attention"] * 2}
# named forms: name -> (geometry, expert format); packed experts ("mxfp4" | "fp8"), everything else in the run's
# dtype; None: every weight in the run's dtype (GPT-OSS-120B in bf16 does not fit one GPU: for several)
PACKED_SHAPES = {"gpt-oss-20b-mxfp4": ("gpt-oss-20b", "mxfp4"), "gpt-oss-120b": ("gpt-oss-120b", "mxfp4"),
                 "gpt-oss-120b-bf16": ("gpt-oss-120b", None),
                 "qwen3-30b-a3b-fp8": ("qwen3-30b-a3b", "fp8"), "tiny-moe-mxfp4": ("tiny-moe", "mxfp4")}
# openai/gpt-oss-120b: gpt-oss-20b's widths with 36 layers and 128 experts
RANDOM_SHAPES["gpt-oss-120b"] = dict(
    RANDOM_SHAPES["gpt-oss-20b"], num_hidden_layers=36, num_local_experts=128,
    layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(36)])

# per target shape: (draft vocabulary size or None = the target's, mask token id or None = the last id)
HEAD_VOCAB = {"llama3.1-8b": (32000, None), "llama3.1-70b": (32000, None), "gpt-oss-120b-bf16": (None, 201020),
              "gpt-oss-20b": (None, 201020), "gpt-oss-20b-mxfp4": (None, 201020),
              "gpt-oss-120b": (None, 201020), "qwen3-30b-a3b": (None, None), "qwen3-30b-a3b-fp8": (None, None)}
RANDOM_PREFIX = "random:"
# every random target's name (a geometry, or a packed form that may share its geometry's name: gpt-oss-120b)
RANDOM_TARGETS = tuple(dict.fromkeys([*RANDOM_SHAPES, *PACKED_SHAPES]))


def parse_random(value: str, flag: str) -> Optional[str]:
    """The part after "random:" (None when `value` is not a random spec)."""
    if not value.startswith(RANDOM_PREFIX):
        return None
    rest = value[len(RANDOM_PREFIX):]
    if not rest:
        raise BenchError(f"{flag} {value}: give what follows 'random:'")
    return rest


def geometry(shape: str) -> str:
    """The `RANDOM_SHAPES` geometry of a random target's name (a packed form's, `PACKED_SHAPES`)."""
    return PACKED_SHAPES.get(shape, (shape, None))[0]


def _normal(key, shape, dtype, std):
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _fill(shape, dtype, value):
    return jnp.full(shape, value, dtype)


@functools.lru_cache(maxsize=None)
def _on(fn, statics: tuple, sharding):
    """`fn` jitted with its arguments `statics` static, its output placed with `sharding` (None: the default
    device)."""
    return jax.jit(fn, static_argnums=statics, **({} if sharding is None else {"out_shardings": sharding}))


def _random_params(abstract, key, scale: float = 0.02, shardings=None):
    """Random params for an abstract tree, generated one leaf at a time (peak memory: the weights plus one float32
    leaf, so a 20B model fits where a whole-tree float32 draw would not) on the default device, or with shardings (a
    matching tree of `jax.sharding.Sharding`s) straight into each leaf's shards: normal(0, scale) matrices, ones for
    norm weights and layer scalars, zeros for biases and sinks, normal(0, 1) mask_hidden (as speculators initialises
    it)."""
    leaves, treedef = jax.tree.flatten_with_path(abstract)
    where = [None] * len(leaves) if shardings is None else jax.tree.leaves(shardings)
    out = []
    for i, ((path, leaf), sharding) in enumerate(zip(leaves, where)):
        name = str(getattr(path[-1], "key", path[-1]))
        shape = tuple(leaf.shape)
        if name in ("weight", "layer_scalar") or "bias" in name or name == "sinks":
            out.append(_on(_fill, (0, 1, 2), sharding)(shape, leaf.dtype, 1 if name in ("weight", "layer_scalar")
                                                        else 0))
        else:
            out.append(_on(_normal, (1, 2, 3), sharding)(jax.random.fold_in(key, i), shape, leaf.dtype,
                                                         1.0 if name == "mask_hidden" else scale))
    return jax.tree.unflatten(treedef, out)


def random_target(shape: str, dtype, seed: int = 0, mesh=None, experts: str = "expert") -> Target:
    """A target of the named geometry (`RANDOM_SHAPES`, or `PACKED_SHAPES` with packed MXFP4 / FP8 experts) with
    random weights; mesh: generated in place on it, split by the plan of `pjax.models.sharding` (a target larger
    than one device never exists whole; experts: MoE experts split by "expert" or "intermediate")."""
    geometry, fmt = PACKED_SHAPES.get(shape, (shape, None))
    if geometry not in RANDOM_SHAPES:
        raise BenchError(f"--target random:{shape}: unknown shape (expected one of "
                         f"{', '.join('random:' + s for s in RANDOM_TARGETS)})")
    cfg = config_from_hf(RANDOM_SHAPES[geometry], f"random:{shape}")
    abstract = abstract_target(cfg, dtype)
    key = jax.random.key(seed)
    n = axis_size(mesh, MODEL_AXIS)
    on_mesh = (lambda tree: None) if mesh is None else (  # noqa: E731
        lambda tree: jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(tree, cfg, n, experts)))
    if fmt is None:
        return Target(cfg, abstract.graphdef, _random_params(abstract.params, key, shardings=on_mesh(abstract.params)),
                      experts)
    params = jax.tree.map(lambda x: x, abstract.params)  # a copy: the experts are replaced below
    unpacked = {}
    for i, layer in params["layers"].items():
        mlp = layer.get("mlp", {})
        for name in ("gate_up", "down"):
            if name in mlp:
                unpacked[(i, name)] = mlp.pop(name)
    params = _random_params(params, key, shardings=on_mesh(params))  # everything else, one leaf at a time
    for j, ((i, name), leaf) in enumerate(sorted(unpacked.items())):
        packed = jax.eval_shape(functools.partial(random_weight, shape=tuple(leaf.shape), fmt=fmt), jax.random.key(0))
        sharding = None if mesh is None else jax.tree.map(lambda s: NamedSharding(mesh, s),
                                                          leaf_spec(("layers", i, "mlp", name), packed, cfg, n, experts))
        draw = _on(random_weight, (1, 2), sharding)
        params["layers"][i]["mlp"][name] = draw(jax.random.fold_in(key, 2 ** 31 + j), tuple(leaf.shape), fmt)
    return Target(cfg, abstract.graphdef, params, experts)


def random_head(target: Target, spec: str, *, parallel: bool, dtype, shape: Optional[str] = None, seed: int = 1,
                flag: str = "--head") -> Drafter:
    """A random head of `spec` = N layers shaped for `target` (`pjax.train.drafter_config_for_target`): P-EAGLE
    (mask token and mask_hidden) when `parallel`, else EAGLE-3. `shape`: the random target's name, which picks
    the published draft vocabulary."""
    if not spec.isdigit() or int(spec) < 1:
        raise BenchError(f"{flag} random:{spec}: expected random:N with N >= 1 draft layers")
    from pjax.train.heads import drafter_config_for_target
    vd, mask = HEAD_VOCAB.get(shape, (None, None))
    v = target.config.vocab_size
    cfg = drafter_config_for_target(target.config, num_layers=int(spec), draft_vocab_size=vd,
                                    mask_token_id=(v - 1 if mask is None else mask) if parallel else None,
                                    model_kind="peagle" if parallel else "eagle3")
    key = jax.random.key(seed)
    abstract = abstract_drafter(cfg, dtype)
    params = _random_params(abstract.params, key)
    d2t = None
    if cfg.draft_vocab_size < v:  # a random ascending draft vocabulary
        ids = np.sort(np.random.default_rng(seed).permutation(v)[:cfg.draft_vocab_size])
        d2t = jnp.asarray(ids - np.arange(cfg.draft_vocab_size), jnp.int32)
    return Drafter(cfg, abstract.graphdef, params, d2t)
