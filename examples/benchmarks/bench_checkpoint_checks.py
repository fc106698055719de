"""Cost of the load-time integrity checks: the per-tensor checksums of pjax-native copies (`verify`) and the
NaN / inf check of every loader (`check_finite`), each one jitted program over all parameters.

    PYTHONPATH=. python3 examples/benchmarks/bench_checkpoint_checks.py           # GPU: Llama-3.1-8B geometry, bf16
    PYTHONPATH=. python3 examples/benchmarks/bench_checkpoint_checks.py --save    # + native save / load, verify on/off
    PYTHONPATH=. python3 examples/benchmarks/bench_checkpoint_checks.py --tiny    # CPU smoke test

Weights are random (normal, on device, one program). For each check: the first call (compile + run) and the
median of `--repeats` further calls, with the bytes read and the rate. `--save` also writes a pjax-native copy
to `--dir` (16 GB for the 8B model in bf16) and times `load_target` with verify on and off (disk-bound: run it
twice to see the page-cache figure). Prints a table; writes JSON to $OUT/bench_checkpoint_checks.json when $OUT
is set.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from pjax.checkpoint import integrity
from pjax.models.families import config_from_hf
from pjax.models.target import abstract_target

LLAMA8B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
           "rms_norm_eps": 1e-5, "hidden_act": "silu", "rope_theta": 500000.0}
TINY = dict(LLAMA8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def random_params(abstract, key):
    """All leaves normal(0, 0.02) in their dtype, made on device by one jitted program."""
    leaves, treedef = jax.tree.flatten(abstract.params)

    @jax.jit
    def make(key):
        keys = jax.random.split(key, len(leaves))
        return [0.02 * jax.random.normal(k, l.shape, jnp.float32).astype(l.dtype) for k, l in zip(keys, leaves)]
    return jax.tree.unflatten(treedef, make(key))


def timed(fn, repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t0
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        runs.append(time.perf_counter() - t0)
    return first, statistics.median(runs)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--save", action="store_true", help="also time a native save and load_target (verify on / off)")
    p.add_argument("--dir", default=None, help="directory for --save (default: a temporary directory)")
    a = p.parse_args()
    hf = TINY if a.tiny else LLAMA8B
    dtype = jnp.dtype(a.dtype)
    abstract = abstract_target(config_from_hf(hf), dtype)
    target = dataclasses.replace(abstract, params=random_params(abstract, jax.random.key(0)))
    leaves = jax.tree.leaves(target.params)
    nbytes = sum(x.size * x.dtype.itemsize for x in leaves)
    rows = {}
    jax.block_until_ready(leaves)
    for name, fn in (("checksums (verify)", lambda: integrity.checksums(leaves)),
                     ("non-finite counts (check_finite)", lambda: integrity.nonfinite_counts(leaves))):
        first, med = timed(fn, a.repeats)
        rows[name] = {"first_s": first, "median_s": med, "GB_per_s": nbytes / med / 1e9}
    if a.save:
        import pjax
        from pjax.checkpoint.native import save_native_target
        root = Path(a.dir or tempfile.mkdtemp(prefix="pjax-checks-"))
        t0 = time.perf_counter()
        out = save_native_target(target, hf, root / "native", overwrite=True)
        rows["save_native_target"] = {"median_s": time.perf_counter() - t0}
        for verify in (True, False, True):
            t0 = time.perf_counter()
            jax.block_until_ready(pjax.load_target(out, dtype=dtype, verify=verify).params)
            rows[f"load_target verify={verify}" + (" (again)" if f"load_target verify={verify}" in rows else "")] = {
                "median_s": time.perf_counter() - t0}
        if a.dir is None:
            shutil.rmtree(root)
    print(f"device: {jax.devices()[0].device_kind}; {len(leaves)} tensors, {nbytes / 1e9:.2f} GB ({dtype.name}); "
          f"jax {jax.__version__}")
    print("| step | first call (s) | median (s) | GB/s |\n|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r.get('first_s', float('nan')):.3f} | {r['median_s']:.4f} | "
              f"{r.get('GB_per_s', float('nan')):.0f} |")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_checkpoint_checks.json").write_text(json.dumps(
            {"device": jax.devices()[0].device_kind, "bytes": nbytes, "dtype": dtype.name, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
