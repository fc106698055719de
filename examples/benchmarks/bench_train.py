"""P-EAGLE training throughput and peak memory: a 4-layer head on an 8B-shaped (Llama-3.1-8B) target at
2K / 8K / 16K tokens per row, single pass vs sequence partitioning (spec D.5).

    PYTHONPATH=. python3 examples/benchmarks/bench_train.py            # GPU: 8B-shaped target, 4-layer head
    PYTHONPATH=. python3 examples/benchmarks/bench_train.py --tiny     # CPU smoke test (tiny shapes)
    PYTHONPATH=. python3 examples/benchmarks/bench_train.py --lengths 16384 --segments 1 4

Each (row length, segments) configuration runs in its own process (so peak memory is per
configuration and an out-of-memory error only loses that row). One step = the full jitted train step:
frozen target forward over the packed row (bf16, features online), EAGLE shift, COD sampling
(K = --num-depths, r 0.7 / 0.2, --max-anchors), drafter forward/backward (bf16 compute over float32
master weights, --draft-vocab draft vocabulary), AdamW update. Random weights and synthetic rows
(3 documents per row, 75% of tokens supervised). tokens/s = row tokens per step / median step time.
Prints a markdown table; writes JSON to $OUT/bench_train.json when $OUT is set.

Partitioning with static shapes: segment s runs the depth-0 prefix [0, end_s) plus a block per depth
sized for the worst case (one element per anchor of its range), one segment at a time (a loop over a
switch), so peak activation memory is the largest segment's. With K = 8 and no anchor cap a single
pass holds ~3.4 x L elements, the last of 4 segments ~2.6 x L, of 8 segments ~2.2 x L (CPU compile
of a small config, L = 2048: peak temporaries 482 / 378 / 292 MiB for 1 / 4 / 8 segments). Compile
time grows with the number of segments (one program per segment).
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

SHAPES = {  # (target layers, H, I, heads, kv heads, head dim, vocab), head layers, draft vocab
    "llama3.1-8b": ((32, 4096, 14336, 32, 8, 128, 128256), 4, 32000),
    "tiny": ((4, 64, 128, 4, 2, 16, 260), 2, 200),
}


def _args(argv=None):
    p = argparse.ArgumentParser(description="P-EAGLE training benchmark")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny shapes, short rows")
    p.add_argument("--lengths", type=int, nargs="*", default=None, help="tokens per row")
    p.add_argument("--segments", type=int, nargs="*", default=None, help="partition counts (1 = single pass)")
    p.add_argument("--rows", type=int, default=1, help="rows per step (one per device)")
    p.add_argument("--steps", type=int, default=None, help="timed steps")
    p.add_argument("--split-target", action="store_true", help="target weights split over the devices (shard_target)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--num-depths", type=int, default=8)
    p.add_argument("--max-anchors", type=int, default=0, help="0 = unlimited (paper / Automodel); 512 = speculators")
    p.add_argument("--attn-chunk", type=int, default=None, help="drafter attention query chunk")
    p.add_argument("--target-chunk", type=int, default=None, help="target attention query chunk")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # "length,segments": run one config in-process
    return p.parse_args(argv)


def _cfg(layers, h, inter, heads, kv, hd, vocab):
    from pjax.config import LayerSpec, ModelConfig, RopeSpec
    rope = RopeSpec(kind="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
    return ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_heads=heads,
                       layers=tuple(LayerSpec(hd, kv, rope) for _ in range(layers)), rms_norm_eps=1e-5)


def synthetic_batch(rows, length, vocab, seed=0):
    import numpy as np
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, vocab, (rows, length)).astype(np.int32)
    cuts = np.sort(rng.integers(length // 8, length, (rows, 2)), axis=1)
    idx = np.arange(length)[None]
    doc = (idx >= cuts[:, :1]).astype(np.int32) + (idx >= cuts[:, 1:]).astype(np.int32)
    doc[:, -max(1, length // 64):] = -1  # a little padding at the end
    lm = ((rng.random((rows, length)) < 0.75) & (doc >= 0)).astype(np.int32)
    return dict(tokens=toks, loss_mask=lm, document_ids=doc)


def run_one(a, length, segments):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pjax.models.drafter import Drafter
    from pjax.models.target import init_target
    from pjax.train import (CodConfig, OptimConfig, TrainConfig, drafter_config_for_target, init_drafter_for_target,
                            make_mesh)
    from pjax.train.state import init_train_state
    from pjax.train.step import make_train_step
    from pjax.train.step import replicate, shard_batch, shard_target
    shape = "tiny" if a.tiny else "llama3.1-8b"
    tshape, head_layers, vd = SHAPES[shape]
    tcfg = _cfg(*tshape)
    dtype = jnp.float32 if a.tiny else jnp.bfloat16
    target = init_target(tcfg, jax.random.key(0), dtype)
    n = tcfg.num_layers
    aux = tcfg.default_aux_layer_ids() if n >= 8 else (1, 2, 3)  # (2, 16, 29) for the 8B shape
    dcfg = drafter_config_for_target(tcfg, num_layers=head_layers, draft_vocab_size=vd, mask_token_id=tshape[-1] - 1,
                                     aux_layer_ids=aux, num_depths=a.num_depths)
    drafter = init_drafter_for_target(target, dcfg, jax.random.key(1))
    cfg = TrainConfig(total_seq_len=length, batch_rows=a.rows, total_steps=1000,
                      cod=CodConfig(num_depths=a.num_depths, max_anchors=a.max_anchors or None),
                      num_segments=segments, optim=OptimConfig(lr=1e-4, warmup_steps=10),
                      compute_dtype=None if a.tiny else "bfloat16",
                      attn_chunk=a.attn_chunk or (None if a.tiny else 1024),
                      target_chunk=a.target_chunk or (None if a.tiny else 2048))
    mesh = make_mesh(jax.devices()[:a.rows]) if a.rows <= jax.device_count() else make_mesh()
    step = make_train_step(cfg, mesh)
    state = replicate(init_train_state(drafter, cfg), mesh)
    shell = replicate(Drafter(drafter.config, drafter.graphdef, None, drafter.d2t), mesh)
    target = shard_target(target, mesh) if a.split_target else replicate(target, mesh)  # the unplaced copy is freed
    batches = [shard_batch(synthetic_batch(a.rows, length, tcfg.vocab_size, seed=i), mesh) for i in range(4)]
    t0 = time.perf_counter()
    state, m = step(state, shell, target, batches[0])
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    for i in range(a.warmup):
        state, m = step(state, shell, target, batches[(i + 1) % 4])
    jax.block_until_ready(m)
    times = []
    for i in range(a.steps or (3 if a.tiny else 5)):
        t0 = time.perf_counter()
        state, m = step(state, shell, target, batches[i % 4])
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    stats = jax.local_devices()[0].memory_stats() or {}  # device 0 (it also held the target before placement)
    tokens = a.rows * length
    return dict(length=length, segments=segments, rows=a.rows, step_s=med, step_s_min=min(times),
                tokens_per_s=tokens / med, compile_s=compile_s, loss=float(m["loss"]),
                elements=int(np.sum(jax.device_get(m["total"]))),
                peak_gib=stats.get("peak_bytes_in_use", 0) / 2**30 if stats else None,
                live_gib=stats.get("bytes_in_use", 0) / 2**30 if stats else None, split_target=a.split_target,
                device=str(jax.devices()[0].device_kind), shape=shape)


def main(argv=None):
    a = _args(argv)
    if a.one:
        length, segments = (int(x) for x in a.one.split(","))
        print("RESULT " + json.dumps(run_one(a, length, segments)), flush=True)
        return
    lengths = a.lengths or ([128, 256] if a.tiny else [2048, 8192, 16384])
    segments = a.segments or ([1, 2] if a.tiny else [1, 4])
    passthrough = [x for x in (argv if argv is not None else sys.argv[1:])]
    results = []
    for length in lengths:
        for seg in segments:
            cmd = [sys.executable, __file__, *passthrough, "--one", f"{length},{seg}"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not line:
                err = (proc.stderr.strip().splitlines() or ["?"])[-1][:160]
                results.append(dict(length=length, segments=seg, error=err))
                print(f"length {length} segments {seg}: FAILED ({err})", flush=True)
            else:
                results.append(json.loads(line[0][7:]))
                r = results[-1]
                mem = "n/a" if r["peak_gib"] is None else f"peak {r['peak_gib']:.2f} GiB, live {r['live_gib']:.2f} GiB"
                print(f"length {length} segments {seg}: {r['tokens_per_s']:.0f} tok/s, step {r['step_s']*1e3:.1f} ms, "
                      f"{mem}", flush=True)
    print("\n| tokens/row | segments | supervised COD elements | step (ms) | tokens/s | peak memory (GiB) | compile (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['length']} | {r['segments']} | - | - | - | failed: {r['error']} | - |")
        else:
            peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
            print(f"| {r['length']} | {r['segments']} | {r['elements']} | {r['step_s']*1e3:.1f} | "
                  f"{r['tokens_per_s']:.0f} | {peak} | {r['compile_s']:.0f} |")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "bench_train.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
