"""End-to-end `pjax.generate` timing on random-weight targets: what a user's generation costs per round.

    PYTHONPATH=. python examples/benchmarks/bench_generate.py chunks   # the bounded-chunk device loop vs one call
    PYTHONPATH=. python examples/benchmarks/bench_generate.py steps    # ms per round: none / P-EAGLE / EAGLE-3
    PYTHONPATH=. python examples/benchmarks/bench_generate.py steps --xla-sweep   # the same under XLA flag sets
    PYTHONPATH=. python examples/benchmarks/bench_generate.py profile  # where a generation's device time goes
    PYTHONPATH=. python examples/benchmarks/bench_generate.py fused    # the fused layer kernels: xla vs pallas
    PYTHONPATH=. python examples/benchmarks/bench_generate.py prefill  # a batch's prefill: padded vs packed
    PYTHONPATH=. python examples/benchmarks/bench_generate.py host     # the host's ms to start a generation
    ... --tiny                                                          # CPU smoke run (tiny shapes)

chunks: for the 8B shape at batch 1 and 64, output tokens/s of one device call for the whole generation
(chunk_seconds=None) and of the default bounded chunks (chunk_seconds=1.0, generate's default: progress, Ctrl-C, streaming), same
seeds and rounds; median over --repeats; the ratio is the chunking's throughput cost.
steps: decode time per round of plain decoding, a P-EAGLE round (one drafter pass) and an EAGLE-3 round (K passes)
at batch 1 on the 445M shape (24 x 1024) and the 8B shape; --xla-sweep re-runs the measurement in subprocesses
under each XLA_FLAGS set of FLAG_SETS (e.g. XLA command buffers, i.e. CUDA graphs, for the loop body) and prints one
table. profile: one generation per case (--shapes x --batches, plain and P-EAGLE) under the profiler (GPU):
kernels per round, kernel-busy vs wall time of the device span, the longest idle gaps (launch-bound steps, chunk
boundaries) and the most launched kernels (launches per round, mean time each).
fused: the fused few-row layer kernels (pjax.kernels.fused_linear) on the 445M shape (--fused-shapes), in one process:
(1) per op at 1 / 8 / 16 rows (decode, K = 7 verify, a 16-slot draft), the device time of the model's XLA ops against
the Pallas kernel that replaces them (one copy per layer's weights in one program, so weights come from HBM, not
L2), with the weight bytes' roofline at 4.3 TB/s; --sweep adds the kernels under the tile variants of FUSED_SWEEP;
(2) ms per round of plain decoding and P-EAGLE / EAGLE-3 K = 7 rounds at batch 1 for each of --implementations,
with kernels per round and the GPU's busy fraction from one traced generation each.
prefill: the prefill of a static batch of B ragged prompts (lengths drawn log-normally around --prefill-median, the
longest --prefill-longest: the code pair's prompts have median 82 and longest 347 tokens), padded (each prompt a row
of the longest one's bucket) against packed (the prompts in one row under a document mask), per shape and B of
--prefill-batches. Two parts (--prefill-parts): "generate", for plain decoding (the target's prefill) and P-EAGLE
(target and drafter): positions computed and median prefill ms (the engine's clock: both prefill programs and the
first tokens' copy to the host); "drafter", for a P-EAGLE head of --drafter-layers layers and a 1-layer EAGLE-3 head
(K = --k): the drafter's prefill slots padded / packed (each prompt's L + K - 1 slots, L for EAGLE-3) and the median
host ms of the engine's own compiled prefill programs (`engine_prefill`), the drafter's alone and target + drafter
(the first-token path), synchronised calls; the programs compiled are listed at the end.
Weights are random bf16; acceptance is then ~0, so every round emits one token and has the same cost as a
round with accepted drafts (the same slots are computed). Compilation is excluded (a warm-up generation first).
Prints markdown; writes JSON to --out (default $OUT/bench_generate.json when $OUT is set).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pjax  # noqa: E402
from pjax.config import LayerSpec, ModelConfig, RopeSpec  # noqa: E402
from pjax.decode.compiled import compile_stats  # noqa: E402
from pjax.decode.draft import packed_draft_length, prefill_mask_slots  # noqa: E402
from pjax.models.drafter import DrafterConfig  # noqa: E402

SHAPES = {  # name: (layers, hidden, intermediate, heads, kv heads, head dim, vocab)
    "llama3.1-8b": (32, 4096, 14336, 32, 8, 128, 128256),
    "llama-445m": (24, 1024, 3840, 16, 16, 64, 32000),
    "tiny": (2, 64, 128, 4, 2, 32, 257),  # head_dim 32: RoPE halves of 16, the smallest the fused kernels take
}
FUSED_SWEEP = {  # `fused --sweep`: FusedLinearConfig variants timed for every kernel (pjax.kernels.fused_linear.config)
    "block_k=128": dict(block_k=128), "block_k=512": dict(block_k=512), "stages=3": dict(stages=3),
    "stages=6": dict(stages=6), "min_block_n=32": dict(min_block_n=32), "programs_per_sm=1": dict(programs_per_sm=1),
    "programs_per_sm=4": dict(programs_per_sm=4), "warps=2": dict(warps=2), "warps=8": dict(warps=8),
}
FLAG_SETS = {  # XLA_FLAGS variants for --xla-sweep (each in its own process)
    "default": "",
    "command-buffers": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL "
                       "--xla_gpu_graph_min_graph_size=1",
    "no-command-buffers": "--xla_gpu_enable_command_buffer=",
}


def llama(layers, h, inter, heads, kv, hd, vocab) -> ModelConfig:
    rope = RopeSpec(kind="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
    return ModelConfig("llama", vocab, h, inter, heads, tuple(LayerSpec(hd, kv, rope) for _ in range(layers)),
                       rms_norm_eps=1e-5)


def models(shape: str, head_layers: int, peagle: bool = True):
    """Random bf16 target of `shape` and a random head (`head`)."""
    layers, h, inter, heads, kv, hd, vocab = SHAPES[shape]
    target = pjax.init_target(llama(layers, h, inter, heads, kv, hd, vocab), jax.random.key(0), jnp.bfloat16)
    return target, head(shape, head_layers, peagle)


def head(shape, head_layers: int, peagle: bool = True):
    """A random bf16 head of `head_layers` layers for the target of `shape` (a name of SHAPES or its tuple): P-EAGLE
    (a mask token) or EAGLE-3."""
    n, h, inter, heads, kv, hd, vocab = SHAPES[shape] if isinstance(shape, str) else shape
    aux = (2, n // 2, n - 3) if n >= 8 else (0, 1, 2)
    dcfg = DrafterConfig(layer=llama(head_layers, h, inter, heads, kv, hd, vocab), num_aux=3, target_hidden_size=h,
                         draft_vocab_size=vocab, mask_token_id=vocab - 1 if peagle else None, aux_layer_ids=aux,
                         has_mask_hidden=peagle, model_kind="peagle" if peagle else "eagle3")
    return pjax.init_drafter(dcfg, jax.random.key(1), jnp.bfloat16)


def prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab - 1, (batch, length)).tolist()


def precompile(target, drafter, ps, **kw) -> None:
    """A generation's start without its run: `pjax.decode.Generation` checks the inputs, builds its engine and finds
    (or compiles) the programs."""
    pjax.decode.Generation(target, drafter, ps, **kw).close()


def run_host(args) -> dict:
    """host: the host's share of starting a generation (input checks, the models' dtype checks, the three program
    lookups), a batch of one --prompt-len prompt, timed as `pjax.decode.precompile` after a warm-up (every program
    compiled: it runs nothing on the device), median ms of 10 x --repeats calls, per shape of --shapes at its layer
    count with the tiny shape's widths (the cost counts arrays, not bytes) and drafting mode."""
    rows = []
    for shape in args.shapes.split(","):
        struct = (SHAPES[shape][0],) + SHAPES["tiny"][1:]
        target = pjax.init_target(llama(*struct), jax.random.key(0), jnp.bfloat16)
        for drafting in ("none", "parallel", "sequential"):
            drafter = None if drafting == "none" else head(struct, 1 if drafting == "sequential" else 4,
                                                           drafting == "parallel")
            kw = dict(max_new_tokens=args.new_tokens, num_speculative_tokens=args.k, drafting=drafting)
            ps = prompts(1, args.prompt_len, struct[-1])
            precompile(target, drafter, ps, **kw)
            times = []
            for _ in range(10 * args.repeats):
                t0 = time.perf_counter()
                precompile(target, drafter, ps, **kw)
                times.append(1e3 * (time.perf_counter() - t0))
            rows.append({"shape": shape, "layers": struct[0], "drafting": drafting,
                         "arrays": len(jax.tree.leaves((target, drafter))), "host_ms": statistics.median(times)})
    print("| shape (layers) | drafting | model arrays | host ms per generation |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} ({r['layers']}) | {r['drafting']} | {r['arrays']} | {r['host_ms']:.2f} |")
    return {"rows": rows}


def timed(target, drafter, ps, *, repeats: int, **kw) -> dict:
    """Warm-up generation (compiles), then `repeats` timed ones; medians of the engine's own clocks."""
    pjax.generate(target, drafter, ps, **kw)
    runs = [pjax.generate(target, drafter, ps, **kw).stats for _ in range(repeats)]
    rounds = runs[0]["rounds"]
    return {"output_tokens_per_s": statistics.median(r["output_tokens_per_s"] for r in runs),
            "decode_ms_per_round": statistics.median(1e3 * r["decode_time_s"] / max(r["rounds"], 1) for r in runs),
            "rounds": rounds, "output_tokens": runs[0]["output_tokens"], "device_chunks": runs[0]["device_chunks"],
            "host_dispatch_ms": statistics.median(1e3 * r["host_dispatch_s"] for r in runs)}


def run_chunks(args) -> list[dict]:
    shape = "tiny" if args.tiny else "llama3.1-8b"
    target, drafter = models(shape, 1 if args.tiny else 4)
    rows = []
    for batch in ([1, 4] if args.tiny else [int(b) for b in args.batches.split(",")]):
        ps = prompts(batch, args.prompt_len, SHAPES[shape][-1])
        kw = dict(max_new_tokens=args.new_tokens, num_speculative_tokens=args.k, drafting="parallel",
                  repeats=args.repeats)
        one = timed(target, drafter, ps, chunk_seconds=None, **kw)
        chunked = timed(target, drafter, ps, chunk_seconds=args.chunk_seconds, **kw)
        rows.append({"shape": shape, "batch": batch, "one_call": one, "chunked": chunked,
                     "chunked_over_one_call": chunked["output_tokens_per_s"] / one["output_tokens_per_s"]})
    print(f"\n| shape | batch | one call tok/s | chunks ({args.chunk_seconds} s) tok/s | chunks | ratio | host dispatch ms "
          "(one call / chunks) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['batch']} | {r['one_call']['output_tokens_per_s']:.1f} | "
              f"{r['chunked']['output_tokens_per_s']:.1f} | {r['chunked']['device_chunks']} | "
              f"{r['chunked_over_one_call']:.4f} | {r['one_call']['host_dispatch_ms']:.1f} / "
              f"{r['chunked']['host_dispatch_ms']:.1f} |")
    return rows


def run_steps(args) -> list[dict]:
    rows = []
    head_layers = {"tiny": 1, "llama-445m": 2, "llama3.1-8b": 4}
    for shape in (["tiny"] if args.tiny else args.shapes.split(",")):
        p_layers = head_layers[shape]
        target, peagle = models(shape, p_layers, peagle=True)
        _, eagle3 = models(shape, 1, peagle=False)
        ps = prompts(1, args.prompt_len, SHAPES[shape][-1])
        kw = dict(max_new_tokens=args.new_tokens, chunk_seconds=None, repeats=args.repeats)
        for mode, drafter, k in (("none", None, 0), ("parallel", peagle, args.k), ("sequential", eagle3, args.k)):
            m = timed(target, drafter, ps, drafting=mode, num_speculative_tokens=max(k, 1), **kw)
            rows.append({"shape": shape, "drafting": mode, "k": k, **m})
    print("\n| shape | drafting | K | ms per round | rounds |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['drafting']} | {r['k']} | {r['decode_ms_per_round']:.3f} | {r['rounds']} |")
    return rows


def ragged_lengths(batch: int, median: int, longest: int, seed: int = 0) -> list[int]:
    """`batch` prompt lengths, log-normal around `median` (sigma 0.6) within [8, longest]; the first is `longest`."""
    lengths = np.clip(np.random.default_rng(seed).lognormal(np.log(median), 0.6, batch), 8, longest).astype(int)
    lengths[0] = longest
    return lengths.tolist()


def host_ms(f, args, calls: int) -> float:
    """Median host ms of `calls` synchronised calls f(*args), after one warm-up call."""
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


class _PrefillDone(Exception):
    """`engine_prefill`: the generation's prefill has run; stop before its decode loop compiles."""


def engine_prefill(target, drafter, ps, **kw) -> dict:
    """The engine's own prefill programs for a generation of the prompts `ps` (`pjax.Generation` with `kw`):
    {"prefill_target" / "prefill_drafter": (executable, arguments, static settings)}, recorded from the engine's
    compilation cache as the generation builds and runs them (so they are compiled and warm), the generation stopped
    before it compiles its decode loop. Calling exe(*arguments) repeats that prefill program exactly."""
    G = importlib.import_module("pjax.decode.generate")
    engine_compiled, got = G._compiled, {}

    def record(name, args, kwargs, *rest):
        if name not in ("prefill_target", "prefill_drafter"):
            raise _PrefillDone
        exe, seconds = engine_compiled(name, args, kwargs, *rest)
        got[name] = (exe, args, kwargs)
        return exe, seconds
    G._compiled = record
    try:
        G.Generation(target, drafter, ps, max_new_tokens=1, **kw)
    except _PrefillDone:
        pass
    finally:
        G._compiled = engine_compiled
    return got


def first_token_path(exe_t, args_t, exe_d, args_d):
    """The target's prefill program, then the drafter's on its state and features (as `pjax.Generation` runs them)."""
    state, aux = exe_t(*args_t)
    return exe_d(args_d[0], state, aux, *args_d[3:])


def prefill_generate_rows(args, shape, target, peagle, ps) -> list[dict]:
    """Per drafting mode (none, P-EAGLE): a generation's prefill padded and packed on the engine's clock."""
    rows = []
    for mode, drafter in (("none", None), ("parallel", peagle)):
        row = {"shape": shape, "batch": len(ps), "drafting": mode, "prompt_tokens": sum(map(len, ps))}
        for layout in ("padded", "packed"):
            kw = dict(max_new_tokens=1, drafting=mode, num_speculative_tokens=args.k, prefill=layout)
            pjax.generate(target, drafter, ps, **kw)  # compiles
            runs = [pjax.generate(target, drafter, ps, **kw).stats for _ in range(args.repeats)]
            row[f"{layout}_positions"] = runs[0]["prefill_tokens"]
            row[f"{layout}_ms"] = statistics.median(1e3 * r["prefill_time_s"] for r in runs)
        row["padded_over_packed"] = row["padded_ms"] / row["packed_ms"]
        rows.append(row)
    return rows


def prefill_drafter_rows(args, shape, target, heads, ps) -> list[dict]:
    """Per head (drafting mode, drafter, K): the engine's drafter prefill program alone, and the first-token path
    (target prefill + drafter prefill), padded and packed, median host ms of synchronised calls."""
    rows = []
    for mode, drafter, k in heads:
        row = {"shape": shape, "batch": len(ps), "drafting": mode, "head_layers": drafter.config.layer.num_layers,
               "k": k, "prompt_tokens": sum(map(len, ps))}
        kk = k if mode == "parallel" else 1  # slots each prompt adds: K - 1 mask slots, none for EAGLE-3
        for layout in ("padded", "packed"):
            progs = engine_prefill(target, drafter, ps, drafting=mode, num_speculative_tokens=k, prefill=layout)
            exe_t, args_t, _ = progs["prefill_target"]
            exe_d, args_d, static = progs["prefill_drafter"]
            (b, lp), n = args_d[3].shape, static["packed_len"]
            row[f"{layout}_slots"] = b * (lp + prefill_mask_slots(kk)) if n is None else packed_draft_length(n, b, kk)
            row[f"{layout}_drafter_ms"] = host_ms(exe_d, args_d, args.repeats)
            row[f"{layout}_first_token_ms"] = host_ms(first_token_path, (exe_t, args_t, exe_d, args_d), args.repeats)
        row["drafter_padded_over_packed"] = row["padded_drafter_ms"] / row["packed_drafter_ms"]
        row["first_token_padded_over_packed"] = row["padded_first_token_ms"] / row["packed_first_token_ms"]
        rows.append(row)
    return rows


def run_prefill(args) -> dict:
    parts = args.prefill_parts.split(",")
    if not set(parts) <= {"generate", "drafter"}:
        raise ValueError(f"--prefill-parts {args.prefill_parts!r}: expected generate and/or drafter")
    out = {"generate": [], "drafter": []}
    before = compile_stats()
    head_layers = {"tiny": 1, "llama-445m": 2, "llama3.1-8b": 4}
    for shape in (["tiny"] if args.tiny else args.shapes.split(",")):
        target, peagle = models(shape, head_layers[shape])
        heads = [("parallel", head(shape, args.drafter_layers), args.k),
                 ("sequential", head(shape, 1, peagle=False), args.k)]
        vocab = SHAPES[shape][-1]
        for batch in map(int, args.prefill_batches.split(",")):
            lengths = ragged_lengths(batch, args.prefill_median, args.prefill_longest)
            rng = np.random.default_rng(batch)
            ps = [rng.integers(0, vocab - 1, n).tolist() for n in lengths]
            if "generate" in parts:
                out["generate"] += prefill_generate_rows(args, shape, target, peagle, ps)
            if "drafter" in parts:
                out["drafter"] += prefill_drafter_rows(args, shape, target, heads, ps)
    out["programs_compiled"] = {name: n - before.get(name, (0, 0.0))[0] for name, (n, _) in compile_stats().items()
                                if n > before.get(name, (0, 0.0))[0]}
    if out["generate"]:
        print("\n| shape | B | drafting | prompt tokens | padded positions | packed positions | padded ms | packed ms "
              "| padded / packed |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in out["generate"]:
            print(f"| {r['shape']} | {r['batch']} | {r['drafting']} | {r['prompt_tokens']} | {r['padded_positions']} "
                  f"| {r['packed_positions']} | {r['padded_ms']:.2f} | {r['packed_ms']:.2f} | "
                  f"{r['padded_over_packed']:.2f}x |")
    if out["drafter"]:
        print(f"\nThe drafter's prefill alone and the first-token path (target + drafter prefill), median host ms "
              f"of {args.repeats}:")
        print("| shape | B | drafting | head layers | K | padded slots | packed slots | drafter padded ms "
              "| drafter packed ms | padded / packed | target + drafter padded ms | target + drafter packed ms "
              "| padded / packed |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in out["drafter"]:
            print(f"| {r['shape']} | {r['batch']} | {r['drafting']} | {r['head_layers']} | {r['k']} "
                  f"| {r['padded_slots']} | {r['packed_slots']} | {r['padded_drafter_ms']:.2f} "
                  f"| {r['packed_drafter_ms']:.2f} | {r['drafter_padded_over_packed']:.2f}x "
                  f"| {r['padded_first_token_ms']:.2f} | {r['packed_first_token_ms']:.2f} "
                  f"| {r['first_token_padded_over_packed']:.2f}x |")
    print("\nprograms compiled: " + ", ".join(f"{n} {name}" for name, n in out["programs_compiled"].items()))
    return out


def traced_generation(target, drafter, ps, **kw):
    """One generation under the profiler (after a warm-up one): (GPU kernel events [(start, end, name)] or None on a
    CPU, the generation's stats)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import tempfile

    from devtime import _gpu_kernel_events
    from jax.profiler import ProfileData
    pjax.generate(target, drafter, ps, **kw)  # compile + warm
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            stats = pjax.generate(target, drafter, ps, **kw).stats
        finally:
            jax.profiler.stop_trace()
        files = sorted(Path(d).rglob("*.xplane.pb"))
        return (_gpu_kernel_events(ProfileData.from_file(str(files[-1]))) if files else None), stats


def run_profile(args) -> list[dict]:
    """Per case: one traced generation; kernel count per round, busy / span, the longest gaps between kernels."""
    if args.tiny:
        cases = [("tiny", "none", 1, None), ("tiny", "parallel", 1, 1e-4)]
    else:  # every shape x batch, plain and P-EAGLE; one device call per generation except the 8B shape's
        cases = [(shape, mode, int(b), args.chunk_seconds if shape == "llama3.1-8b" else None)
                 for shape in args.shapes.split(",") for b in args.batches.split(",") for mode in ("none", "parallel")]
    rows = []
    for shape, mode, batch, chunk in cases:
        target, drafter = models(shape, {"tiny": 1, "llama-445m": 2, "llama3.1-8b": 4}[shape])
        ps = prompts(batch, args.prompt_len, SHAPES[shape][-1])
        kw = dict(max_new_tokens=args.new_tokens, num_speculative_tokens=args.k, drafting=mode, chunk_seconds=chunk)
        events, stats = traced_generation(target, drafter if mode != "none" else None, ps, **kw)
        if not events:
            print(f"{shape} {mode}: no GPU trace (CPU run)")
            continue
        busy = sum(e - s for s, e, _ in events)
        span = events[-1][1] - events[0][0]
        kinds = {}  # kernel name -> [launches, busy ns], over the whole generation
        for s, e, name in events:
            k = kinds.setdefault(name, [0, 0])
            k[0], k[1] = k[0] + 1, k[1] + e - s
        per_round = max(stats["rounds"], 1)
        top = sorted(kinds.items(), key=lambda kv: -kv[1][0])[:args.top_kernels]
        gaps = sorted(((events[i + 1][0] - events[i][1], i) for i in range(len(events) - 1)), reverse=True)[:5]
        row = {"shape": shape, "drafting": mode, "batch": batch, "chunk_seconds": chunk, "rounds": stats["rounds"],
               "device_chunks": stats["device_chunks"], "kernels": len(events),
               "kernels_per_round": len(events) / max(stats["rounds"], 1), "busy_ms": busy / 1e6,
               "span_ms": span / 1e6, "busy_fraction": busy / span,
               "largest_gaps_us": [round(g / 1e3, 1) for g, _ in gaps],
               "kernels_by_name": [{"name": n, "per_round": c / per_round, "us_each": t / c / 1e3}
                                   for n, (c, t) in top]}
        rows.append(row)
        print(f"{shape} {mode} b={batch}: {row['kernels_per_round']:.0f} kernels/round, busy {row['busy_ms']:.1f} of "
              f"{row['span_ms']:.1f} ms ({row['busy_fraction']:.0%}), {row['device_chunks']} chunks, largest gaps "
              f"{row['largest_gaps_us']} us", flush=True)
        for k in row["kernels_by_name"]:
            print(f"    {k['per_round']:7.1f} x {k['us_each']:7.2f} us  {k['name'][:110]}")
    return rows


def _device_us(op, target, inputs, calls: int):
    """(us per copy, kernels per copy, {kernel name: median us}) of op(layer i, inputs[i]) for every copy i in one
    jitted program (copy i uses layer i's weights). Without a GPU (smoke runs): host time per copy, no kernels."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from devtime import profile_calls
    r = len(inputs)
    prog = jax.jit(lambda t, ins: [op(t.module.layers[i], ins[i]) for i in range(r)])
    prof = profile_calls(prog, (target, inputs), calls=calls)
    if prof is None:
        return host_ms(prog, (target, inputs), calls) / r * 1e3, float("nan"), {}
    spans, kernels = prof
    by_name = {}
    for ks in kernels:
        for name, _, dur in ks:
            by_name.setdefault(name, []).append(dur / 1e3)
    return (statistics.median(spans) / r / 1e3, len(kernels[0]) / r,
            {n: statistics.median(d) for n, d in by_name.items() if n.startswith("pjax_")})


def fused_ops(cfg: ModelConfig, config):
    """name -> (weight bytes, the decoder layer's XLA ops, the Pallas kernel(s) under `config`), as functions of
    (layer, inputs): x [B, T, H] the residual stream, pos [B, T], o [B, T, nh x hd] the attention output, h [B, T, I]
    the MLP activation."""
    from pjax.kernels.fused_linear import pallas as fl
    from pjax.models.layers import activation, rope_tables
    spec = cfg.layers[0]
    hd, nh, nkv, h, inter = spec.head_dim, cfg.num_heads, spec.num_kv_heads, cfg.hidden_size, cfg.intermediate_size
    flat = lambda a: a.reshape(-1, a.shape[-1])  # noqa: E731

    def xla_qkv(lay, i):
        return lay.self_attn.qkv(lay.input_layernorm(i["x"]), i["pos"])

    def pallas_qkv(lay, i):
        a, n = lay.self_attn, lay.input_layernorm
        cos, sin = rope_tables(a.rope, hd, i["pos"])
        qk = {} if a.q_norm is None else dict(q_norm=a.q_norm.weight[...], k_norm=a.k_norm.weight[...])
        return fl.norm_qkv(flat(i["x"]), n.weight[...], a.q_proj.kernel[...], a.k_proj.kernel[...],
                           a.v_proj.kernel[...], flat(cos), flat(sin), head_dim=hd, eps=n.eps,
                           fp32_multiply=n.fp32_multiply, **qk, config=config)

    def xla_swiglu(lay, i):
        xn = lay.post_attention_layernorm(i["x"])
        return activation("silu", lay.mlp.gate_proj(xn), lay.mlp.up_proj(xn), cfg)

    def pallas_swiglu(lay, i):
        n = lay.post_attention_layernorm
        return fl.norm_swiglu(flat(i["x"]), n.weight[...], lay.mlp.gate_proj.kernel[...], lay.mlp.up_proj.kernel[...],
                              eps=n.eps, fp32_multiply=n.fp32_multiply, config=config)

    def xla_layer(lay, i):  # the layer without its attention: the attention output stands in by q
        q, _, _ = xla_qkv(lay, i)
        x = i["x"] + lay.self_attn.o_proj(q.reshape(i["o"].shape))
        return x + lay.mlp(lay.post_attention_layernorm(x))

    def pallas_layer(lay, i):
        q, _, _ = pallas_qkv(lay, i)
        x = fl.linear_residual(q, lay.self_attn.o_proj.kernel[...], flat(i["x"]), config=config)
        return fl.linear_residual(pallas_swiglu(lay, dict(x=x)), lay.mlp.down_proj.kernel[...], x, config=config)

    b = 2  # bytes per bf16 weight
    return {
        "norm + q/k/v + RoPE": (b * h * (nh + 2 * nkv) * hd, xla_qkv, pallas_qkv),
        "o-proj + residual": (b * nh * hd * h, lambda lay, i: i["x"] + lay.self_attn.o_proj(i["o"]),
                              lambda lay, i: fl.linear_residual(flat(i["o"]), lay.self_attn.o_proj.kernel[...],
                                                                flat(i["x"]), config=config)),
        "norm + gate/up + SwiGLU": (b * 2 * h * inter, xla_swiglu, pallas_swiglu),
        "down-proj + residual": (b * inter * h, lambda lay, i: i["x"] + lay.mlp.down_proj(i["h"]),
                                 lambda lay, i: fl.linear_residual(flat(i["h"]), lay.mlp.down_proj.kernel[...],
                                                                   flat(i["x"]), config=config)),
        "layer without attention": (b * h * ((nh + 2 * nkv) * hd + nh * hd + 3 * inter), xla_layer, pallas_layer),
    }


def fused_kernel_rows(args, shape: str, target) -> list[dict]:
    """Per op and row count: the XLA ops vs the Pallas kernel (and --sweep's tile variants), device us per call."""
    import dataclasses

    from pjax.kernels.fused_linear.config import DEFAULT
    cfg = target.config
    spec = cfg.layers[0]
    copies = min(cfg.num_layers, 2 if args.tiny else 8)  # 8 x 32 MB of 445M layer weights: well past the 50 MB L2
    rows, variants = [], {"default": DEFAULT}
    if args.sweep:
        variants.update({n: dataclasses.replace(DEFAULT, **kw) for n, kw in FUSED_SWEEP.items()})
    for t in ((1, 3) if args.tiny else (1, 8, 16)):
        rs = np.random.default_rng(t)
        rnd = lambda *shape_: jnp.asarray(rs.normal(size=shape_), jnp.bfloat16)  # noqa: E731
        inputs = [dict(x=rnd(1, t, cfg.hidden_size), pos=jnp.asarray(rs.integers(0, 4096, (1, t)), jnp.int32),
                       o=rnd(1, t, cfg.num_heads * spec.head_dim), h=rnd(1, t, cfg.intermediate_size))
                  for _ in range(copies)]
        for name, (nbytes, xla_op, pallas_op) in fused_ops(cfg, DEFAULT).items():
            xla_us, xla_k, _ = _device_us(xla_op, target, inputs, args.calls)
            outs = [np.concatenate([np.asarray(a, np.float32).reshape(-1) for a in jax.tree.leaves(
                jax.jit(lambda tg, i, op=op: op(tg.module.layers[0], i))(target, inputs[0]))]) for op in (xla_op,
                                                                                                    pallas_op)]
            rel_err = float(np.abs(outs[1] - outs[0]).max() / np.abs(outs[0]).max())  # bf16: ~1e-2 = an ulp or two
            row = {"shape": shape, "op": name, "rows": t, "weight_mb": nbytes / 1e6, "roofline_us": nbytes / 4.3e6,
                   "xla_us": xla_us, "xla_kernels": xla_k, "pallas_rel_err": rel_err, "pallas": {}}
            for vname, config in variants.items():
                _, _, pallas_op = fused_ops(cfg, config)[name]
                try:
                    us, k, named = _device_us(pallas_op, target, inputs, args.calls)
                except Exception as e:  # a tile variant that does not compile: report it, time the others
                    print(f"  {name} rows={t} {vname}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                row["pallas"][vname] = {"us": us, "kernels": k, "kernel_us": named, "tb_per_s": nbytes / us / 1e6}
            rows.append(row)
            p = row["pallas"].get("default", {"us": float("nan"), "kernels": float("nan"), "tb_per_s": float("nan")})
            print(f"| {name} | {t} | {row['weight_mb']:.1f} | {row['roofline_us']:.2f} | {xla_us:.2f} ({xla_k:.0f}) | "
                  f"{p['us']:.2f} ({p['kernels']:.0f}) | {xla_us / p['us']:.2f} | {p['tb_per_s']:.2f} | {rel_err:.1e} |",
                  flush=True)
    if args.sweep:
        print("\n| op | rows | " + " | ".join(variants) + " |  (Pallas us per call)")
        print("|---|---|" + "---|" * len(variants))
        for r in rows:
            cells = " | ".join(f"{r['pallas'][v]['us']:.2f}" if v in r["pallas"] else "failed" for v in variants)
            print(f"| {r['op']} | {r['rows']} | {cells} |")
    return rows


def run_fused(args) -> dict:
    """The fused layer kernels: per-op device time against the XLA ops they replace, then whole rounds."""
    out = {"kernels": [], "steps": []}
    head_layers = {"tiny": 2, "llama-445m": 2, "llama3.1-8b": 4}
    impls = args.implementations.split(",")
    for shape in (["tiny"] if args.tiny else args.fused_shapes.split(",")):
        target, peagle = models(shape, head_layers[shape], peagle=True)
        if args.only in ("all", "kernels"):
            print(f"\n{shape}, bf16, batch 1: device us per call (kernels per call)")
            print("| op | rows | weight MB | roofline us (4.3 TB/s) | XLA us | Pallas us | XLA / Pallas | Pallas TB/s | "
                  "Pallas vs XLA max err / max |XLA| |")
            print("|---|---|---|---|---|---|---|---|---|", flush=True)
            out["kernels"] += fused_kernel_rows(args, shape, target)
        if args.only not in ("all", "steps"):
            continue
        _, eagle3 = models(shape, 1, peagle=False)
        ps = prompts(1, args.prompt_len, SHAPES[shape][-1])
        kw = dict(max_new_tokens=min(args.new_tokens, 16) if args.tiny else args.new_tokens, chunk_seconds=None)
        print(f"\n{shape}, batch 1, {kw['max_new_tokens']} new tokens, K = {args.k}, median of {args.repeats}")
        print("| drafting | implementation | ms per round | vs xla | kernels per round | GPU busy |")
        print("|---|---|---|---|---|---|", flush=True)
        for mode, drafter, k in (("none", None, 0), ("parallel", peagle, args.k), ("sequential", eagle3, args.k)):
            base = None
            for impl in impls:
                run_kw = dict(kw, drafting=mode, num_speculative_tokens=max(k, 1), implementation=impl)
                m = timed(target, drafter, ps, repeats=args.repeats, **run_kw)
                events, stats = traced_generation(target, drafter, ps, **run_kw)
                if events:
                    busy = sum(e - s for s, e, _ in events) / (events[-1][1] - events[0][0])
                    m.update(kernels_per_round=len(events) / max(stats["rounds"], 1), busy_fraction=busy)
                base = base or m["decode_ms_per_round"]
                out["steps"].append({"shape": shape, "drafting": mode, "k": k, "implementation": impl, **m})
                print(f"| {mode} K={k} | {impl} | {m['decode_ms_per_round']:.3f} | "
                      f"{base / m['decode_ms_per_round']:.2f}x | {m.get('kernels_per_round', float('nan')):.1f} | "
                      f"{m.get('busy_fraction', float('nan')):.0%} |", flush=True)
    return out


def sweep(argv: list[str]) -> dict:
    """Re-run `steps` under every XLA flag set, each in a fresh process; one table."""
    out = {}
    for name, flags in FLAG_SETS.items():
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
        with_json = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_generate_{name}.json"
        rest, skip = [], False
        for a in argv:  # this run's own arguments minus the sweep flag, the mode and --out
            if skip or a in ("--xla-sweep", "steps", "--out") or a.startswith("--out="):
                skip = a == "--out"
                continue
            rest.append(a)
        cmd = [sys.executable, __file__, "steps", "--out", str(with_json)] + rest
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            print(f"{name}: failed\n{proc.stderr[-2000:]}")
            continue
        out[name] = json.loads(with_json.read_text())["steps"]
        print(f"{name}: done in {time.perf_counter() - t0:.0f} s")
    print("\n| shape | drafting | " + " | ".join(f"{n} ms/round" for n in out) + " |")
    print("|---|---|" + "---|" * len(out))
    first = next(iter(out.values()), [])
    for i, r in enumerate(first):
        cells = " | ".join(f"{v[i]['decode_ms_per_round']:.3f}" for v in out.values())
        print(f"| {r['shape']} | {r['drafting']} K={r['k']} | {cells} |")
    return out


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("chunks", "steps", "profile", "fused", "prefill", "host"))
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk-seconds", type=float, default=1.0)
    ap.add_argument("--top-kernels", type=int, default=40, help="profile: kernel names listed per case")
    ap.add_argument("--batches", default="1,64", help="chunks, profile: comma-separated batch sizes")
    ap.add_argument("--shapes", default="llama-445m,llama3.1-8b",
                    help="steps, prefill, profile: comma-separated shapes of SHAPES")
    ap.add_argument("--xla-sweep", action="store_true", help="steps under each XLA_FLAGS set (subprocesses)")
    ap.add_argument("--fused-shapes", default="llama-445m", help="fused: comma-separated shapes of SHAPES")
    ap.add_argument("--implementations", default="xla,auto,pallas", help="fused: kernel switches compared per round")
    ap.add_argument("--only", choices=("all", "kernels", "steps"), default="all", help="fused: one part only")
    ap.add_argument("--sweep", action="store_true", help="fused: also time the kernels under FUSED_SWEEP's tiles")
    ap.add_argument("--calls", type=int, default=20, help="fused: profiled calls per op timing")
    ap.add_argument("--prefill-batches", default=None, help="prefill: comma-separated batch sizes (default 8,32,64; "
                                                             "--tiny: 4)")
    ap.add_argument("--prefill-median", type=int, default=None,
                    help="prefill: median prompt length (default 82; --tiny: 20)")
    ap.add_argument("--prefill-longest", type=int, default=None,
                    help="prefill: longest prompt (default 347; --tiny: 40)")
    ap.add_argument("--prefill-parts", default="generate,drafter",
                    help="prefill: comma-separated parts: generate (a generation's prefill per drafting mode), "
                         "drafter (the drafter's prefill alone and target + drafter, P-EAGLE and EAGLE-3)")
    ap.add_argument("--drafter-layers", type=int, default=4, help="prefill: the P-EAGLE head's layers (drafter part)")
    ap.add_argument("--out", default=None, help="JSON output path (default $OUT/bench_generate.json)")
    args = ap.parse_args(argv)
    for name, full, tiny in (("prefill_batches", "8,32,64", "4"), ("prefill_median", 82, 20),
                             ("prefill_longest", 347, 40)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    if args.xla_sweep:
        result = {"sweep": sweep(argv)}
    else:
        result = {args.what: {"chunks": run_chunks, "steps": run_steps, "profile": run_profile,
                              "fused": run_fused, "prefill": run_prefill, "host": run_host}[args.what](args)}
    result["meta"] = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": argv}
    out = args.out or (os.path.join(os.environ["OUT"], "bench_generate.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
