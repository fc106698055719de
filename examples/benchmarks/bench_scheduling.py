"""Continuous batching against static batches on the one engine, and what a chunk boundary costs.

    PYTHONPATH=. python3 examples/benchmarks/bench_scheduling.py                 # GPU: the code pair's geometry
    PYTHONPATH=. python3 examples/benchmarks/bench_scheduling.py --shape tiny --concurrency 8 --prompts 16 \\
        --new-tokens 32 --prompt-len 16 --repeats 1                             # CPU smoke run
    PYTHONPATH=. python3 examples/benchmarks/bench_scheduling.py --only free --shape llama3.1-8b --concurrency 8 \\
        --slots 64 --fill-new 1536                                              # what free slots cost

ratio: `--prompts` random prompts of `--prompt-len` tokens, `--new-tokens` each (no EOS), at concurrency c, as
`pjax bench` runs them: static batches (`pjax.bench.BatchBackend`, `pjax.generate`'s path) and continuous batching
(`EngineBackend`), plain decoding and P-EAGLE K = 3 with acceptance simulated at the code pair's rates (random
weights, a 4-layer head). The two schedulings alternate run by run (a GPU's speed drifts a few percent within a
minute), `--repeats` runs each; the medians and their ratio are printed.
gap: the engine's fixed-trip chunk program (plain decoding, c rows; 8 rounds) called back to back, the host reading
the previous chunk's outputs and then working X ms after each call, as a pipelined step does: were the device a
chunk ahead of the host, the ms per chunk would not grow with X. Both programs: without the top-k / top-p truncation
(what the engine runs while no request asks for it) and with it (a vocabulary sort in every round).
free: c requests (plain decoding) in an engine of c slots, and in one of `--slots` slots every one of which has served
a request of `--fill-new` tokens first (a server at low load; a round computes every slot): output tok/s, medians.
Prints markdown; writes JSON to $OUT/bench_scheduling.json when $OUT is set.
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

from pjax.bench.backend import BatchBackend, EngineBackend, Request, RunSettings  # noqa: E402
from pjax.bench.models import random_head, random_target  # noqa: E402
from pjax.decode import EngineConfig  # noqa: E402
from pjax.decode.engine import Engine, RequestParams  # noqa: E402
from pjax.decode.inputs import bucket_capacity  # noqa: E402

SIMULATED = (0.82, 0.780, 0.828)  # the code pair's conditional acceptance per draft position (K = 3)


def ratio(target, head, requests, a) -> list[dict]:
    rows = []
    for mode, k, sim in (("none", 0, None), ("parallel", 3, SIMULATED)):
        s = RunSettings(drafting=mode, k=k, concurrency=a.concurrency, max_new_tokens=a.new_tokens,
                        max_positions=a.prompt_len + a.new_tokens + 16, simulate_acceptance=sim)
        arms = {"static": BatchBackend(target, {"parallel": head}, EngineConfig()),
                "continuous": EngineBackend(target, {"parallel": head}, EngineConfig())}
        for backend in arms.values():
            backend.prepare(requests, s)
        tok_s = {name: [] for name in arms}
        for _ in range(a.repeats):
            for name, backend in arms.items():
                r = backend.run(requests, s)
                tok_s[name].append(sum(len(x.tokens) for x in r.requests) / r.duration_s)
        med = {name: statistics.median(v) for name, v in tok_s.items()}
        rows.append({"drafting": mode, "k": k, **{f"{n}_tok_s": v for n, v in med.items()},
                     "continuous_over_static": med["continuous"] / med["static"], "runs": tok_s})
    return rows


def gap(target, requests, a) -> list[dict]:
    """The engine's fixed-trip chunk program (plain decoding, c rows) called back to back with X ms of host work
    after each call (the engine's own program and state, called by hand): ms per chunk and per call."""
    s = RunSettings(drafting="none", k=0, concurrency=a.concurrency, max_new_tokens=a.new_tokens,
                    max_positions=a.prompt_len + a.new_tokens)
    backend = BatchBackend(target, {}, EngineConfig())
    backend.prepare(requests[:a.concurrency], s)
    eng = backend.engine(s)
    rows = []
    for ms, filters in [(ms, f) for f in (False, True) for ms in (0.0, 0.5, 1.0, 2.0, 4.0)]:
        exe = eng._chunk_program(True, 0, "filtered" if filters else "sampled")  # noqa: SLF001
        times, calls = [], []
        for _ in range(3):
            t0, previous = time.perf_counter(), None
            for _ in range(12):
                t = time.perf_counter()
                eng._state, view = exe(*eng._chunk_args(True))  # noqa: SLF001
                calls.append(time.perf_counter() - t)
                if previous is not None:
                    np.asarray(previous)  # the host reads the previous chunk's view, as a pipelined step does
                previous = view
                end = time.perf_counter() + ms / 1e3
                while time.perf_counter() < end:
                    pass
            jax.block_until_ready(view)
            times.append((time.perf_counter() - t0) / 12)
        rows.append({"host_ms": ms, "filters": filters, "chunk_ms": 1e3 * statistics.median(times),
                     "call_ms": 1e3 * statistics.median(calls)})
    return rows


def free(target, requests, a) -> list[dict]:
    """c requests in flight (plain decoding) in an engine of c slots and in one of --slots slots, each slot having
    served a request of --fill-new tokens first: output tok/s, the median of --repeats runs after a warm one."""
    def serve(eng, reqs, new) -> float:
        for r in reqs:
            eng.submit(list(r.tokens), RequestParams(new))
        t0, out = time.perf_counter(), 0
        while eng.has_work:
            out += sum(len(ev.new_tokens) for ev in eng.step())
        return out / (time.perf_counter() - t0)
    c, rows = a.concurrency, []
    for slots in (c, a.slots):
        capacity = bucket_capacity(a.prompt_len + max(a.new_tokens, a.fill_new) + 16)
        eng = Engine(target, None, EngineConfig(drafting="none", max_slots=slots, max_len=capacity))
        serve(eng, [requests[i % len(requests)] for i in range(slots)], a.fill_new)  # every slot serves a request
        serve(eng, requests[:c], a.new_tokens)  # warm: the c-request admission
        runs = [serve(eng, requests[:c], a.new_tokens) for _ in range(a.repeats)]
        rows.append({"concurrency": c, "slots": slots, "tok_s": statistics.median(runs), "runs": runs})
        del eng  # its caches go before the next engine's are allocated
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="code-pair", help="a random target (pjax.bench.models), default code-pair")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--slots", type=int, default=64, help="free: the larger engine's slots")
    ap.add_argument("--fill-new", type=int, default=1024, help="free: tokens of the request each slot serves first")
    ap.add_argument("--only", choices=("ratio", "gap", "free"), default=None, help="one of the measurements")
    a = ap.parse_args(argv)
    target = random_target(a.shape, jnp.bfloat16)
    head = random_head(target, "4", parallel=True, dtype=jnp.bfloat16, shape=a.shape)
    rng = np.random.default_rng(0)
    requests = [Request(str(i), tuple(int(t) for t in rng.integers(0, target.config.vocab_size, a.prompt_len)), i)
                for i in range(a.prompts)]
    run = lambda name: a.only in (None, name)  # noqa: E731
    out = {"device": jax.devices()[0].device_kind, "args": vars(a),
           "ratio": ratio(target, head, requests, a) if run("ratio") else [],
           "gap": gap(target, requests, a) if run("gap") else [],
           "free": free(target, requests, a) if run("free") else []}
    print(f"## {a.shape}, c = {a.concurrency}, {a.prompts} prompts of {a.prompt_len} tokens, {a.new_tokens} new "
          f"tokens ({out['device']})\n")
    if out["ratio"]:
        print("| drafting | static tok/s | continuous tok/s | continuous / static |\n|---|---|---|---|")
    for r in out["ratio"]:
        print(f"| {r['drafting']} (K = {r['k']}) | {r['static_tok_s']:,.1f} | {r['continuous_tok_s']:,.1f} | "
              f"{r['continuous_over_static']:.3f} |")
    if out["gap"]:
        print("\n| round | host work between calls (ms) | ms per chunk | ms per call |\n|---|---|---|---|")
    for r in out["gap"]:
        print(f"| {'with' if r['filters'] else 'without'} top-k / top-p | {r['host_ms']} | {r['chunk_ms']:.2f} | "
              f"{r['call_ms']:.2f} |")
    if out["free"]:
        print(f"\n| requests in flight | slots (each served {a.fill_new} tokens first) | tok/s | vs c slots |\n"
              "|---|---|---|---|")
    for r in out["free"]:
        print(f"| {r['concurrency']} | {r['slots']} | {r['tok_s']:,.1f} | {r['tok_s'] / out['free'][0]['tok_s']:.3f} |")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_scheduling.json").write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
