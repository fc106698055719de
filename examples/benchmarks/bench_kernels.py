"""Check every Pallas kernel against its XLA reference on the device and time both.

    PYTHONPATH=. python3 examples/benchmarks/bench_kernels.py            # GPU: full table (~9 min on an H200)
    PYTHONPATH=. python3 examples/benchmarks/bench_kernels.py --smoke    # CPU: tiny shapes, interpret mode

Timing: each op is unrolled R times inside one jitted program, each copy on its own input buffers
(distinct values, so XLA can neither merge nor overlap-share copies); the program is warmed up and called
N times under the profiler, and the reported time is median(device span of a call) / R, read from the
GPU's kernel timestamps (`devtime.py`): device time per op including its launch gaps inside a program,
free of the host round trip that a synchronised call pays on the H200 machine (~0.1-4 ms, varying).
Without a GPU (smoke runs) the host-clock slope between R- and 2R-copy programs is used instead.
R ~ 0.25 GB of input / op bytes, 4..40 (metadata: 200). Attention copies share K/V (only q differs); a
bandwidth above the HBM peak is flagged as an invalid measurement.
Do not feed all copies the same buffers (even through optimization_barrier): on an H200 with JAX 0.11.2
that gave attention "bandwidths" of 13-16 TB/s, i.e. copies were merged or overlapped. Ratio = xla / pallas
measured in the same run. Attention bandwidth = K/V bytes read (2 * B * context * nkv * hd * 2 bytes) / time.
Prints markdown tables; --json writes all rows.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from devtime import profile_calls
from pjax.kernels.acceptance import pallas as acc_pallas
from pjax.kernels.acceptance import reference as acc_ref
from pjax.kernels.cache_attention import pallas as attn_pallas
from pjax.kernels.cache_attention import reference as attn_ref
from pjax.kernels.metadata import pallas as meta_pallas
from pjax.kernels.metadata import reference as meta_ref

T0 = time.time()
ROWS: list[dict] = []


def log(*a):
    print(*a, flush=True)


def timed(op, arg_sets, *, calls: int) -> float:
    """Device seconds of one op call. The op runs once per element of `arg_sets[:R]` (R = len // 2) inside
    one jitted program; on a GPU the program's device span is read from the profiler (`devtime.py`) and
    divided by R. Without a GPU plane: host-clock slope between the R- and 2R-copy programs (the fixed
    per-call cost cancels)."""
    half = len(arg_sets) // 2
    prog = jax.jit(lambda s: [op(*a) for a in s])
    prof = profile_calls(prog, (arg_sets[:half],), calls=calls)
    if prof is not None:
        spans, kernels = prof
        if len(spans) == calls:
            return statistics.median(spans) / half * 1e-9
        log(f"  (profile: {len(spans)} kernel groups for {calls} calls; using busy time)")
        return sum(d for ks in kernels for _, _, d in ks) / calls / half * 1e-9

    def median_call(sets):
        f = jax.jit(lambda s: [op(*a) for a in s])
        jax.block_until_ready(f(sets))
        ts = []
        for _ in range(calls):
            t = time.perf_counter()
            jax.block_until_ready(f(sets))
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    return (median_call(arg_sets) - median_call(arg_sets[:half])) / half


def auto_reps(nbytes: float, lo: int = 4, hi: int = 40) -> int:
    """Copies R of the smaller timing program (the larger runs 2R)."""
    return int(max(lo, min(hi, round(0.25e9 / max(nbytes, 1)))))


HBM_PEAK_TBPS = 4.8  # H200 datasheet


def guarded(fn):
    @functools.wraps(fn)
    def run(*a, **k):
        try:
            return fn(*a, **k)
        except Exception as e:  # keep benchmarking the other shapes
            log(f"| {fn.__name__} {a} {k} FAILED: {type(e).__name__}: {str(e)[:400]} |")
    return run


def over_budget(budget):
    return time.time() - T0 > budget


# ---------------------------------------------------------------- acceptance
def acc_inputs(b, k, v, *, dtype=jnp.bfloat16, temp=1.0, trunc=False, seed=0):
    key = jax.random.key(seed)
    logits = (jax.random.normal(key, (b, k + 1, v), jnp.float32) * 3).astype(dtype)
    am = jnp.argmax(logits.astype(jnp.float32), -1).astype(jnp.int32)
    rnd = jax.random.randint(jax.random.fold_in(key, 1), (b, k), 0, v)
    pre = jax.random.randint(jax.random.fold_in(key, 2), (b, 1), 0, k + 1)
    drafts = jnp.where(jnp.arange(k)[None] < pre, am[:, :k], rnd).astype(jnp.int32)
    kw = dict(temperature=jnp.full((b,), temp, jnp.float32), seeds=jnp.arange(b, dtype=jnp.uint32),
              positions=jnp.full((b,), 1000, jnp.int32), num_drafts=None,
              top_k=jnp.full((b,), 50, jnp.int32) if trunc else None,
              top_p=jnp.full((b,), 0.9, jnp.float32) if trunc else None)
    return logits, drafts, kw


@guarded
def bench_acceptance(b, k, v, *, reps, calls, temp=1.0, trunc=False, label="", tile=None, warps=None, unroll=None,
                     target=None, stages=None, xla=True, with_q=False):
    logits, drafts, kw = acc_inputs(b, k, v, temp=temp, trunc=trunc)
    q = jax.nn.softmax(jax.random.normal(jax.random.key(7), (b, k, v), jnp.float32), -1) if with_q else None
    reps = reps or auto_reps(logits.size * 2)
    cfg = {x: y for x, y in (("tile", tile), ("num_warps", warps), ("unroll", unroll), ("num_stages", stages)) if y}
    old_target = acc_pallas.TARGET_PROGRAMS
    acc_pallas.TARGET_PROGRAMS = target or old_target

    def run(impl):
        if impl == "xla":
            return lambda lg, d, pos: acc_ref.accept(lg, d, q, **{**kw, "positions": pos})
        return lambda lg, d, pos: acc_pallas.accept(lg, d, q, **{**kw, "positions": pos}, **cfg)
    args = (logits, drafts, kw["positions"])
    r = jax.jit(run("xla"))(*args)
    p = jax.jit(run("pallas"))(*args)
    same = float(np.mean(np.all(np.asarray(r.tokens) == np.asarray(p.tokens), axis=1)))
    sets = [(logits + jnp.asarray(i * 1e-3, logits.dtype), drafts, kw["positions"] + i) for i in range(2 * reps)]
    t_x = timed(run("xla"), sets, calls=calls) if xla else float("nan")
    t_p = timed(run("pallas"), sets, calls=calls)
    del sets
    acc_pallas.TARGET_PROGRAMS = old_target
    if target:
        cfg["target_programs"] = target
    row = dict(op="acceptance", B=b, K=k, V=v, mode=label or ("greedy" if temp == 0 else "sampled"),
               xla_us=t_x * 1e6, pallas_us=t_p * 1e6, ratio=t_x / t_p, rows_equal=same,
               logits_MB=b * (k + 1) * v * 2 / 1e6, cfg=cfg, reps=reps,
               pallas_TBps=b * (k + 2) * v * 2 / t_p / 1e12)
    ROWS.append(row)
    log(f"| acceptance | {b} | {k} | {v} | {row['mode']} | {row['xla_us']:.1f} | {row['pallas_us']:.1f} | "
        f"{row['ratio']:.2f} | {same:.3f} | {row['pallas_TBps']:.2f} | {cfg} |")
    return row


# ---------------------------------------------------------------- metadata
@guarded
def bench_metadata(b, k, *, reps, calls, cfg=None):
    reps = reps or 200
    rs = np.random.default_rng(0)
    args = (jnp.asarray(rs.integers(0, k + 1, b), jnp.int32), jnp.asarray(rs.integers(0, 10 ** 5, (b, k + 1)), jnp.int32),
            jnp.asarray(rs.integers(0, 10 ** 5, b), jnp.int32), jnp.asarray(rs.integers(0, 10 ** 4, b), jnp.int32))
    kw = dict(num_slots=2 * k, mask_token_id=128002)
    fx = lambda *a: meta_ref.build_draft_inputs(*a, **kw)
    cfg = cfg or {}
    fp = lambda *a: meta_pallas.build_draft_inputs(*a, **kw, **cfg)
    r, p = jax.jit(fx)(*args), jax.jit(fp)(*args)
    exact = all(bool(np.array_equal(np.asarray(x), np.asarray(y))) for x, y in zip(r, p))
    sets = [(args[0], args[1], args[2], args[3] + i) for i in range(2 * reps)]
    t_x = timed(fx, sets, calls=calls)
    t_p = timed(fp, sets, calls=calls)
    row = dict(op="metadata", B=b, K=k, xla_us=t_x * 1e6, pallas_us=t_p * 1e6, ratio=t_x / t_p, exact=exact)
    ROWS.append(row)
    row["cfg"] = cfg
    log(f"| metadata | {b} | {k} | {row['xla_us']:.2f} | {row['pallas_us']:.2f} | {row['ratio']:.2f} | {exact} | {cfg} |")
    return row


# ---------------------------------------------------------------- attention
@guarded
def bench_attention(b, ctx, t, *, reps, calls, nh=32, nkv=8, hd=128, cfg=None, xla=True, label="", kernel_only=False):
    key = jax.random.key(1)
    kq, kk, kv_ = jax.random.split(key, 3)
    q = jax.random.normal(kq, (b, t, nh, hd), jnp.bfloat16)
    k = jax.random.normal(kk, (b, ctx, nkv, hd), jnp.bfloat16)
    v = jax.random.normal(kv_, (b, ctx, nkv, hd), jnp.bfloat16)
    q_pos = jnp.broadcast_to(jnp.arange(ctx - t, ctx, dtype=jnp.int32), (b, t))  # last t positions of the cache
    cfg = cfg or {}
    reps = reps or auto_reps(2 * k.size * 2)
    fx = lambda q_, k_, v_: attn_ref.cache_attention(q_, k_, v_, q_pos, scale=hd ** -0.5)
    fp = lambda q_, k_, v_: attn_pallas.cache_attention(q_, k_, v_, q_pos, scale=hd ** -0.5, **cfg)
    if kernel_only:  # the split kernel without its XLA merge epilogue
        fp = lambda q_, k_, v_: attn_pallas.partials(q_, k_, v_, q_pos, scale=hd ** -0.5, **cfg)
    args = (q, k, v)
    sets = [(q + jnp.asarray(i * 1e-3, q.dtype), k, v) for i in range(2 * reps)]
    p = jax.jit(fp)(*args)
    row = dict(op="attention", B=b, ctx=ctx, T=t, cfg=cfg, label=label, reps=reps)
    if xla and not kernel_only:
        r = jax.jit(fx)(*args)
        row["max_abs_err"] = float(jnp.max(jnp.abs(r.astype(jnp.float32) - p.astype(jnp.float32))))
        row["xla_us"] = timed(fx, sets, calls=calls) * 1e6
    row["pallas_us"] = timed(fp, sets, calls=calls) * 1e6
    kv_bytes = 2 * b * ctx * nkv * hd * 2
    row["pallas_TBps"] = kv_bytes / (row["pallas_us"] * 1e-6) / 1e12
    if xla:
        row["xla_TBps"] = kv_bytes / (row["xla_us"] * 1e-6) / 1e12
        row["ratio"] = row["xla_us"] / row["pallas_us"]
    if max(row["pallas_TBps"], row.get("xla_TBps", 0)) > HBM_PEAK_TBPS:
        row["label"] = label = label + " INVALID(>HBM peak)"
    ROWS.append(row)
    log(f"| attention {label} | {b} | {ctx} | {t} | {row.get('xla_us', float('nan')):.1f} | {row['pallas_us']:.1f} | "
        f"{row.get('ratio', float('nan')):.2f} | {row.get('xla_TBps', float('nan')):.2f} | {row['pallas_TBps']:.2f} | "
        f"{row.get('max_abs_err', float('nan')):.4f} | {cfg} |")
    del q, k, v, sets
    return row


@guarded
def bench_read(nbytes, *, reps, calls):
    """Ceiling at this size: one XLA reduction over a bf16 buffer of `nbytes` (slope timing)."""
    x = jax.random.normal(jax.random.key(2), (nbytes // 2 // 4096, 4096), jnp.bfloat16)
    reps = reps or auto_reps(nbytes)
    sets = [(x + jnp.asarray(i, x.dtype),) for i in range(2 * reps)] if nbytes < 2 ** 29 else [(x,)] * 2
    t = timed(lambda y: jnp.sum(y, axis=0, dtype=jnp.float32), sets, calls=calls)
    ROWS.append(dict(op="read", MB=nbytes / 1e6, us=t * 1e6, TBps=nbytes / t / 1e12))
    log(f"| read (XLA sum) | {nbytes / 1e6:.1f} MB | {t * 1e6:.1f} us | {nbytes / t / 1e12:.2f} TB/s |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpret mode)")
    ap.add_argument("--only", default="meta,acc,attn,tune")
    ap.add_argument("--budget", type=float, default=380.0, help="seconds; later sections are skipped past it")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    only = set(a.only.split(","))
    log(f"# bench_kernels {time.strftime('%Y-%m-%d %H:%M:%S')}  jax {jax.__version__}  devices {jax.devices()}")
    if a.smoke:
        reps, calls = 2, 3
        vocabs, batches, ks, ctxs, ts = [300], [1, 3], [3], [256], [4]
        attn_geo = dict(nh=4, nkv=2, hd=32)
    else:
        reps, calls = None, 15  # None: adaptive copies per program
        vocabs, batches, ks, ctxs, ts = [128256, 151936, 201088], [1, 8, 64], [3, 7, 11], [16384, 1024], [4, 8, 12, 22]
        attn_geo = {}
    if "meta" in only:
        log("\n| op | B | K | xla us | pallas us | xla/pallas | exact |\n|---|---|---|---|---|---|---|")
        for b in batches:
            for k in ks:
                bench_metadata(b, k, reps=reps, calls=calls)
    if "acc" in only:
        log("\n| op | B | K | V | mode | xla us | pallas us | xla/pallas | rows equal | pallas TB/s | cfg |"
            "\n|---|---|---|---|---|---|---|---|---|---|---|")
        kk = 7 if not a.smoke else ks[0]
        for temp in (0.0, 1.0):
            for b in batches:
                for k in ks:
                    bench_acceptance(b, k, vocabs[0], reps=reps, calls=calls, temp=temp)
            for v in vocabs[1:]:
                for b in batches:
                    bench_acceptance(b, kk, v, reps=reps, calls=calls, temp=temp)
        bench_acceptance(batches[-1] if a.smoke else 8, kk, vocabs[0], reps=reps, calls=calls, trunc=True,
                         label="top-k50/top-p0.9")
    if "attn" in only and not over_budget(a.budget):
        log("\n| op | B | context | T | xla us | pallas us | xla/pallas | xla TB/s | pallas TB/s | max abs err | cfg |"
            "\n|---|---|---|---|---|---|---|---|---|---|---|")
        for ctx in ctxs:
            for b in batches:
                for t in ts:
                    if over_budget(a.budget) or (ctx == 1024 and t in (4, 12)):
                        continue
                    bench_attention(b, ctx, t, reps=reps, calls=calls, **attn_geo)
    if "tune-meta" in only and not a.smoke:
        log("\n| op | B | K | xla us | pallas us | xla/pallas | exact | cfg |\n|---|---|---|---|---|---|---|---|")
        for b in (8, 64):
            for rows, nw in ((16, 1), (4, 1), (1, 1), (16, 4), (4, 4), (64, 4)):
                bench_metadata(b, 7, reps=reps, calls=calls, cfg=dict(rows_per_program=rows, num_warps=nw))
        log("\n| op | B | K | V | mode | xla us | pallas us | xla/pallas | rows equal | pallas TB/s | cfg |"
            "\n|---|---|---|---|---|---|---|---|---|---|---|")
        for b in (1, 8, 64):  # sampled drafts with their probabilities (q): the residual race path
            bench_acceptance(b, 7, 128256, reps=reps, calls=calls, with_q=True, label="sampled, draft_probs")
    if "attn-splits" in only and not a.smoke:  # KV-length split count at small batch
        log("\n| op | B | context | T | xla us | pallas us | xla/pallas | xla TB/s | pallas TB/s | max abs err | cfg |"
            "\n|---|---|---|---|---|---|---|---|---|---|---|")
        for b, t, splits in ((1, 4, (33, 32, 16)), (1, 8, (33, 32, 16)), (1, 12, (33, 32)), (1, 22, (33, 32, 16)),
                             (8, 8, (5, 4, 8)), (8, 12, (5, 4, 8))):
            for sp in splits:
                bench_attention(b, 16384, t, reps=reps, calls=calls, xla=False, label="splits", cfg=dict(splits=sp))
    if "tune" in only and not a.smoke:
        log("\n## variants\n\n| op | B | K | V | mode | xla us | pallas us | xla/pallas | rows equal | pallas TB/s | cfg |"
            "\n|---|---|---|---|---|---|---|---|---|---|---|")
        for temp in (0.0, 1.0):  # loop shape of the vocabulary pass
            for tile, unroll, st, nw, tp in ((1024, 2, 1, 4, 1024), (1024, 4, 2, 4, 1024), (2048, 4, 1, 8, 1024),
                                             (1024, 4, 1, 4, 2048), (1024, 4, 1, 4, 528)):
                if not over_budget(a.budget):
                    bench_acceptance(64, 7, 128256, reps=reps, calls=calls, temp=temp, label=f"variant t={temp}",
                                     tile=tile, unroll=unroll, stages=st, warps=nw, target=tp, xla=False)
        log("\n| op | B | context | T | xla us | pallas us | xla/pallas | xla TB/s | pallas TB/s | max abs err | cfg |"
            "\n|---|---|---|---|---|---|---|---|---|---|---|")
        for b, t in ((1, 8), (1, 22), (64, 8)):  # the split kernel alone (no merge epilogue), and split shapes
            bench_attention(b, 16384, t, reps=reps, calls=calls, xla=False, label="kernel only", kernel_only=True)
            for cfg in (dict(splits=16, block_k=128, num_warps=8), dict(block_k=128, num_warps=8), dict(splits=66)):
                if not over_budget(a.budget):
                    bench_attention(b, 16384, t, reps=reps, calls=calls, xla=False, label="variant", cfg=cfg)
        bench_read(67_108_864, reps=reps, calls=calls)  # the K/V bytes of one batch-1 16K layer
        bench_read(1 << 30, reps=reps, calls=calls)
    log(f"\n# done in {time.time() - T0:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(ROWS, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
