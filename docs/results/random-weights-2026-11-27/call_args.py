"""A measurement record, not part of pjax (`python3 docs/results/random-weights-2026-11-27/call_args.py`, output in
call-args.txt). Host cost of one call by argument count: N weights (not donated) and M state arrays (donated), jit vs AOT."""
import sys, time
import jax, jax.numpy as jnp, numpy as np
gpu = jax.default_backend() != "cpu"
def f(ws, ss):
    acc = sum(w[0, 0].astype(jnp.float32) for w in ws) if ws else jnp.float32(0)
    return [s.at[0, 0].add(acc.astype(s.dtype)) for s in ss]
for n, m in ((0, 8), (0, 75), (265, 0), (265, 8), (265, 75), (130, 75)):
    ws = [jnp.ones((256, 256), jnp.bfloat16) + i for i in range(n)]
    ss = [jnp.zeros((64, 1024), jnp.bfloat16) + i for i in range(m)]
    j = jax.jit(f, donate_argnums=(1,) if gpu else ())
    aot = j.lower(ws, ss).compile()
    for name, call in (("jit", j), ("aot", aot)):
        for _ in range(3):
            ss = call(ws, ss)
        jax.block_until_ready(ss)
        d = []
        for _ in range(30):
            a = time.perf_counter(); ss = call(ws, ss); d.append(time.perf_counter() - a); jax.block_until_ready(ss)
        print(f"{jax.default_backend()} weights {n:3d} donated state {m:2d} {name}: {1e3 * np.median(d):.3f} ms a call",
              flush=True)
