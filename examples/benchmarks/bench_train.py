"""Training throughput and peak memory, in one command (H200: about 7 minutes):

    PYTHONPATH=. python3 examples/benchmarks/bench_train.py --out bench_train.json
    PYTHONPATH=. python3 examples/benchmarks/bench_train.py --tiny                      # CPU smoke test
    PYTHONPATH=. python3 examples/benchmarks/bench_train.py --lengths 2048 16384 --segments 1 4   # head sweep only

1. Target LM step (`pjax.train.target_lm.make_lm_step`, what `train_target_lm` runs): a 445M Llama-shaped target
   (24 layers, hidden 1024, 16 query / 8 KV heads of 64, MLP 4096, vocabulary 32768), 16 rows x 2,048 tokens, one
   document per row; bf16 compute over float32 master weights and AdamW state, cross-entropy over token chunks of
   the vocabulary. Attention three ways: "auto" (cuDNN: single-document rows are its padding-causal layout),
   "pallas" (the Pallas flash kernel, what packed documents run) and "xla" (the jnp reference in query chunks).
   tokens/s; MFU = 6 x params x tokens/s / 989e12 (H200 bf16 dense peak; params include the embeddings); peak
   memory = `jax.devices()[0].memory_stats()["peak_bytes_in_use"]`.
2. P-EAGLE head training with online features (`pjax.train.step.make_train_step`): a frozen 8B-shaped target
   (Llama-3.1-8B, random bf16 weights) computes its features inside the step over one 16,384-token row (3 documents),
   then a 4-layer head (32K draft vocabulary, K = 8 depths, COD ratios 0.7 / 0.2, no anchor cap) trains on the COD
   layout in a single pass (no sequence partitioning), bf16 over float32 masters, AdamW. tokens/s, peak memory.
   `--head-shape code-pair --rows 8 --lengths 2048 --no-remat [--objective eagle3] --profile 20`: the code pair's head
   step (338M target, 4-layer P-EAGLE or 1-layer EAGLE-3 head, 32K vocabulary, 8 rows x 2,048 tokens) and where its
   kernel time goes.

Each configuration runs in its own process (peak memory per configuration; an out-of-memory error loses only that
row; a configuration past --timeout seconds is reported as such). Random weights and synthetic tokens. Prints a
table; writes the results as JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PEAK_FLOPS = 989e12  # H200 (and H100 SXM) bf16 dense tensor-core peak
LM_SHAPES = {  # (layers, H, I, heads, kv heads, head dim, vocab), rows, tokens per row
    "445m": ((24, 1024, 4096, 16, 8, 64, 32768), 16, 2048),
    "tiny": ((2, 64, 128, 4, 2, 16, 260), 2, 128),
}
HEAD_SHAPES = {  # target (layers, H, I, heads, kv heads, head dim, vocab), P-EAGLE head layers, draft vocab
    "llama3.1-8b": ((32, 4096, 14336, 32, 8, 128, 128256), 4, 32000),
    "code-pair": ((24, 1024, 2816, 16, 4, 64, 32768), 4, 32768),  # examples/code_pair's target and heads
    "tiny": ((4, 64, 128, 4, 2, 16, 260), 2, 200),
}
LM_IMPLEMENTATIONS = ("auto", "pallas", "xla")


def _args(argv=None):
    p = argparse.ArgumentParser(description="pjax training benchmark")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny shapes, short rows")
    p.add_argument("--out", default=None, help="write the results as JSON to this path")
    p.add_argument("--lm", nargs="*", default=None, choices=LM_IMPLEMENTATIONS,
                   help="target LM attention implementations (default: all three; none with --lengths)")
    p.add_argument("--lengths", type=int, nargs="*", default=None, help="head training: tokens per row")
    p.add_argument("--segments", type=int, nargs="*", default=None, help="head training: partition counts")
    p.add_argument("--rows", type=int, default=1, help="head training: rows per step (one per device)")
    p.add_argument("--steps", type=int, default=None, help="timed steps")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--remat", action="store_true", help="target LM: rematerialise each decoder layer")
    p.add_argument("--split-target", action="store_true", help="head training: target split over the devices")
    p.add_argument("--head-shape", choices=[k for k in HEAD_SHAPES if k != "tiny"], default="llama3.1-8b",
                   help="head training: the target and head (code-pair: run with --rows 8 --lengths 2048 --no-remat, "
                        "the code pair's step)")
    p.add_argument("--objective", choices=["peagle", "eagle3"], default="peagle",
                   help="head training: P-EAGLE (4 layers, COD) or EAGLE-3 (1 layer, 3 training-time-test steps)")
    p.add_argument("--no-remat", action="store_true", help="head training: no per-layer rematerialisation")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also trace two steps and list the N kernels (by name) that take the most time")
    p.add_argument("--num-depths", type=int, default=8)
    p.add_argument("--max-anchors", type=int, default=0, help="0 = unlimited (paper / Automodel); 512 = speculators")
    p.add_argument("--timeout", type=int, default=300, help="seconds per configuration")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # run one configuration in-process
    return p.parse_args(argv)


def _model_config(layers, h, inter, heads, kv, hd, vocab):
    from pjax.config import LayerSpec, ModelConfig, RopeSpec
    rope = RopeSpec(kind="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
    return ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_heads=heads,
                       layers=tuple(LayerSpec(hd, kv, rope) for _ in range(layers)), rms_norm_eps=1e-5)


def _timed(step_fn, n_warmup, n_steps):
    """(compile + first step seconds, [step seconds]) of step_fn() -> something to block on."""
    import jax
    t0 = time.perf_counter()
    jax.block_until_ready(step_fn())
    first = time.perf_counter() - t0
    for _ in range(n_warmup):
        jax.block_until_ready(step_fn())
    times = []
    for _ in range(n_steps):
        t0 = time.perf_counter()
        jax.block_until_ready(step_fn())
        times.append(time.perf_counter() - t0)
    return first, times


def _memory():
    import jax
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use", 0) / 2**30 if stats else None


def synthetic_batch(rows, length, vocab, seed=0, documents=3):
    """Random tokens; `documents` per row (cut at random points) with a little padding at the end, 75% supervised."""
    import numpy as np
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, vocab, (rows, length)).astype(np.int32)
    cuts = np.sort(rng.integers(length // 8, length, (rows, documents - 1)), axis=1)
    doc = (np.arange(length)[None, :, None] >= cuts[:, None, :]).sum(-1).astype(np.int32)
    doc[:, -max(1, length // 64):] = -1
    lm = ((rng.random((rows, length)) < 0.75) & (doc >= 0)).astype(np.int32)
    return dict(tokens=toks, loss_mask=lm, document_ids=doc)


def run_lm(a, implementation):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pjax.models.target import Target, init_target
    from pjax.train.target_lm import causal_lengths, make_lm_step
    shape = "tiny" if a.tiny else "445m"
    tshape, rows, length = LM_SHAPES[shape]
    cfg = _model_config(*tshape)
    target = init_target(cfg, jax.random.key(0), jnp.float32)  # float32 masters
    n_params = int(sum(np.prod(x.shape) for x in jax.tree.leaves(target.params)))
    init, step = make_lm_step(lr=1e-4, steps=1000, warmup=10, compute_dtype=None if a.tiny else "bfloat16",
                              remat=a.remat, implementation=implementation)
    state = dict(params=target.params, opt=init(target.params))
    shell = Target(cfg, target.graphdef, None)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (rows, length)), jnp.int32)
    doc = np.zeros((rows, length), np.int32)  # one document per row
    lengths = jnp.asarray(causal_lengths(doc))
    doc = jnp.asarray(doc)
    del target

    def one():
        state["params"], state["opt"], loss = step(state["params"], state["opt"], shell, tokens, doc, lengths)
        return loss

    first, times = _timed(one, a.warmup, a.steps or (3 if a.tiny else 5))
    med = statistics.median(times)
    tps = rows * length / med
    return dict(kind="lm", implementation=implementation, params=n_params, rows=rows, length=length, step_s=med,
                tokens_per_s=tps, mfu=6 * n_params * tps / PEAK_FLOPS, compile_s=first, peak_gib=_memory(),
                loss=float(one()), remat=a.remat, device=str(jax.devices()[0].device_kind), shape=shape)


def run_head(a, length, segments):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pjax.models.drafter import Drafter
    from pjax.models.target import init_target
    from pjax.train import (CodConfig, OptimConfig, TrainConfig, drafter_config_for_target, init_drafter_for_target,
                            make_mesh)
    from pjax.train.state import init_train_state
    from pjax.train.step import make_train_step, replicate, shard_batch, shard_target
    shape = "tiny" if a.tiny else a.head_shape
    tshape, head_layers, vd = HEAD_SHAPES[shape]
    peagle = a.objective == "peagle"
    tcfg = _model_config(*tshape)
    target = init_target(tcfg, jax.random.key(0), jnp.float32 if a.tiny else jnp.bfloat16)
    aux = tcfg.default_aux_layer_ids() if tcfg.num_layers >= 8 else (1, 2, 3)
    dcfg = drafter_config_for_target(tcfg, num_layers=head_layers if peagle else 1, draft_vocab_size=vd,
                                     mask_token_id=tshape[-1] - 1, aux_layer_ids=aux, model_kind=a.objective,
                                     num_depths=a.num_depths if peagle else None)
    drafter = init_drafter_for_target(target, dcfg, jax.random.key(1))
    cfg = TrainConfig(objective=a.objective, total_seq_len=length, batch_rows=a.rows, total_steps=1000,
                      cod=CodConfig(num_depths=a.num_depths, max_anchors=a.max_anchors or None),
                      num_segments=segments if peagle else 1, remat=not a.no_remat,
                      optim=OptimConfig(lr=1e-4, warmup_steps=10, train_embeddings=peagle),
                      compute_dtype=None if a.tiny else "bfloat16")
    mesh = make_mesh(devices=jax.devices()[:a.rows]) if a.rows <= jax.device_count() else make_mesh()
    step = make_train_step(cfg, mesh)
    state = dict(s=replicate(init_train_state(drafter, cfg), mesh))
    shell = replicate(Drafter(drafter.config, drafter.graphdef, None, drafter.d2t), mesh)
    target = shard_target(target, mesh) if a.split_target else replicate(target, mesh)
    batches = [shard_batch(synthetic_batch(a.rows, length, tcfg.vocab_size, seed=i), mesh) for i in range(2)]
    it = iter(range(10**9))

    def one():
        state["s"], m = step(state["s"], shell, target, batches[next(it) % 2])
        state["m"] = m
        return m

    first, times = _timed(one, a.warmup, a.steps or (3 if a.tiny else 2))
    med = statistics.median(times)
    m = state["m"]
    return dict(kind="head", length=length, segments=segments, rows=a.rows, step_s=med,
                tokens_per_s=a.rows * length / med, compile_s=first, peak_gib=_memory(), loss=float(m["loss"]),
                elements=int(np.sum(jax.device_get(m["total"]))), split_target=a.split_target,
                device=str(jax.devices()[0].device_kind), shape=shape, objective=a.objective, remat=not a.no_remat,
                kernels=_kernel_times(one, a.profile))


def _kernel_times(step_fn, top: int):
    """[(kernel name, ms per step, launches per step)] of the `top` kernels taking the most time over two traced
    steps (names with their numeric suffixes folded); [] without --profile or without a GPU."""
    if not top:
        return []
    from devtime import kernel_groups, profile_calls
    traced = profile_calls(step_fn, (), calls=2)
    if traced is None:
        return []
    return [(name, ns / 1e6, int(n)) for name, ns, n in kernel_groups(traced[1], top)]


def _configs(a):
    sweep = a.lengths is not None or a.segments is not None
    lm = a.lm if a.lm is not None else ([] if sweep else list(LM_IMPLEMENTATIONS))
    lengths = a.lengths or ([256] if a.tiny else [16384])
    segments = a.segments or [1]
    heads = [f"head,{n},{s}" for n in lengths for s in segments]
    fused = [f"lm,{impl}" for impl in lm if impl != "xla"]
    return fused + heads + [f"lm,{impl}" for impl in lm if impl == "xla"]  # the slow reference last


def _run_one(a, spec):
    kind, *rest = spec.split(",")
    return run_lm(a, rest[0]) if kind == "lm" else run_head(a, int(rest[0]), int(rest[1]))


def _label(r):
    if r["kind"] == "lm":
        return f"target LM 16x2048, attention {r['implementation']}" if r.get("shape") != "tiny" else \
            f"target LM (tiny), attention {r['implementation']}"
    what = f"{r.get('shape', 'llama3.1-8b')} {r.get('objective', 'peagle')}{'' if r.get('remat', True) else ' no remat'}"
    return f"head training ({what}), {r['rows']} x {r['length']} tokens, {r['segments']} segment(s)"


def main(argv=None):
    a = _args(argv)
    if a.one:
        print("RESULT " + json.dumps(_run_one(a, a.one)), flush=True)
        return
    passthrough = [x for x in (argv if argv is not None else sys.argv[1:])]
    results = []
    for spec in _configs(a):
        cmd = [sys.executable, __file__, *passthrough, "--one", spec]
        kind, *rest = spec.split(",")
        base = dict(kind=kind, implementation=rest[0]) if kind == "lm" else dict(kind=kind, length=int(rest[0]),
                                                                                 segments=int(rest[1]))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not line:
                err = (proc.stderr.strip().splitlines() or ["?"])[-1][:200]
                results.append(dict(base, error=err))
            else:
                results.append(json.loads(line[0][7:]))
        except subprocess.TimeoutExpired:
            results.append(dict(base, error=f"timed out after {a.timeout} s"))
        r = results[-1]
        print(f"{spec}: " + (f"FAILED ({r['error']})" if "error" in r else
                             f"{r['tokens_per_s']:.0f} tok/s, step {r['step_s'] * 1e3:.1f} ms, peak {r['peak_gib']}"),
              flush=True)
    print("\n| configuration | step (ms) | tokens/s | MFU | peak memory (GiB) | compile + first step (s) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['kind']} {r.get('implementation', r.get('length'))} | failed: {r['error']} | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"
        peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        print(f"| {_label(r)} | {r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:.0f} | {mfu} | {peak} | "
              f"{r['compile_s']:.0f} |")
    for r in results:
        if r.get("kernels"):
            print(f"\n{_label(r)}: kernel time per step by name (two traced steps)")
            for name, ms, n in r["kernels"]:
                print(f"  {ms:8.2f} ms {n:5d}x  {name}")
    if a.out:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(results, indent=1))
        os.replace(tmp, out)
    return results


if __name__ == "__main__":
    main()
