"""Helpers to build tiny random Hugging Face checkpoints on CPU for parity tests. torch is imported by the helpers
that use it, so a test module that only needs `rel_err` never imports it."""
import numpy as np

from pjax.check.families import hf_logits, randomize  # shared with `python -m pjax check`

__all__ = ["check_cached_extend", "hf_hidden_states", "hf_logits", "pjax_full_forward", "randomize", "rel_err",
           "save_tiny"]


def save_tiny(model_cls, config, path, seed=0, init_std=None):
    """Instantiate `model_cls(config)` with seeded random weights in float32, save_pretrained to path."""
    import torch

    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    if init_std is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.ndim >= 1 and "norm" not in name:
                    p.normal_(0, init_std)
    model.save_pretrained(path)
    return model


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def hf_hidden_states(model, ids):
    """transformers' hidden_states tuple as numpy ([k] = residual stream entering layer k, k < L)."""
    import torch

    with torch.no_grad():
        out = model(torch.as_tensor(np.asarray(ids)), output_hidden_states=True)
    return [h.float().numpy() for h in out.hidden_states], out.logits.float().numpy()


def pjax_full_forward(target, ids, aux_layer_ids=()):
    """One jitted full causal forward: (float32 logits [B, T, V], aux [B, T, A*H] or None, final pre-norm)."""
    import jax
    import jax.numpy as jnp

    from pjax.models.target import forward, logits_from_hidden

    @jax.jit
    def run(target, ids):
        pos = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
        out = forward(target, ids, pos, aux_layer_ids=tuple(aux_layer_ids), return_final=True)
        return logits_from_hidden(target, out.hidden), out.aux, target.module.norm(out.final)
    return tuple(np.asarray(x) if x is not None else None for x in run(target, jnp.asarray(ids, jnp.int32)))


def check_cached_extend(target, ids, full, prefix, chunks=(1, 4), capacity=None, hf_full=None, tol=1e-5):
    """Prefill ragged per-row prefixes (lengths `prefix`) into a KV cache in `max(chunks)`-token steps with
    `valid` masks, then extend by alternating chunks (e.g. 1 and K+1 tokens). Each chunk's logits must
    equal the full causal forward's `full` [B, T, V] at the same positions (and transformers' `hf_full`
    within 1e-4 when given). Only two step shapes are compiled."""
    import jax
    import jax.numpy as jnp

    from pjax.models.cache import init_cache
    from pjax.models.target import forward, logits_from_hidden
    ids = jnp.asarray(ids, jnp.int32)
    b, total = ids.shape
    prefix = np.asarray(prefix)
    step = jax.jit(forward)
    cache = init_cache(target.config, b, capacity or total + max(chunks), jnp.float32)
    big = max(chunks)

    def run(pos, valid):
        nonlocal cache
        take = jnp.asarray(np.minimum(pos, total - 1))
        out = step(target, jnp.take_along_axis(ids, take, 1), jnp.asarray(pos), cache, valid=jnp.asarray(valid))
        cache = out.cache
        return np.asarray(logits_from_hidden(target, out.hidden))

    for start in range(0, int(prefix.max()), big):  # prefill: rows stop at their own length
        pos = start + np.broadcast_to(np.arange(big), (b, big))
        run(pos, pos < prefix[:, None])
    cur, n, done = prefix.copy(), 0, set()
    while True:
        chunk = chunks[n % len(chunks)]
        if not (cur + chunk <= total).all():
            break
        pos = cur[:, None] + np.arange(chunk)[None]
        got = run(pos, np.ones(pos.shape, bool))
        rows = np.arange(b)[:, None]
        assert rel_err(got, full[rows, pos]) <= tol, (chunk, cur, rel_err(got, full[rows, pos]))
        if hf_full is not None:
            assert rel_err(got, hf_full[rows, pos]) <= 1e-4, (chunk, cur)
        cur, n = cur + chunk, n + 1
        done.add(chunk)
    assert done == set(chunks)
