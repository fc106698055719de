"""Greedy exactness of the engine: parallel, sequential and plain decoding equal transformers' greedy
`generate` on tiny checkpoints of every target family (ragged batch; K in {1, 3, 7, 11}, one per family
to bound compile time), and with injected drafts (every accepted-prefix length) the KV bookkeeping of
target and drafter stays exact."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf

import convert
import pjax
from pjax.config import LayerSpec, ModelConfig, RopeSpec
from pjax.decode import Sampling
from pjax.decode.generate import _jitted
from pjax.models.drafter import DrafterConfig, init_drafter
from pjax.models.families import PARSERS
from tests.hf_utils import randomize

V = 97
NEW = 12
PROMPTS = [[5, 17, 3], [9, 1, 44, 60, 2, 71, 33, 8, 90, 12, 4], [30, 31, 32, 33, 34, 35]]  # ragged
FAMILIES = {
    "llama": (tf.LlamaForCausalLM, tf.LlamaConfig, dict(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16})),
    "qwen3": (tf.Qwen3ForCausalLM, tf.Qwen3Config, dict(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)),
    "qwen3_moe": (tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig, dict(
        vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1])),
    "gpt_oss": (tf.GptOssForCausalLM, tf.GptOssConfig, dict(
        vocab_size=V, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
        num_experts_per_tok=2, head_dim=16, num_attention_heads=4, num_key_value_heads=2, sliding_window=6,
        swiglu_limit=1.0, max_position_embeddings=256,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0})),
    "gemma4": (tf.Gemma4ForCausalLM, tf.Gemma4TextConfig, dict(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, hidden_size_per_layer_input=0, final_logit_softcapping=3.0, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"])),
}
K_OF = {"llama": 3, "qwen3": 1, "qwen3_moe": 7, "gpt_oss": 11, "gemma4": 11}  # gpt_oss/gemma4: K+1 > window
AVAILABLE = [f for f in FAMILIES if f in PARSERS]
# tiny CPU programs: compile time dominates, so skip LLVM optimisation (numerics are unchanged in kind)
FAST = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else {}
FAST_KEY = tuple(sorted(FAST.items()))


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


def hf_greedy(model, prompts, new):
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
    model_cls, cfg_cls, kw = FAMILIES[name]
    torch.manual_seed(0)
    model = randomize(model_cls(cfg_cls(**kw)).float().eval(), std=0.2)
    path = tmp_root / name
    model.save_pretrained(path)
    target = convert.load_target(path, dtype=jnp.float32)
    new = 40 if name == "llama" else NEW  # llama: 30 tokens + room for the oracle drafts of the injection test
    return target, make_drafter(target, draft_vocab_size=64), hf_greedy(model, PROMPTS, new)  # Vd < V: d2t map


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return tmp_path_factory.mktemp("engine_greedy")


@pytest.fixture(scope="module", params=AVAILABLE)
def family(request, tmp_root):
    return request.param, build(request.param, tmp_root)


@pytest.mark.parametrize("drafting", ["parallel", "sequential", "none"])
def test_greedy_equals_transformers(family, drafting):
    name, (target, drafter, ref) = family
    k = K_OF[name]
    res = pjax.generate(target, drafter, PROMPTS, max_new_tokens=NEW, num_speculative_tokens=k, drafting=drafting,
                        compiler_options=FAST)
    assert res.tokens == [r[:NEW] for r in ref]
    assert res.stats["stop_reasons"] == ["length"] * len(PROMPTS)
    assert res.stats["output_tokens"] == NEW * len(PROMPTS)
    if drafting != "none":
        assert res.stats["num_speculative_tokens"] == k and len(res.stats["acceptance_rates"]) == k


@pytest.fixture(scope="module")
def llama(tmp_root):
    return build("llama", tmp_root)


@pytest.mark.parametrize("drafting", ["parallel", "sequential"])
def test_injected_drafts_every_accept_length(llama, drafting):
    """Rounds driven with drafts taken from the true greedy continuation, corrupted at a chosen index c
    (c = K: all correct). Checks: accepted count == c, output == transformers, and before each round
    the engine's own drafts equal those of a fresh prefill over everything accepted so far (so the
    incremental drafter KV cache, with its overwritten mask / EAGLE-3 slots, is exact)."""
    target, drafter, ref = llama
    k, new, cap, lp = 3, 30, 64, 48
    spec = pjax.decode.make_spec(target, drafter, max_new_tokens=new, num_speculative_tokens=k, drafting=drafting)
    b = len(PROMPTS)
    samp = Sampling(jnp.zeros(b), jnp.zeros(b, jnp.int32), jnp.ones(b), jnp.zeros(b, jnp.uint32))
    prefill, round_ = _jitted("prefill", False, FAST_KEY), _jitted("round", False, FAST_KEY)

    def run_prefill(seqs):
        pad = np.zeros((b, lp), np.int32)
        for i, s in enumerate(seqs):
            pad[i, :len(s)] = s
        return prefill(target, drafter, jnp.asarray(pad), jnp.asarray([len(s) for s in seqs], jnp.int32), samp,
                       spec=spec, capacity=cap, cache_dtype=None)

    state = run_prefill(PROMPTS)
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(new):
        done = np.asarray(state.done)
        if done.all():
            break
        num_out = np.asarray(state.num_out)
        # the engine's drafts == drafts proposed from scratch over the accepted context
        fresh = run_prefill([PROMPTS[i] + ref[i][:max(num_out[i] - 1, 0)] for i in range(b)])
        live = ~done
        np.testing.assert_array_equal(np.asarray(state.drafts)[live], np.asarray(fresh.drafts)[live])
        drafts, cut = np.zeros((b, k), np.int32), np.full(b, k)
        for i in range(b):
            truth = ref[i][num_out[i]:num_out[i] + k]
            cut[i] = rng.integers(0, k + 1)
            drafts[i] = truth
            if cut[i] < k:
                drafts[i, cut[i]] = (truth[cut[i]] + 1 + rng.integers(0, V - 1)) % V
        before = np.asarray(state.accepted)
        state = round_(target, drafter, dataclasses_replace(state, drafts=jnp.asarray(drafts)), samp, spec=spec)
        got = np.asarray(state.accepted) - before
        np.testing.assert_array_equal(got[live], cut[live])
        seen.update(got[live].tolist())
    out = np.asarray(state.out)
    assert [out[i, :new].tolist() for i in range(b)] == [r[:new] for r in ref]
    assert np.asarray(state.num_out).tolist() == [new] * b
    assert seen == set(range(k + 1))


def dataclasses_replace(state, **kw):
    import dataclasses
    return dataclasses.replace(state, **kw)
