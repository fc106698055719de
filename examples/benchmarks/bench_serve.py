"""What the HTTP server costs over the engine it runs: the same requests through `pjax.serve.Engine` stepped directly
(all submitted at once, one thread) and through `python -m pjax serve`'s app (uvicorn on loopback, the AsyncEngine
bridge, detokenization, SSE) with one streaming `openai` request per prompt, all sent at once from a client process.

    PYTHONPATH=. python examples/benchmarks/bench_serve.py            # GPU: Llama-3.1-8B shape, P-EAGLE K = 7
    PYTHONPATH=. python examples/benchmarks/bench_serve.py --tiny     # CPU smoke run (tiny shapes)

Weights are random bf16 with simulated acceptance (pjax.bench.simulate: seeded per-position verdicts,
so rounds emit tokens as a trained head's would); the tokenizer is a word-level one covering the whole vocabulary,
built in memory, so detokenization does one DecodeStream step per token as with a real tokenizer. Every request has
a --prompt-len random prompt and generates exactly --max-tokens tokens (ignore_eos). Per slot count (--slots, the
engine's batch; requests = --requests-per-slot x slots): output tokens/s, TTFT and TPOT p50 / p90 (the engine's
clocks for the direct run, the client's for the server), and server / direct ratios.
Compilation happens before timing (every admission program the run can use, run once, then one untimed pass).
Prints markdown; writes JSON to --out (default $OUT/bench_serve.json when $OUT is set). On an H200 (8B shape, slots
1 and 16, 256 + 256 tokens) expect a few minutes, most of it initialising the weights and compiling.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pjax  # noqa: E402
from pjax.config import LayerSpec, ModelConfig, RopeSpec  # noqa: E402
from pjax.models.drafter import DrafterConfig  # noqa: E402
from pjax.bench.simulate import SimulatedAcceptance  # noqa: E402
from pjax.decode.inputs import bucket_batch  # noqa: E402
from pjax.serve import AsyncEngine, Engine, EngineConfig, RequestParams  # noqa: E402
from pjax.serve.cli import _bind  # noqa: E402
from pjax.serve.openai_api import ServedModel, create_app  # noqa: E402
from pjax.text.tokenizer import Tokenizer  # noqa: E402

SHAPES = {  # name: (layers, hidden, intermediate, heads, kv heads, head dim, vocab)
    "llama3.1-8b": (32, 4096, 14336, 32, 8, 128, 128256),
    "tiny": (3, 64, 128, 4, 2, 16, 257),
}
ACCEPT = (0.8, 0.65, 0.5, 0.4, 0.3, 0.2, 0.15)  # per-position acceptance of a good P-EAGLE head (simulated)


def llama(layers, h, inter, heads, kv, hd, vocab) -> ModelConfig:
    rope = RopeSpec(kind="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
    return ModelConfig("llama", vocab, h, inter, heads, tuple(LayerSpec(hd, kv, rope) for _ in range(layers)),
                       rms_norm_eps=1e-5)


def models(shape: str, dtype):
    """Random target of `shape` and a one-layer random P-EAGLE head."""
    layers, h, inter, heads, kv, hd, vocab = SHAPES[shape]
    target = pjax.init_target(llama(layers, h, inter, heads, kv, hd, vocab), jax.random.key(0), dtype)
    aux = (2, layers // 2, layers - 3) if layers >= 8 else (0, 1, 2)
    dcfg = DrafterConfig(layer=llama(1, h, inter, heads, kv, hd, vocab), num_aux=3, target_hidden_size=h,
                         draft_vocab_size=vocab, mask_token_id=vocab - 1, aux_layer_ids=aux, has_mask_hidden=True,
                         model_kind="peagle")
    return target, pjax.init_drafter(dcfg, jax.random.key(1), dtype)


def word_tokenizer(vocab: int) -> Tokenizer:
    """A word-level tokenizer of `vocab` tokens "w0".."w{vocab-1}" (decoding joins them with spaces)."""
    from tokenizers import Tokenizer as Backend, models as tm, pre_tokenizers

    backend = Backend(tm.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend)


def pct(xs, q):
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summary(tokens: int, wall: float, ttft: list, tpot: list) -> dict:
    return {"output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall,
            "ttft_p50_ms": 1e3 * pct(ttft, 0.5), "ttft_p90_ms": 1e3 * pct(ttft, 0.9),
            "tpot_p50_ms": 1e3 * pct(tpot, 0.5), "tpot_p90_ms": 1e3 * pct(tpot, 0.9)}


def direct(engine: Engine, prompts, params: RequestParams) -> dict:
    """Every request submitted at once; step until done; the engine's per-request clocks."""
    t0 = time.perf_counter()
    for p in prompts:
        engine.submit(p, params)
    stats = []
    while engine.has_work:
        stats += [e.stats for e in engine.step() if e.finished]
    wall = time.perf_counter() - t0
    return summary(sum(s["output_tokens"] for s in stats), wall, [s["ttft_s"] for s in stats],
                   [s["tpot_s"] for s in stats])


def served(engine: Engine, model: ServedModel, prompts, max_tokens: int) -> dict:
    """The same requests as streaming /v1/completions calls, all at once, from a client process (its parsing does
    not share this process's GIL); the client's clocks."""
    import uvicorn

    bridge = AsyncEngine(engine)
    sock = _bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(bridge, model), log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    try:
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump({"url": url, "model": model.name, "prompts": prompts, "max_tokens": max_tokens}, f)
            f.flush()
            r = subprocess.run([sys.executable, __file__, "--client", f.name], capture_output=True, text=True,
                               check=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    finally:
        server.should_exit = True
        thread.join(60)
        bridge.close()
        sock.close()
    return json.loads(r.stdout.strip().splitlines()[-1])


def client(job_file: str) -> dict:
    """The load: one streaming request per prompt, all at once (after one untimed request)."""
    import openai

    job = json.loads(Path(job_file).read_text())

    async def one(c, prompt):
        t0 = time.perf_counter()
        first, usage = None, None
        stream = await c.completions.create(model=job["model"], prompt=prompt, max_tokens=job["max_tokens"],
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter() - t0
            usage = chunk.usage or usage
        e2e = time.perf_counter() - t0
        n = usage.completion_tokens
        return n, first, (e2e - first) / (n - 1) if n > 1 else None

    async def run():
        c = openai.AsyncOpenAI(base_url=job["url"], api_key="none", max_retries=0, timeout=3600)
        await one(c, job["prompts"][0])  # the connection pool and the app's first-request paths
        t0 = time.perf_counter()
        out = await asyncio.gather(*(one(c, p) for p in job["prompts"]))
        return out, time.perf_counter() - t0
    out, wall = asyncio.run(run())
    return summary(sum(n for n, _, _ in out), wall, [f for _, f, _ in out], [t for _, _, t in out])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shapes, float32")
    ap.add_argument("--slots", default=None, help="comma-separated engine batch sizes (default 1,16; tiny 1,4)")
    ap.add_argument("--requests-per-slot", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=None, help="default 256 (tiny 16)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 256 (tiny 32)")
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--out", default=None)
    ap.add_argument("--client", metavar="JOB.json", help=argparse.SUPPRESS)  # the load process (internal)
    args = ap.parse_args(argv)
    if args.client:
        print(json.dumps(client(args.client)))
        return
    shape, dtype = ("tiny", jnp.float32) if args.tiny else ("llama3.1-8b", jnp.bfloat16)
    slots = [int(s) for s in (args.slots or ("1,4" if args.tiny else "1,16")).split(",")]
    prompt_len = args.prompt_len or (16 if args.tiny else 256)
    max_tokens = args.max_tokens or (32 if args.tiny else 256)
    k = args.k
    target, drafter = models(shape, dtype)
    vocab = target.config.vocab_size
    tokenizer = word_tokenizer(vocab)
    params = RequestParams(max_new_tokens=max_tokens)
    max_len = prompt_len + max_tokens + 2 * k
    print(f"# bench_serve: {shape}, {jax.devices()[0].device_kind}, jax {jax.__version__}, P-EAGLE K = {k} "
          f"(simulated acceptance {list(ACCEPT[:k])}), prompts {prompt_len}, {max_tokens} new tokens each\n")
    print("| slots | requests | path | tokens/s | TTFT p50 / p90 ms | TPOT p50 / p90 ms |")
    print("| ---: | ---: | --- | ---: | ---: | ---: |")
    rows = []
    for c in slots:
        n = c * args.requests_per_slot
        rng = np.random.default_rng(c)
        prompts = rng.integers(0, vocab - 1, (n, prompt_len)).tolist()
        engine = Engine(target, drafter, EngineConfig(max_slots=c, max_len=max_len, num_speculative_tokens=k,
                                                      drafting="parallel", prefill="padded"),
                        acceptance=SimulatedAcceptance(tuple(ACCEPT[:k])))
        admissions = sorted({bucket_batch(i) for i in range(1, engine.max_slots + 1)})
        compile_s = engine.precompile(admissions, [prompt_len], warm=True)  # every admission this run can make
        direct(engine, prompts[:c], params)  # one untimed pass: first-run costs
        d = direct(engine, prompts, params)
        model = ServedModel(name="bench", tokenizer=tokenizer, vocab_size=vocab, max_len=max_len, slack=2 * k,
                            drafting="parallel", num_speculative_tokens=k)
        s = served(engine, model, prompts, max_tokens)
        assert s["output_tokens"] == d["output_tokens"] == n * max_tokens, (s, d)
        for path, r in (("engine", d), ("server", s)):
            print(f"| {c} | {n} | {path} | {r['output_tokens_per_s']:.1f} | {r['ttft_p50_ms']:.1f} / "
                  f"{r['ttft_p90_ms']:.1f} | {r['tpot_p50_ms']:.2f} / {r['tpot_p90_ms']:.2f} |", flush=True)
        rows.append({"slots": c, "requests": n, "compile_s": compile_s, "engine": d, "server": s,
                     "server_over_engine_tokens_per_s": s["output_tokens_per_s"] / d["output_tokens_per_s"]})
    print()
    for r in rows:
        print(f"slots {r['slots']}: server / engine throughput {r['server_over_engine_tokens_per_s']:.3f}")
    out = args.out or (os.path.join(os.environ["OUT"], "bench_serve.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps({"shape": shape, "device": jax.devices()[0].device_kind,
                                         "jax": jax.__version__, "k": k, "accept": list(ACCEPT[:k]),
                                         "prompt_len": prompt_len, "max_tokens": max_tokens, "rows": rows}, indent=1))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
