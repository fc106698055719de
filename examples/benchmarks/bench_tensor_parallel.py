"""Tensor-parallel scaling: the decode step and the P-EAGLE round of a target split over 1, 2, 4, ... devices.

    PYTHONPATH=. python3 examples/benchmarks/bench_tensor_parallel.py                 # GPU: Llama-3.1-8B shape
    PYTHONPATH=. python3 examples/benchmarks/bench_tensor_parallel.py --devices 1,2,4 --batch 1,64 --k 7
    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
        PYTHONPATH=. python3 examples/benchmarks/bench_tensor_parallel.py --tiny    # CPU smoke test

For each device count n the random bf16 target (`random:<shape>` of `pjax.bench.models`) is generated in place on a
1 x n mesh (`pjax.make_mesh`, split by the plan of `pjax.models.sharding`), the random P-EAGLE head replicated, and
the engine's chunk program (`pjax.decode.engine.fixed_chunk`: `--rounds` rounds in one program, the state placed as
the engine places it) is timed on a state whose caches hold `--context` positions:
- "decode": plain decoding (drafting none, one target step per round, greedy sampling);
- "peagle": a P-EAGLE round (verify K + 1 positions, accept, one drafter pass), K = --k.
Timing: warm-up, then `--groups` groups of `--calls` chunk calls dispatched back to back; the median per round.
Weights are random (acceptance ~0: every round emits one token), so a round costs what it costs at any acceptance.
One JSON line per measurement: device count, batch, mode, ms per round, speedup and scaling efficiency against the
one-device run of the same mode and batch (speedup / n) when that ran first.

Every device count runs the kernels of --implementation (default "auto": the Pallas kernels where they are faster on
a GPU): on several devices the same kernels as on one, per shard (`pjax.models.per_shard`); pass --implementation
xla to time XLA's partitioned references instead.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pjax  # noqa: E402
from pjax.bench.models import random_head, random_target  # noqa: E402
from pjax.decode import EngineConfig, Sampling, make_spec  # noqa: E402
from pjax.decode.engine import fixed_chunk, mesh_config, state_shardings  # noqa: E402
from pjax.dtypes import parse_dtype  # noqa: E402
from pjax.kernels import IMPLEMENTATIONS  # noqa: E402
from pjax.models import place_drafter  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import synthetic_state  # noqa: E402

DONATE = jax.default_backend() != "cpu"


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def placed_state(target, head, spec, batch: int, capacity: int, context: int, mesh):
    """`synthetic_state` built in place with the engine's shardings (no whole cache on one device); no drafter cache
    for plain decoding."""
    def make():
        state = synthetic_state(target, head, spec, batch, capacity, context)
        return state if spec.drafting.speculative else dataclasses.replace(state, drafter_cache=None)
    return jax.jit(make, out_shardings=state_shardings(jax.eval_shape(make), mesh))()


def time_chunks(target, head, spec, batch: int, a, mesh) -> float:
    """Median ms per round of the engine's fixed-trip chunk program."""
    capacity = a.context + (a.warmup + a.groups * a.calls) * a.rounds * (spec.k + 1) + 2 * spec.k + 8
    state = placed_state(target, head, spec, batch, capacity, a.context, mesh)
    drafter = head if spec.drafting.speculative else None
    b = batch
    sampling = Sampling(jnp.zeros(b), jnp.zeros(b, jnp.int32), jnp.ones(b), jnp.arange(b, dtype=jnp.uint32))
    sampling = jax.device_put(sampling, state_shardings(sampling, mesh))
    fn = jax.jit(functools.partial(fixed_chunk, spec=spec, rounds=a.rounds, mesh=mesh),
                 donate_argnums=(2,) if DONATE else ())
    for _ in range(a.warmup):
        state, view = fn(target, drafter, state, sampling)
    jax.block_until_ready(state)
    per_round = []
    for _ in range(a.groups):
        t0 = time.perf_counter()
        for _ in range(a.calls):
            state, view = fn(target, drafter, state, sampling)
        jax.block_until_ready((state, view))
        per_round.append((time.perf_counter() - t0) * 1e3 / (a.calls * a.rounds))
    return statistics.median(per_round)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3.1-8b", help="random target geometry (pjax.bench.models.RANDOM_SHAPES)")
    ap.add_argument("--devices", type=ints, default=None, help="device counts, comma-separated (default 1,2,4 "
                    "as far as devices exist)")
    ap.add_argument("--batch", type=ints, default=[1, 64], help="rows per round, comma-separated (default 1,64)")
    ap.add_argument("--k", type=int, default=7, help="P-EAGLE drafts per round (default 7)")
    ap.add_argument("--head-layers", type=int, default=4, help="layers of the random P-EAGLE head (default 4)")
    ap.add_argument("--modes", default="decode,peagle", help="decode, peagle or both (default)")
    ap.add_argument("--context", type=int, default=1024, help="positions already in the caches (default 1024)")
    ap.add_argument("--rounds", type=int, default=16, help="rounds per chunk program (default 16)")
    ap.add_argument("--calls", type=int, default=5, help="chunk calls per timed group (default 5)")
    ap.add_argument("--groups", type=int, default=5, help="timed groups (default 5; the median is printed)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed chunk calls first (default 2)")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--implementation", default="auto", choices=IMPLEMENTATIONS,
                    help="the kernel switch of every run (several devices run the kernels per shard)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: the tiny shape, small batches and context")
    a = ap.parse_args(argv)
    if a.tiny:
        a.shape, a.context, a.rounds, a.calls, a.groups, a.warmup, a.head_layers = "tiny", 32, 2, 1, 1, 1, 1
        a.batch = [1, 4] if a.batch == [1, 64] else a.batch
    dtype = parse_dtype(a.dtype, what="--dtype")
    devices = a.devices or [n for n in (1, 2, 4) if n <= jax.device_count()]
    if max(devices) > jax.device_count():
        ap.error(f"--devices {max(devices)}: only {jax.device_count()} device(s) are visible")
    base = {}
    for n in devices:
        mesh = pjax.make_mesh(1, n, devices=jax.devices()[:n])
        target = random_target(a.shape, dtype, mesh=mesh)
        head = place_drafter(random_head(target, str(a.head_layers), parallel=True, dtype=dtype, shape=a.shape), mesh)
        for mode in a.modes.split(","):
            peagle = mode == "peagle"
            cfg = mesh_config(EngineConfig(drafting="parallel" if peagle else "none",
                                           num_speculative_tokens=a.k if peagle else None,
                                           implementation=a.implementation), mesh)
            spec = make_spec(target, head if peagle else None, cfg, max_new_tokens=1 << 20)
            for b in a.batch:
                ms = time_chunks(target, head, spec, b, a, mesh)
                one = base.setdefault((mode, b), ms) if n == 1 else base.get((mode, b))
                row = {"bench": "tensor_parallel", "shape": a.shape, "devices": n, "batch": b, "mode": mode,
                       "k": spec.k, "context": a.context, "implementation": cfg.implementation,
                       "ms_per_round": round(ms, 4), "tokens_per_s_at_zero_acceptance": round(b * 1e3 / ms, 1),
                       "speedup": None if one is None else round(one / ms, 3),
                       "scaling_efficiency": None if one is None else round(one / ms / n, 3),
                       "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
                       "date": time.strftime("%Y-%m-%d")}
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
