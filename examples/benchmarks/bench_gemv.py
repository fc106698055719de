"""Why is a 1-token decode step slower than an 8-token extend? Weight-streaming matmuls on the device.

    PYTHONPATH=. python3 examples/benchmarks/bench_gemv.py

Times (inside one jitted fori_loop, so no host dispatch is counted) a chain of 32 bf16 matmuls
x[M, 4096] @ W_i over distinct weights ([in, out] = [4096, 14336] and the transposed [out, in] layout), for
M = 1, 2, 8, and the device read bandwidth (sum over a 2 GiB buffer). Prints GB/s per variant.
"""
import os
import sys
import time

import jax
import jax.numpy as jnp

TINY = bool(os.environ.get("TINY"))
N_W, D_IN, D_OUT, REPS = (2, 64, 256, 2) if TINY else (32, 4096, 14336, 20)


def timed(f, *args):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return sorted(ts)[2]


def main():
    k = jax.random.key(0)
    w = jnp.stack([jax.random.normal(jax.random.fold_in(k, i), (D_IN, D_OUT), jnp.bfloat16) for i in range(N_W)])
    wt = jnp.swapaxes(w, 1, 2).copy()
    nbytes = w.size * 2

    buf = jax.random.normal(k, (1 << (12 if TINY else 30),), jnp.bfloat16)  # 2 GiB (int32-indexable)

    @jax.jit
    def read(b):
        return jax.lax.fori_loop(0, REPS, lambda i, acc: acc + jnp.sum(b * (1 + i).astype(b.dtype),
                                                                        dtype=jnp.float32), 0.0)
    t = timed(read, buf)
    print(f"read bandwidth (sum): {REPS * buf.size * 2 / t / 1e9:.0f} GB/s", flush=True)
    del buf

    for layout, ww in (("[in,out]", w), ("[out,in]", wt)):
        for m in (1, 2, 8):
            x = jax.random.normal(k, (m, D_IN), jnp.bfloat16)

            def body(i, x, ww=ww, layout=layout):
                for j in range(N_W):
                    if layout == "[in,out]":
                        y = jnp.dot(x, ww[j], preferred_element_type=jnp.float32)
                    else:
                        y = jnp.einsum("mi,oi->mo", x, ww[j], preferred_element_type=jnp.float32)
                    x = (y[:, :D_IN] * 1e-2).astype(jnp.bfloat16)
                return x
            f = jax.jit(lambda x, body=body: jax.lax.fori_loop(0, REPS, body, x))
            t = timed(f, x)
            print(f"{layout} M={m}: {t / REPS * 1e3:.3f} ms per 32 matmuls, {REPS * nbytes / t / 1e9:.0f} GB/s",
                  flush=True)


if __name__ == "__main__":
    sys.exit(main())
