"""A measurement record, not part of pjax (tree of commit 68afb7f; run from the repository root:
`python3 docs/results/random-weights-2026-11-27/chunk_loop.py plain`, output in chunk-loop.txt). Where the serving chunk's fixed cost goes: the engine's chunk (data-dependent while loop, early exit) against a
fixed-trip-count loop of the same rounds, per call, 64 slots of the code-pair geometry (random weights, simulated
acceptance). argv: tag [small]."""
import functools, os, sys, time
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
from pjax.bench.models import random_target, random_head
from pjax.serve import Engine, EngineConfig, RequestParams
from pjax.decode.step import spec_round, decode_chunk

tag = sys.argv[1]
small = len(sys.argv) > 2
shape = "tiny" if small else "code-pair"
dt = jnp.float32 if small else jnp.bfloat16
t = random_target(shape, dt)
h = random_head(t, "4", parallel=True, dtype=dt, shape=shape)
slots = 8 if small else 64
eng = Engine(t, h, EngineConfig(max_slots=slots, max_len=512, num_speculative_tokens=3, rounds_per_step=8,
                                simulate_acceptance=(0.82, 0.78, 0.828)))
eng.precompile_admissions([[128] * slots], warm=True)
for i in range(slots):
    eng.submit(np.arange(10, 138) + i, RequestParams(360))
eng.step()  # the admission
s0 = jax.tree.map(jnp.copy, eng._state)
samp = eng._sampling
jax.block_until_ready(s0)
spec = eng.spec

def fixed(target, drafter, state, sampling, *, n):
    return jax.lax.fori_loop(0, n, lambda i, s: spec_round(target, drafter, s, sampling, spec=spec), state)

def timeit(call, label, reps=7):
    walls, disp = [], []
    for r in range(reps + 1):
        s = jax.tree.map(jnp.copy, s0); jax.block_until_ready(s)
        a = time.perf_counter(); out = call(s); b = time.perf_counter(); jax.block_until_ready(out)
        c = time.perf_counter()
        if r:
            walls.append(c - a); disp.append(b - a)
    print(f"{tag} {label}: call {1e3 * np.median(walls):.2f} ms (returns after {1e3 * np.median(disp):.2f} ms)",
          flush=True)
    return np.median(walls)

exe = eng._chunk_program((t, h, s0, samp, np.int32(8)))
res = {}
for n in (1, 8, 32):
    res[("while", n)] = timeit(lambda s, n=n: exe(t, h, s, samp, np.int32(n)), f"while early-exit {n:2d} rounds")
for n in (1, 8, 32):
    f = jax.jit(functools.partial(fixed, n=n), donate_argnums=(2,) if jax.default_backend() != "cpu" else ())
    c = f.lower(t, h, s0, samp).compile()
    res[("fixed", n)] = timeit(lambda s, c=c: c(t, h, s, samp), f"fixed-trip      {n:2d} rounds")
for kind in ("while", "fixed"):
    per = (res[(kind, 32)] - res[(kind, 8)]) / 24
    print(f"{tag} {kind}: {1e3 * per:.3f} ms a round, fixed {1e3 * (res[(kind, 8)] - 8 * per):.2f} ms a call")
