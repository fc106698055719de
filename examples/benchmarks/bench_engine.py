"""Speculative round timing: P-EAGLE parallel drafting vs EAGLE-3 sequential drafting, the round broken
into verify / accept / draft, and N rounds in one on-device loop vs N separate jitted calls.

    PYTHONPATH=. python3 examples/benchmarks/bench_engine.py           # GPU: Llama-3.1-8B target, 4-layer head
    PYTHONPATH=. python3 examples/benchmarks/bench_engine.py --tiny    # CPU smoke test (tiny shapes)

Weights are random bf16 (timing only; acceptance is ~0, so every round emits one token and writes the
same slot layout). Every step is one jitted program; caches are threaded through calls (donated on GPU).
Timing: warm-up, then `--calls` synchronised calls, median (ms) reported, p10/p90 in the JSON.

1. drafter step for K = 1..11: parallel = one drafter forward over 2K slots (accepted + bonus + K-1
   mask slots), sequential = one forward over the K+1 accepted/bonus slots then K-1 one-token passes;
   both include feature fusion (fc), the lm_head on the K sampled slots and argmax.
2. one full round (verify -> accept -> draft, one program) and its parts timed separately:
   verify (target over K+1 tokens + float32 logits + aux features), accept, draft.
3. N rounds: one lax.fori_loop program, N back-to-back jitted calls (async dispatch), and N calls that
   read the stop flags after every round (the host round-trip a Python loop needs).
Prints markdown tables; writes JSON to $OUT/bench_engine.json when $OUT is set.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
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

import pjax  # noqa: E402
from pjax.config import LayerSpec, ModelConfig, RopeSpec  # noqa: E402
from pjax.decode import Sampling, make_spec, prefill, spec_round, verify  # noqa: E402
from pjax.decode import draft as D  # noqa: E402
from pjax.decode.step import _accept  # noqa: E402
from pjax.models.drafter import DrafterConfig, combine, init_drafter  # noqa: E402


def llama_cfg(layers, h, inter, heads, kv, hd, vocab) -> ModelConfig:
    rope = RopeSpec(kind="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
    return ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_heads=heads,
                       layers=tuple(LayerSpec(hd, kv, rope) for _ in range(layers)), rms_norm_eps=1e-5)


SHAPES = {  # (target layers, H, I, heads, kv heads, head dim, vocab), head layers
    "llama3.1-8b": ((32, 4096, 14336, 32, 8, 128, 128256), 4),
    "tiny": ((2, 64, 128, 4, 2, 16, 257), 2),
}


def build(name: str, dtype):
    (layers, h, inter, heads, kv, hd, vocab), head_layers = SHAPES[name]
    tcfg = llama_cfg(layers, h, inter, heads, kv, hd, vocab)
    target = pjax.init_target(tcfg, jax.random.key(0), dtype)
    n = layers
    dcfg = DrafterConfig(layer=llama_cfg(head_layers, h, inter, heads, kv, hd, vocab), num_aux=3,
                         target_hidden_size=h, draft_vocab_size=vocab, mask_token_id=vocab - 1,
                         aux_layer_ids=(min(2, n), n // 2, max(n - 3, 0)) if n >= 3 else (0, 1, 2))
    drafter = init_drafter(dcfg, jax.random.key(1), dtype)
    return target, drafter


def timed(fn, state, calls: int, warmup: int = 2):
    """fn(state) -> state; returns (median, p10, p90) ms of synchronised calls, and the final state."""
    for _ in range(warmup):
        state = fn(state)
    jax.block_until_ready(state)
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        state = fn(state)
        jax.block_until_ready(state)
        ts.append((time.perf_counter() - t0) * 1e3)
    q = np.percentile(ts, [10, 90])
    return (statistics.median(ts), float(q[0]), float(q[1])), state


def _donate(*names):
    return names if jax.default_backend() != "cpu" else ()


class Bench:
    def __init__(self, target, drafter, batch: int, context: int, budget: int, dtype):
        self.target, self.drafter, self.b, self.ctx, self.dtype = target, drafter, batch, context, dtype
        self.capacity = -(-(context + budget) // 128) * 128
        b = batch
        self.sampling = Sampling(jnp.zeros(b), jnp.zeros(b, jnp.int32), jnp.ones(b), jnp.arange(b, dtype=jnp.uint32))
        self.prompts = jax.random.randint(jax.random.key(2), (b, context), 0, target.config.vocab_size - 1)

    def spec(self, k, drafting, max_new=1 << 20):
        return make_spec(self.target, self.drafter, max_new_tokens=max_new, num_speculative_tokens=k,
                         drafting=drafting)

    def prefill(self, spec):
        fn = jax.jit(prefill, static_argnames=("spec", "capacity", "cache_dtype"))
        lengths = jnp.full((self.b,), self.ctx, jnp.int32)
        return fn(self.target, self.drafter, self.prompts, lengths, self.sampling, spec=spec, capacity=self.capacity)

    def draft_step(self, k, drafting, calls):
        """One drafter step after a verify at the prompt end (n = 0 accepted: 2K slots in parallel mode)."""
        spec = self.spec(k, drafting)
        st = self.prefill(spec)
        b, h = self.b, self.target.config.hidden_size
        aux = jnp.zeros((b, k + 1, 3 * h), self.dtype) + 0.1
        vt = jnp.concatenate([st.last[:, None], st.drafts], axis=1)
        n = jnp.zeros((b,), jnp.int32)
        active = jnp.ones((b,), bool)

        @functools.partial(jax.jit, donate_argnums=_donate(0) and (0,))
        def step(cache):
            comb = combine(self.drafter, aux)
            drafts, _, cache = D.draft_round(self.drafter, cache, comb, vt, n, st.last, st.pos, active,
                                             self.sampling, spec)
            return cache, drafts

        def run(carry):
            cache, _ = step(carry[0])
            return cache, None
        res, _ = timed(run, (st.drafter_cache, None), calls)
        return res

    def round_parts(self, k, drafting, calls):
        spec = self.spec(k, drafting)
        st = self.prefill(spec)
        t, d, samp = self.target, self.drafter, self.sampling
        active = jnp.ones((self.b,), bool)
        nd = jnp.full((self.b,), k, jnp.int32)

        @functools.partial(jax.jit, donate_argnums=_donate(0) and (0,))
        def ver(tcache):
            logits, aux, tcache, _ = verify(t, dataclasses.replace(st, target_cache=tcache), nd, active, spec)
            return tcache, (logits, aux)
        out = {}
        out["verify"], (tc, (logits, aux)) = timed(lambda c: ver(c[0]), (st.target_cache, None), calls)
        st = dataclasses.replace(st, target_cache=tc)
        acc = jax.jit(lambda lg: _accept(lg, st.drafts, None, samp, st.pos + 1, nd, spec))
        out["accept"], _ = timed(lambda r: acc(logits), None, calls)
        res = acc(logits)
        vt = jnp.concatenate([st.last[:, None], st.drafts], axis=1)

        @functools.partial(jax.jit, donate_argnums=_donate(0) and (0,))
        def dr(dcache):
            comb = combine(d, aux)
            drafts, _, dcache = D.draft_round(d, dcache, comb, vt, res.num_accepted, res.next_token, st.pos,
                                              active, samp, spec)
            return dcache, drafts
        out["draft"], _ = timed(lambda c: dr(c[0]), (st.drafter_cache, None), calls)
        rnd = jax.jit(functools.partial(spec_round, spec=spec), donate_argnums=_donate(2) and (2,))
        out["round"], _ = timed(lambda s: rnd(t, d, s, samp), st, calls)
        return out

    def loops(self, k, drafting, rounds, calls):
        """ms per round: N rounds in one fori_loop program vs N jitted calls (async / synced per round)."""
        spec = self.spec(k, drafting)
        t, d, samp = self.target, self.drafter, self.sampling
        st0 = self.prefill(spec)
        one = jax.jit(functools.partial(spec_round, spec=spec))

        @jax.jit
        def many(s):
            return jax.lax.fori_loop(0, rounds, lambda i, x: spec_round(t, d, x, samp, spec=spec), s)

        def device(_):
            return many(st0)

        def async_calls(_):
            s = st0
            for _ in range(rounds):
                s = one(t, d, s, samp)
            return s

        def synced_calls(_):
            s = st0
            for _ in range(rounds):
                s = one(t, d, s, samp)
                bool(s.done.all())  # what a host loop checking stop conditions pays every round
            return s
        out = {}
        for name, fn in (("while_loop", device), ("separate_calls", async_calls), ("separate_calls_synced", synced_calls)):
            (med, p10, p90), _ = timed(fn, None, calls, warmup=1)
            out[name] = (med / rounds, p10 / rounds, p90 / rounds)
        return out


def write_json(result):
    out = os.environ.get("OUT")
    if not out:
        return None
    path = Path(out) / "bench_engine.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.rename(path)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes for a CPU smoke test")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=None, help="prompt tokens in the cache (default 2048)")
    ap.add_argument("--ks", default=None, help="comma-separated K values (default 1..11)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds for the loop comparison (default 64)")
    ap.add_argument("--calls", type=int, default=None, help="timed calls per measurement (default 30)")
    args = ap.parse_args(argv)
    tiny = args.tiny
    name = "tiny" if tiny else "llama3.1-8b"
    ks = [int(x) for x in args.ks.split(",")] if args.ks else ([1, 3] if tiny else list(range(1, 12)))
    context = args.context or (16 if tiny else 2048)
    rounds = args.rounds or (3 if tiny else 64)
    calls = args.calls or (2 if tiny else 30)
    dtype = jnp.float32 if tiny else jnp.bfloat16
    target, drafter = build(name, dtype)
    kmax = max(ks)
    bench = Bench(target, drafter, args.batch, context, budget=(rounds + 2 * calls + 8) * (kmax + 1) + 2 * kmax,
                  dtype=dtype)
    result = {"model": name, "device": str(jax.devices()[0]), "jax": jax.__version__, "batch": args.batch,
              "context": context, "calls": calls, "drafter_pass": {"parallel": {}, "sequential": {}},
              "round": {}, "loop": {}}
    print(f"# bench_engine: {name}, batch {args.batch}, context {context}, {jax.devices()[0]}\n")
    print("| K | parallel draft ms | sequential draft ms | parallel / parallel K=1 |")
    print("|---|---|---|---|")
    for k in ks:
        par = bench.draft_step(k, "parallel", calls)
        seq = bench.draft_step(k, "sequential", calls)
        result["drafter_pass"]["parallel"][k] = par
        result["drafter_pass"]["sequential"][k] = seq
        base = result["drafter_pass"]["parallel"][ks[0]][0]
        print(f"| {k} | {par[0]:.3f} | {seq[0]:.3f} | {par[0] / base:.2f} |")
    print("\n| mode | K | verify ms | accept ms | draft ms | sum | round (one program) ms |")
    print("|---|---|---|---|---|---|---|")
    for drafting in ("parallel", "sequential"):
        for k in sorted({ks[0], kmax}):
            parts = bench.round_parts(k, drafting, calls)
            result["round"][f"{drafting}_k{k}"] = parts
            s = parts["verify"][0] + parts["accept"][0] + parts["draft"][0]
            print(f"| {drafting} | {k} | {parts['verify'][0]:.3f} | {parts['accept'][0]:.3f} | "
                  f"{parts['draft'][0]:.3f} | {s:.3f} | {parts['round'][0]:.3f} |")
    print(f"\n| mode | K | ms/round: {rounds} rounds in one while_loop | separate calls | separate calls + "
          "host sync |")
    print("|---|---|---|---|---|")
    for drafting in ("parallel",):
        lp = bench.loops(kmax, drafting, rounds, max(1, calls // 5))
        result["loop"][f"{drafting}_k{kmax}"] = lp
        print(f"| {drafting} | {kmax} | {lp['while_loop'][0]:.3f} | {lp['separate_calls'][0]:.3f} | "
              f"{lp['separate_calls_synced'][0]:.3f} |")
    path = write_json(result)
    if path:
        print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()
