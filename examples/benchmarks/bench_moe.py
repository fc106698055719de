"""MoE kernels on the device: the grouped matmul (prefill / verify past the few-pair kernel, and its backward)
against `jax.lax.ragged_dot`, and the low-bit expert matmul (MXFP4 / FP8 dequantised in registers) against the bf16
expert kernel, with bytes-moved bandwidth over the measured HBM copy bandwidth.

    cd examples/benchmarks && PYTHONPATH=../..:. python3 bench_moe.py   # GPU: roofline, low-bit, grouped (~2 min)
    ... bench_moe.py --only tune,small-tune,lowbit-tune,lowbit-120b      # tile sweeps, GPT-OSS-120B rows
    ... bench_moe.py --only candidates    # grouped matmuls side by side: ragged_dot (XLA, Triton lowering),
                                          # JAX's Hopper ragged_dot_mgpu, tokamax (where installed), pjax's
    ... bench_moe.py --only crossover     # the same at the c = 8 verifies (2-4 pairs per expert), GPT-OSS-120B's
                                          # MXFP4 expert kernel at 32 x 4 pairs
    ... bench_moe.py --smoke                                             # CPU: tiny shapes, interpret mode

Timing as bench_kernels.py (`timed`: R copies of the op on distinct inputs in one program, median device span
over calls / R). Routing is uniform random (grouped) or distinct experts per token, each copy on other experts
(low-bit decode). Low-bit bandwidth counts the bytes read: the selected experts' packed data + scales, and the
activations; bf16 rows count 2 bytes a weight.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench_kernels import timed
from pjax.kernels.expert_matmul import pallas as em_pallas
from pjax.kernels.expert_matmul import reference as em_ref
from pjax.kernels.grouped_matmul import pallas as gm_pallas
from pjax.kernels.grouped_matmul import reference as gm_ref
from pjax.kernels.grouped_matmul.config import DEFAULT as GM_DEFAULT
from pjax.kernels.grouped_matmul.config import for_shape
from pjax.kernels.expert_matmul.config import DEFAULT as EM_DEFAULT
from pjax.kernels.quantized import QuantizedWeight

ROWS: list[dict] = []


def log(*a):
    print(*a, flush=True)


def rel_err(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def copy_bandwidth(calls):
    """Measured HBM roofline: a device copy of 2 GB (bytes read + written) / time."""
    n = 2 ** 29 if on_gpu() else 2 ** 16
    sets = [(jax.random.normal(jax.random.key(i), (n,), jnp.float32),) for i in range(4)]
    t = timed(lambda a: a * 1.0001, sets, calls=calls)
    return 2 * n * 4 / t / 1e12


def on_gpu():
    return jax.default_backend() == "gpu"


# ------------------------------------------------------------------------------------------- grouped matmul
def grouped_inputs(e, din, dout, pairs):
    """Two argument sets (x [pairs, din], w [e, din, dout], group sizes [e]) of bf16 inputs, uniform routing."""
    rs = np.random.default_rng(pairs)
    sizes = jnp.asarray(np.bincount(rs.integers(0, e, pairs), minlength=e), jnp.int32)
    w = (jax.random.normal(jax.random.key(0), (e, din, dout), jnp.float32) * 0.05).astype(jnp.bfloat16)
    return [(jax.random.normal(jax.random.key(i + 1), (pairs, din), jnp.bfloat16), w, sizes) for i in range(2)]


def bench_grouped(label, e, din, dout, pairs, *, calls, configs=(None,), backward=False):
    sets = grouped_inputs(e, din, dout, pairs)
    w, sizes = sets[0][1:]
    x = sets[0][0]
    want = jax.jit(gm_ref.grouped_matmul)(x, w, sizes)
    flops = 2 * pairs * din * dout
    t_x = timed(gm_ref.grouped_matmul, sets, calls=calls)
    for cfg in configs:
        f = jax.jit(lambda x_, w_, s_, cfg=cfg: gm_pallas.grouped_matmul(x_, w_, s_, config=cfg))
        err = rel_err(f(x, w, sizes), want)
        t_p = timed(f, sets, calls=calls)
        cfg = cfg or for_shape(pairs, e)
        row = dict(op="grouped_matmul", shape=label, pairs=pairs, din=din, dout=dout, xla_us=t_x * 1e6,
                   pallas_us=t_p * 1e6, ratio=t_x / t_p, pallas_tflops=flops / t_p / 1e12, err=err,
                   cfg=dataclasses.asdict(cfg))
        ROWS.append(row)
        log(f"| grouped fwd | {label} | {pairs} | {din}x{dout} | {t_x * 1e6:.0f} | {t_p * 1e6:.0f} | "
            f"{t_x / t_p:.1f} | {flops / t_p / 1e12:.0f} | {err:.1e} | {cfg.block_m},{cfg.block_k},{cfg.block_n},"
            f"w{cfg.warps},s{cfg.stages} |")
    if backward:
        g = [jax.random.normal(jax.random.key(9 + i), (pairs, dout), jnp.bfloat16) for i in range(2)]
        bsets = [(*s, gi) for s, gi in zip(sets, g)]

        def vjp(impl):
            from pjax.kernels.grouped_matmul import grouped_matmul
            return lambda x_, w_, s_, g_: jax.vjp(lambda a, b: grouped_matmul(a, b, s_, implementation=impl),
                                                  x_, w_)[1](g_)
        ref = jax.jit(vjp("xla"))(*bsets[0])
        got = jax.jit(vjp("pallas"))(*bsets[0])
        err = max(rel_err(a, b) for a, b in zip(got, ref))
        t_x, t_p = timed(vjp("xla"), bsets, calls=calls), timed(vjp("pallas"), bsets, calls=calls)
        ROWS.append(dict(op="grouped_matmul_bwd", shape=label, pairs=pairs, din=din, dout=dout, xla_us=t_x * 1e6,
                         pallas_us=t_p * 1e6, ratio=t_x / t_p, pallas_tflops=2 * flops / t_p / 1e12, err=err))
        log(f"| grouped bwd (dx, dw) | {label} | {pairs} | {din}x{dout} | {t_x * 1e6:.0f} | {t_p * 1e6:.0f} | "
            f"{t_x / t_p:.1f} | {2 * flops / t_p / 1e12:.0f} | {err:.1e} | |")


def grouped_candidates():
    """{name: (x [M, K], w [G, K, N], sizes [G]) -> [M, N]} of every grouped matmul this device and install run:
    jax.lax.ragged_dot (XLA's lowering, and its Pallas Triton lowering behind a JAX flag), JAX's Hopper
    ragged_dot_mgpu at a few tile settings, tokamax's ragged_dot (mosaic, triton) if installed, pjax's kernel."""
    out = {"ragged_dot (XLA)": jax.lax.ragged_dot,
           "ragged_dot (Triton lowering)": ("jax_ragged_dot_use_gpu_pallas_triton_lowering", jax.lax.ragged_dot),
           "pjax grouped_matmul": lambda a, b, c: gm_pallas.grouped_matmul(a, b, c)}
    if on_gpu() and "H" in jax.devices()[0].device_kind:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
        for bm, bn, gbn in ((64, 128, 1), (128, 128, 1), (128, 256, 1), (128, 128, 4)):
            out[f"ragged_dot_mgpu {bm}x{bn}x64, grid_block_n {gbn}"] = functools.partial(
                lambda a, b, c, **kw: ragged_dot_mgpu.ragged_dot(a, b, group_sizes=c, **kw), block_m=bm, block_n=bn,
                block_k=64, max_concurrent_steps=4, grid_block_n=gbn)
    try:
        import tokamax
        from absl import flags
        flags.FLAGS.mark_as_parsed()  # tokamax reads absl flags; this script's own arguments are not theirs
        for impl in ("mosaic", "triton"):
            out[f"tokamax ({impl})"] = functools.partial(
                lambda a, b, c, impl: tokamax.ragged_dot(a, b, c, implementation=impl), impl=impl)
    except ImportError as e:
        log(f"  (tokamax not installed: {e})")
    return out


def bench_candidates(label, e, din, dout, pairs, *, calls):
    sets = grouped_inputs(e, din, dout, pairs)
    want = jax.jit(gm_ref.grouped_matmul)(*sets[0])
    flops = 2 * pairs * din * dout
    for name, op in grouped_candidates().items():
        flag, op = op if isinstance(op, tuple) else (None, op)
        try:
            if flag:
                jax.config.update(flag, True)
            err = rel_err(jax.jit(op)(*sets[0]), want)
            t = timed(op, sets, calls=calls)
        except Exception as ex:  # a candidate that cannot run this shape: say why, go on
            log(f"| {label} | {pairs} | {din}x{dout} | {name} | - | - | {type(ex).__name__}: "
                f"{str(ex).splitlines()[0][:120]} |")
            ROWS.append(dict(op="grouped_candidate", shape=label, pairs=pairs, din=din, dout=dout, candidate=name,
                             error=str(ex)[:500]))
            continue
        finally:
            if flag:
                jax.config.update(flag, False)
        ROWS.append(dict(op="grouped_candidate", shape=label, pairs=pairs, din=din, dout=dout, candidate=name,
                         us=t * 1e6, tflops=flops / t / 1e12, err=err))
        log(f"| {label} | {pairs} | {din}x{dout} | {name} | {t * 1e6:.0f} | {flops / t / 1e12:.0f} | {err:.1e} |")


# ------------------------------------------------------------------------------------------- low-bit expert matmul
def packed(fmt, e, din, dout, key):
    if fmt == "mxfp4":
        return QuantizedWeight(jax.random.bits(key, (e, dout, din // 2), jnp.uint8),
                               jax.random.randint(key, (e, dout, din // 32), 118, 124).astype(jnp.uint8))
    data = (jax.random.normal(key, (e, dout, din), jnp.bfloat16) * 64).astype(jnp.float8_e4m3fn)
    return QuantizedWeight(data, jax.random.uniform(key, (e, -(-dout // 128), -(-din // 128)), jnp.float32) / 64,
                           "fp8", (128, 128))


def bench_lowbit(label, fmt, e, din, dout, n, k, *, calls, reps, config=EM_DEFAULT, xla=False):
    """n tokens x top-k distinct experts of w [e, din, dout] (fmt "bf16" / "mxfp4" / "fp8"); e = 1: a dense
    linear. Each copy routes to other experts (no L2 sharing)."""
    rs = np.random.default_rng(n * k + e)
    key = jax.random.key(e + din)
    w = ((jax.random.normal(key, (e, din, dout), jnp.float32) * 0.05).astype(jnp.bfloat16) if fmt == "bf16"
         else packed(fmt, e, din, dout, key))

    def ids(i):
        if e == 1:
            return jnp.zeros((n * k,), jnp.int32)
        return jnp.asarray((np.stack([rs.choice(e, k, replace=False) for _ in range(n)]) + i * k) % e,
                           jnp.int32).reshape(-1)
    sets = [(jax.random.normal(jax.random.key(i + 1), (n, din), jnp.bfloat16), ids(i), w) for i in range(2 * reps)]
    x, idx, _ = sets[0]
    op = lambda x_, i_, w_: em_pallas.expert_matmul(x_, i_, w_, repeat=k, config=config)
    err = rel_err(jax.jit(op)(x, idx, w), jax.jit(lambda a, b, c: em_ref.expert_matmul(a, b, c, k))(x, idx, w))
    t = timed(op, sets, calls=calls)
    t_ref = timed(lambda a, b, c: em_ref.expert_matmul(a, b, c, k), sets, calls=calls) if xla else float("nan")
    distinct = len(np.unique(np.asarray(idx)))
    per_expert = (w.nbytes // e) if fmt != "bf16" else din * dout * 2
    nbytes = distinct * per_expert + n * din * 2 + n * k * dout * 2
    row = dict(op="expert_matmul", fmt=fmt, shape=label, tokens=n, top_k=k, din=din, dout=dout, us=t * 1e6,
               xla_us=t_ref * 1e6,
               tbps=nbytes / t / 1e12, err=err,
               bn=min(em_pallas.tiles(n * k, din, dout, config)[1],
                      10 ** 9 if fmt == "bf16" else config.lowbit_block_n),
               bk=em_pallas.k_tile(din, w, config),
               steps=em_pallas.k_steps(din, w, em_pallas.padded_rows(n * k), config),
               tail=[size for _, size in em_pallas.k_plan(din, w, em_pallas.padded_rows(n * k), config)[3]],
               config=dataclasses.asdict(config))
    ROWS.append(row)
    return row


def lowbit_table(calls, reps, shapes, configs=(EM_DEFAULT,)):
    log("\n| shape | tokens x top-k | din x dout | bf16 us | bf16 TB/s | packed | packed us | packed TB/s | "
        "of roofline | bf16/packed | packed xla us | rel err | bk x steps + tail tiles, bn, warps, stages |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, fmt, e, din, dout, n, k in shapes:
        b = bench_lowbit(label, "bf16", e, din, dout, n, k, calls=calls, reps=reps)
        for cfg in configs:
            q = bench_lowbit(label, fmt, e, din, dout, n, k, calls=calls, reps=reps, config=cfg, xla=True)
            log(f"| {label} | {n} x {k} | {din}x{dout} | {b['us']:.1f} | {b['tbps']:.2f} | {fmt} | {q['us']:.1f} | "
                f"{q['tbps']:.2f} | {q['tbps'] / ROOF[0]:.0%} | {b['us'] / q['us']:.2f} | {q['xla_us']:.1f} | "
                f"{q['err']:.1e} | "
                f"{q['bk']}x{q['steps']} + {q['tail']}, {q['bn']}, {cfg.warps}, "
                f"{cfg.mxfp4_stages if fmt == 'mxfp4' else cfg.stages} |")


ROOF = [float("nan")]
CANDIDATES_HEADER = ("\n| shape | pairs | din x dout | grouped matmul | us | TFLOP/s | rel err |\n"
                     "|---|---|---|---|---|---|---|")
GROUPED_HEADER = ("\n| op | shape | pairs | din x dout | xla us | pallas us | xla/pallas | pallas TFLOP/s | rel err | "
                  "tiles |\n|---|---|---|---|---|---|---|---|---|---|")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--only", default="roof,lowbit,grouped")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    only = set(args.only.split(","))
    calls = 3 if args.smoke else 20
    t0 = time.time()
    log(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    ROOF[0] = copy_bandwidth(calls)
    log(f"HBM copy bandwidth (read + write): {ROOF[0]:.2f} TB/s")
    if args.smoke:
        lowbit_table(calls, 2, [("tiny", "mxfp4", 4, 64, 32, 1, 2), ("tiny", "fp8", 4, 128, 128, 2, 2)])
        log(GROUPED_HEADER)
        bench_grouped("tiny", 4, 32, 48, 40, calls=calls, backward=True)
        log(CANDIDATES_HEADER)
        bench_candidates("tiny", 4, 32, 48, 40, calls=calls)
        return
    if "lowbit" in only:
        gpt20, gpt120, qwen = ("gpt-oss-20b", 32), ("gpt-oss-120b", 128), ("qwen3-30b-a3b", 128)
        shapes = []
        for n in (1, 8):
            for (name, e) in (gpt20, gpt120) if "lowbit-120b" in only else (gpt20,):
                shapes += [(name + " gate_up", "mxfp4", e, 2880, 5760, n, 4),
                           (name + " down", "mxfp4", e, 2880, 2880, n, 4)]
            shapes += [(qwen[0] + " gate_up", "fp8", 128, 2048, 1536, n, 8),
                       (qwen[0] + " down", "fp8", 128, 768, 2048, n, 8),
                       ("dense q_proj 2048x4096", "fp8", 1, 2048, 4096, n, 1)]
        variants = [EM_DEFAULT] if "lowbit-tune" not in only else [
            EM_DEFAULT, dataclasses.replace(EM_DEFAULT, lowbit_steps=4), dataclasses.replace(EM_DEFAULT, stages=4),
            dataclasses.replace(EM_DEFAULT, warps=8, programs_per_sm=1)]
        if "lowbit-fp8-8" in only:  # the FP8 rows at 8 tokens only
            shapes = [s for s in shapes if s[1] == "fp8" and s[5] == 8]
        lowbit_table(calls, 8, shapes, variants)
        log(f"[{time.time() - t0:.0f} s]")
    if "grouped" in only:
        log(GROUPED_HEADER)
        for pairs in (256, 1024, 4096, 32768):  # c = 64: verify K = 3 (1,024 pairs), prefill 64 x 128 (32,768)
            bench_grouped("gpt-oss-20b gate_up", 32, 2880, 5760, pairs, calls=calls, backward=pairs == 4096)
            bench_grouped("gpt-oss-20b down", 32, 2880, 2880, pairs, calls=calls)
        bench_grouped("qwen3-30b-a3b gate_up", 128, 2048, 1536, 8192, calls=calls)
        log(f"[{time.time() - t0:.0f} s]")
    if "candidates" in only:
        log(CANDIDATES_HEADER)
        for label, e, din, dout, pairs in (
                ("gpt-oss-20b gate_up", 32, 2880, 5760, 256), ("gpt-oss-20b gate_up", 32, 2880, 5760, 1024),
                ("gpt-oss-20b gate_up", 32, 2880, 5760, 4096), ("gpt-oss-20b gate_up", 32, 2880, 5760, 32768),
                ("gpt-oss-20b down", 32, 2880, 2880, 1024), ("gpt-oss-20b down", 32, 2880, 2880, 32768),
                ("qwen3-30b-a3b gate_up", 128, 2048, 1536, 8192)):
            bench_candidates(label, e, din, dout, pairs, calls=calls)
        log(f"[{time.time() - t0:.0f} s]")
    if "crossover" in only:  # the c = 8, K = 3 verifies where speculation lost: 2-4 pairs per expert
        log(CANDIDATES_HEADER)
        for label, e, din, dout, pairs in (
                ("gpt-oss-20b gate_up", 32, 2880, 5760, 128), ("qwen3-30b-a3b gate_up", 128, 2048, 1536, 256),
                ("qwen3-30b-a3b down", 128, 768, 2048, 256)):
            bench_candidates(label, e, din, dout, pairs, calls=calls)
        lowbit_table(calls, 8, [("gpt-oss-120b gate_up", "mxfp4", 128, 2880, 5760, 32, 4),
                                ("gpt-oss-120b down", "mxfp4", 128, 2880, 2880, 32, 4)])
        log(f"[{time.time() - t0:.0f} s]")
    if "small-tune" in only:  # between the few-pair kernel and prefill
        cfgs = [dataclasses.replace(GM_DEFAULT, **c) for c in (
            dict(), dict(block_m=16, block_n=64), dict(block_m=32, block_n=64),
            dict(block_m=16, block_n=128, stages=4), dict(block_m=32, block_k=128, block_n=64, stages=4))]
        for pairs in (256, 1024):
            bench_grouped("gpt-oss-20b gate_up", 32, 2880, 5760, pairs, calls=calls, configs=cfgs)
        log(f"[{time.time() - t0:.0f} s]")
    if "tune" in only:
        cfgs = [dataclasses.replace(GM_DEFAULT, **c) for c in (
            dict(block_m=128, block_k=64, block_n=128, warps=8), dict(block_m=64, block_k=64, block_n=256, warps=8),
            dict(block_m=128, block_k=64, block_n=256, warps=8, stages=3), dict(block_m=32, block_n=128))]
        bench_grouped("gpt-oss-20b gate_up", 32, 2880, 5760, 32768, calls=calls, configs=cfgs)
        bench_grouped("gpt-oss-20b gate_up", 32, 2880, 5760, 1024, calls=calls, configs=cfgs)
        log(f"[{time.time() - t0:.0f} s]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(roofline_tbps=ROOF[0], rows=ROWS), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
