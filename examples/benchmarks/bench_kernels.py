"""Check every Pallas kernel against its XLA reference on the device and time both.

    PYTHONPATH=. python3 examples/benchmarks/bench_kernels.py            # GPU: full table (~9 min on an H200)
    PYTHONPATH=. python3 examples/benchmarks/bench_kernels.py --smoke    # CPU: tiny shapes, interpret mode

Timing: each op is unrolled R times inside one jitted program, each copy on its own input buffers
(distinct values, so XLA can neither merge nor overlap-share copies); the program is warmed up and called
N times under the profiler, and the reported time is median(device span of a call) / R, read from the
GPU's kernel timestamps (`devtime.py`): device time per op including its launch gaps inside a program,
free of the host round trip that a synchronised call pays on the H200 machine (~0.1-4 ms, varying).
Without a GPU (smoke runs) the host-clock slope between R- and 2R-copy programs is used instead.
R ~ 0.25 GB of input / op bytes, 4..40 (metadata: 200). Attention copies get their own K/V (up to 40 GB in
all; beyond that, at B=64 16K, only q differs and 4+ GB per copy cannot sit in the 50 MB L2); a bandwidth
above the HBM peak is flagged as an invalid measurement. The acceptance sampling arrays (temperature,
seeds, num_drafts) are runtime inputs, as in the engine's round.
Do not feed all copies the same buffers (even through optimization_barrier): on an H200 with JAX 0.11.2
that gave attention "bandwidths" of 13-16 TB/s, i.e. copies were merged or overlapped. Ratio = xla / pallas
measured in the same run. Attention bandwidth = K/V bytes read (2 * B * context * nkv * hd * 2 bytes) / time.
Prints markdown tables; --json writes all rows.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from devtime import profile_calls
from pjax.kernels import dispatch
from pjax.kernels.acceptance import config as acc_config
from pjax.kernels.acceptance import pallas as acc_pallas
from pjax.kernels.acceptance import reference as acc_ref
from pjax.kernels.cache_attention import api as attn_api
from pjax.kernels.cache_attention import config as attn_config
from pjax.kernels.cache_attention import mosaic as attn_mosaic
from pjax.kernels.cache_attention import pallas as attn_pallas
from pjax.kernels.cache_attention import reference as attn_ref
from pjax.kernels.expert_matmul import config as em_config
from pjax.kernels.expert_matmul import pallas as em_pallas
from pjax.kernels.expert_matmul import reference as em_ref
from pjax.kernels.metadata import config as meta_config
from pjax.kernels.metadata import pallas as meta_pallas
from pjax.kernels.metadata import reference as meta_ref

T0 = time.time()
ROWS: list[dict] = []
LAUNCHES = [float("nan")]  # kernels per op copy in the last `timed` program


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
        LAUNCHES[0] = len(kernels[0]) / half  # kernels per op copy (XLA may fuse independent copies)
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


def chain_times(op, arg_sets, *, calls: int, kernel: str):
    """GPU only: the op once per element of `arg_sets[:R]` (R = len // 2) in one jitted program, called `calls`
    times under the profiler -> (median device span per copy, median duration of the kernels whose name contains
    `kernel`), in us."""
    half = len(arg_sets) // 2
    prog = jax.jit(lambda s: [op(*a) for a in s])
    spans, kernels = profile_calls(prog, (arg_sets[:half],), calls=calls)
    dur = statistics.median(d for ks in kernels for name, _, d in ks if kernel in name)
    return statistics.median(spans) / half / 1e3, dur / 1e3


def auto_reps(nbytes: float, lo: int = 4, hi: int = 40) -> int:
    """Copies R of the smaller timing program (the larger runs 2R)."""
    return int(max(lo, min(hi, round(0.25e9 / max(nbytes, 1)))))


HBM_PEAK_TBPS = 4.8  # H200 datasheet
DISTINCT_KV_BYTES = 40e9  # attention copies get their own K/V up to this many bytes in all


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
    if temp is None:  # mixed rows: temperatures in [0.2, 2) (inexact reciprocals), every fourth row greedy
        t = jax.random.uniform(jax.random.fold_in(key, 3), (b,), jnp.float32, 0.2, 2.0)
        temperature = jnp.where(jnp.arange(b) % 4 == 3, 0.0, t)
    else:
        temperature = jnp.full((b,), temp, jnp.float32)
    kw = dict(temperature=temperature, seeds=jnp.arange(b, dtype=jnp.uint32),
              positions=jnp.full((b,), 1000, jnp.int32), num_drafts=jnp.full((b,), k, jnp.int32),
              top_k=jnp.full((b,), 50, jnp.int32) if trunc else None,
              top_p=jnp.full((b,), 0.9, jnp.float32) if trunc else None)
    return logits, drafts, kw


@guarded
def bench_acceptance(b, k, v, *, reps, calls, temp=1.0, trunc=False, label="", tile=None, warps=None, unroll=None,
                     target=None, stages=None, xla=True, with_q=False):
    logits, drafts, kw = acc_inputs(b, k, v, temp=temp, trunc=trunc)
    q = jax.nn.softmax(jax.random.normal(jax.random.key(7), (b, k, v), jnp.float32), -1) if with_q else None
    reps = reps or auto_reps(logits.size * 2)
    cfg = {x: y for x, y in (("tile", tile), ("warps", warps), ("unroll", unroll), ("stages", stages),
                             ("target_programs", target)) if y}
    config = dataclasses.replace(acc_config.DEFAULT, **cfg)

    def run(impl):  # the per-row sampling arrays are runtime inputs, as in the engine's round
        fn = acc_ref.accept if impl == "xla" else functools.partial(acc_pallas.accept, config=config)
        return lambda lg, d, pos, temp, seeds, n: fn(lg, d, q, temperature=temp, seeds=seeds, positions=pos,
                                                     num_drafts=n, top_k=kw["top_k"], top_p=kw["top_p"])
    runtime = (kw["temperature"], kw["seeds"], kw["num_drafts"])
    args = (logits, drafts, kw["positions"]) + runtime
    r = jax.jit(run("xla"))(*args)
    p = jax.jit(run("pallas"))(*args)
    same = float(np.mean(np.all(np.asarray(r.tokens) == np.asarray(p.tokens), axis=1)))
    sets = [(logits + jnp.asarray(i * 1e-3, logits.dtype), drafts, kw["positions"] + i) + runtime
            for i in range(2 * reps)]
    t_x = timed(run("xla"), sets, calls=calls) if xla else float("nan")
    n_x = LAUNCHES[0] if xla else float("nan")
    t_p = timed(run("pallas"), sets, calls=calls)
    del sets
    row = dict(op="acceptance", B=b, K=k, V=v, mode=label or {0.0: "greedy", None: "mixed"}.get(temp, "sampled"),
               xla_us=t_x * 1e6, pallas_us=t_p * 1e6, ratio=t_x / t_p, rows_equal=same,
               logits_MB=b * (k + 1) * v * 2 / 1e6, cfg=cfg, reps=reps,
               pallas_TBps=b * (k + 2) * v * 2 / t_p / 1e12, launches_xla=n_x, launches_pallas=LAUNCHES[0])
    ROWS.append(row)
    log(f"| acceptance | {b} | {k} | {v} | {row['mode']} | {row['xla_us']:.1f} | {row['pallas_us']:.1f} | "
        f"{row['ratio']:.2f} | {same:.3f} | {row['pallas_TBps']:.2f} | {n_x:.1f} / {LAUNCHES[0]:.1f} | {cfg} |")
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
    config = dataclasses.replace(meta_config.DEFAULT, **cfg)
    fp = lambda *a: meta_pallas.build_draft_inputs(*a, **kw, config=config)
    r, p = jax.jit(fx)(*args), jax.jit(fp)(*args)
    exact = all(bool(np.array_equal(np.asarray(x), np.asarray(y))) for x, y in zip(r, p))
    sets = [(args[0], args[1], args[2], args[3] + i) for i in range(2 * reps)]
    t_x = timed(fx, sets, calls=calls)
    n_x = LAUNCHES[0]
    t_p = timed(fp, sets, calls=calls)
    row = dict(op="metadata", B=b, K=k, xla_us=t_x * 1e6, pallas_us=t_p * 1e6, ratio=t_x / t_p, exact=exact,
               launches_xla=n_x, launches_pallas=LAUNCHES[0], cfg=cfg)
    ROWS.append(row)
    log(f"| metadata | {b} | {k} | {row['xla_us']:.2f} | {row['pallas_us']:.2f} | {row['ratio']:.2f} | {exact} | "
        f"{n_x:.2f} / {LAUNCHES[0]:.2f} | {cfg} |")
    return row


# ---------------------------------------------------------------- expert matmul (MoE decode / verify)
EXPERT_HEADER = ("\n| op | model | tokens x top-k | din x dout | distinct experts | xla us | pallas us | xla/pallas | "
                 "pallas TB/s | max rel err | cfg |\n|---|---|---|---|---|---|---|---|---|---|---|")


@guarded
def bench_expert_matmul(model, e, din, dout, n, k, *, reps, calls, cfg=None):
    """n tokens x top-k experts (distinct per token) against w [e, din, dout]; each copy routes to other experts
    (copy i starts at expert i * k), so copies do not share weights through L2. Bandwidth = distinct selected
    experts' bytes / time."""
    w = (jax.random.normal(jax.random.key(0), (e, din, dout), jnp.float32) * 0.05).astype(jnp.bfloat16)
    rs = np.random.default_rng(0)
    reps = reps or 8

    def ids(i):
        return jnp.asarray((np.stack([rs.choice(e, k, replace=False) for _ in range(n)]) + i * k) % e, jnp.int32)
    sets = [(jax.random.normal(jax.random.key(i + 1), (n * k, din), jnp.bfloat16), ids(i).reshape(-1), w)
            for i in range(2 * reps)]
    x, idx, _ = sets[0]
    cfg = cfg or {}
    config = dataclasses.replace(em_config.DEFAULT, **{x: y for x, y in cfg.items() if x != "block_n"})
    fp = functools.partial(em_pallas.expert_matmul, block_n=cfg.get("block_n"), config=config)
    r = np.asarray(jax.jit(em_ref.expert_matmul)(x, idx, w), np.float32)
    got = np.asarray(jax.jit(fp)(x, idx, w), np.float32)
    err = float(np.max(np.abs(got - r)) / max(np.max(np.abs(r)), 1e-9))
    t_x = timed(em_ref.expert_matmul, sets, calls=calls)
    t_p = timed(fp, sets, calls=calls)
    distinct = len(np.unique(np.asarray(idx)))
    tbps = distinct * din * dout * 2 / t_p / 1e12
    cfg = {"block_n": em_pallas.tiles(n * k, din, dout, config)[1], **cfg}
    row = dict(op="expert_matmul", model=model, tokens=n, top_k=k, din=din, dout=dout, distinct=distinct,
               xla_us=t_x * 1e6, pallas_us=t_p * 1e6, ratio=t_x / t_p, pallas_tbps=tbps, err=err, cfg=cfg)
    ROWS.append(row)
    log(f"| expert_matmul | {model} | {n} x {k} | {din} x {dout} | {distinct} | {t_x * 1e6:.1f} | {t_p * 1e6:.1f} | "
        f"{t_x / t_p:.2f} | {tbps:.2f} | {err:.1e} | {cfg} |")
    return row


# ---------------------------------------------------------------- attention
ATTN_HEADER = ("\n| op | B | context | T | xla us | pallas us | xla/pallas | xla TB/s | pallas TB/s | max abs err |"
               " mosaic us (TB/s, err) | auto | cfg |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def _attention_inputs(b, ctx, t, nh, nkv, hd, reps):
    """Random bf16 q [b, t, nh, hd], K/V [b, ctx, nkv, hd], q at the last t positions of the cache, and 2R copies
    for the timing programs: distinct K/V per copy where they fit (no copy can hit another's bytes in L2), else only
    q differs. -> (q, k, v, q_pos, sets, R, shared)."""
    kq, kk, kv_ = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(kq, (b, t, nh, hd), jnp.bfloat16)
    k = jax.random.normal(kk, (b, ctx, nkv, hd), jnp.bfloat16)
    v = jax.random.normal(kv_, (b, ctx, nkv, hd), jnp.bfloat16)
    q_pos = jnp.broadcast_to(jnp.arange(ctx - t, ctx, dtype=jnp.int32), (b, t))
    reps = reps or auto_reps(2 * k.size * 2)
    share = 2 * reps * 2 * k.size * 2 > DISTINCT_KV_BYTES
    sets = [(q + jnp.asarray(i * 1e-3, q.dtype), k if share else k + jnp.asarray(i * 1e-2, k.dtype),
             v if share else v + jnp.asarray(i * 1e-2, v.dtype)) for i in range(2 * reps)]
    return q, k, v, q_pos, sets, reps, share


@guarded
def bench_attention(b, ctx, t, *, reps, calls, nh=32, nkv=8, hd=128, cfg=None, xla=True, label="", kernel_only=False):
    q, k, v, q_pos, sets, reps, share = _attention_inputs(b, ctx, t, nh, nkv, hd, reps)
    cfg = cfg or {}
    fx = lambda q_, k_, v_: attn_ref.cache_attention(q_, k_, v_, q_pos, scale=hd ** -0.5)
    fp = lambda q_, k_, v_: attn_pallas.cache_attention(q_, k_, v_, q_pos, scale=hd ** -0.5, **cfg)
    if kernel_only:  # the split kernel without its XLA merge epilogue
        fp = lambda q_, k_, v_: attn_pallas.partials(q_, k_, v_, q_pos, scale=hd ** -0.5, **cfg)
    args = (q, k, v)
    p = jax.jit(fp)(*args)
    row = dict(op="attention", B=b, ctx=ctx, T=t, cfg=cfg, label=label, reps=reps, shared_kv=share)
    r = None if kernel_only else jax.jit(fx)(*args).astype(jnp.float32)
    if r is not None:  # every configuration is checked against the reference, timed or not
        row["max_abs_err"] = float(jnp.max(jnp.abs(r - p.astype(jnp.float32))))
    if xla and not kernel_only:
        row["xla_us"] = timed(fx, sets, calls=calls) * 1e6
    row["pallas_us"] = timed(fp, sets, calls=calls) * 1e6
    kv_bytes = 2 * b * ctx * nkv * hd * 2
    row["pallas_TBps"] = kv_bytes / (row["pallas_us"] * 1e-6) / 1e12
    if xla:
        row["xla_TBps"] = kv_bytes / (row["xla_us"] * 1e-6) / 1e12
        row["ratio"] = row["xla_us"] / row["pallas_us"]
    mosaic = ""  # the Mosaic GPU kernel where it takes the shape (default tiles only): time (TB/s, max abs err)
    if not cfg and not kernel_only and attn_mosaic.available() and attn_mosaic.unsupported_reason(q, k) is None:
        fm = lambda q_, k_, v_: attn_mosaic.cache_attention(q_, k_, v_, q_pos, scale=hd ** -0.5)
        m = jax.jit(fm)(*args)
        row["mosaic_max_abs_err"] = float(jnp.max(jnp.abs(r - m.astype(jnp.float32))))
        del m
        row["mosaic_us"] = timed(fm, sets, calls=calls) * 1e6
        row["mosaic_TBps"] = kv_bytes / (row["mosaic_us"] * 1e-6) / 1e12
        mosaic = f"{row['mosaic_us']:.1f} ({row['mosaic_TBps']:.2f}, {row['mosaic_max_abs_err']:.4f})"
    row["auto"] = attn_api.choose(q, k) if jax.default_backend() == "gpu" else "xla"
    if max(row["pallas_TBps"], row.get("xla_TBps", 0), row.get("mosaic_TBps", 0)) > HBM_PEAK_TBPS:
        row["label"] = label = label + " INVALID(>HBM peak)"
    ROWS.append(row)
    log(f"| attention {label} | {b} | {ctx} | {t} | {row.get('xla_us', float('nan')):.1f} | {row['pallas_us']:.1f} | "
        f"{row.get('ratio', float('nan')):.2f} | {row.get('xla_TBps', float('nan')):.2f} | {row['pallas_TBps']:.2f} | "
        f"{row.get('max_abs_err', float('nan')):.4f} | {mosaic} | {row['auto']} | {cfg} |")
    del q, k, v, sets, r
    return row


def bench_mosaic_swap(b, ctx, t, *, reps, calls, nh=32, nkv=8, hd=128):
    """The Mosaic kernel with its second consumer on 64 padded query rows vs on the rows past 64 as wgmma columns
    (`swap`), same inputs, same run: whole op (split kernel + merge), max abs error vs the reference."""
    q, k, v, q_pos, sets, _, _ = _attention_inputs(b, ctx, t, nh, nkv, hd, reps)
    r = jax.jit(lambda *x: attn_ref.cache_attention(*x, q_pos, scale=hd ** -0.5))(q, k, v).astype(jnp.float32)
    row = dict(op="attention mosaic swap", B=b, ctx=ctx, T=t, default_swap=attn_mosaic.swap_default(q, k))
    kv_bytes = 2 * b * ctx * nkv * hd * 2
    for swap in (False, True):
        f = lambda q_, k_, v_, swap=swap: attn_mosaic.cache_attention(q_, k_, v_, q_pos, scale=hd ** -0.5, swap=swap)
        row[f"err_swap={swap}"] = float(jnp.max(jnp.abs(jax.jit(f)(q, k, v).astype(jnp.float32) - r)))
        row[f"us_swap={swap}"] = timed(f, sets, calls=calls) * 1e6
    ROWS.append(row)
    pct = lambda us: kv_bytes / (us * 1e-6) / 1e12 / 4.34 * 100
    log(f"| {b} | {ctx} | {t} | {row['us_swap=False']:.1f} ({pct(row['us_swap=False']):.1f}%, "
        f"{row['err_swap=False']:.4f}) | {row['us_swap=True']:.1f} ({pct(row['us_swap=True']):.1f}%, "
        f"{row['err_swap=True']:.4f}) | {row['default_swap']} |")
    del q, k, v, sets, r
    return row


MERGE_SETTINGS = ({"merge_dims": 32}, {}, {"merge_warps": 2}, {"merge_warps": 8}, {"merge_tile": 16384})


def bench_merge_settings(b, t, *, calls, nh=32, nkv=8, hd=128, settings=MERGE_SETTINGS):
    """The whole op (`api.choose`'s kernel + the Triton merge) with each setting of the merge's `AttentionConfig`
    fields (merge_dims / merge_warps / merge_tile; {} = the defaults), same inputs, same run, each setting twice:
    op time (chain) and the merge kernel's profiler duration, us."""
    q, k, v, q_pos, sets, _, _ = _attention_inputs(b, 16384, t, nh, nkv, hd, 4)
    impl = attn_api.choose(q, k)
    op = attn_mosaic.cache_attention if impl == "mosaic" else attn_pallas.cache_attention
    cells = []
    for setting in settings * 2:
        config = dataclasses.replace(attn_config.DEFAULT, **setting)
        span, merge = chain_times(lambda *a: op(*a, q_pos, scale=hd ** -0.5, config=config), sets, calls=calls,
                                  kernel="merge")
        cells.append(f"{span:.2f} ({merge:.2f})")
    log(f"| {b} | {t} | {nh}/{nkv} x {hd} | {impl} | " + " | ".join(cells) + " |")
    del q, k, v, sets


def check_attention_ragged(s: int):
    """Both kernels against the reference on ragged batches: per-row start positions and lengths, a sliding
    window, attention sinks; Llama (32/8 x 128) and GPT-OSS (64/8 x 64) geometries, s keys. Logs max abs error."""
    log("\n| ragged check | B | context | T | nh/nkv x hd | window | implementation | max abs err |"
        "\n|---|---|---|---|---|---|---|---|")
    rs = np.random.default_rng(0)
    for b, t, nh, nkv, hd, window in ((8, 22, 32, 8, 128, None), (8, 22, 32, 8, 128, 4096), (4, 12, 64, 8, 64, 128),
                                      (2, 12, 32, 8, 128, None)):
        q, k, v = (jnp.asarray(rs.normal(size=sh), jnp.bfloat16) for sh in ((b, t, nh, hd), (b, s, nkv, hd),
                                                                             (b, s, nkv, hd)))
        start = rs.integers(0, s - t, b)
        q_pos = jnp.asarray(start[:, None] + np.arange(t)[None], jnp.int32)
        kw = dict(scale=hd ** -0.5, window=window, sinks=jnp.asarray(rs.normal(size=nh), jnp.float32),
                  kv_len=jnp.asarray(np.minimum(start + t + rs.integers(0, 64, b), s), jnp.int32))
        ref = attn_ref.cache_attention(q, k, v, q_pos, **kw).astype(jnp.float32)
        impls = [("pallas", attn_pallas.cache_attention)]
        if attn_mosaic.available() and attn_mosaic.unsupported_reason(q, k) is None:
            impls.append(("mosaic", attn_mosaic.cache_attention))
        for name, f in impls:
            out = jax.jit(lambda *x: f(*x, **kw))(q, k, v, q_pos).astype(jnp.float32)
            err = float(jnp.max(jnp.abs(out - ref)))
            ROWS.append(dict(op="attention ragged check", B=b, T=t, nh=nh, hd=hd, window=window, impl=name, err=err))
            log(f"| ragged check | {b} | {s} | {t} | {nh}/{nkv} x {hd} | {window} | {name} | {err:.4f} |")


def _read_kernel(k_ref, v_ref, o_ref, *, per, bk):
    """Program (h, s): sum of K and V rows [s * per, (s + 1) * per) of KV head h -- the attention kernel's
    reads with no compute."""
    h, sp = pl.program_id(0), pl.program_id(1)

    def body(i, acc):
        start = pl.multiple_of(sp * per + i * bk, bk)
        return acc + jnp.sum(k_ref[pl.ds(start, bk), h, :].astype(jnp.float32)
                             + v_ref[pl.ds(start, bk), h, :].astype(jnp.float32), axis=0)

    o_ref[h, sp, :] = jax.lax.fori_loop(0, per // bk, body, jnp.zeros((k_ref.shape[-1],), jnp.float32))


def pallas_read(k, v, *, splits, bk, num_warps=4, num_stages=3):
    """k, v [S, nkv, hd] (one batch row of the cache) -> [nkv, splits, hd] f32 partial sums."""
    s, nkv, hd = k.shape
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
    return pl.pallas_call(functools.partial(_read_kernel, per=s // splits, bk=bk), grid=(nkv, splits),
                          out_shape=jax.ShapeDtypeStruct((nkv, splits, hd), jnp.float32), in_specs=[full(k), full(v)],
                          out_specs=pl.BlockSpec((nkv, splits, hd), lambda *_: (0, 0, 0)),
                          compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
                          interpret=dispatch.interpret())(k, v)


@guarded
def bench_read_kv(ctx, *, reps, calls, nkv=8, hd=128):
    """Ceiling for one batch-1 layer: a Pallas kernel that only streams the K/V bytes (same layout, grid and
    distinct buffers per copy as the attention rows), best of a few grid / tile shapes."""
    k = jax.random.normal(jax.random.key(3), (ctx, nkv, hd), jnp.bfloat16)
    v = jax.random.normal(jax.random.key(4), (ctx, nkv, hd), jnp.bfloat16)
    nbytes = 2 * k.size * 2
    reps = reps or auto_reps(nbytes)
    sets = [(k + jnp.asarray(i * 1e-2, k.dtype), v + jnp.asarray(i * 1e-2, v.dtype)) for i in range(2 * reps)]
    best = None
    for splits, bk in ((32, 64), (64, 64), (32, 128), (16, 128)):
        if ctx % (splits * bk) == 0:
            t = timed(functools.partial(pallas_read, splits=splits, bk=bk), sets, calls=calls)
            best = min(best or (t, splits, bk), (t, splits, bk))
    if best is None:  # no grid shape divides this context
        return
    t, splits, bk = best
    ROWS.append(dict(op="read_kv", ctx=ctx, us=t * 1e6, TBps=nbytes / t / 1e12, splits=splits, block_k=bk))
    log(f"| read ceiling (Pallas, K/V bytes only) | 1 | {ctx} | - | | {t * 1e6:.1f} | | | {nbytes / t / 1e12:.2f} | | "
        f"splits={splits} block_k={bk} |")


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
    ap.add_argument("--only", default="meta,acc,moe,attn,tune")
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
        # attention T: verify K + 1 = 4, 8, 12 and draft 2K = 6, 14, 22 queries for K = 3, 7, 11
        vocabs, batches, ks, ctxs = [128256, 151936, 201088], [1, 8, 64], [3, 7, 11], [16384, 1024]
        ts = [4, 6, 8, 12, 14, 22]
        attn_geo = {}
    if "meta" in only:
        log("\n| op | B | K | xla us | pallas us | xla/pallas | exact | launches xla / pallas |"
            "\n|---|---|---|---|---|---|---|---|")
        for b in batches:
            for k in ks:
                bench_metadata(b, k, reps=reps, calls=calls)
    if "acc" in only:
        log("\n| op | B | K | V | mode | xla us | pallas us | xla/pallas | rows equal | pallas TB/s | launches x/p |"
            " cfg |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
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
    if "acc" in only or "acc-mixed" in only:  # per-row temperatures with inexact 1 / t, a quarter greedy
        for b in batches:
            bench_acceptance(b, 7 if not a.smoke else ks[0], vocabs[0], reps=reps, calls=calls, temp=None)
    if "moe" in only or "moe-tune" in only:  # (model, experts, hidden, expert intermediate, top-k)
        moes = [("tiny", 8, 64, 48, 2)] if a.smoke else [("qwen3-30b-a3b", 128, 2048, 768, 8),
                                                          ("gpt-oss-20b", 32, 2880, 2880, 4)]
        log(EXPERT_HEADER)
        for model, e, h, inter, k in moes:
            for n in ((1, 3) if a.smoke else (1, 8)):  # decode, verify K = 7
                for din, dout in ((h, 2 * inter), (inter, h)):  # gate_up, down
                    sweep = [{}] + ([dict(block_n=bn) for bn in (32, 64, 128) if dout % bn == 0] + [
                        dict(warps=w, stages=st) for w, st in ((4, 2), (4, 4), (8, 3), (8, 4))]
                        if "moe-tune" in only else [])
                    for cfg in sweep:
                        bench_expert_matmul(model, e, din, dout, n, k, reps=reps, calls=calls, cfg=cfg)
    if "attn" in only and not over_budget(a.budget):
        log(ATTN_HEADER)
        for ctx in ctxs:
            for b in batches:
                for t in ts:
                    if over_budget(a.budget) or (ctx == 1024 and t not in (8, 22)):
                        continue
                    bench_attention(b, ctx, t, reps=reps, calls=calls, **attn_geo)
                if b == 1 and not a.smoke:
                    bench_read_kv(ctx, reps=reps, calls=calls)
                if ctx == 16384 and not a.smoke:  # GPT-OSS verify K = 11: 8 query heads per KV head (96 rows), hd 64
                    bench_attention(b, ctx, 12, reps=reps, calls=calls, nh=64, nkv=8, hd=64, label="gpt-oss")
    if "attn-table" in only and not a.smoke:  # docs/performance.md's attention table: 16K, batch 1 / 8 / 64
        log(ATTN_HEADER)
        for b in batches:
            bench_attention(b, 16384, 22, reps=reps, calls=calls)  # Llama draft of K = 11
            bench_attention(b, 16384, 12, reps=reps, calls=calls, nh=64, nkv=8, hd=64, label="gpt-oss")
        check_attention_ragged(16384)
    if "attn-merge" in only and not a.smoke and jax.default_backend() == "gpu":  # the merge kernel's settings
        names = " | ".join(str(st or "defaults") for st in MERGE_SETTINGS * 2)  # cells: op us (merge kernel us)
        log(f"\n| B | T | heads x hd | kernel | {names} |\n|" + "---|" * (4 + 2 * len(MERGE_SETTINGS)))
        for b, t, geo in ((1, 22, {}), (1, 12, dict(nh=64, hd=64)), (8, 22, {}), (1, 8, {}), (8, 12, dict(nh=64, hd=64))):
            bench_merge_settings(b, t, calls=calls, **geo)
    if "attn-swap" in only and not a.smoke and attn_mosaic.available():  # Mosaic second consumer: rows vs columns
        log("\n| B | context | T | rows us (% of 4.34 TB/s, err) | swap us (%, err) | default swap |"
            "\n|---|---|---|---|---|---|")
        for b, ctx in ((1, 16384), (1, 16384), (2, 16384), (8, 16384), (64, 16384)):
            bench_mosaic_swap(b, ctx, 22, reps=reps, calls=calls)
    if ("attn" in only or "attn-check" in only) and not over_budget(a.budget):
        check_attention_ragged(256 if a.smoke else 16384)
    if "tune-meta" in only and not a.smoke:
        log("\n| op | B | K | xla us | pallas us | xla/pallas | exact | launches xla / pallas | cfg |"
            "\n|---|---|---|---|---|---|---|---|---|")
        for b in (8, 64):
            for rows, nw in ((16, 4), (8, 4), (8, 2), (16, 2), (32, 4), (16, 8)):
                bench_metadata(b, 7, reps=reps, calls=calls,
                               cfg=dict(rows_per_program=rows, warps=nw, warps_few_rows=nw))
        log("\n| op | B | K | V | mode | xla us | pallas us | xla/pallas | rows equal | pallas TB/s | cfg |"
            "\n|---|---|---|---|---|---|---|---|---|---|---|")
        for b in (1, 8, 64):  # sampled drafts with their probabilities (q): the residual race path
            bench_acceptance(b, 7, 128256, reps=reps, calls=calls, with_q=True, label="sampled, draft_probs")
    if "attn-splits" in only and not a.smoke:  # KV-length split count at small batch
        log(ATTN_HEADER)
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
        log(ATTN_HEADER)
        for b, t in ((1, 8), (1, 22), (64, 8)):  # the split kernel alone (no merge epilogue), and split shapes
            bench_attention(b, 16384, t, reps=reps, calls=calls, xla=False, label="kernel only", kernel_only=True)
            for cfg in (dict(block_k=64), dict(block_k=64, num_stages=4), dict(splits=32)):
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
