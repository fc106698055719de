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
one-device run of the same mode and batch (speedup / n) when that ran first; the HBM roofline of the round (the
bytes one device reads: its weight shards, MoE experts only as far as the round's tokens reach them in expectation,
its KV heads of the cache; over the device's HBM bandwidth) and the fraction of it reached; with --profile, the
share of the first device's kernel time spent in collectives (NCCL kernels in a profiler trace of two chunks).
MoE targets: --experts expert | intermediate picks how the experts are split (`pjax.models.sharding`).

Every device count runs the kernels of --implementation (default "auto": the Pallas kernels where they are faster on
a GPU): on several devices the same kernels as on one, per shard (`pjax.models.per_shard`); pass --implementation
xla to time XLA's partitioned references instead.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
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
from pjax.models.sharding import EXPERT_SHARDING  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import synthetic_state  # noqa: E402
from devtime import gpu_kernel_events, trace_calls  # noqa: E402

DONATE = jax.default_backend() != "cpu"
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}  # peak HBM bandwidth by device kind (vendor data sheets)
COLLECTIVE = re.compile(r"nccl|all.?reduce|all.?gather|reduce.?scatter|all.?to.?all|collective", re.I)
EXPERT_LEAVES = ("gate_up", "down", "gate_up_bias", "down_bias")


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def placed_state(target, head, spec, batch: int, capacity: int, context: int, mesh):
    """`synthetic_state` built in place with the engine's shardings (no whole cache on one device); no drafter cache
    for plain decoding."""
    def make():
        state = synthetic_state(target, head, spec, batch, capacity, context)
        return state if spec.drafting.speculative else dataclasses.replace(state, drafter_cache=None)
    return jax.jit(make, out_shardings=state_shardings(jax.eval_shape(make), mesh))()


def device_bytes(x, device) -> int:
    """Bytes of array `x` held by `device`."""
    return sum(s.data.nbytes for s in x.addressable_shards if s.device == device)


def round_bytes(target, head, spec, batch: int, context: int, device, n: int, itemsize: int) -> float:
    """HBM bytes `device` (one of n on the "model" axis) reads in one round: its weight shards (MoE experts scaled by
    the expected share of experts the round's tokens reach), the drafter's weights (speculative rounds), and its KV
    heads (all of them where n does not divide them) of `context` cached positions per row (sliding-window layers:
    at most their window) at `itemsize` bytes."""
    cfg = target.config
    tokens = batch * (spec.k + 1)
    moe = cfg.moe
    reach = 1.0 if moe is None else 1.0 - (1.0 - moe.top_k / moe.num_experts) ** tokens
    total = 0.0
    for path, x in jax.tree_util.tree_flatten_with_path(target.params)[0]:
        names = [str(getattr(p, "key", getattr(p, "idx", p))) for p in path]
        expert = "mlp" in names and any(name in EXPERT_LEAVES for name in names)
        total += (reach if expert else 1.0) * device_bytes(x, device)
    if spec.drafting.speculative:
        total += sum(device_bytes(x, device) for x in jax.tree.leaves(head.params))
    for layer in cfg.layers:
        seen = context if layer.sliding_window is None else min(context, layer.sliding_window)
        kv_heads = layer.num_kv_heads // n if layer.num_kv_heads % n == 0 else layer.num_kv_heads
        total += batch * seen * 2 * kv_heads * layer.head_dim * itemsize
    return total


def collective_share(events) -> float:
    """The share of kernel time spent in collective kernels, from `devtime.gpu_kernel_events`."""
    busy = sum(e - s for s, e, _ in events)
    return sum(e - s for s, e, name in events if COLLECTIVE.search(name)) / max(busy, 1)


def time_chunks(target, head, spec, batch: int, a, mesh) -> tuple[float, float | None]:
    """(median ms per round of the engine's fixed-trip chunk program, with a.profile on a GPU the share of the first
    device's kernel time in collectives over two traced chunks, else None)."""
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
    share = None
    if a.profile and jax.default_backend() == "gpu":
        box = [state]

        def call():
            box[0], out = fn(target, drafter, box[0], sampling)
            return out
        events = gpu_kernel_events(trace_calls(call, (), 2))
        share = None if not events else round(collective_share(events), 4)
    return statistics.median(per_round), share


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
    ap.add_argument("--experts", default="expert", choices=EXPERT_SHARDING,
                    help="MoE targets: experts split by expert (expert parallel) or by intermediate dimension")
    ap.add_argument("--profile", action="store_true", help="GPU: also the share of kernel time in collectives")
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
        target = random_target(a.shape, dtype, mesh=mesh, experts=a.experts)
        head = place_drafter(random_head(target, str(a.head_layers), parallel=True, dtype=dtype, shape=a.shape), mesh)
        for mode in a.modes.split(","):
            peagle = mode == "peagle"
            cfg = mesh_config(EngineConfig(drafting="parallel" if peagle else "none",
                                           num_speculative_tokens=a.k if peagle else None,
                                           implementation=a.implementation), mesh)
            spec = make_spec(target, head if peagle else None, cfg, max_new_tokens=1 << 20)
            for b in a.batch:
                ms, share = time_chunks(target, head, spec, b, a, mesh)
                hbm = next((v for k, v in HBM_BYTES_PER_S.items() if k in jax.devices()[0].device_kind), None)
                roof = None if hbm is None else 1e3 * round_bytes(target, head, spec, b, a.context, jax.devices()[0],
                                                                  n, dtype.itemsize) / hbm
                one = base.setdefault((mode, b), ms) if n == 1 else base.get((mode, b))
                row = {"bench": "tensor_parallel", "shape": a.shape, "devices": n, "batch": b, "mode": mode,
                       "k": spec.k, "context": a.context, "implementation": cfg.implementation,
                       "experts": a.experts if target.config.moe else None,
                       "ms_per_round": round(ms, 4), "tokens_per_s_at_zero_acceptance": round(b * 1e3 / ms, 1),
                       "roofline_ms": None if roof is None else round(roof, 4),
                       "of_roofline": None if roof is None else round(roof / ms, 3), "collective_share": share,
                       "speedup": None if one is None else round(one / ms, 3),
                       "scaling_efficiency": None if one is None else round(one / ms / n, 3),
                       "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
                       "xla_flags": os.environ.get("XLA_FLAGS"),
                       "date": time.strftime("%Y-%m-%d")}
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
