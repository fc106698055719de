"""How many thread-block clusters of a given size run at once when each program fills an SM (H100 / H200)?

    PYTHONPATH=. python3 examples/benchmarks/cluster_waves.py      # GPU (Hopper, JAX >= 0.11), ~10 s

Why: a single-launch flash-decoding attention that merges its splits inside a cluster (the splits of a KV head as
one cluster, partials exchanged through shared or global memory after a cluster barrier) only pays off if all its
clusters run in one wave. Each program here holds ~200 KB of shared memory (one per SM, as the cache-attention
kernels) and spins for a fixed number of dependent multiply-adds; a launch that needs two waves takes about twice
as long (device time, from the profiler) as the same programs unclustered. Results: docs/benchmarks.md section 2.
"""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


def spin(x, *, cluster: int, programs: int, iters: int = 20000, smem_bytes: int = 200 * 1024):
    """x [programs] f32 -> [programs, 128]: every program spins `iters` dependent FMAs on its element."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def kern(x_ref, o_ref):
        def body(row, _hold):
            i = lax.axis_index("g") * cluster + lax.axis_index("c")
            v = lax.fori_loop(0, iters, lambda _, a: a * 1.0000001 + 1e-7, x_ref[i])
            row[...] = jnp.full((128,), v, jnp.float32)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(row, o_ref.at[i])
            plgpu.wait_smem_to_gmem(0)
        pl.run_scoped(body, plgpu.SMEM((128,), jnp.float32), plgpu.SMEM((smem_bytes // 4,), jnp.float32))

    return plgpu.kernel(kern, out_type=jax.ShapeDtypeStruct((programs, 128), jnp.float32),
                        grid=(programs // cluster,), grid_names=("g",), cluster=(cluster,), cluster_names=("c",))(x)


def main():
    from devtime import profile_calls  # this directory: on sys.path when run as a script

    print(f"# cluster waves {time.strftime('%Y-%m-%d %H:%M:%S')} jax {jax.__version__} {jax.devices()[0]}")
    print("| programs | cluster 1 us | cluster 8 us | cluster 16 us |\n|---|---|---|---|")
    for programs in (128, 112, 64):
        cells = []
        for cluster in (1, 8, 16):
            x = jnp.ones((programs,), jnp.float32)
            f = jax.jit(lambda x, c=cluster, p=programs: spin(x, cluster=c, programs=p))
            spans, _ = profile_calls(f, (x,), calls=10)  # device time of the kernel, from the GPU's timestamps
            cells.append(f"{statistics.median(spans) / 1e3:.1f}")
        print(f"| {programs} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
