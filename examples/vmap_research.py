"""Research API: one speculative round for ONE sequence, `jax.vmap`ped over many sequences.

`pjax.decode.prefill_single` and `pjax.decode.round_single` take and return a `DecodeState` without a
batch axis, so ordinary JAX transformations compose with them. Here: draw many independent samples of
the same prompt (one seed each) in lock step, and measure how the acceptance of each draft position
changes with the sampling temperature - the kind of sweep that needs thousands of sequences, not a
serving loop.

    PYTHONPATH=. python3 examples/vmap_research.py                       # random tiny models (CPU)
    PYTHONPATH=. python3 examples/vmap_research.py --target DIR --drafter DIR --prompt 1,2,3 --samples 512

Every random draw is keyed on (seed, absolute position), so sample i of this script equals what
`pjax.generate(..., seed=i)` returns for the same prompt and settings.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pjax  # noqa: E402
from pjax.config import LayerSpec, ModelConfig, RopeSpec  # noqa: E402
from pjax.decode import EngineConfig, Sampling, make_spec, prefill_single, round_single  # noqa: E402
from pjax.models.drafter import DrafterConfig, init_drafter  # noqa: E402


def tiny_models():
    rope = RopeSpec(theta=10000.0)
    cfg = ModelConfig("llama", 64, 32, 64, 4, tuple(LayerSpec(8, 2, rope) for _ in range(2)), rms_norm_eps=1e-5)
    target = pjax.init_target(cfg, jax.random.key(0), jnp.float32, scale=0.4)
    head = ModelConfig("llama", 64, 32, 64, 4, (LayerSpec(8, 2, rope),), rms_norm_eps=1e-5)
    dcfg = DrafterConfig(layer=head, num_aux=3, target_hidden_size=32, draft_vocab_size=64, mask_token_id=63,
                         aux_layer_ids=(0, 1, 2))
    return target, init_drafter(dcfg, jax.random.key(1), jnp.float32, scale=0.2)


def sample_many(target, drafter, prompt, *, samples, temperature, k, new_tokens, drafting="parallel"):
    """Run `samples` sequences of `prompt` (seeds 0..samples-1) to completion; returns the final
    batched DecodeState (leading axis = sample)."""
    spec = make_spec(target, drafter, EngineConfig(num_speculative_tokens=k, drafting=drafting),
                     max_new_tokens=new_tokens)
    # every row samples without top-k / top-p: fixed, the round neither branches nor (under vmap) sorts the vocabulary
    spec = dataclasses.replace(spec, sampling="sampled" if temperature > 0 else "greedy")
    capacity = len(prompt) + new_tokens + 2 * k
    init = jax.jit(jax.vmap(functools.partial(prefill_single, spec=spec, capacity=capacity),
                            in_axes=(None, None, None, None, 0)))
    step = jax.jit(jax.vmap(functools.partial(round_single, spec=spec), in_axes=(None, None, 0, 0)))
    n = samples
    sampling = Sampling(temperature=jnp.full((n,), temperature, jnp.float32), top_k=jnp.zeros((n,), jnp.int32),
                        top_p=jnp.ones((n,), jnp.float32), seed=jnp.arange(n, dtype=jnp.uint32))
    prompt_arr = jnp.asarray(prompt, jnp.int32)
    state = init(target, drafter, prompt_arr, jnp.int32(len(prompt)), sampling)

    def cond(s):
        return ~jnp.all(s.done)

    run = jax.jit(lambda s: jax.lax.while_loop(cond, lambda x: step(target, drafter, x, sampling), s))
    return run(state)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="Hugging Face target directory (default: random tiny models)")
    ap.add_argument("--drafter", help="P-EAGLE / EAGLE-3 head directory")
    ap.add_argument("--prompt", default="1,2,3,4,5", help="comma-separated token ids")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--temperatures", default="0.5,1.0,1.5")
    args = ap.parse_args(argv)
    if args.target:
        target = pjax.load_target(args.target)
        drafter = pjax.load_drafter(args.drafter, target=target)
    else:
        target, drafter = tiny_models()
    prompt = [int(x) for x in args.prompt.split(",")]
    print(f"| temperature | mean acceptance length | per-position acceptance (K={args.k}) | distinct outputs |")
    print("|---|---|---|---|")
    for t in (float(x) for x in args.temperatures.split(",")):
        s = sample_many(target, drafter, prompt, samples=args.samples, temperature=t, k=args.k,
                        new_tokens=args.new_tokens)
        drafts = int(s.num_drafts.sum())
        rates = np.asarray(s.accepted_at.sum(0)) / max(drafts, 1)
        mal = 1 + int(s.accepted.sum()) / max(drafts, 1)
        outs = {tuple(np.asarray(row[:n]).tolist()) for row, n in zip(s.out, s.num_out)}
        print(f"| {t} | {mal:.3f} | {' '.join(f'{r:.3f}' for r in rates)} | {len(outs)} |")


if __name__ == "__main__":
    main()
