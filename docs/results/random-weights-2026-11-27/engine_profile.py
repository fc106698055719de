"""A measurement record, not part of pjax: where the serving engine's time per chunk goes at c = 64 on the code-pair
geometry (random weights, simulated acceptance): the chunk call, the snapshot (device_get), the rest of `step`, the
caller; then the chunk program alone, back to back. It wraps Engine internals as of commit 8e0c67b; run from the
repository root: `python3 docs/results/random-weights-2026-11-27/engine_profile.py 8` (rounds per chunk)."""
import sys, time
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
from pjax.bench.models import random_target, random_head
from pjax.serve import Engine, EngineConfig, RequestParams
import pjax.serve.engine as E

rps = int(sys.argv[1]) if len(sys.argv) > 1 else 8
t = random_target("code-pair", jnp.bfloat16)
h = random_head(t, "4", parallel=True, dtype=jnp.bfloat16, shape="code-pair")
eng = Engine(t, h, EngineConfig(max_slots=64, max_len=512, num_speculative_tokens=3, rounds_per_step=rps,
                                simulate_acceptance=(0.82, 0.78, 0.828)))
eng.precompile_admissions([[128] * 64], warm=True)
acc = {"dispatch": 0.0, "snapshot": 0.0, "step": 0.0, "caller": 0.0, "chunks": 0, "admits": 0}
real_chunk, real_snap = eng._chunk_program, eng._snapshot
def chunk_prog(args):
    exe = real_chunk(args)
    def call(*a):
        t0 = time.perf_counter(); r = exe(*a); acc["dispatch"] += time.perf_counter() - t0; acc["chunks"] += 1
        return r
    return call
def snap():
    t0 = time.perf_counter(); real_snap(); acc["snapshot"] += time.perf_counter() - t0
eng._chunk_program, eng._snapshot = chunk_prog, snap
rng = np.random.default_rng(0)
prompts = [rng.integers(10, 30000, 128) for _ in range(128)]
for rep in range(2):
    for k in acc: acc[k] = 0 if k in ("chunks", "admits") else 0.0
    sub = 0; done = 0; t0 = time.perf_counter(); tl = time.perf_counter()
    while sub < len(prompts) or eng.has_work:
        while sub < len(prompts) and eng.num_running + eng.num_waiting < 64:
            eng.submit(prompts[sub], RequestParams(256)); sub += 1
        ts = time.perf_counter(); acc["caller"] += ts - tl
        ev = eng.step()
        tl = time.perf_counter(); acc["step"] += tl - ts
        done += sum(e.finished for e in ev)
    wall = time.perf_counter() - t0
    print(f"rps {rps} rep {rep}: wall {wall*1e3:.1f} ms, {acc['chunks']} chunks; per chunk: dispatch "
          f"{acc['dispatch']/acc['chunks']*1e3:.3f} ms, snapshot {acc['snapshot']/acc['chunks']*1e3:.3f}, step total "
          f"{acc['step']/acc['chunks']*1e3:.3f}, caller {acc['caller']/acc['chunks']*1e3:.3f}")
# the device's own chunk time: 64 running rows, chunks back to back without reading
for i in range(64): eng.submit(prompts[i], RequestParams(256))
eng.step()  # admission
st = eng._state
exe = real_chunk((eng._target, eng._drafter, st, eng._sampling, np.int32(rps)))
for n in (1, 4):
    jax.block_until_ready(st); t0 = time.perf_counter()
    for _ in range(n):
        st = exe(eng._target, eng._drafter, st, eng._sampling, np.int32(rps))[0]
    jax.block_until_ready(st)
    print(f"{n} chunks back to back: {(time.perf_counter()-t0)/n*1e3:.3f} ms a chunk")
t0 = time.perf_counter(); hh = jax.device_get({k: getattr(st, k) for k in E._HOST_FIELDS}); print(f"device_get idle: {(time.perf_counter()-t0)*1e3:.3f} ms")
