"""Tiny Hugging Face checkpoints of every target family pjax reads, shared by `python -m pjax check`'s `targets`
section and the tests: transformers' class names and config arguments per family, random weights, logits.

transformers and torch are imported by the functions that use them, so importing this module needs neither.
"""
from __future__ import annotations

import numpy as np

from pjax.models.families import PARSERS

__all__ = ["AVAILABLE", "FAMILIES", "VOCAB", "hf_logits", "randomize"]

VOCAB = 97
FAMILIES = {  # family: (transformers model class, config class, config arguments)
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16})),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1])),
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
        num_experts_per_tok=2, head_dim=16, num_attention_heads=4, num_key_value_heads=2, sliding_window=6,
        swiglu_limit=1.0, max_position_embeddings=256,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0})),
    "gemma4": ("Gemma4ForCausalLM", "Gemma4TextConfig", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, hidden_size_per_layer_input=0, final_logit_softcapping=3.0, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"])),
}
AVAILABLE = [f for f in FAMILIES if f in PARSERS]  # the families this pjax reads


def randomize(model, seed=0, std=0.1, norm_jitter=0.2, skip=()):
    """All parameters and state-dict buffers of a torch model normal(0, std); norm weights 1 + normal(0, norm_jitter)
    (so a wrong norm convention shows up); names containing any of `skip` are left alone."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if any(s in name for s in skip) or not t.is_floating_point() or "inv_freq" in name:
                continue
            if name not in model.state_dict():
                continue
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
            t.copy_(1 + norm_jitter * noise if "norm" in name or "layer_scalar" in name else std * noise)
    return model


def hf_logits(model, ids) -> np.ndarray:
    """A transformers causal LM's float32 logits [B, T, V] for token ids [B, T]."""
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids))).logits.float().numpy()
