"""Shared pieces of the engine tests: tiny checkpoints of every target family (written by transformers, configs
from `pjax.check.families`, which `python -m pjax check` compares against transformers), a random P-EAGLE or EAGLE-3
head for a target, transformers' greedy continuations, and the numpy law of processed logits (temperature, top-k,
top-p). torch and transformers are imported by the helpers that use them (`build`, `hf_greedy`), so the engine
tests that do not compare against transformers never import them."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import pjax
from pjax.config import LayerSpec, ModelConfig, RopeSpec
from pjax.models.drafter import DrafterConfig, init_drafter
from pjax.check.families import AVAILABLE, FAMILIES, VOCAB, randomize  # the tiny checkpoints of every family

V = VOCAB
NEW = 12
PROMPTS = [[5, 17, 3], [9, 1, 44, 60, 2, 71, 33, 8, 90, 12, 4], [30, 31, 32, 33, 34, 35]]  # ragged
K_OF = {"llama": 3, "qwen3": 1, "qwen3_moe": 7, "gpt_oss": 11, "gemma4": 11}  # gpt_oss/gemma4: K+1 > window
# tiny CPU programs: compile time dominates, so skip LLVM optimisation (numerics are unchanged in kind)
FAST = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else {}
FAST_KEY = tuple(sorted(FAST.items()))


def fast_default_compiles(monkeypatch):
    """Decoding programs built with no compiler options (by code that takes none: the bench backends, the command
    line, the examples) compile with FAST's, as the tests' own calls pass them. Only the build changes: the programs,
    their cache keys and compile counts are the same."""
    import pjax.decode.compiled as compiled
    real = compiled.jitted
    monkeypatch.setattr(compiled, "jitted", lambda name, donate, options=(): real(name, donate, options or FAST_KEY))


def tiny_llama(vocab: int, hidden: int = 32, *, seed: int = 0, scale: float = 0.3):
    """A 2-layer float32 Llama target built in memory (8 query / 2 KV heads per layer, MLP 64): the engine tests'
    model."""
    cfg = ModelConfig("llama", vocab, hidden, 64, 4, tuple(LayerSpec(8, 2, RopeSpec(theta=10000.0)) for _ in range(2)),
                      rms_norm_eps=1e-5)
    return pjax.init_target(cfg, jax.random.key(seed), jnp.float32, scale=scale)


def tiny_pair(vocab: int, hidden: int = 32):
    """`tiny_llama` and a random P-EAGLE head for it (`make_drafter`)."""
    target = tiny_llama(vocab, hidden)
    return target, make_drafter(target)


def make_drafter(target, seed=1, aux=(1, 0, 2), mask_token_id="last", num_layers=1, **kw):
    """Random P-EAGLE head (init_drafter) matching `target`'s vocabulary and width (mask token: the last id)."""
    if mask_token_id == "last":
        mask_token_id = target.config.vocab_size - 1
    h = target.config.hidden_size
    layer = ModelConfig("llama", target.config.vocab_size, h, 2 * h, 4,
                        tuple(LayerSpec(8, 2, RopeSpec(theta=10000.0)) for _ in range(num_layers)), rms_norm_eps=1e-5)
    cfg = DrafterConfig(layer=layer, num_aux=len(aux), target_hidden_size=h,
                        draft_vocab_size=kw.pop("draft_vocab_size", target.config.vocab_size),
                        mask_token_id=mask_token_id, aux_layer_ids=tuple(aux), **kw)
    return init_drafter(cfg, jax.random.key(seed), jnp.float32, scale=0.2)


def make_eagle3(target, sharpen: float = 6.0, **kw):
    """A random EAGLE-3 head for `target` (`make_drafter` without mask token and mask feature; sequential drafting
    only) whose lm_head is scaled by `sharpen` (peaked distributions: draft trees several levels deep)."""
    d = make_drafter(target, mask_token_id=None, has_mask_hidden=False, model_kind="eagle3", **kw)
    return dataclasses.replace(d, params={**d.params, "lm_head": {"kernel": d.params["lm_head"]["kernel"] * sharpen}})


def processed(logits, temperature, top_k, top_p):
    """numpy: softmax(logits / T) restricted to the top-k lanes, then to the smallest top-probability set
    whose mass reaches top_p (lanes whose strictly larger mass is < top_p), renormalised."""
    x = np.asarray(logits, np.float64) / temperature
    keep = np.ones(x.shape[-1], bool)
    if top_k:
        keep &= x >= np.sort(x)[::-1][top_k - 1]
    p = np.where(keep, np.exp(x - x[keep].max()), 0.0)
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p)
        before = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
        cut = np.zeros(x.shape[-1], bool)
        cut[order[before < top_p]] = True
        p = np.where(cut, p, 0.0)
        p /= p.sum()
    return p


def hf_greedy(model, prompts, new):
    import torch

    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                               eos_token_id=None)
            out.append(g[0, len(p):].tolist())
    return out


@functools.lru_cache(maxsize=None)
def build(name, tmp_root):
    """(target, random drafter, transformers' greedy continuation of PROMPTS)."""
    import torch
    import transformers as tf

    model_cls, cfg_cls, kw = FAMILIES[name]
    torch.manual_seed(0)
    model = randomize(getattr(tf, model_cls)(getattr(tf, cfg_cls)(**kw)).float().eval(), std=0.2)
    path = tmp_root / name
    model.save_pretrained(path)
    target = pjax.load_target(path, dtype=jnp.float32)
    new = 40 if name == "llama" else NEW  # llama: 30 tokens + room for the oracle drafts of the injection test
    return target, make_drafter(target, draft_vocab_size=64), hf_greedy(model, PROMPTS, new)  # Vd < V: d2t map


def round_programs(target, drafter, spec, rows: int, prompt_len: int, capacity: int):
    """Greedy rounds driven by hand: (run_prefill(seqs) -> DecodeState of the token lists `seqs` right-padded to
    prompt_len with a cache of `capacity`, jitted `spec_round`), both compiled with FAST."""
    from pjax.decode import Sampling
    samp = Sampling(jnp.zeros(rows), jnp.zeros(rows, jnp.int32), jnp.ones(rows), jnp.zeros(rows, jnp.uint32))
    prefill = jax.jit(pjax.decode.prefill, static_argnames=("spec", "capacity", "cache_dtype"), compiler_options=FAST)
    round_ = jax.jit(pjax.decode.spec_round, static_argnames=("spec",), compiler_options=FAST)

    def run_prefill(seqs):
        pad = np.zeros((rows, prompt_len), np.int32)
        for i, s in enumerate(seqs):
            pad[i, :len(s)] = s
        return prefill(target, drafter, jnp.asarray(pad), jnp.asarray([len(s) for s in seqs], jnp.int32), samp,
                       spec=spec, capacity=capacity, cache_dtype=None)
    return samp, run_prefill, round_
