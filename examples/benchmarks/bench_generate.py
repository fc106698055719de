"""End-to-end `pjax.generate` timing on random-weight targets: what a user's generation costs per round.

    PYTHONPATH=. python examples/benchmarks/bench_generate.py chunks   # the bounded-chunk device loop vs one call
    PYTHONPATH=. python examples/benchmarks/bench_generate.py steps    # ms per round: none / P-EAGLE / EAGLE-3
    PYTHONPATH=. python examples/benchmarks/bench_generate.py steps --xla-sweep   # the same under XLA flag sets
    PYTHONPATH=. python examples/benchmarks/bench_generate.py profile  # where a generation's device time goes
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
prefill: the prefill of a static batch of B ragged prompts (lengths drawn log-normally around --prefill-median, the
longest --prefill-longest: the code pair's prompts have median 82 and longest 347 tokens), padded (each prompt a row
of the longest one's bucket) against packed (the prompts in one row under a document mask), per shape and B of
--prefill-batches, for plain decoding (the target's prefill) and P-EAGLE (target and drafter): positions computed
and median prefill ms (the engine's clock: both prefill programs and the first tokens' copy to the host); the
programs compiled are listed at the end.
Weights are random bf16; acceptance is then ~0, so every round emits one token and has the same cost as a
round with accepted drafts (the same slots are computed). Compilation is excluded (a warm-up generation first).
Prints markdown; writes JSON to --out (default $OUT/bench_generate.json when $OUT is set).
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

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pjax  # noqa: E402
from pjax.config import LayerSpec, ModelConfig, RopeSpec  # noqa: E402
from pjax.decode.compiled import compile_stats  # noqa: E402
from pjax.models.drafter import DrafterConfig  # noqa: E402

SHAPES = {  # name: (layers, hidden, intermediate, heads, kv heads, head dim, vocab)
    "llama3.1-8b": (32, 4096, 14336, 32, 8, 128, 128256),
    "llama-445m": (24, 1024, 3840, 16, 16, 64, 32000),
    "tiny": (2, 64, 128, 4, 2, 32, 257),
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


def run_prefill(args) -> dict:
    out = {"generate": []}
    before = compile_stats()
    head_layers = {"tiny": 1, "llama-445m": 2, "llama3.1-8b": 4}
    for shape in (["tiny"] if args.tiny else args.shapes.split(",")):
        target, peagle = models(shape, head_layers[shape])
        vocab = SHAPES[shape][-1]
        for batch in map(int, args.prefill_batches.split(",")):
            lengths = ragged_lengths(batch, args.prefill_median, args.prefill_longest)
            rng = np.random.default_rng(batch)
            ps = [rng.integers(0, vocab - 1, n).tolist() for n in lengths]
            out["generate"] += prefill_generate_rows(args, shape, target, peagle, ps)
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
    print("\nprograms compiled: " + ", ".join(f"{n} {name}" for name, n in out["programs_compiled"].items()))
    return out


def traced_generation(target, drafter, ps, **kw):
    """One generation under the profiler (after a warm-up one): (GPU kernel events [(start, end, name)] or None on a
    CPU, the generation's stats)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import tempfile

    from devtime import gpu_kernel_events
    from jax.profiler import ProfileData
    pjax.generate(target, drafter, ps, **kw)  # compile + warm
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            stats = pjax.generate(target, drafter, ps, **kw).stats
        finally:
            jax.profiler.stop_trace()
        files = sorted(Path(d).rglob("*.xplane.pb"))
        return (gpu_kernel_events(ProfileData.from_file(str(files[-1]))) if files else None), stats


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
    ap.add_argument("what", choices=("chunks", "steps", "profile", "prefill", "host"))
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
    ap.add_argument("--prefill-batches", default=None, help="prefill: comma-separated batch sizes (default 8,32,64; "
                                                             "--tiny: 4)")
    ap.add_argument("--prefill-median", type=int, default=None,
                    help="prefill: median prompt length (default 82; --tiny: 20)")
    ap.add_argument("--prefill-longest", type=int, default=None,
                    help="prefill: longest prompt (default 347; --tiny: 40)")
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
                              "prefill": run_prefill, "host": run_host}[args.what](args)}
    result["meta"] = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": argv}
    out = args.out or (os.path.join(os.environ["OUT"], "bench_generate.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
