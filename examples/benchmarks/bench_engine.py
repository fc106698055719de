"""Speculative round timing: P-EAGLE parallel drafting vs EAGLE-3 sequential drafting, the round broken
into verify / accept / draft, and N rounds in one on-device loop vs N separate jitted calls.

    PYTHONPATH=. python3 examples/benchmarks/bench_engine.py           # GPU: Llama-3.1-8B target, 4-layer head
    PYTHONPATH=. python3 examples/benchmarks/bench_engine.py --tiny    # CPU smoke test (tiny shapes)

Weights are random bf16 (timing only; acceptance is ~0, so every round emits one token and writes the
same slot layout); the head has a 32000-token draft vocabulary (d2t map) like the Llama-3.1-8B EAGLE-3
heads. Caches start at `--context` positions (values are zeros: costs do not depend on them); the XLA
attention path reads the whole cache buffer, so the printed capacity sets the attention cost. Every step
is one jitted program; caches are threaded through calls (donated on GPU).
Timing: warm-up, then groups of `--calls` calls dispatched back to back (device time per call); median
over the groups reported, p10/p90 in the JSON.

1. drafter step for K = 1..11: parallel = one drafter forward over 2K slots (accepted + bonus + K-1
   mask slots), sequential = one forward over the K+1 accepted/bonus slots then K-1 one-token passes;
   both include feature fusion (fc), the lm_head on the K sampled slots and argmax.
2. one full round (verify -> accept -> draft, one program) and its parts timed separately:
   verify (target over K+1 tokens + float32 logits + aux features), accept, draft; on a GPU also the
   device spans (profiler kernel timestamps, `devtime.py`) of the round, the accept program and the
   drafter-input metadata program, and their share of the round.
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
from pjax.models.cache import init_cache  # noqa: E402
from pjax.decode import DecodeState, EngineConfig, Sampling, make_spec, spec_round, verify  # noqa: E402
from pjax.decode import draft as D  # noqa: E402
from pjax.kernels import IMPLEMENTATIONS, accept  # noqa: E402
from pjax.kernels.metadata import build_draft_inputs  # noqa: E402
from pjax.models.drafter import DrafterConfig, combine, init_drafter, init_drafter_cache  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from devtime import profile_calls  # noqa: E402


def llama_cfg(layers, h, inter, heads, kv, hd, vocab) -> ModelConfig:
    rope = RopeSpec(kind="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
    return ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_heads=heads,
                       layers=tuple(LayerSpec(hd, kv, rope) for _ in range(layers)), rms_norm_eps=1e-5)


SHAPES = {  # (target layers, H, I, heads, kv heads, head dim, vocab), head layers, draft vocab
    "llama3.1-8b": ((32, 4096, 14336, 32, 8, 128, 128256), 4, 32000),  # Vd as the Llama-3.1-8B EAGLE-3 heads
    "tiny": ((2, 64, 128, 4, 2, 16, 257), 2, 200),
}


def build(name: str, dtype):
    """Random target and P-EAGLE head of the named shape."""
    (layers, h, inter, heads, kv, hd, vocab), head_layers, draft_vocab = SHAPES[name]
    tcfg = llama_cfg(layers, h, inter, heads, kv, hd, vocab)
    target = pjax.init_target(tcfg, jax.random.key(0), dtype)
    n = layers
    dcfg = DrafterConfig(layer=llama_cfg(head_layers, h, inter, heads, kv, hd, vocab), num_aux=3,
                         target_hidden_size=h, draft_vocab_size=draft_vocab, mask_token_id=vocab - 1,
                         aux_layer_ids=(min(2, n), n // 2, max(n - 3, 0)) if n >= 3 else (0, 1, 2))
    drafter = init_drafter(dcfg, jax.random.key(1), dtype)
    return target, drafter


DONATE = jax.default_backend() != "cpu"  # CPU ignores donation (and warns)


def timed(fn, state, calls: int, warmup: int = 2, groups: int = 5):
    """fn(state) -> state, threaded through the calls; returns ((median, p10, p90) ms per call, final state).

    Calls are dispatched back to back (`calls` per group, one block at the end of each group), so the
    numbers are device time per call, not the host round trip of a synchronised call (~4 ms on the H200
    machine); the median and spread are over the groups.
    """
    for _ in range(warmup):
        state = fn(state)
    jax.block_until_ready(state)
    ts = []
    for _ in range(groups):
        t0 = time.perf_counter()
        for _ in range(calls):
            state = fn(state)
        jax.block_until_ready(state)
        ts.append((time.perf_counter() - t0) * 1e3 / calls)
    q = np.percentile(ts, [10, 90])
    return (statistics.median(ts), float(q[0]), float(q[1])), state


def device_span(fn, state, calls: int):
    """((span, busy) ms, state): median device span of one call of fn(state) -> state from the profiler's
    kernel timestamps (no host round trip, launch gaps inside the program included) and median busy time (sum
    of its kernels' durations: the cost when its launches are queued behind other work, as inside the round);
    ((None, None), state) without a GPU."""
    box = [state]

    def call():
        box[0] = fn(box[0])
        return box[0]
    prof = profile_calls(call, (), calls=calls)
    if prof is None or len(prof[0]) != calls:
        return (None, None), box[0]
    busy = statistics.median(sum(d for *_, d in ks) for ks in prof[1])
    return (statistics.median(prof[0]) / 1e6, busy / 1e6), box[0]


def synthetic_state(target, drafter, spec, batch: int, capacity: int, pos: int) -> DecodeState:
    """A decode state at position `pos` with zero caches (costs do not depend on the cached values)."""
    b, k = batch, spec.k
    z = functools.partial(jnp.zeros, dtype=jnp.int32)
    return DecodeState(
        target_cache=init_cache(target.config, b, capacity, target.dtype),
        drafter_cache=init_drafter_cache(drafter, b, capacity, drafter.dtype), last=z((b,)),
        pos=jnp.full((b,), pos, jnp.int32), drafts=z((b, k)), draft_probs=None,
        out=jnp.full((b, spec.out_len), -1, jnp.int32), num_out=z((b,)), done=jnp.zeros((b,), bool),
        stop=z((b,)), rounds=z((b,)), num_drafts=z((b,)), num_draft_tokens=z((b,)), accepted=z((b,)),
        accepted_at=z((b, k)))


def draft_only(drafter, cache, aux, verify_tokens, num_accepted, next_token, start_pos, sampling, spec):
    """The draft step of a round: fc over the K+1 verify features, drafter pass(es), lm_head, argmax."""
    comb = combine(drafter, aux)
    active = jnp.ones(num_accepted.shape, bool)
    drafts, _, _, cache = D.draft_round(drafter, cache, comb, verify_tokens, num_accepted, next_token, start_pos,
                                        active, sampling, spec)
    return cache, drafts


def verify_only(target, cache, last, drafts, pos, spec):
    """The verify step: target over [last, d_1..d_K], float32 logits, aux features."""
    b = last.shape[0]
    st = DecodeState(cache, None, last, pos, drafts, *([None] * 10))
    nd = jnp.full((b,), spec.k, jnp.int32)
    logits, aux, cache, _ = verify(target, st, nd, jnp.ones((b,), bool), spec)
    return cache, logits, aux


def accept_only(logits, drafts, q, sampling, positions, num_drafts, spec):
    """The round's chain acceptance (`pjax.kernels.accept`) without top-k / top-p filters."""
    return accept(logits, drafts, q, temperature=sampling.temperature.astype(jnp.float32),
                  seeds=sampling.seed.astype(jnp.uint32), positions=positions.astype(jnp.int32),
                  num_drafts=num_drafts.astype(jnp.int32), implementation=spec.implementation)


def rounds_in_loop(target, drafter, state, sampling, spec, rounds):
    """`rounds` rounds in one program (fori_loop, a while_loop with a counter: no host round-trip)."""
    return jax.lax.fori_loop(0, rounds, lambda i, s: spec_round(target, drafter, s, sampling, spec=spec), state)


def jitted(compiler_options=None):
    """The timed programs (caches donated on GPU)."""
    jit = functools.partial(jax.jit, compiler_options=compiler_options)
    don = (1,) if DONATE else ()
    return dict(
        draft=jit(draft_only, static_argnames=("spec",), donate_argnums=don),
        verify=jit(verify_only, static_argnames=("spec",), donate_argnums=don),
        accept=jit(accept_only, static_argnames=("spec",)),
        round=jit(spec_round, static_argnames=("spec",), donate_argnames=("state",) if DONATE else ()),
        loop=jit(rounds_in_loop, static_argnames=("spec", "rounds"), donate_argnames=("state",) if DONATE else ()))


class Bench:
    def __init__(self, target, drafter, batch: int, context: int, capacity: int, compiler_options=None,
                 implementation: str = "auto"):
        self.target, self.drafter, self.b, self.ctx, self.capacity = target, drafter, batch, context, capacity
        self.implementation = implementation
        self.fn = jitted(compiler_options)
        b = batch
        self.sampling = Sampling(jnp.zeros(b), jnp.zeros(b, jnp.int32), jnp.ones(b), jnp.arange(b, dtype=jnp.uint32))

    def spec(self, k, drafting):
        return make_spec(self.target, self.drafter, EngineConfig(num_speculative_tokens=k, drafting=drafting,
                                                                 implementation=self.implementation),
                         max_new_tokens=4096)

    def state(self, spec):
        return synthetic_state(self.target, self.drafter, spec, self.b, self.capacity, self.ctx)

    def _features(self, k):
        h = self.target.config.hidden_size
        aux = 0.1 * jax.random.normal(jax.random.key(3), (self.b, k + 1, 3 * h), jnp.float32)
        return aux.astype(self.target.dtype)

    def draft_step(self, k, drafting, calls):
        """One draft step after a verify at the context end with n = 0 accepted (2K parallel slots)."""
        spec = self.spec(k, drafting)
        st = self.state(spec)
        aux = self._features(k)
        vt = jnp.zeros((self.b, k + 1), jnp.int32)
        n = jnp.zeros((self.b,), jnp.int32)
        draft = self.fn["draft"]
        res, _ = timed(lambda c: draft(self.drafter, c, aux, vt, n, st.last, st.pos, self.sampling, spec=spec)[0],
                       st.drafter_cache, calls)
        return res

    def round_parts(self, k, drafting, calls):
        spec = self.spec(k, drafting)
        st = self.state(spec)
        t, d, samp = self.target, self.drafter, self.sampling
        fn = self.fn
        out = {}
        keep = {}

        def ver(c):
            c, keep["logits"], keep["aux"] = fn["verify"](t, c, st.last, st.drafts, st.pos, spec=spec)
            return c
        out["verify"], tcache = timed(ver, st.target_cache, calls)
        logits = keep["logits"]
        nd = jnp.full((self.b,), k, jnp.int32)

        pos1 = st.pos + 1  # outside the timed call: an eager op would add a host dispatch gap to the span

        def acc(_):
            return fn["accept"](logits, st.drafts, None, samp, pos1, nd, spec=spec)
        out["accept"], res = timed(acc, None, calls)
        (out["accept_span"], out["accept_busy"]), _ = device_span(acc, None, calls)
        meta = jax.jit(functools.partial(build_draft_inputs, num_slots=2 * k, mask_token_id=spec.mask_token_id,
                                         implementation=spec.implementation))
        vt = jnp.concatenate([st.last[:, None], st.drafts], axis=1)
        build = lambda _: meta(res.num_accepted, vt, res.next_token, st.pos)
        (out["metadata_span"], out["metadata_busy"]), _ = device_span(build, None, calls)
        out["draft"], dcache = timed(
            lambda c: fn["draft"](d, c, keep["aux"], vt, res.num_accepted, res.next_token, st.pos, samp, spec=spec)[0],
            st.drafter_cache, calls)
        st = dataclasses.replace(st, target_cache=tcache, drafter_cache=dcache)
        rnd = lambda s: fn["round"](t, d, s, samp, spec=spec)
        out["round"], st = timed(rnd, st, calls)
        (out["round_span"], _), _ = device_span(rnd, st, calls)
        return out

    def loops(self, k, drafting, rounds, calls):
        """ms per round: N rounds in one fori_loop program vs N jitted calls (async / synced per round)."""
        spec = self.spec(k, drafting)
        t, d, samp = self.target, self.drafter, self.sampling
        st = self.state(spec)
        one, many = self.fn["round"], self.fn["loop"]

        def device(s):
            return many(t, d, s, samp, spec=spec, rounds=rounds)

        def async_calls(s):
            for _ in range(rounds):
                s = one(t, d, s, samp, spec=spec)
            return s

        def synced_calls(s):
            for _ in range(rounds):
                s = one(t, d, s, samp, spec=spec)
                bool(s.done.all())  # what a host loop checking stop conditions pays every round
            return s
        out = {}
        for name, fn in (("while_loop", device), ("separate_calls", async_calls),
                         ("separate_calls_synced", synced_calls)):
            (med, p10, p90), st = timed(fn, st, calls, warmup=1)
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
    ap.add_argument("--implementation", default="auto", choices=IMPLEMENTATIONS,
                    help="kernel switch of every op of the round (pjax.kernels; default auto)")
    args = ap.parse_args(argv)
    tiny = args.tiny
    name = "tiny" if tiny else "llama3.1-8b"
    ks = [int(x) for x in args.ks.split(",")] if args.ks else ([1, 2] if tiny else list(range(1, 12)))
    context = args.context or (16 if tiny else 2048)
    rounds = args.rounds or (3 if tiny else 64)
    calls = args.calls or (2 if tiny else 30)
    dtype = jnp.float32 if tiny else jnp.bfloat16
    t0 = time.perf_counter()
    target, drafter = build(name, dtype)
    jax.block_until_ready((target, drafter))
    print(f"built random {name} target + head in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    kmax = max(ks)
    # room for every threaded round (acceptance ~0: one position per round); full rows stop cleanly and
    # keep the same per-round cost, so the timings do not depend on it
    loop_calls = max(1, calls // 5)
    capacity = -(-(context + 3 * rounds * (loop_calls + 1) + 4 * (kmax + 1) + 64) // 128) * 128
    fast = {"xla_backend_optimization_level": 0} if tiny and jax.default_backend() == "cpu" else None
    bench = Bench(target, drafter, args.batch, context, capacity, compiler_options=fast,
                  implementation=args.implementation)
    result = {"model": name, "device": str(jax.devices()[0]), "jax": jax.__version__, "batch": args.batch,
              "implementation": args.implementation,
              "context": context, "capacity": capacity, "calls": calls, "rounds": rounds,
              "drafter_pass": {"parallel": {}, "sequential": {}}, "round": {}, "loop": {}}
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
        for k in ([kmax] if tiny else sorted({ks[0], kmax})):
            parts = bench.round_parts(k, drafting, calls)
            result["round"][f"{drafting}_k{k}"] = parts
            s = parts["verify"][0] + parts["accept"][0] + parts["draft"][0]
            print(f"| {drafting} | {k} | {parts['verify'][0]:.3f} | {parts['accept'][0]:.3f} | "
                  f"{parts['draft'][0]:.3f} | {s:.3f} | {parts['round'][0]:.3f} |")
    spans = {key: p for key, p in result["round"].items()
             if None not in (p.get("round_span"), p.get("accept_span"), p.get("metadata_span"))}
    if spans:
        print("\nFrom the profiler: stand-alone accept / metadata programs, kernel busy time (their cost with "
              "launches queued, as in the round) and device span (with the host's launch gaps of a lone call: upper "
              "bound)\n\n| round | accept busy / span ms | metadata busy / span ms | round span ms | "
              "(accept + metadata) / round: busy / span |\n|---|---|---|---|---|")
        for key, p in spans.items():
            busy = (p["accept_busy"] + p["metadata_busy"]) / p["round_span"]
            span = (p["accept_span"] + p["metadata_span"]) / p["round_span"]
            print(f"| {key} | {p['accept_busy']:.4f} / {p['accept_span']:.4f} | {p['metadata_busy']:.4f} / "
                  f"{p['metadata_span']:.4f} | {p['round_span']:.3f} | {100 * busy:.2f}% / {100 * span:.2f}% |")
    print(f"\n| mode | K | ms/round: {rounds} rounds in one while_loop | separate calls | separate calls + "
          "host sync |")
    print("|---|---|---|---|---|")
    for drafting in ("parallel",):
        lp = bench.loops(kmax, drafting, rounds, loop_calls)
        result["loop"][f"{drafting}_k{kmax}"] = lp
        print(f"| {drafting} | {kmax} | {lp['while_loop'][0]:.3f} | {lp['separate_calls'][0]:.3f} | "
              f"{lp['separate_calls_synced'][0]:.3f} |")
    path = write_json(result)
    if path:
        print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()
