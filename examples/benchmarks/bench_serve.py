"""Output tokens/s of the OpenAI server (`python -m pjax serve`'s app and uvicorn server) through HTTP, against
`python -m pjax bench --scheduling continuous` (the engine driven directly) on the same prompts and settings.

    PYTHONPATH=. python examples/benchmarks/bench_serve.py --out DIR        # GPU: Llama-3.1-8B shape, random weights
    PYTHONPATH=. python examples/benchmarks/bench_serve.py --out DIR --target TINY_DIR --head TINY_HEAD \\
        --dtype f32 --concurrency 1,4 --num-prompts 4,8 --max-new-tokens 32      # CPU smoke run (a tiny pair)

1. Runs `python -m pjax bench` (P-EAGLE drafting at --k, --simulate-acceptance for random weights, --ignore-eos, so
   every request decodes --max-new-tokens tokens) into DIR/bench and reads its output tokens/s per concurrency.
2. Builds the same prompts (`pjax.bench.runner.build_prompt_set`: the dataset's first prompts, random ids of
   --prompt-len for a random target, else the tokenizer's rendering), then per concurrency c an engine of c slots as
   the bench's (same KV capacity, rounds per step, simulated acceptance), compiles its admissions of 1 to c
   requests, and serves it on 127.0.0.1 (`pjax.serve.cli.make_server`). Client processes (--client-processes, the c
   streams split between them) keep c streaming /v1/completions requests in flight (the prompts as token ids,
   ignore_eos, temperature 0; vLLM's --max-concurrency c) after one untimed request each, all starting together,
   and time from the first request to the last token.
3. Prints, per c, both tokens/s and their ratio (the server's HTTP, detokenization and event-loop cost; goal >= 0.95)
   and the CPU share of the busiest client process, of the server's event loop and of its engine thread over the
   timed load (near 100%: that one bounds the row; a client: give more --client-processes); writes
   DIR/bench_serve.json.

A random target's server detokenizes with a word-level tokenizer covering the vocabulary (built in memory: one
DecodeStream step per token, as with a real tokenizer).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

ACCEPT = "0.75,0.67,0.64,0.64,0.64,0.64,0.64"  # conditional per-position rates of a trained P-EAGLE head (K = 7)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory (the bench's output goes to OUT/bench)")
    ap.add_argument("--target", default="random:llama3.1-8b", help="random:SHAPE or a target directory")
    ap.add_argument("--head", default="random:4", help="random:N or a P-EAGLE head directory")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--simulate-acceptance", default=None,
                    help=f"default for random heads: {ACCEPT} (cut to K); none for a trained head")
    ap.add_argument("--concurrency", default="1,8,64")
    ap.add_argument("--num-prompts", default="8,32,128", help="one count per concurrency")
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--prompt-len", type=int, default=128, help="random targets: random prompts of this length")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--rounds-per-step", type=int, default=8)
    ap.add_argument("--client-processes", type=int, default=max(1, len(os.sched_getaffinity(0)) // 4),
                    help="client processes sharing the c streams (default: a quarter of the CPU cores; at most c)")
    ap.add_argument("--compilation-cache", metavar="DIR", default=None,
                    help="JAX's persistent compilation cache for both runs: the server's engines load the programs "
                         "the bench compiled (default: pjax-bench-serve-cache in the temporary directory)")
    ap.add_argument("--client", metavar="JOB.json", help=argparse.SUPPRESS)  # the load process (internal)
    return ap.parse_args(argv)


def run_bench(args, out: Path) -> dict:
    """`python -m pjax bench --scheduling continuous` -> {concurrency: output tokens/s}."""
    cmd = [sys.executable, "-m", "pjax", "bench", "--target", args.target, "--head", args.head, "--drafting",
           "parallel", "--k", str(args.k), "--concurrency", args.concurrency, "--num-prompts", args.num_prompts,
           "--dataset", args.dataset, "--max-new-tokens", str(args.max_new_tokens), "--ignore-eos", "--scheduling",
           "continuous", "--rounds-per-step", str(args.rounds_per_step), "--dtype", args.dtype, "--out", str(out),
           "--no-progress", "--compilation-cache", args.compilation_cache]
    if args.target.startswith("random:"):
        cmd += ["--prompt-len", str(args.prompt_len)]
    if args.simulate_acceptance:
        cmd += ["--simulate-acceptance", args.simulate_acceptance]
    print("$", " ".join(cmd), flush=True)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    subprocess.run(cmd, check=True, env=dict(os.environ, PYTHONPATH=path), cwd=ROOT)
    rows = json.loads((out / "bench.json").read_text())
    return {r["concurrency"]: r["output_tokens_per_s"] for r in rows if r["drafting"] == "parallel"}


def word_tokenizer(vocab: int):
    """A word-level tokenizer of `vocab` tokens "w0".."w{vocab-1}" (decoding joins them with spaces)."""
    from tokenizers import Tokenizer as Backend, models as tm, pre_tokenizers
    from pjax.text.tokenizer import Tokenizer

    backend = Backend(tm.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend)


def load(args):
    """(target, head, tokenizer, prompts: list of token-id lists, in the bench's order)."""
    import pjax
    from pjax.bench.datasets import load_dataset
    from pjax.bench.models import parse_random, random_head, random_target
    from pjax.bench.runner import build_prompt_set
    from pjax.dtypes import parse_dtype
    from pjax.text import load_tokenizer

    dtype = parse_dtype(args.dtype)
    shape = parse_random(args.target, "--target")
    count = max(int(n) for n in args.num_prompts.split(","))
    dataset = load_dataset(args.dataset)
    if shape is not None:
        target = random_target(shape, dtype)
        tokenizer = word_tokenizer(target.config.vocab_size)
        ps = build_prompt_set(dataset, count, random_vocab=target.config.vocab_size, prompt_len=args.prompt_len)
    else:
        target = pjax.load_target(args.target, dtype)
        tokenizer = load_tokenizer(args.target)
        chat = tokenizer.has_chat_template  # the bench's --chat auto
        ps = build_prompt_set(dataset, count, render=lambda content: tokenizer.render(content, chat=chat))
    n = parse_random(args.head, "--head")
    head = (random_head(target, n, parallel=True, dtype=dtype, shape=shape) if n is not None
            else pjax.load_drafter(args.head, dtype, target=target))
    return target, head, tokenizer, [list(r.tokens) for r in ps.requests]


def serve_and_load(args, target, head, tokenizer, prompts, c: int, max_positions: int) -> dict:
    """Serve an engine of c slots (as the bench's: KV capacity for max_positions, the whole prompt set's longest
    request) and drive it with c clients in flight: output tokens, wall s."""
    from pjax.decode.inputs import bucket_capacity
    from pjax.bench.simulate import SimulatedAcceptance
    from pjax.serve import AsyncEngine, Engine, EngineConfig
    from pjax.serve.cli import make_server
    from pjax.serve.openai_api import ServedModel, create_app

    k = args.k
    sim = tuple(float(x) for x in args.simulate_acceptance.split(","))[:k] if args.simulate_acceptance else None
    max_len = bucket_capacity(max_positions)
    engine = Engine(target, head, EngineConfig(max_slots=c, max_len=max_len, num_speculative_tokens=k,
                                               drafting="parallel", rounds_per_step=args.rounds_per_step),
                    acceptance=None if sim is None else SimulatedAcceptance(sim))
    # admissions of 1 to c requests: as many as arrive between two chunks
    compile_s = engine.precompile(range(1, c + 1), {len(p) for p in prompts}, warm=True, sampling="greedy")
    model = ServedModel(name="bench", tokenizer=tokenizer, vocab_size=target.config.vocab_size, max_len=max_len,
                        slack=engine.slack, drafting="parallel", num_speculative_tokens=engine.spec.k)
    name = f"bench-serve-engine-{c}-{time.monotonic_ns()}"
    bridge = AsyncEngine(engine, name=name)
    engine_thread = next(t for t in threading.enumerate() if t.name == name)
    server = make_server(create_app(bridge, model), log_level="warning")
    sock = socket.create_server(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions"
    try:
        before = engine.compile_s
        load = run_clients(url, prompts, args.max_new_tokens, c, args.client_processes,
                           {"event loop": thread.native_id, "engine": engine_thread.native_id})
        load["compile_s_during_load"] = engine.compile_s - before  # 0 unless a program was missing
    finally:
        server.should_exit = True
        thread.join(60)
        bridge.close()
        sock.close()
    return dict(load, compile_s=compile_s)


def run_clients(url: str, prompts, max_tokens: int, c: int, processes: int, threads: dict) -> dict:
    """c streaming requests in flight from `processes` client processes (the c streams split between them, prompt j
    sent by the process owning stream j mod c; one Python process streams only so many tokens a second): each sends
    one untimed request, then all start together: output tokens, wall s from the first request sent to the last
    token, the busiest client process's CPU seconds over its wall, and over the same time those of this process's
    `threads` ({name: native thread id}): a share near 1 names what bounds the row (a client, the server's event
    loop, the engine thread)."""
    c = min(c, len(prompts))
    n = max(1, min(processes, c))
    owner = [i for i in range(n) for _ in range(c // n + (i < c % n))]  # stream -> process
    procs, files = [], []
    for i in range(n):
        mine = [p for j, p in enumerate(prompts) if owner[j % c] == i]
        f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump({"url": url, "prompts": mine, "max_tokens": max_tokens, "concurrency": owner.count(i)}, f)
        f.close()
        files.append(f.name)
        procs.append(subprocess.Popen([sys.executable, __file__, "--out", "-", "--client", f.name], text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      env=dict(os.environ, JAX_PLATFORMS="cpu")))
    try:
        for p in procs:  # a barrier: every process has finished its untimed request
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a client process failed before its load (exit status {p.wait()})")
        cpu0, t0 = {k: thread_cpu_s(t) for k, t in threads.items()}, time.time()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        parts = []
        for p in procs:
            out, _ = p.communicate()
            if p.returncode:
                raise RuntimeError(f"a client process failed (exit status {p.returncode})")
            parts.append(json.loads(out.strip().splitlines()[-1]))
        server_cpu = {k: (thread_cpu_s(t) - cpu0[k]) / (time.time() - t0) for k, t in threads.items()}
    finally:
        for p in procs:
            p.kill()  # (a no-op once it exited)
        for name in files:
            os.unlink(name)
    tokens = sum(p["output_tokens"] for p in parts)
    wall = max(p["t_end"] for p in parts) - min(p["t_start"] for p in parts)
    return {"output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall, "client_processes": n,
            "client_cpu_share": max(p["cpu_s"] / (p["t_end"] - p["t_start"]) for p in parts),
            "server_cpu_share": server_cpu}


def thread_cpu_s(native_id: int) -> float:
    """CPU seconds (user + system) a thread of this process has run (Linux: /proc; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def client(job_file: str) -> dict:
    """One client process: one untimed request, "ready" on stdout, then on a line from stdin `concurrency` streaming
    requests in flight over its prompts."""
    import httpx

    job = json.loads(Path(job_file).read_text())

    async def one(http, prompt) -> int:
        body = {"model": "bench", "prompt": prompt, "max_tokens": job["max_tokens"], "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        tokens = None
        async with http.stream("POST", job["url"], json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"usage":{' in line:
                    tokens = json.loads(line[6:])["usage"]["completion_tokens"]
        return tokens

    async def run():
        c = job["concurrency"]
        async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=c + 1)) as http:
            await one(http, job["prompts"][0])
            gate = asyncio.Semaphore(c)

            async def gated(prompt):
                async with gate:
                    return await one(http, prompt)
            print("ready", flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            t0, cpu0 = time.time(), time.process_time()
            tokens = await asyncio.gather(*(gated(p) for p in job["prompts"]))
            return sum(tokens), t0, time.time(), time.process_time() - cpu0
    tokens, t0, t1, cpu = asyncio.run(run())
    return {"output_tokens": tokens, "t_start": t0, "t_end": t1, "cpu_s": cpu}


def main(argv=None):
    args = parse_args(argv)
    if args.client:
        print(json.dumps(client(args.client)))
        return
    if args.simulate_acceptance is None and args.head.startswith("random:"):
        args.simulate_acceptance = ",".join(ACCEPT.split(",")[:args.k])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.compilation_cache = args.compilation_cache or os.path.join(tempfile.gettempdir(), "pjax-bench-serve-cache")
    bench = run_bench(args, out / "bench")  # first: its process has the device to itself
    import jax
    from pjax.decode.compiled import use_compilation_cache

    use_compilation_cache(args.compilation_cache)

    target, head, tokenizer, prompts = load(args)
    counts = [int(n) for n in args.num_prompts.split(",")]
    longest = max(len(p) for p in prompts) + args.max_new_tokens + 2 * args.k
    rows = []
    for c, n in zip((int(x) for x in args.concurrency.split(",")), counts):
        s = serve_and_load(args, target, head, tokenizer, prompts[:n], c, longest)
        rows.append({"concurrency": c, "prompts": n, "bench_output_tokens_per_s": bench[c],
                     "server_output_tokens_per_s": s["output_tokens_per_s"],
                     "server_over_bench": s["output_tokens_per_s"] / bench[c], "server": s})
        assert s["output_tokens"] == n * args.max_new_tokens, s
        print(f"c={c}: bench {bench[c]:.1f} tok/s, server {s['output_tokens_per_s']:.1f} tok/s "
              f"({s['output_tokens_per_s'] / bench[c]:.3f}x); CPU: busiest of {s['client_processes']} client "
              f"process(es) {s['client_cpu_share']:.0%}, event loop {s['server_cpu_share']['event loop']:.0%}, "
              f"engine thread {s['server_cpu_share']['engine']:.0%}", flush=True)
        if s["compile_s_during_load"]:
            print(f"  warning: {s['compile_s_during_load']:.1f} s of compilation during the load", flush=True)
    print(f"\n# bench_serve: {args.target}, head {args.head}, {jax.devices()[0].device_kind}, jax {jax.__version__}, "
          f"P-EAGLE K = {args.k}, simulated acceptance {args.simulate_acceptance}, {args.max_new_tokens} new "
          f"tokens per request\n")
    print("| concurrency | prompts | pjax bench (continuous) tok/s | server (HTTP) tok/s | server / bench | "
          "client processes | CPU: busiest client / event loop / engine thread |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['concurrency']} | {r['prompts']} | {r['bench_output_tokens_per_s']:.1f} | "
              f"{r['server_output_tokens_per_s']:.1f} | {r['server_over_bench']:.3f} | "
              f"{r['server']['client_processes']} | {r['server']['client_cpu_share']:.0%} / "
              f"{r['server']['server_cpu_share']['event loop']:.0%} / {r['server']['server_cpu_share']['engine']:.0%} |")
    (out / "bench_serve.json").write_text(json.dumps({
        "target": args.target, "head": args.head, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
        "k": args.k, "simulate_acceptance": args.simulate_acceptance, "max_new_tokens": args.max_new_tokens,
        "rows": rows}, indent=1))
    print(f"wrote {out / 'bench_serve.json'}")


if __name__ == "__main__":
    main()
