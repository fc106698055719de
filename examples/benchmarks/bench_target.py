"""Target-model step latency next to the HBM roofline (batch 1, random weights built on the device: bf16, packed
MXFP4 / FP8 experts for the shapes named so, `pjax.bench.models`).

    PYTHONPATH=. python3 examples/benchmarks/bench_target.py            # GPU: dense, MoE bf16 / FP8 / MXFP4 shapes
    PYTHONPATH=. python3 examples/benchmarks/bench_target.py --models gpt-oss-120b   # one H200: peak memory too
    PYTHONPATH=. python3 examples/benchmarks/bench_target.py --tiny     # CPU smoke test (tiny shapes)

Steps (each one jitted program, KV cache donated, context ~1K):
  decode  1 token  -> float32 logits of that token            (plain autoregressive step)
  extend  K+1 = 8  -> float32 logits of all 8 tokens            (speculative verification step)
Timing: warm-up, then >= 30 calls, each synchronised; the median is reported (p10/p90 alongside), plus
the mean of a back-to-back (pipelined) run of the same length.
Roofline: bytes that must be read per step / measured device read bandwidth (a jitted loop of sums over a
2 GiB bf16 buffer). The headline time is the pipelined one (calls dispatched back to back, as in a
generation loop); the synchronised per-call median also counts the host round trip. Bytes = weights touched (every matrix except
the embedding table, of which only the looked-up rows; MoE layers: the experts actually selected —
top_k for one token, the expected number of distinct experts E(1 - (1 - k/E)^T) under uniform routing for
T tokens; packed experts count their packed bytes and scales) + the whole KV cache buffer read by attention + the
new K/V written. process_peak_device_bytes: the device's peak allocation in the process so far (a model's own peak
where it is the first or largest of the run: `--models NAME` for one).
--profile (GPU): each step's kernels from the profiler (`devtime.py`): how many, their summed time against the
step's device span (the rest is the device waiting between kernels), and the kernels taking the most time, grouped
by name with their numeric suffixes folded (`devtime.kernel_groups`).
Prints a markdown table; writes JSON to $OUT/bench_target.json when $OUT is set (or to --json PATH).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from devtime import kernel_groups, profile_calls  # noqa: E402

from pjax.bench.models import RANDOM_TARGETS, random_target  # noqa: E402
from pjax.kernels import IMPLEMENTATIONS  # noqa: E402
from pjax.models.cache import init_cache  # noqa: E402
from pjax.models.target import Target, forward, logits_from_hidden  # noqa: E402

MODELS = ("llama3.1-8b", "qwen3-30b-a3b", "qwen3-30b-a3b-fp8", "gpt-oss-20b", "gpt-oss-20b-mxfp4", "gpt-oss-120b")
TINY = ("tiny", "tiny-moe-mxfp4")


def make_step(last_only: bool, implementation: str = "auto"):
    """(target, tokens [B,T], positions [B,T], cache) -> (float32 logits, cache); cache donated; implementation: the
    kernel switch (`pjax.kernels`)."""
    def step(target, tokens, positions, cache):
        out = forward(target, tokens, positions, cache, implementation=implementation)
        hidden = out.hidden[:, -1:] if last_only else out.hidden  # logits only where they are needed
        return logits_from_hidden(target, hidden), out.cache
    return jax.jit(step, donate_argnums=(3,))


def nbytes(tree) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def step_bytes(target: Target, cache, tokens: int) -> dict:
    """Bytes a step must move: weights touched, KV read (the whole cache buffer), KV written."""
    cfg, p = target.config, target.params
    emb = p["embed_tokens"]["embedding"]
    row = emb.shape[1] * emb.dtype.itemsize
    weights = nbytes(p) - nbytes(emb) + tokens * row + (nbytes(emb) if cfg.tie_word_embeddings else 0)
    if cfg.moe is not None:
        e, k = cfg.moe.num_experts, cfg.moe.top_k
        touched = e * (1 - (1 - k / e) ** tokens)  # distinct experts per layer (exactly k for one token)
        for layer, spec in zip(p["layers"].values() if isinstance(p["layers"], dict) else p["layers"], cfg.layers):
            if spec.moe:
                experts = sum(nbytes(layer["mlp"][n]) for n in ("gate_up", "down", "gate_up_bias", "down_bias")
                              if layer["mlp"].get(n) is not None)
                weights -= experts * (1 - touched / e)
    kv_read = nbytes(cache)
    per_token = sum(2 * s.num_kv_heads * s.head_dim for s in cfg.layers) * cache[0].k.dtype.itemsize
    return {"weight_bytes": int(weights), "kv_read_bytes": kv_read, "kv_write_bytes": tokens * per_token,
            "bytes": int(weights) + kv_read + tokens * per_token}


def copy_bandwidth(nbytes_: int, repeats: int) -> float:
    """Measured device read bandwidth in bytes/s: a jitted loop of `repeats` full reductions over a bf16
    buffer (inside one program, so host dispatch is not counted; 4.36 TB/s seen on the H200)."""
    x = jax.random.normal(jax.random.key(0), (nbytes_ // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: jax.lax.fori_loop(
        0, repeats, lambda i, acc: acc + jnp.sum(a * (1 + i).astype(a.dtype), dtype=jnp.float32), 0.0))
    jax.block_until_ready(f(x))
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        jax.block_until_ready(f(x))
        ts.append(time.perf_counter() - t)
    del x
    return repeats * nbytes_ / statistics.median(ts)


def time_step(step, target, tokens, positions, cache, *, warmup: int, repeats: int):
    """Returns (per-call seconds list, pipelined mean seconds, cache)."""
    for _ in range(warmup):
        out, cache = step(target, tokens, positions, cache)
    jax.block_until_ready(out)
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        out, cache = step(target, tokens, positions, cache)
        jax.block_until_ready(out)
        ts.append(time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(repeats):
        out, cache = step(target, tokens, positions, cache)
    jax.block_until_ready(out)
    return ts, (time.perf_counter() - t) / repeats, cache


def kernel_profile(step, target, tokens, positions, cache, *, calls: int = 10, top: int = 12):
    """GPU: the step's kernels (per call, medians over `calls`): count, device span and summed kernel time in us,
    and the `top` name groups by time (`devtime.kernel_groups`: one group per kind of fusion or
    kernel); None without a GPU plane. Returns (that, the cache: each call donates it to the next)."""
    state = [cache]

    def call():
        out, state[0] = step(target, tokens, positions, state[0])
        return out
    prof = profile_calls(call, (), calls=calls)
    if prof is None:
        return None, state[0]
    spans, kernels = prof
    busy = statistics.median(sum(d for _, _, d in ks) for ks in kernels)
    return {"kernels": len(kernels[0]), "span_us": statistics.median(spans) / 1e3, "busy_us": busy / 1e3,
            "top": [(name, n, ns / 1e3) for name, ns, n in kernel_groups(kernels, top)]}, state[0]


def bench_model(name, *, context, k1, warmup, repeats, bandwidth, dtype, implementation="auto",
                profile=False) -> list[dict]:
    target = random_target(name, dtype)  # pjax.bench.models: published geometries, packed experts where named
    cfg = target.config
    cache = init_cache(cfg, 1, context + k1, dtype)
    rows = []
    for kind, t in (("decode", 1), ("extend", k1)):
        step = make_step(last_only=(t == 1), implementation=implementation)
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, t)), jnp.int32)
        positions = jnp.asarray(context + np.arange(t)[None], jnp.int32)
        b = step_bytes(target, cache, t)
        ts, pipelined, cache = time_step(step, target, tokens, positions, cache, warmup=warmup, repeats=repeats)
        med = statistics.median(ts)
        roof = b["bytes"] / bandwidth
        prof, cache = kernel_profile(step, target, tokens, positions, cache) if profile else (None, cache)
        rows.append(dict(model=name, step=kind, tokens=t, context=context, implementation=implementation, profile=prof,
                         median_ms=1e3 * med,
                         p10_ms=1e3 * float(np.percentile(ts, 10)), p90_ms=1e3 * float(np.percentile(ts, 90)),
                         pipelined_ms=1e3 * pipelined, roofline_ms=1e3 * roof, roofline_fraction=roof / pipelined, sync_fraction=roof / med,
                         weight_bytes_total=nbytes(target.params), process_peak_device_bytes=peak_bytes(), **b))
        print(f"  {name} {kind}: {1e3 * med:.3f} ms (roofline {1e3 * roof:.3f} ms)", flush=True)
        if prof:
            print(f"    {prof['kernels']} kernels, span {prof['span_us']:.0f} us, kernels busy "
                  f"{prof['busy_us']:.0f} us ({prof['busy_us'] / prof['span_us']:.0%}); by time (count, us per step):",
                  flush=True)
            for kname, n, us in prof["top"]:
                print(f"      {us:8.1f} us {n:6.0f}x  {kname}", flush=True)
    del target, cache
    return rows


def peak_bytes():
    """The device's peak allocated bytes in this process so far (None where the backend does not report it)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def markdown(rows, bandwidth) -> str:
    """The rows as a table; with --profile on a GPU also each step's device span (no host time) over the roofline."""
    device = any(r["profile"] for r in rows)
    lines = [f"measured read bandwidth: {bandwidth / 1e9:.0f} GB/s", "",
             "| model | step | tokens | context | median ms | p10-p90 ms | pipelined ms | GB read | roofline ms "
             "| roofline / pipelined |" + (" device ms | roofline / device |" if device else ""),
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if device else "")]
    for r in rows:
        span = r["profile"]["span_us"] / 1e3 if r["profile"] else float("nan")
        lines.append(f"| {r['model']} | {r['step']} | {r['tokens']} | {r['context']} | {r['median_ms']:.3f} | "
                     f"{r['p10_ms']:.3f}-{r['p90_ms']:.3f} | {r['pipelined_ms']:.3f} | {r['bytes'] / 1e9:.3f} | "
                     f"{r['roofline_ms']:.3f} | {r['roofline_fraction']:.2f} |"
                     + (f" {span:.3f} | {r['roofline_ms'] / span:.2f} |" if device else ""))
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--models", default=None, help=f"comma-separated random target shapes (default {','.join(MODELS)}; "
                                                   f"any of {', '.join(RANDOM_TARGETS)})")
    ap.add_argument("--context", type=int, default=None, help="tokens already in the cache (default 1024; tiny 32)")
    ap.add_argument("--k", type=int, default=7, help="speculative tokens K (extend step = K+1 tokens)")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls (default 30, tiny 3)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up calls (default 5, tiny 1)")
    ap.add_argument("--implementation", default="auto", choices=IMPLEMENTATIONS,
                    help="kernel switch of the forward (pjax.kernels; default auto)")
    ap.add_argument("--profile", action="store_true", help="GPU: each step's kernels (count, busy time, the top ones)")
    ap.add_argument("--json", default=None, help="JSON output path (default $OUT/bench_target.json)")
    a = ap.parse_args(argv)
    names = a.models.split(",") if a.models else list(TINY if a.tiny else MODELS)
    for n in names:
        if n not in RANDOM_TARGETS:
            ap.error(f"unknown model {n!r} (choose from {', '.join(RANDOM_TARGETS)})")
    context = a.context or (32 if a.tiny else 1024)
    repeats = a.repeats or (3 if a.tiny else 30)
    warmup = a.warmup or (1 if a.tiny else 5)
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}", flush=True)
    bandwidth = copy_bandwidth((16 << 20) if a.tiny else (2 << 30), 5 if a.tiny else 20)
    rows = []
    for n in names:
        rows += bench_model(n, context=context, k1=a.k + 1, warmup=warmup, repeats=repeats,
                            bandwidth=bandwidth, dtype=jnp.bfloat16, implementation=a.implementation,
                            profile=a.profile)
    report = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
              "copy_bandwidth_Bps": bandwidth, "rows": rows}
    print(markdown(rows, bandwidth))
    path = a.json or (os.path.join(os.environ["OUT"], "bench_target.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=1))
        print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
